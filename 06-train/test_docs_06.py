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
GPU_GB = 80  # the pages plan for 80 GB GPUs


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
         f"AdamW's step is about lr = {short(cfg.lr)} per weight",
         f"moves no token out of [{low:g}, {high:g}]")
    assert TORL["lr"] == cfg.lr


def test_part_one_states_the_demo_and_torl_settings():
    demo = Config()
    says("06-train.md",
         f"{demo.num_minibatches} in the CPU demo, {TORL['num_minibatches']} in ToRL's script (the torl-1.5b preset)",
         f"the CPU demo uses {short(demo.lr)}",
         f"at its defaults ({demo.num_minibatches} mini-batches, lr {short(demo.lr)})",
         f"the torl-1.5b preset clips at {TORL['eps_low']} on both sides",
         f"scale (`scale_advantages={TORL['scale_advantages']}`)",
         f"`dtype=\"{TORL['dtype']}\"`")
    assert TORL["eps_low"] == TORL["eps_high"]


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


def test_the_memory_plan_is_the_torl_presets():
    n = parameters("qwen2.5-math-1.5b")
    state = 16 * n / 1e9
    share = TORL["gpu_memory_utilization"]
    says("06-scaling.md",
         f"which has {n:,} parameters",
         f"| **trainer state** | 16 / parameter | **{state:.1f}** |",
         f"| vLLM at `gpu_memory_utilization={share}` (the torl-1.5b preset) | {share:.0%} of {GPU_GB} GB | "
         f"{share * GPU_GB:.0f} |",
         f"| of which KV cache (after weights and work space) | {kv_bytes_per_token('qwen2.5-math-1.5b'):,} / token |",
         f"| **left for the step, vLLM awake** | | **about {GPU_GB - state - share * GPU_GB:.0f}** |",
         f"| **left for the step, vLLM asleep** | | **about {GPU_GB - state:.0f}** |",
         f"the preset's {TORL['max_model_len']:,} tokens (`max_model_len`",
         f"The preset runs micro-batches of {TORL['micro_batch_size']} with checkpointing",
         f"the {GPU_GB - state:.0f} GB left with vLLM asleep and not the {GPU_GB - state - share * GPU_GB:.0f} GB")
    assert TORL["gradient_checkpointing"]


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
    n = parameters("qwen2.5-math-7b")
    share = TORL_7B["gpu_memory_utilization"]
    says("06-scaling.md",
         f"Qwen2.5-Math-7B ({n:,} parameters",
         f"| **trainer state** | **{16 * parameters('qwen2.5-math-1.5b') / 1e9:.1f}** | "
         f"**{16 * n / 1e9:.1f}: does not fit** | **{16 * n / 8 / 1e9:.1f}** |",
         f"| vLLM KV cache per token | {kv_bytes_per_token('qwen2.5-math-1.5b'):,} B | "
         f"{kv_bytes_per_token('qwen2.5-math-7b'):,} B |",
         f"FSDP2 (`strategy={TORL_7B['strategy']}`",
         f"({12 * n / 8 / 1e9:.1f} of them, weights and AdamW state, kept during rollout)",
         f"vLLM at `gpu_memory_utilization={share}` ({share * GPU_GB:.0f} GB",
         f"the logits of a micro-batch of {TORL_7B['micro_batch_size']}",
         f"(the lab's preset: {TORL['gpu_memory_utilization']}, no offload)")


def test_the_deal_of_problems_to_ranks_is_shards():
    from distributed import DataParallel

    ranks = [DataParallel(rank=r, world_size=2).shard(list(range(8)), num_minibatches=2) for r in (0, 1)]
    says("06-scaling.md", f"rank 0 gets problems {ranks[0]} and rank 1 {ranks[1]}")


# --------------------------------------------------------------------------- part 3: beyond ToRL


def test_part_three_states_the_loop_defaults_and_the_ablation_arms():
    from ablation import ARMS

    demo = Config()
    says("06-beyond-torl.md",
         f"`--dynamic-sampling-rounds` ({demo.dynamic_sampling_rounds}) extra rounds",
         f"responses use a fraction of the {demo.max_response_tokens}-token budget",
         f"({demo.steps} steps of {demo.problems_per_step} problems × {demo.group_size} samples, lr {short(demo.lr)}, "
         f"a {demo.max_response_tokens}-token budget",
         f"one sampled answer to each of {demo.eval_problems} toy problems",
         f"ToRL's {TORL['max_response_tokens']}-token budget",
         f"the default `--degenerate-frac {bench_args([]).degenerate_frac}`",
         *(f"| {arm} | {ARMS[arm][1]} |" for arm in ("baseline", "dynamic", "mask-truncated", "void-filter",
                                                    "token-sum", "bf16", "bf16-tis")))
    assert ARMS["bf16-tis"][0][-2:] == ["--tis-cap", "2.0"]
    assert not demo.dynamic_sampling and demo.skip_zero_advantage


@pytest.mark.parametrize("name", ["06-train.md", "06-scaling.md", "06-beyond-torl.md"])
def test_each_page_ends_with_questions_and_folded_answers(name):
    text = (DOCS / name).read_text(encoding="utf-8")
    questions = text.split("## Questions to check yourself")[1].split("## Answers")[0]
    asked = [line for line in questions.splitlines() if line[:1].isdigit()]
    assert len(asked) == text.count("<details><summary>") == text.count("</details>") > 0
    assert text.rstrip().endswith("</details>")
