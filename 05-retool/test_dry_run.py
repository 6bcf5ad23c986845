"""The dry run's cost of a recipe (FLOPs, seconds, GPU-hours) and the plans that need more than one node."""
import dataclasses
from pathlib import Path

import pytest

from dry_run import DECODE_BANDWIDTH_SHARE, HBM_TBPS, PEAK_TFLOPS, cost_plan, cost_table, memory_plan, model_shape
from retool import Config, make_config

RETOOL = Path(__file__).with_name("retool.py")


# A made-up shape: 1M parameters, 2 layers of 1 KV head of 64, so a token's KV is 2 x 2 x 1 x 64 x 2 = 512 bytes.
SHAPE = {"parameters": 1_000_000, "num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 64}


def test_the_cost_of_a_step_is_two_n_a_generated_token_and_eight_n_a_trained_one():
    cfg = Config()  # cpu-demo: 8 problems x 8 samples, 96 response tokens of a 512-token context, 20 steps
    cost = cost_plan(cfg, SHAPE, gpus=2, gpu="A100", decode_rate=1000.0, train_mfu=0.5, call_s=0.5)
    assert (cost.trajectories, cost.decode_tokens, cost.update_tokens) == (64, 64 * 96, 64 * 512)
    assert cost.decode_flops == 2 * 1e6 * 64 * 96
    assert cost.flops_per_update_token == 8 and cost.update_flops == 8 * 1e6 * 64 * 512  # old log-probs 2N + 6N
    assert cost.decode_s == pytest.approx(32 * 96 / 1000.0 + cfg.tool_budget * 0.5)  # one GPU's half, then its calls
    assert cost.update_s == pytest.approx(8 * 1e6 * 64 * 512 / (2 * PEAK_TFLOPS["A100"] * 1e12 * 0.5))
    assert cost.gpu_hours == pytest.approx((cost.decode_s + cost.update_s) * 20 * 2 / 3600)  # no eval file: none


def test_the_old_log_prob_pass_is_counted_only_when_grpo_step_runs_it():
    """One mini-batch and no TIS: the update's own forward gives pi_old (grpo_step), 6N a trained token, not 8N."""
    import update_options

    for minibatches, tis_cap, per_token in [(1, 0.0, 6), (2, 0.0, 8), (1, 2.0, 8)]:
        cfg = dataclasses.replace(Config(), num_minibatches=minibatches, tis_cap=tis_cap)
        cost = cost_plan(cfg, SHAPE, gpus=1, gpu="H100", decode_rate=1000.0)
        assert cost.flops_per_update_token == per_token and cost.update_flops == per_token * 1e6 * 64 * 512
        assert update_options.update_gives_pi_old(cfg) == (per_token == 6)  # the rule the dry run prices
        line = next(line for line in cost_table(cfg, cost, 1, "H100", 0.35).splitlines() if "update:" in line)
        assert ("2N old log-probs" in line) == (per_token == 8), line
        assert ("old log-probs from the same forward" in line) == (per_token == 6), line


def test_decode_reads_the_weights_and_every_sequences_kv_cache_once_a_step():
    """Bandwidth, not FLOPs, bounds decode; a batch the KV cache cannot hold decodes in waves."""
    cfg = dataclasses.replace(Config(), gradient_checkpointing=True, dtype="bfloat16")  # the engine: 2 bytes a parameter
    cost = cost_plan(cfg, SHAPE, gpus=1, gpu="H100", response_tokens=48, call_s=2.0)
    assert cost.flops_per_update_token == 10 and not cost.decode_rate_assumed
    step_s = (2 * 1e6 + 64 * 512 * (416 + 48 / 2)) / (HBM_TBPS["H100"] * 1e12 * DECODE_BANDWIDTH_SHARE)
    assert cost.decode_step_ms == pytest.approx(1000 * step_s) and cost.waves == 1
    assert cost.decode_s == pytest.approx(48 * step_s + cfg.tool_budget * 2.0)  # the longest trajectory's calls
    assert cost.decode_tokens == 64 * 48 and cost.update_tokens == 64 * (512 - 96 + 48)  # a mean response of 48
    halves = cost_plan(cfg, SHAPE, gpus=1, gpu="H100", response_tokens=48, call_s=2.0, kv_tokens=32 * 512)
    half_step_s = (2 * 1e6 + 32 * 512 * (416 + 24)) / (HBM_TBPS["H100"] * 1e12 * DECODE_BANDWIDTH_SHARE)
    assert halves.waves == 2 and halves.decode_s == pytest.approx(2 * 48 * half_step_s + cfg.tool_budget * 2.0)


def test_evaluations_add_their_decode_every_eval_every_steps_and_before_and_after():
    cfg = dataclasses.replace(Config(), eval_every=5, eval_k=2, dtype="bfloat16")  # 20 steps: 4 evaluations, + before, after
    cost = cost_plan(cfg, SHAPE, gpus=1, gpu="H100", call_s=0.0, eval_rows=10)
    step_s = (2 * 1e6 + 20 * 512 * (416 + cfg.eval_max_response_tokens / 2)) / (HBM_TBPS["H100"] * 1e12 * DECODE_BANDWIDTH_SHARE)
    assert cost.eval_s == pytest.approx(cfg.eval_max_response_tokens * step_s)
    assert cost.gpu_hours == pytest.approx(((cost.decode_s + cost.update_s) * 20 + 6 * cost.eval_s) / 3600)


def test_simpletir_7b_fits_one_node_with_a_micro_batch_of_two():
    """Two sequences at their longest, as SimpleTIR's token budget packs them; the logits' bf16 peak no longer caps it."""
    cfg = make_config("simpletir-7b", {})
    shape = model_shape(cfg.model)
    assert cfg.micro_batch_size == 2
    one_node = memory_plan(cfg, shape, gpus=8, gpu_gb=80)
    assert one_node.problems == [] and sum(one_node.update.values()) <= 80 and sum(one_node.rollout.values()) <= 80
    eight = memory_plan(dataclasses.replace(cfg, micro_batch_size=8), shape, gpus=16, gpu_gb=80)
    assert len(eight.problems) == 1 and eight.problems[0].startswith("the update needs 118.0 GB a GPU")
    two_nodes = memory_plan(cfg, shape, gpus=16, gpu_gb=80)
    assert two_nodes.problems == [] and cfg.problems_per_step % (cfg.num_minibatches * 16) == 0


# What a GPU preset's micro-batch leaves of the GPU for what the plan does not count: one layer's activations
# while it is recomputed, the allocator's fragments.
UNCOUNTED = 0.25


@pytest.mark.parametrize("preset, gpus", [("torl-1.5b", 8), ("torl-7b", 8), ("simpletir-7b", 8)])
def test_each_gpu_preset_takes_the_largest_micro_batch_the_plan_fits_with_a_quarter_to_spare(preset, gpus):
    cfg = make_config(preset, {})
    shape = model_shape(cfg.model)

    def update_gb(size):
        return sum(memory_plan(dataclasses.replace(cfg, micro_batch_size=size), shape, gpus, 80).update.values())

    assert update_gb(cfg.micro_batch_size) <= (1 - UNCOUNTED) * 80 < update_gb(2 * cfg.micro_batch_size)


def test_fsdp_plans_the_unsharded_root_the_prefetched_layer_its_gradients_and_the_reserves():
    from dry_run import CONTEXT_GB, GB, NCCL_GB

    cfg = make_config("simpletir-7b", {})
    shape = model_shape(cfg.model)  # untied: embedding and lm_head are two root tensors
    plan = memory_plan(cfg, shape, gpus=16, gpu_gb=80)
    root = 2 * shape["embedding"]
    layer = (shape["parameters"] - root) / shape["num_hidden_layers"]
    assert not shape["tied"] and plan.update["FSDP2's unsharded root (embedding, lm_head), bf16, and its bf16 gradient"] \
        == pytest.approx(4 * root / GB)
    assert plan.update["two gathered bf16 layers (the running one and the prefetched next)"] == pytest.approx(4 * layer / GB)
    assert plan.update["a layer's unsharded gradients, bf16 and float32"] == pytest.approx(6 * layer / GB)
    for phase in (plan.rollout, plan.update):
        assert phase["CUDA context"] == CONTEXT_GB and phase["NCCL"] == NCCL_GB
    assert "vLLM's CUDA graphs (asleep)" in plan.update and not cfg.enforce_eager
    one = memory_plan(make_config("cpu-demo", {}), model_shape("Qwen/Qwen2.5-Math-1.5B"), gpus=1, gpu_gb=80)
    assert "NCCL" not in one.update and "vLLM's CUDA graphs (asleep)" not in one.update  # one GPU; eager engine


def test_the_dry_run_plans_nodes_and_prints_the_total(tmp_path, preloaded_python):
    done = preloaded_python.run([RETOOL, "--preset", "simpletir-7b", "--dry-run", "--plan-nodes", "2",
                                 "--plan-gpu", "A100", "--assume-train-mfu", "0.4"], cwd=tmp_path, timeout=120)
    out = done.stdout
    assert "16 x 80 GB GPU(s) (2 nodes of 8) planned" in out and "ranks: 16 x fsdp" in out, out
    assert "refused: the update" not in out and "at 40% MFU" in out and f"A100 at {PEAK_TFLOPS['A100']:g}" in out
    cfg = make_config("simpletir-7b", {})
    shape = model_shape(cfg.model)
    cost = cost_plan(cfg, shape, 16, "A100", train_mfu=0.4, kv_tokens=memory_plan(cfg, shape, 16, 80).kv_tokens)
    assert f"simpletir-7b: about {cost.gpu_hours:,.0f} GPU-hours on 16 x A100 at the assumed rates" in out


def test_the_pages_cost_and_simpletir_plans_are_the_dry_runs():
    """docs/05-torl.md shows the cost lines, the three totals and simpletir-7b's plans: each is what the code prints."""
    from doc_pages import says
    from dry_run import cost_table, layout_line, plan_table

    def plan(preset, gpus):
        cfg = make_config(preset, {})
        shape = model_shape(cfg.model)
        plan = memory_plan(cfg, shape, gpus, 80)
        return cfg, shape, plan, cost_plan(cfg, shape, gpus, "H100", kv_tokens=plan.kv_tokens)

    cfg, _, _, cost = plan("torl-1.5b", 8)
    says("05-torl.md", *[line.strip() for line in cost_table(cfg, cost, 8, "H100", 0.35).splitlines()],
         f"torl-1.5b: about {cost.gpu_hours:,.0f} GPU-hours on 8 x H100 at the assumed rates")
    says("05-torl.md", f"torl-7b, about {plan('torl-7b', 8)[3].gpu_hours:,.0f} GPU-hours on 8 x H100",
         f"simpletir-7b (below), about {plan('simpletir-7b', 16)[3].gpu_hours:,.0f} on 16 x H100")
    cfg, shape, one_node, _ = plan("simpletir-7b", 8)
    says("05-torl.md", f"steps={cfg.steps}`", f"`max_model_len={cfg.max_model_len}`", f"`tool_budget={cfg.tool_budget}`",
         f"`micro_batch_size={cfg.micro_batch_size}`: two sequences at their longest")
    says("05-torl.md", f"two sequences' logits are {one_node.update['logits of a micro-batch of 2']:.1f} GB")
    cfg, shape, two_nodes, _ = plan("simpletir-7b", 16)
    update = next(line for line in plan_table(cfg, two_nodes, shape).splitlines() if "update (vLLM asleep)" in line)
    says("05-torl.md", update.strip())
    assert one_node.problems == [] and two_nodes.problems == []
    assert layout_line(cfg, 16).startswith("ranks: 16 x fsdp")
