"""The dry run's cost of a recipe (FLOPs, seconds, GPU-hours) and the plans that need more than one node."""
import dataclasses
from pathlib import Path

import pytest

from dry_run import PEAK_TFLOPS, cost_plan, memory_plan, model_shape
from retool import Config, make_config

RETOOL = Path(__file__).with_name("retool.py")


def test_the_cost_of_a_step_is_two_n_a_generated_token_and_eight_n_a_trained_one():
    cfg = Config()  # cpu-demo: 8 problems x 8 samples, 96 response tokens of a 512-token context, 20 steps
    cost = cost_plan(cfg, parameters=1_000_000, gpus=2, peak_tflops=100.0, decode_rate=1000.0, train_mfu=0.5)
    assert (cost.trajectories, cost.decode_tokens, cost.update_tokens) == (64, 64 * 96, 64 * 512)
    assert cost.decode_flops == 2 * 1e6 * 64 * 96
    assert cost.flops_per_update_token == 8 and cost.update_flops == 8 * 1e6 * 64 * 512  # old log-probs 2N + 6N
    assert cost.decode_s == pytest.approx(64 * 96 / (2 * 1000.0))
    assert cost.update_s == pytest.approx(8 * 1e6 * 64 * 512 / (2 * 100e12 * 0.5))
    assert cost.gpu_hours == pytest.approx((cost.decode_s + cost.update_s) * 20 * 2 / 3600)


def test_checkpointing_adds_a_forward_and_the_default_decode_rate_is_a_tenth_of_the_peak():
    cfg = dataclasses.replace(Config(), gradient_checkpointing=True)
    cost = cost_plan(cfg, parameters=1_000_000, gpus=1, peak_tflops=100.0, response_tokens=48)
    assert cost.flops_per_update_token == 10
    assert cost.decode_rate == pytest.approx(0.1 * 100e12 / 2e6) and cost.decode_rate_from_peak
    assert cost.decode_tokens == 64 * 48 and cost.update_tokens == 64 * (512 - 96 + 48)  # a mean response of 48


def test_simpletir_7b_is_refused_on_one_node_and_planned_on_two():
    cfg = make_config("simpletir-7b", {})
    shape = model_shape(cfg.model)
    one_node = memory_plan(cfg, shape, gpus=8, gpu_gb=80)
    assert len(one_node.problems) == 1 and one_node.problems[0].startswith("the update needs 85.4 GB a GPU")
    assert one_node.problems[0].endswith("(it needs at least 13 GPUs: 2 nodes of 8)")
    two_nodes = memory_plan(cfg, shape, gpus=16, gpu_gb=80)
    assert two_nodes.problems == [] and cfg.problems_per_step % (cfg.num_minibatches * 16) == 0
    assert sum(two_nodes.update.values()) <= 80 and sum(two_nodes.rollout.values()) <= 80


def test_the_dry_run_plans_nodes_and_prints_the_total(tmp_path, preloaded_python):
    done = preloaded_python.run([RETOOL, "--preset", "simpletir-7b", "--dry-run", "--plan-nodes", "2",
                                 "--plan-gpu", "A100", "--assume-train-mfu", "0.4"], cwd=tmp_path, timeout=120)
    out = done.stdout
    assert "16 x 80 GB GPU(s) (2 nodes of 8) planned" in out and "ranks: 16 x fsdp" in out, out
    assert "refused: the update" not in out and "at 40% MFU" in out and f"A100 at {PEAK_TFLOPS['A100']:g}" in out
    cfg = make_config("simpletir-7b", {})
    cost = cost_plan(cfg, model_shape(cfg.model)["parameters"], 16, PEAK_TFLOPS["A100"], train_mfu=0.4)
    assert f"simpletir-7b: about {cost.gpu_hours:,.0f} GPU-hours on 16 x A100 at the assumed rates" in out


def test_the_pages_cost_and_simpletir_plans_are_the_dry_runs():
    """docs/05-torl.md shows the cost lines, the three totals and simpletir-7b's plans: each is what the code prints."""
    from doc_pages import says
    from dry_run import cost_table, layout_line, plan_table

    def plan(preset, gpus):
        cfg = make_config(preset, {})
        shape = model_shape(cfg.model)
        return cfg, shape, memory_plan(cfg, shape, gpus, 80), cost_plan(cfg, shape["parameters"], gpus, PEAK_TFLOPS["H100"])

    cfg, _, _, cost = plan("torl-1.5b", 8)
    says("05-torl.md", *[line.strip() for line in cost_table(cfg, cost, 8, "H100", 0.35).splitlines()],
         f"torl-1.5b: about {cost.gpu_hours:,.0f} GPU-hours on 8 x H100 at the assumed rates")
    says("05-torl.md", f"torl-7b, about {plan('torl-7b', 8)[3].gpu_hours:,.0f} GPU-hours on 8 x H100",
         f"simpletir-7b (below), about {plan('simpletir-7b', 16)[3].gpu_hours:,.0f} on 16 x H100")
    cfg, shape, one_node, _ = plan("simpletir-7b", 8)
    says("05-torl.md", f"refused: {one_node.problems[0]}", f"steps={cfg.steps}`",
         f"`max_model_len={cfg.max_model_len}`", f"`tool_budget={cfg.tool_budget}`")
    cfg, shape, two_nodes, _ = plan("simpletir-7b", 16)
    update = next(line for line in plan_table(cfg, two_nodes, shape).splitlines() if "update (vLLM asleep)" in line)
    says("05-torl.md", update.strip(), f"logits of {two_nodes.update['logits of a micro-batch of 2']:.1f} GB")
    assert layout_line(cfg, 16).startswith("ranks: 16 x fsdp") and one_node.problems[0].endswith("2 nodes of 8)")
