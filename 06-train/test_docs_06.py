"""docs/06 restates defaults, presets and sizes: each number here is read from the code, so the pages cannot drift."""
from __future__ import annotations

import pytest
import torch

from bench_train import SHAPES
from bench_train import parse_args as bench_args
from doc_pages import DOCS, page, says
from grpo import GRPOConfig, group_advantages, grpo_step, load_policy, make_optimizer
from retool import PRESETS, Config

TORL, TORL_7B = PRESETS["torl-1.5b"], PRESETS["torl-7b"]


def short(x: float) -> str:
    """1e-6, 2e-5: how the pages write a learning rate."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def parameters(shape: str) -> int:
    """Parameters of a model of `bench_train.SHAPES[shape]`, counted on the meta device."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape])).parameters())


def kv_bytes_per_token(shape: str) -> int:
    """K and V of every layer, bf16."""
    s = SHAPES[shape]
    return s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * (s["hidden_size"] // s["num_attention_heads"]) * 2


# --------------------------------------------------------------------------- part 1: the update


def test_the_objective_and_its_clip_table_are_grpo_configs_defaults():
    cfg = GRPOConfig()
    low, high = 1 - cfg.eps_low, 1 + cfg.eps_high
    says("06-train.md",
         f"clip(r_t, 1 - {cfg.eps_low}, 1 + {cfg.eps_high})",
         f"eps_low {cfg.eps_low} and eps_high {cfg.eps_high}",
         f"| A > 0 | r > {high:g} | removes the gradient |",
         f"| A < 0 | r < {low:g} | removes the gradient |",
         f"`max_grad_norm` ({cfg.max_grad_norm})",
         f"`GRPOConfig`'s lr is ToRL's {short(cfg.lr)}",
         f"AdamW's step is about lr = {short(cfg.lr)} per weight")
    says("06-clip-exercise.md", f"moves few tokens out of [{low:g}, {high:g}]")  # measured: the default run clips a few
    assert TORL["lr"] == cfg.lr


def test_part_one_states_the_demo_and_torl_settings():
    demo = Config()
    says("06-train.md",
         f"{demo.num_minibatches} in the CPU demo, {TORL['num_minibatches']} in ToRL's script (the torl-1.5b preset)",
         f"the CPU demo uses {short(demo.lr)}",
         f"the torl-1.5b preset clips at {TORL['eps_low']} on both sides",
         f"scale (`scale_advantages={TORL['scale_advantages']}`)",
         f"`dtype=\"{TORL['dtype']}\"`")
    says("06-clip-exercise.md", f"at its defaults ({demo.num_minibatches} mini-batches, lr {short(demo.lr)})")
    assert TORL["eps_low"] == TORL["eps_high"]


def test_the_page_says_which_micro_batch_size_each_default_is():
    """GRPOConfig's default is the torl-1.5b preset's, Config's the CPU demo's (cpu-demo is Config's defaults)."""
    assert GRPOConfig.micro_batch_size == TORL["micro_batch_size"] and "micro_batch_size" not in PRESETS["cpu-demo"]
    says("06-train.md", f"`GRPOConfig`'s {GRPOConfig.micro_batch_size} is the torl-1.5b preset's",
         f"chapter 05's `Config` has the CPU demo's {Config.micro_batch_size}")


def test_the_advantage_printout_is_what_group_advantages_gives():
    for rewards in ([1, -1, -1, -1], [1, 1, 1, -1], [-1, -1, -1, -1], [1, 1, -1, -1]):
        says("06-train.md", f"{rewards} -> {group_advantages(rewards, 4)} "
                            f"scaled: {group_advantages(rewards, 4, scale=True)[0]}")


def test_every_metric_of_grpo_step_is_in_the_metrics_table(tiny_model_path):
    from rollout import Trajectory

    policy = load_policy(tiny_model_path, device="cpu")
    cfg = GRPOConfig(num_minibatches=1, tis_cap=2.0)
    trajectory = Trajectory("p", 0, "", [5, 6], [7, 8, 9], [0.0] * 3, [1, 0, 1], "", advantage=1.0)
    metrics = grpo_step(policy, make_optimizer(policy, cfg), [trajectory], cfg)
    table = page("06-train.md").split("## Metrics")[1].split("\n## ")[0]
    assert [key for key in metrics if f"`{key}`" not in table] == []


# --------------------------------------------------------------------------- part 2: memory, speed, more GPUs


def dry_run_plan(preset: str):
    """What `retool.py --preset PRESET --dry-run` plans without CUDA: its config, shape, plan and printed plan lines."""
    from dry_run import layout_line, memory_plan, model_shape, plan_table
    from retool import make_config
    from retool import parse_args as retool_args

    args, _ = retool_args(["--preset", preset, "--dry-run"])
    cfg = make_config(preset, {})
    shape = model_shape(cfg.model)
    plan = memory_plan(cfg, shape, args.plan_gpus, args.plan_gpu_gb)
    lines = [f"dry run of preset {preset}: {args.plan_gpus} x {args.plan_gpu_gb:.0f} GB GPU(s) planned",
             layout_line(cfg, args.plan_gpus)]
    for line in plan_table(cfg, plan, shape).splitlines():  # the model line ends with where its shape came from
        lines.append(line.strip().split(" (")[0] if line.strip().startswith("model ") else line.strip())
    return cfg, shape, plan, lines


def trainer_gb(plan) -> float:
    """The update's trainer state: weights, AdamW moments and gradients, GB per GPU."""
    return sum(gb for name, gb in plan.update.items() if name in ("trainer weights, float32", "AdamW m and v",
                                                                  "gradients, float32"))


def test_the_memory_rules_are_memory_plans():
    """The rules docs/06-scaling.md states are the arithmetic of 05-retool/dry_run.py's memory_plan."""
    from dry_run import CHUNK_BYTES, GB, HIDDEN_BYTES, VLLM_WORK_SPACE_GB
    from logprob_chunks import CHUNK_TOKENS

    s, kv = SHAPES["qwen2.5-math-1.5b"], kv_bytes_per_token("qwen2.5-math-1.5b")
    head = s["hidden_size"] // s["num_attention_heads"]
    says("06-scaling.md",
         "**Trainer state: 16 bytes a parameter**: float32 weights (4), their gradients (4) and AdamW's moments "
         "m and v (8)",
         f"its weights in bf16 (2 bytes a parameter, a full copy on every GPU), about {VLLM_WORK_SPACE_GB:g} GB of "
         f"work space, and the rest KV cache",
         f"For Qwen2.5-Math-1.5B ({s['num_hidden_layers']} layers, {s['num_key_value_heads']} KV heads of {head}) "
         f"that is {s['num_hidden_layers']} × 2 × {s['num_key_value_heads']} × {head} × 2 = {kv:,} bytes a token",
         "**Logits: one chunk at a time.**",
         f"({s['vocab_size']:,} entries for Qwen2.5-Math-1.5B)",
         f"{HIDDEN_BYTES} bytes a hidden\n  unit with their gradient",
         f"one chunk of {CHUNK_TOKENS:,} tokens at",
         f"about {CHUNK_BYTES} bytes a value of the chunk",
         f"hidden float32 values a token ({s['num_hidden_layers']} × {s['hidden_size']} for 1.5B)")
    assert TORL["gradient_checkpointing"] and TORL_7B["gradient_checkpointing"]
    for preset, model in (("torl-1.5b", "qwen2.5-math-1.5b"), ("torl-7b", "qwen2.5-math-7b")):
        cfg, shape, plan, _ = dry_run_plan(preset)
        p, shard = plan.parameters, plan.gpus if cfg.strategy == "fsdp" else 1
        tokens = cfg.micro_batch_size * cfg.max_model_len
        assert trainer_gb(plan) == pytest.approx(16 * p / shard / GB)
        # FSDP2's gradients exist during the update only; DDP's live in its buckets for the run
        assert ("DDP's gradient buckets, float32" in plan.rollout) == (cfg.strategy == "ddp")
        if cfg.strategy == "ddp":
            assert plan.rollout["DDP's gradient buckets, float32"] == pytest.approx(4 * p / GB)
        assert not any(name.startswith("logits") for name in plan.update)
        assert plan.update["checkpointed layer inputs"] == pytest.approx(
            tokens * shape["num_hidden_layers"] * shape["hidden_size"] * 4 / GB)
        assert cfg.dtype in ("bfloat16", "auto")  # vLLM's weights: 2 bytes a parameter
        share = cfg.gpu_memory_utilization * plan.gpu_gb
        assert plan.kv_tokens == int((share - 2 * p / GB - VLLM_WORK_SPACE_GB) * GB / kv_bytes_per_token(model))


def test_the_memory_plan_is_the_torl_presets():
    """docs/06-scaling.md shows the dry run's plan for both presets: every line is what memory_plan prints today."""
    for preset in ("torl-1.5b", "torl-7b"):
        cfg, _, plan, lines = dry_run_plan(preset)
        says("06-scaling.md", *lines)
        assert not plan.problems and max(sum(plan.rollout.values()), sum(plan.update.values())) <= plan.gpu_gb
        # the sleep is what makes each preset fit: the update beside an awake vLLM would pass the GPU
        assert sum(plan.update.values()) + cfg.gpu_memory_utilization * plan.gpu_gb > plan.gpu_gb - 2
    cfg, _, plan, _ = dry_run_plan("torl-1.5b")
    says("06-scaling.md", f"The torl-1.5b preset's plan for a node of {plan.gpus} × {plan.gpu_gb:g} GB GPUs")
    assert plan.kv_tokens >= plan.tokens_in_flight  # all fit
    from dry_run import memory_plan, model_shape

    one = memory_plan(cfg, model_shape(cfg.model), gpus=1, gpu_gb=plan.gpu_gb)  # the rank's share; no DDP, no NCCL
    assert one.rollout == {k: v for k, v in plan.rollout.items() if not k.startswith(("DDP", "NCCL"))}
    assert one.update == {k: v for k, v in plan.update.items() if k != "NCCL"}
    assert (one.kv_tokens, one.problems) == (plan.kv_tokens, [])


def test_the_gpu_benchmark_runs_at_the_torl_presets_settings():
    bench = bench_args([])
    prompt = TORL["max_model_len"] - TORL["max_response_tokens"]
    assert TORL["num_minibatches"] == 1 and TORL["gradient_checkpointing"]
    says("06-scaling.md",
         f"({bench.sequences} sequences of {prompt} prompt + {TORL['max_response_tokens']:,} response tokens, "
         f"one mini-batch, micro-batch {TORL['micro_batch_size']}, gradient checkpointing on)",
         f"batch : {bench.sequences} sequences x",
         f"(median of {bench.steps};",
         f"{round(bench.degenerate_frac * bench.sequences)} of {bench.sequences} rows have advantage 0")


def test_the_7b_plan_is_the_torl_7b_preset():
    from dry_run import GB

    n = parameters("qwen2.5-math-7b")
    s, kv = SHAPES["qwen2.5-math-7b"], kv_bytes_per_token("qwen2.5-math-7b")
    head = s["hidden_size"] // s["num_attention_heads"]
    cfg, _, plan, _ = dry_run_plan("torl-7b")
    says("06-scaling.md",
         f"FSDP2 (`strategy={TORL_7B['strategy']}`",
         f"4 bytes a parameter, {4 * n / 1e9:.1f} GB for Qwen2.5-Math-7B",
         f"Qwen2.5-Math-7B ({s['num_hidden_layers']} layers of hidden {s['hidden_size']:,}, "
         f"{s['num_key_value_heads']} KV heads of {head}, vocabulary {s['vocab_size']:,}, no tied embeddings) "
         f"fits no {plan.gpu_gb:g} GB GPU unsharded",
         f"The torl-7b preset shards it over the {plan.gpus} GPUs of a node",
         f"the trainer's lines are 1/{plan.gpus} of 16 bytes a parameter",
         f"{s['num_hidden_layers']} × 2 × {s['num_key_value_heads']} × {head} × 2 = {kv:,} bytes a token",
         f"Micro-batches of {TORL_7B['micro_batch_size']} keep the logits' peak down",
         f"{plan.gpus} × {2 * n / 1e9:.1f} GB for 7B",
         f"only rank 0 reads the float32 weights, {4 * n / 1e9:.1f} GB of host memory at 7B",
         f"Every rank loading would hold {plan.gpus * 4 * n / 1e9:.0f} GB on an {plan.gpus}-GPU node")
    says("06-nodes.md", f"(the lab's preset: {TORL['gpu_memory_utilization']}, no offload)")
    assert plan.parameters == n and not s["tie_word_embeddings"] and 16 * n / GB > plan.gpu_gb
    assert cfg.strategy == "fsdp" and plan.kv_tokens < plan.tokens_in_flight  # some wait
    root = 2 * s["vocab_size"] * s["hidden_size"]  # embedding and lm_head
    assert plan.update["FSDP2's unsharded root (embedding, lm_head), bf16, and its bf16 gradient"] == pytest.approx(
        4 * root / GB)
    assert plan.update["two gathered bf16 layers (the running one and the prefetched next)"] == pytest.approx(
        4 * (n - root) / s["num_hidden_layers"] / GB)
    says("06-scaling.md", "the root module (embedding and lm_head, not resharded after the forward, and lm_head's bf16",
         "the running layer and the prefetched next in bf16, and one layer's gradients, bf16 and float32")


def test_the_deal_of_problems_to_ranks_is_shards():
    from distributed import DataParallel

    ranks = [DataParallel(rank=r, world_size=2).shard(list(range(8)), num_minibatches=2) for r in (0, 1)]
    says("06-scaling.md", f"rank 0 gets problems {ranks[0]} and rank 1 {ranks[1]}")


# --------------------------------------------------------------------------- part 3: the options of the field


def test_part_three_states_the_loop_defaults_and_the_ablation_arms():
    from ablation import ARMS
    from retool import make_config

    demo, chained = Config(), make_config("cpu-chained", {})
    says("06-beyond-torl.md",
         f"`--dynamic-sampling-rounds` ({demo.dynamic_sampling_rounds}) extra rounds",
         f"responses use a fraction of the {demo.max_response_tokens}-token budget",
         f"ToRL's {TORL['max_response_tokens']}-token budget",
         f"the default `--degenerate-frac {bench_args([]).degenerate_frac}`")
    says("06-ablation-runs.md",
         f"`cpu-chained` preset, {chained.steps} steps, RL seeds 0, 1 and 2",
         f"--seeds 0 1 2 --steps {chained.steps}",
         f"one sample on each of the first {chained.eval_problems} held-out problems",
         *(f"| {arm} | {ARMS[arm][1]} |" for arm in ("baseline", "dynamic", "mask-truncated", "void-filter",
                                                    "token-sum", "bf16", "bf16-tis")))
    assert ARMS["bf16-tis"][0][-2:] == ["--tis-cap", "2.0"]
    assert not demo.dynamic_sampling and demo.skip_zero_advantage


# --------------------------------------------------------------------------- part 3: the objectives after DAPO


def test_the_objectives_restate_the_refusals_the_worked_examples_and_the_arms():
    import math
    from types import SimpleNamespace

    from ablation import ARMS
    from objectives import GSPO_WIDEST_EPS, cispo_loss, gspo_loss
    from plots import PANELS
    from update_options import tis_weights

    ordinal = ["first", "second", "third", "fourth", "fifth", "sixth"]
    entropy_panel = next(i for i, (_, keys) in enumerate(PANELS) if keys == ["entropy"])
    says("06-beyond-torl.md", f"a clip band wider than {GSPO_WIDEST_EPS} on either side",
         f"a band above {GSPO_WIDEST_EPS} unless", f"in the {ordinal[entropy_panel]} panel of `plots.png`")
    says("06-ablation-runs.md", *(f"| {arm} | {ARMS[arm][1]} | {ARMS[arm][2]} |" for arm in
           ("gspo", "fast", "fast-cispo", "bf16-token-mask", "bf16-sequence-mask")))
    assert ARMS["gspo"][0][-4:] == ["--eps-low", "3e-4", "--eps-high", "4e-4"]
    assert ARMS["fast"][0] == ARMS["fast-cispo"][0][:4] == ["--num-minibatches", "8", "--lr", "5e-5"]
    # GSPO: one token at 1.5 among ten is a sequence ratio of 1.0414, clipped: -1.0004 and no gradient
    old = torch.full((1, 10), -1.0)
    logprobs = old.clone()
    logprobs[0, 0] += math.log(1.5)
    loss, stats = gspo_loss(logprobs.requires_grad_(), old, torch.tensor([1.0]), torch.ones(1, 10))
    says("06-beyond-torl.md", f"s = 1.5^(1/10) = {1.5 ** 0.1:.4f}, above 1 + 4e-4", f"the constant -{-float(loss.detach()):.4f}",
         f"(`clip_high_frac` {stats['clip_high_frac']})")
    # CISPO's column of the table: part 1's hand case
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.1, 0.7, 1.6]])).requires_grad_()
    loss, _ = cispo_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    loss.backward()
    g = (logprobs.grad * 5).tolist()
    says("06-beyond-torl.md", f"| A = +1, r = 1.5 | 0 (clipped) | {g[0][0]:g} / 5 |", f"| A = +1, r = 0.5 | -0.5 / 5 | {g[0][1]:g} / 5 |",
         f"| A = -1, r = 0.7 | 0 (clipped) | +{g[1][1]:g} / 5 |", f"| A = -1, r = 1.6 | +1.6 / 5 | +{g[1][2]:g} / 5 |")
    # the masks' worked example
    batch = SimpleNamespace(loss_mask=torch.ones(1, 3), sampler_logprobs=torch.tensor([[-3.0, -0.2, -1.0]]))
    old = torch.tensor([[-1.5, -0.25, -1.05]])
    rows = {}
    for mode in ("truncate", "token-mask", "sequence-mask"):
        weights, metrics = tis_weights(old, batch, 2.0, mode)
        rows[mode] = (", ".join(f"{w:.3g}" for w in weights[0].tolist()), metrics)
    says("06-beyond-torl.md", f"| truncate | {rows['truncate'][0]} | `tis_capped_frac` {rows['truncate'][1]['tis_capped_frac']:.3f} |",
         f"| token-mask | {rows['token-mask'][0]} | `tis_masked_frac` {rows['token-mask'][1]['tis_masked_frac']:.3f}, "
         f"`tis_masked_seq_frac` {rows['token-mask'][1]['tis_masked_seq_frac']:g} |",
         f"| sequence-mask | {rows['sequence-mask'][0]} (geometric mean {math.exp((1.5 - 0.05 - 0.05) / 3):.3f}",
         f"`tis_masked_frac` {rows['sequence-mask'][1]['tis_masked_frac']:g}, `tis_masked_seq_frac` 0 |")


@pytest.mark.parametrize("name", ["06-train.md", "06-scaling.md", "06-beyond-torl.md", "06-experiments.md"])
def test_each_page_ends_with_questions_and_folded_answers(name):
    text = (DOCS / name).read_text(encoding="utf-8")
    questions = text.split("## Questions to check yourself")[1].split("## Answers")[0]
    asked = [line for line in questions.splitlines() if line[:1].isdigit()]
    assert len(asked) == text.count("<details><summary>") == text.count("</details>") > 0
    assert text.rstrip().endswith("</details>")


def test_the_main_line_on_the_page_is_retools_own_code():
    """Each line of docs/06-train.md's main line, but the `...`, stands in retool.py as it is: the page shows real code."""
    import re
    from pathlib import Path

    block = re.search(r"## The main line.*?```python\n(.*?)```", (DOCS / "06-train.md").read_text(), re.S).group(1)
    retool = (Path(__file__).parent.parent / "05-retool" / "retool.py").read_text().splitlines()
    lines = [line for line in block.splitlines() if line.strip() != "..."]
    assert "grpo_step(" in block and len(lines) >= 7
    assert all(line in retool for line in lines), [line for line in lines if line not in retool]
