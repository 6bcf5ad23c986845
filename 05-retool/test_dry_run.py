"""The dry run's cost of a recipe (FLOPs, seconds, GPU-hours) and the plans that need more than one node."""
import dataclasses
from pathlib import Path

import pytest

from dry_run import DECODE_BANDWIDTH_SHARE, HBM_TBPS, PEAK_TFLOPS, cost_plan, cost_table, memory_plan, model_shape
from retool import Config, make_config

RETOOL = Path(__file__).with_name("retool.py")


# A made-up shape: 1M parameters, 2 layers of 1 KV head of 64, so a token's KV is 2 x 2 x 1 x 64 x 2 = 512 bytes.
SHAPE = {"parameters": 1_000_000, "num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 64}


def test_the_cost_of_a_step_is_two_n_a_generated_token_and_seven_n_a_trained_one():
    cfg = Config()  # cpu-demo: 8 problems x 8 samples, 96 response tokens of a 512-token context, 20 steps
    cost = cost_plan(cfg, SHAPE, gpus=2, gpu="A100", decode_rate=1000.0, train_mfu=0.5, call_s=0.5)
    assert (cost.trajectories, cost.decode_tokens, cost.update_tokens) == (64, 64 * 96, 64 * 512)
    assert cost.decode_flops == 2 * 1e6 * 64 * 96
    # two mini-batches: the second's old log-probs take a pass (2N over half the rows), then 6N forward and backward
    assert cost.flops_per_update_token == 7 and cost.update_flops == 7 * 1e6 * 64 * 512
    assert cost.decode_s == pytest.approx(32 * 96 / 1000.0 + cfg.tool_budget * 0.5)  # one GPU's half, then its calls
    assert cost.update_s == pytest.approx(7 * 1e6 * 64 * 512 / (2 * PEAK_TFLOPS["A100"] * 1e12 * 0.5))
    assert cost.gpu_hours == pytest.approx((cost.decode_s + cost.update_s) * 20 * 2 / 3600)  # no eval file: none


def test_the_old_log_prob_pass_is_counted_only_where_grpo_step_runs_it():
    """Without TIS the first mini-batch's own forwards give pi_old (grpo_step): a pass of its own only for the later
    mini-batches' rows; with TIS for every row."""
    import update_options

    for minibatches, tis_cap, per_token, said in [(1, 0.0, 6, None), (2, 0.0, 7, "1N old log-probs (the later"),
                                                   (4, 0.0, 7.5, "1.5N old log-probs (the later"),
                                                   (1, 2.0, 8, "2N old log-probs (every row")]:
        cfg = dataclasses.replace(Config(), num_minibatches=minibatches, tis_cap=tis_cap)
        cost = cost_plan(cfg, SHAPE, gpus=1, gpu="H100", decode_rate=1000.0)
        assert cost.flops_per_update_token == per_token and cost.update_flops == per_token * 1e6 * 64 * 512
        assert 2 * update_options.old_pass_share(cfg) + 6 == per_token  # the rule the dry run prices
        line = next(line for line in cost_table(cfg, cost, 1, "H100", 0.35).splitlines() if "update:" in line)
        assert (said is not None and said in line) or (said is None and "old log-probs from the same forward" in line), line


def test_decode_reads_the_weights_and_every_sequences_kv_cache_once_a_step():
    """Bandwidth, not FLOPs, bounds decode; a batch the KV cache cannot hold decodes in waves."""
    cfg = dataclasses.replace(Config(), gradient_checkpointing=True, dtype="bfloat16")  # the engine: 2 bytes a parameter
    cost = cost_plan(cfg, SHAPE, gpus=1, gpu="H100", response_tokens=48, call_s=2.0)
    assert cost.flops_per_update_token == 9 and not cost.decode_rate_assumed
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
    """Two sequences at their longest, as SimpleTIR's token budget packs them; no logits of the whole micro-batch cap it.
    Across nodes the trainer is sharded within a node and replicated (HSDP): a second node does not shrink it."""
    cfg = make_config("simpletir-7b", {})
    shape = model_shape(cfg.model)
    assert cfg.micro_batch_size == 2
    one_node = memory_plan(cfg, shape, gpus=8, gpu_gb=80)
    assert one_node.problems == [] and sum(one_node.update.values()) <= 80 and sum(one_node.rollout.values()) <= 80
    eight = memory_plan(dataclasses.replace(cfg, micro_batch_size=8), shape, gpus=16, gpu_gb=80)
    assert len(eight.problems) == 1 and eight.problems[0].startswith("the update needs 90.5 GB a GPU")
    assert "no node of 8 GPUs makes it fit" in eight.problems[0]
    two_nodes = memory_plan(cfg, shape, gpus=16, gpu_gb=80)
    assert two_nodes.problems == [] and cfg.problems_per_step % (cfg.num_minibatches * 16) == 0
    assert (one_node.shard, two_nodes.shard) == (8, 8) and two_nodes.update == one_node.update


def test_across_nodes_the_plan_prices_one_gradient_all_reduce_a_minibatch_between_nodes():
    """HSDP: each GPU's float32 gradient shard is all-reduced with its replicas on the other nodes once a mini-batch;
    a node's GPUs hold the whole gradient, and a ring all-reduce sends 2 (nodes - 1) / nodes of it."""
    from dry_run import NODE_LINK_GB_S, GB

    cfg = make_config("simpletir-7b", {})
    shape = model_shape(cfg.model)
    one = cost_plan(cfg, shape, 8, per_node=8)
    two = cost_plan(cfg, shape, 16, per_node=8)
    four = cost_plan(cfg, shape, 32, per_node=8)
    assert one.node_traffic_gb == 0.0 and one.node_traffic_s == 0.0
    p = shape["parameters"]
    assert two.node_traffic_gb == pytest.approx(cfg.num_minibatches * 2 * (1 / 2) * 4 * p / GB)
    assert four.node_traffic_gb == pytest.approx(cfg.num_minibatches * 2 * (3 / 4) * 4 * p / GB)
    assert two.update_s == pytest.approx(two.update_flops / (16 * PEAK_TFLOPS["H100"] * 1e12 * 0.35)
                                         + two.node_traffic_gb / NODE_LINK_GB_S)
    line = next(line for line in cost_table(cfg, two, 16, "H100", 0.35).splitlines() if "between nodes" in line)
    assert f"{two.node_traffic_gb:,.1f} GB a node a step" in line
    assert not any("between nodes" in line for line in cost_table(cfg, one, 8, "H100", 0.35).splitlines())


def test_dynamic_samplings_extra_rounds_are_counted_at_their_bound_each_a_rollout():
    cfg = dataclasses.replace(Config(), dynamic_sampling=True, dynamic_sampling_rounds=3)
    without = cost_plan(dataclasses.replace(cfg, dynamic_sampling=False), SHAPE, gpus=2, decode_rate=1000.0)
    cost = cost_plan(cfg, SHAPE, gpus=2, decode_rate=1000.0)
    assert without.extra_rounds == 0 and cost.extra_rounds == 3
    assert cost.round_s == pytest.approx(without.decode_s) and cost.decode_s == pytest.approx(4 * without.decode_s)
    assert cost.gpu_hours > 3 * without.gpu_hours * without.decode_s / (without.decode_s + without.update_s)
    line = next(line for line in cost_table(cfg, cost, 2, "H100", 0.35).splitlines() if "dynamic sampling" in line)
    assert "up to 3 extra round(s) a step" in line and f"{cost.round_s:,.1f} s" in line


def test_the_weight_sync_is_a_phase_of_the_plan_with_vllms_weights_awake_beside_the_trainer_state():
    """torch's cache is emptied before the wake (weight_sync.py), so the sync holds the trainer's kept state, vLLM's
    woken weights and the largest weight in flight; its KV cache wakes after, which is the rollout's line."""
    from dry_run import GB, engine_bytes

    for preset in ("torl-1.5b", "torl-7b"):
        cfg = make_config(preset, {})
        shape = model_shape(cfg.model)
        plan = memory_plan(cfg, shape, gpus=8, gpu_gb=80)
        kept = {k: v for k, v in plan.rollout.items() if not k.startswith("vLLM")}
        assert {k: plan.sync[k] for k in kept} == kept  # AdamW's moments (and DDP's buckets) stay; no gradients
        assert "gradients, float32" not in plan.sync
        assert plan.sync["vLLM's weights (awake, KV cache asleep)"] == pytest.approx(engine_bytes(cfg, shape["parameters"]) / GB)
        assert plan.sync["the largest weight in flight (embedding)"] == pytest.approx(2 * shape["embedding"] / GB)
        assert sum(plan.sync.values()) < sum(plan.rollout.values())
    tiny_gpu = memory_plan(make_config("torl-7b", {}), model_shape("Qwen/Qwen2.5-Math-7B"), gpus=8, gpu_gb=30)
    assert any(p.startswith("the ") for p in tiny_gpu.problems)


def test_the_update_plans_one_chunks_logits_and_one_recomputed_layer_not_the_whole_logits():
    from dry_run import CHUNK_BYTES, GB, HIDDEN_BYTES, LAYER_ACTIVATION_BYTES
    from logprob_chunks import CHUNK_TOKENS

    cfg = make_config("torl-1.5b", {})
    shape = model_shape(cfg.model)
    plan = memory_plan(cfg, shape, gpus=8, gpu_gb=80)
    tokens = cfg.micro_batch_size * cfg.max_model_len
    assert not any(name.startswith("logits") for name in plan.update)
    assert plan.update["one chunk's logits and float32 log-probs"] == pytest.approx(
        CHUNK_TOKENS * shape["vocab_size"] * CHUNK_BYTES / GB)
    assert plan.update[f"final hidden states of a micro-batch of {cfg.micro_batch_size} and their gradient, bf16"] == \
        pytest.approx(tokens * shape["hidden_size"] * HIDDEN_BYTES / GB)
    assert plan.update["one layer's activations, recomputed in backward"] == pytest.approx(
        tokens * shape["hidden_size"] * LAYER_ACTIVATION_BYTES / GB)


# What a GPU preset's micro-batch leaves of the GPU for what the plan does not count: the allocator's fragments.
UNCOUNTED = 0.25


@pytest.mark.parametrize("preset, gpus", [("torl-1.5b", 8), ("torl-7b", 8), ("simpletir-7b", 8)])
def test_each_gpu_presets_micro_batch_fits_the_plan_with_a_quarter_to_spare(preset, gpus):
    cfg = make_config(preset, {})
    shape = model_shape(cfg.model)

    def update_gb(size):
        return sum(memory_plan(dataclasses.replace(cfg, micro_batch_size=size), shape, gpus, 80).update.values())

    assert update_gb(cfg.micro_batch_size) <= (1 - UNCOUNTED) * 80 < update_gb(4 * cfg.micro_batch_size)


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
    cost = cost_plan(cfg, shape, 16, "A100", train_mfu=0.4, kv_tokens=memory_plan(cfg, shape, 16, 80).kv_tokens,
                     per_node=8)
    assert f"simpletir-7b: about {cost.gpu_hours:,.0f} GPU-hours on 16 x A100 at the assumed rates" in out


def test_the_pages_cost_and_simpletir_plans_are_the_dry_runs():
    """docs/05-torl.md shows the cost lines, the three totals and simpletir-7b's plans: each is what the code prints."""
    from doc_pages import says
    from dry_run import cost_table, layout_line, plan_table

    def plan(preset, gpus):
        cfg = make_config(preset, {})
        shape = model_shape(cfg.model)
        plan = memory_plan(cfg, shape, gpus, 80)
        return cfg, shape, plan, cost_plan(cfg, shape, gpus, "H100", kv_tokens=plan.kv_tokens, per_node=8)

    cfg, _, _, cost = plan("torl-1.5b", 8)
    says("05-torl.md", *[line.strip() for line in cost_table(cfg, cost, 8, "H100", 0.35).splitlines()],
         f"torl-1.5b: about {cost.gpu_hours:,.0f} GPU-hours on 8 x H100 at the assumed rates")
    says("05-torl.md", f"torl-7b, about {plan('torl-7b', 8)[3].gpu_hours:,.0f} GPU-hours on 8 x H100",
         f"simpletir-7b (below), about {plan('simpletir-7b', 16)[3].gpu_hours:,.0f} on 16 x H100")
    from dry_run import NODE_LINK_GB_S

    says("05-torl.md", f"is added to the update at an assumed {NODE_LINK_GB_S:g} GB/s a node",
         "(`dynamic_sampling_rounds`), each a rollout like the step's own")
    cfg, shape, one_node, _ = plan("simpletir-7b", 8)
    says("05-torl.md", f"steps={cfg.steps}`", f"`max_model_len={cfg.max_model_len}`", f"`tool_budget={cfg.tool_budget}`",
         f"`micro_batch_size={cfg.micro_batch_size}`: two sequences at their longest")
    chunk_gb = one_node.update["one chunk's logits and float32 log-probs"]
    says("05-torl.md", f"one chunk's logits and their float32 work are {chunk_gb:.1f} GB")
    cfg, shape, two_nodes, _ = plan("simpletir-7b", 16)
    update = next(line for line in plan_table(cfg, two_nodes, shape).splitlines() if "update (vLLM asleep)" in line)
    says("05-torl.md", update.strip())
    assert one_node.problems == [] and two_nodes.problems == []
    assert layout_line(cfg, 16).startswith("ranks: 16 x fsdp")
