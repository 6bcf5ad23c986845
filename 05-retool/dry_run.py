"""`retool.py --dry-run`: everything a run can check without loading a model, in seconds, and a memory plan per GPU.

    .venv/bin/python 05-retool/retool.py --preset torl-1.5b --dry-run                 # 8 x 80 GB GPUs planned
    .venv/bin/python 05-retool/retool.py --preset torl-7b --dry-run --plan-gpus 1     # refused: say why
    .venv/bin/python 05-retool/retool.py --preset simpletir-7b --dry-run --plan-nodes 2

It checks the configuration, data files, sandbox (one real call) and rank layout, plans memory per GPU from the
model's shape (`memory_plan`; on CUDA a real run checks it too) and the schedule's cost from FLOPs and assumed rates
(`cost_plan`). The arithmetic: docs/06-scaling.md; GB = 10^9 bytes.
"""
from __future__ import annotations

import contextlib
import io
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

GB = 1e9
VLLM_WORK_SPACE_GB = 2.0  # vLLM's activations and graphs beside weights and KV cache (an estimate)
# Logits exist one chunk at a time (logprob_chunks.py): CHUNK_BYTES per value of a chunk, measured
# (test_the_plans_logit_bytes_are_what_the_chunks_hold); the micro-batch's final hidden states and their gradient, bf16,
# take HIDDEN_BYTES per hidden unit.
CHUNK_BYTES = 20
HIDDEN_BYTES = 4
# Dense bf16 peak of one GPU, TFLOP/s, and its memory bandwidth, TB/s: the vendors' data sheets (SXM, no sparsity).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}
HBM_TBPS = {"H100": 3.35, "H200": 4.8, "A100": 2.04, "B200": 8.0}
# Assumed until a run measures them (decode_tokens_per_s, sandbox_s): the share of the data sheet's bandwidth a
# decode step reaches (decode is bound by memory traffic), and a tool call's seconds on the longest trajectory's path.
DECODE_BANDWIDTH_SHARE = 0.6
TOOL_CALL_S = 1.0
TRAIN_MFU = 0.35  # the update's default share of the peak FLOP/s
# Memory no allocator counts (assumed, to be corrected by a run's peak_memory_gb):
CONTEXT_GB = 1.0  # the CUDA context, cuBLAS and kernel images (more without CUDA's lazy loading)
NCCL_GB = 1.0  # NCCL's communicators and their buffers, with more than one GPU
CUDA_GRAPHS_GB = 1.0  # vLLM's captured CUDA graphs (enforce_eager False): their pool stays while vLLM sleeps
NODE_LINK_GB_S = 400.0  # a node's bandwidth to the others, GB/s, assumed: 8 x 400 Gb/s InfiniBand, as H100 clusters
LAYER_ACTIVATION_BYTES = 16 * 4  # a layer's activations: about 16 float32 values a hidden unit a token (rough)
PLAN_GPUS = {"gpu": 8, "demo": 1}  # --plan-gpus' default: a node of 8 for a GPU preset; the demos run as one process


def add_plan_flags(parser) -> None:
    """The dry run's flags: the GPUs it plans for without CUDA, the rates its cost assumes (fill_plan_defaults)."""
    from lab_cli import at_least

    plan = parser.add_argument_group("--dry-run: the GPUs to plan for (without CUDA) and the assumed rates of its cost")
    plan.add_argument("--plan-gpus", type=at_least(1),
                      help=f"GPUs a node [default: {PLAN_GPUS['gpu']} for a GPU preset, else {PLAN_GPUS['demo']}]")
    plan.add_argument("--plan-nodes", type=at_least(1), default=1, help="nodes [default: 1]")
    plan.add_argument("--plan-gpu-gb", type=at_least(1.0, float), default=80.0, help="memory of each GPU, GB [default: 80]")
    plan.add_argument("--plan-gpu", choices=sorted(PEAK_TFLOPS), default="H100",
                      help="the GPU, for its peak bf16 FLOP/s [default: H100]")
    plan.add_argument("--assume-decode-rate", type=at_least(0.0, float), default=0.0,
                      help=f"tokens/s one GPU decodes; 0: from its memory bandwidth (weights and KV read a step, at "
                           f"{DECODE_BANDWIDTH_SHARE * 100:g}%% of the data sheet's) [default: 0]")
    plan.add_argument("--assume-call-s", type=at_least(0.0, float), default=TOOL_CALL_S,
                      help=f"seconds a tool call adds to the longest trajectory [default: {TOOL_CALL_S:g}]")
    plan.add_argument("--assume-train-mfu", type=at_least(0.001, float), default=TRAIN_MFU,
                      help=f"the update's share of the peak FLOP/s [default: {TRAIN_MFU}]")
    plan.add_argument("--assume-response-tokens", type=at_least(0), default=0,
                      help="mean response length, tokens; 0: the budget, max_response_tokens [default: 0]")


def fill_plan_defaults(args) -> None:
    """The one rule for --plan-gpus when it is not given: PLAN_GPUS by the kind of `args.preset`."""
    from presets import GPU_PRESETS

    args.plan_gpus = args.plan_gpus or PLAN_GPUS["gpu" if args.preset in GPU_PRESETS else "demo"]


@dataclass
class CostPlan:
    trajectories: int  # a step's, on all ranks
    response_tokens: int  # each trajectory's, as assumed
    decode_tokens: int  # a step's rollout: generated tokens (tool output counted too: an upper bound)
    update_tokens: int  # a step's update: every token of every trajectory, prompt and response
    flops_per_update_token: float  # in units of N: 2 x the rows whose old log-probs take a pass + 6 (forward, backward) + 2 (recompute)
    decode_flops: float
    update_flops: float
    decode_rate: float  # tokens/s a GPU, over the rollout
    decode_rate_assumed: bool  # --assume-decode-rate, not the bandwidth model
    decode_step_ms: float  # one decode step of a GPU's batch: weights and KV read once (bandwidth model)
    waves: int  # batches a GPU's trajectories decode in, when the KV cache cannot hold them all
    tool_calls_s: float  # the longest trajectory's tool calls, on the rollout's critical path
    decode_s: float  # the rollout: its slowest GPU's batches plus the longest trajectory's calls
    update_s: float
    eval_s: float  # one evaluation, by the same decode model
    gpu_hours: float  # the whole schedule, evaluations included
    extra_rounds: int = 0  # dynamic sampling: the most extra rollout rounds a step may take, each counted as a rollout
    round_s: float = 0.0  # one rollout round (the step's own or an extra one)
    node_traffic_gb: float = 0.0  # what each node sends to the others a step (HSDP's gradient all-reduce)
    node_traffic_s: float = 0.0  # its time at NODE_LINK_GB_S, added to the update's


@dataclass
class MemoryPlan:
    gpus: int
    gpu_gb: float
    parameters: int
    rollout: dict[str, float] = field(default_factory=dict)  # GB per GPU while sampling
    update: dict[str, float] = field(default_factory=dict)  # GB per GPU during grpo_step (vLLM asleep)
    sync: dict[str, float] = field(default_factory=dict)  # GB per GPU while the new weights load (vLLM's KV cache asleep)
    shard: int = 1  # the GPUs the trainer state is sharded over: FSDP2's within a node (HSDP across nodes), else 1
    kv_tokens: int = 0  # what vLLM's share leaves for the KV cache
    tokens_in_flight: int = 0  # this rank's trajectories at their longest
    group_tokens: int = 0  # one group at its longest
    problems: list[str] = field(default_factory=list)


def dry_run(cfg, preset: str, args, start_sandbox, run_dir: Path) -> int:
    """Print every check, the memory plan and the cost; 0 when a real run would start, 2 when it would be refused.
    `start_sandbox(cfg)`: the loop's own start; `run_dir` is checked as the run checks it, nothing removed."""
    from configuration import config_problems
    from run_folders import check_new_run_dir

    cuda, cuda_gb = _cuda()
    per_node, nodes, gpu_gb = args.plan_gpus, args.plan_nodes, args.plan_gpu_gb
    if cuda:
        per_node, nodes, gpu_gb = cuda, max(1, int(os.environ.get("WORLD_SIZE", cuda)) // cuda), cuda_gb
    gpus = per_node * nodes
    print(f"dry run of preset {preset}: {gpus} x {gpu_gb:.0f} GB GPU(s)" + (f" ({nodes} nodes of {per_node})" if nodes > 1 else "")
          + ("" if cuda else " planned (no CUDA here: --plan-gpus, --plan-nodes, --plan-gpu-gb)"))
    problems = config_problems(cfg, world=gpus)
    for line in problems:
        print(f"  refused: {line}")
    print(f"  configuration: {'ok' if not problems else f'{len(problems)} problem(s) above'}")
    try:
        check_new_run_dir(run_dir, args.overwrite, remove=False)
        from lab_cli import shown  # absolute outside the lab's folder, where runs/ is not the lab's

        print(f"  run folder: {shown(run_dir)} (ok)")
    except SystemExit as refusal:
        print(f"  refused: {str(refusal.code).removeprefix('error: ')}")
        problems.append(str(refusal.code))
    counts = _data_counts(cfg)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the run's own start line; the plan says it indented below
            start_sandbox(cfg).close()
        print(f"  sandbox: ok ({cfg.sandbox_backend}, {cfg.sandbox_isolation}; started and one call in "
              f"{time.perf_counter() - t0:.1f} s)")
    except SystemExit as refusal:
        print(f"  refused: {str(refusal.code).removeprefix('error: ')}")
        problems.append(str(refusal.code))
    if problem := driver_problem():
        print(f"  refused: {problem}")
        problems.append(problem)
    print("  " + layout_line(cfg, gpus))
    shape = model_shape(cfg.model) if cfg.model else None
    if shape is None:
        print(f"  memory plan: the shape of '{cfg.model or 'the cold-started tiny model'}' is unknown here; skipped")
    else:
        plan = memory_plan(cfg, shape, gpus, gpu_gb, per_node)
        print(plan_table(cfg, plan, shape))
        problems += plan.problems
        cost = cost_plan(cfg, shape, gpus, args.plan_gpu, args.assume_decode_rate, args.assume_train_mfu,
                         args.assume_response_tokens, args.assume_call_s, plan.kv_tokens,
                         rows_evaluated(cfg, counts.get("eval_file", 0)), per_node=per_node)
        print(cost_table(cfg, cost, gpus, args.plan_gpu, args.assume_train_mfu))
        print(f"{preset}: about {cost.gpu_hours:,.0f} GPU-hours on {gpus} x {args.plan_gpu} at the assumed rates")
    print(f"dry run: {'a real run would start' if not problems else f'{len(problems)} problem(s): a real run is refused'}")
    return 2 if problems else 0


def check_memory_plan(cfg) -> None:
    """Before a real run on CUDA loads anything: refuse, in one line, a plan that cannot fit."""
    gpus, gpu_gb = _cuda()
    shape = model_shape(cfg.model) if cfg.model and gpus else None
    if shape is None:
        return
    plan = memory_plan(cfg, shape, int(os.environ.get("WORLD_SIZE", "1")), gpu_gb, per_node=gpus)
    if plan.problems:
        raise SystemExit(f"error: {plan.problems[0]} (see --dry-run)")


def cost_plan(cfg, shape: dict, gpus: int, gpu: str = "H100", decode_rate: float = 0.0,
              train_mfu: float = TRAIN_MFU, response_tokens: int = 0, call_s: float = TOOL_CALL_S,
              kv_tokens: int = 0, eval_rows: int = 0, per_node: int | None = None) -> CostPlan:
    """A step's tokens, FLOPs and seconds on `gpus` GPUs, and the GPU-hours of `cfg.steps` steps, each rank planned
    at the budget. Each term and what is not counted: docs/05-torl.md, "The cost before the run"."""
    from update_options import old_pass_share

    n, peak = shape["parameters"], PEAK_TFLOPS[gpu] * 1e12
    response = response_tokens or cfg.max_response_tokens
    prompt = cfg.max_model_len - cfg.max_response_tokens  # the prompt's share of the context
    trajectories = cfg.problems_per_step * cfg.group_size
    old_pass = 2 * old_pass_share(cfg)  # grpo_step's old log-probs, for the rows that take a pass of their own
    per_token = old_pass + 6 + (2 if cfg.gradient_checkpointing else 0)  # forward and backward, recompute
    decode_tokens, update_tokens = trajectories * response, trajectories * (prompt + response)
    calls_s = cfg.tool_budget * call_s

    def rollout_s(sequences: int, steps: int) -> tuple[float, float, int]:
        """(seconds, ms a decode step, waves) for one GPU's `sequences` decoding `steps` tokens each."""
        waves = max(1, -(-sequences * cfg.max_model_len // kv_tokens)) if kv_tokens else 1
        batch = -(-sequences // waves)
        read = engine_bytes(cfg, n) + batch * kv_bytes_per_token(shape) * (prompt + steps / 2)
        step_s = read / (HBM_TBPS[gpu] * 1e12 * DECODE_BANDWIDTH_SHARE)
        if decode_rate:
            return sequences * steps / decode_rate + calls_s, 1000 * step_s, waves
        return waves * steps * step_s + calls_s, 1000 * step_s, waves

    round_s, step_ms, waves = rollout_s(-(-trajectories // gpus), response)
    extra_rounds = cfg.dynamic_sampling_rounds if cfg.dynamic_sampling else 0  # the ranks agree on them: the bound
    decode_s = round_s * (1 + extra_rounds)
    eval_s = rollout_s(-(-eval_rows * cfg.eval_k // gpus), cfg.eval_max_response_tokens)[0] if eval_rows else 0.0
    update_flops = per_token * n * update_tokens
    traffic_gb = node_traffic_gb(cfg, n, gpus, per_node or gpus)
    update_s = update_flops / (gpus * peak * train_mfu) + traffic_gb / NODE_LINK_GB_S
    evals = cfg.steps // cfg.eval_every if cfg.eval_every else 0
    hours = ((decode_s + update_s) * cfg.steps + eval_s * (evals + 2)) * gpus / 3600  # and before and after
    rate = decode_rate or decode_tokens / gpus / max(round_s - calls_s, 1e-9)
    return CostPlan(trajectories, response, decode_tokens, update_tokens, per_token, 2 * n * decode_tokens,
                    update_flops, rate, bool(decode_rate), step_ms, waves, calls_s, decode_s, update_s, eval_s, hours,
                    extra_rounds, round_s, traffic_gb, traffic_gb / NODE_LINK_GB_S)


def node_traffic_gb(cfg, parameters: int, gpus: int, per_node: int) -> float:
    """GB each node sends to the others a step: the float32 gradient's ring all-reduce across nodes, once a mini-batch,
    2 (nodes - 1) / nodes of it (a node's GPUs hold the whole gradient: HSDP's shards; NCCL's hierarchical all-reduce)."""
    nodes = max(1, gpus // per_node)
    return cfg.num_minibatches * 2 * (nodes - 1) / nodes * 4 * parameters / GB


def engine_bytes(cfg, parameters: int) -> int:
    """The sampler's copy of the weights: bf16 (or fp16) as vLLM holds them, float32 when asked."""
    return (2 if cfg.dtype in ("bfloat16", "float16", "auto") else 4) * parameters


def kv_bytes_per_token(shape: dict) -> int:
    """K and V, bf16, every layer."""
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2


def cost_table(cfg, cost: CostPlan, gpus: int, gpu: str, train_mfu: float) -> str:
    from update_options import old_pass_share

    share = old_pass_share(cfg)
    old = (f"{2 * share:g}N old log-probs ({'every row' if share == 1 else 'the later mini-batches'}), " if share
           else "")
    recompute = ", 2N gradient checkpointing's recompute" if cfg.gradient_checkpointing else ""
    how = (f"{cost.decode_rate:,.0f} tokens/s a GPU (--assume-decode-rate)" if cost.decode_rate_assumed else
           f"{cost.decode_rate:,.0f} tokens/s a GPU: a step reads the weights and the batch's KV cache, "
           f"{cost.decode_step_ms:.1f} ms at {DECODE_BANDWIDTH_SHARE:.0%} of {HBM_TBPS[gpu]:g} TB/s"
           + (f", in {cost.waves} waves" if cost.waves > 1 else ""))
    step = cost.decode_s + cost.update_s
    evals = (f" + an evaluation every {cfg.eval_every} steps, {cost.eval_s:,.1f} s each" if cost.eval_s else
             " (evaluations not counted: the eval file is not on this machine)" if cfg.eval_every else "")
    return "\n".join([
        f"  cost (assumed rates, not measurements: {gpu} at {PEAK_TFLOPS[gpu]:g} TFLOP/s bf16; --assume-*):",
        f"    rollout: {cost.trajectories:,} trajectories x {cost.response_tokens:,} tokens = "
        f"{cost.decode_tokens:,} decode tokens a step, 2N FLOPs each: {cost.decode_flops / 1e15:,.1f} PFLOP",
        f"    update: {cost.trajectories:,} x {cfg.max_model_len - cfg.max_response_tokens + cost.response_tokens:,} "
        f"tokens = {cost.update_tokens:,} tokens a step, {cost.flops_per_update_token:g}N FLOPs each ({old}"
        f"6N forward and backward{recompute}{'' if old else '; old log-probs from the same forward'}): {cost.update_flops / 1e15:,.1f} PFLOP",
        f"    decode at {how}; the longest trajectory's {cfg.tool_budget} tool call(s) add {cost.tool_calls_s:,.1f} s",
        *([f"    dynamic sampling: up to {cost.extra_rounds} extra round(s) a step, each a rollout of "
           f"{cost.round_s:,.1f} s; the ranks agree on each round, and the step counts all {cost.extra_rounds}"]
          if cost.extra_rounds else []),
        *([f"    between nodes (HSDP: sharded within a node, replicated across): the gradient's all-reduce, "
           f"{cost.node_traffic_gb:,.1f} GB a node a step, {cost.node_traffic_s:,.2f} s at an assumed "
           f"{NODE_LINK_GB_S:g} GB/s (in the update's time)"] if cost.node_traffic_gb else []),
        f"    time a step on {gpus} GPUs (the slowest rank's, at the budget): rollout {cost.decode_s:,.1f} s + update at "
        f"{train_mfu:.0%} MFU {cost.update_s:,.1f} s = {step:,.1f} s{evals}; {cfg.steps:,} steps: "
        f"{cost.gpu_hours / gpus:,.1f} hours",
        "    a real run logs the measured counterparts in metrics.jsonl: peak_memory_gb (the fullest rank's), "
        "decode_tokens_per_s, update_s, informative_frac"])


def memory_plan(cfg, shape: dict, gpus: int, gpu_gb: float, per_node: int = 8, advise: bool = True) -> MemoryPlan:
    """GB per GPU during the rollout, the update and the weight sync, and what cannot fit (one line each)."""
    from logprob_chunks import CHUNK_TOKENS

    p = shape["parameters"]
    shard = min(gpus, per_node) if cfg.strategy == "fsdp" else 1  # FSDP2 keeps 1/N of the trainer state per GPU
    plan = MemoryPlan(gpus=gpus, gpu_gb=gpu_gb, parameters=p, shard=shard)
    weights, adamw, grads = 4 * p / shard / GB, 8 * p / shard / GB, 4 * p / shard / GB
    share = cfg.gpu_memory_utilization * gpu_gb
    # AdamW's moments exist from the start (make_optimizer), before vLLM takes its share
    plan.rollout = {"trainer weights, float32": weights, "AdamW m and v": adamw}
    if cfg.strategy == "ddp" and gpus > 1:  # the gradients are views of DDP's buckets, which live as long as it does
        plan.rollout["DDP's gradient buckets, float32"] = grads
    plan.rollout[f"vLLM ({cfg.gpu_memory_utilization} of the GPU)"] = share
    tokens, hidden = cfg.micro_batch_size * cfg.max_model_len, shape["hidden_size"]
    plan.update = {"trainer weights, float32": weights, "AdamW m and v": adamw, "gradients, float32": grads,
                   f"final hidden states of a micro-batch of {cfg.micro_batch_size} and their gradient, bf16":
                       tokens * hidden * HIDDEN_BYTES / GB,
                   "one chunk's logits and float32 log-probs": min(tokens, CHUNK_TOKENS) * shape["vocab_size"] * CHUNK_BYTES / GB}
    if cfg.gradient_checkpointing:
        plan.update["checkpointed layer inputs"] = tokens * shape["num_hidden_layers"] * hidden * 4 / GB
        plan.update["one layer's activations, recomputed in backward"] = tokens * hidden * LAYER_ACTIVATION_BYTES / GB
    else:  # every layer's activations are kept for backward
        plan.update["layer activations (no checkpointing)"] = (
            tokens * shape["num_hidden_layers"] * hidden * LAYER_ACTIVATION_BYTES / GB)
    if cfg.strategy == "fsdp":
        # What FSDP2 holds unsharded (docs/06-scaling.md): the root, two layers, one layer's gradients.
        root = shape["embedding"] * (1 if shape.get("tied", False) else 2)
        layer = (p - root) / shape["num_hidden_layers"]
        plan.update["FSDP2's unsharded root (embedding, lm_head), bf16, and its bf16 gradient"] = 4 * root / GB
        plan.update["two gathered bf16 layers (the running one and the prefetched next)"] = 4 * layer / GB
        plan.update["a layer's unsharded gradients, bf16 and float32"] = 6 * layer / GB
    # The sync (weight_sync.py): vLLM's weights woken and loaded a tensor at a time, its KV cache still asleep.
    plan.sync = {name: gb for name, gb in plan.rollout.items() if not name.startswith("vLLM")}
    plan.sync["vLLM's weights (awake, KV cache asleep)"] = engine_bytes(cfg, p) / GB
    plan.sync["the largest weight in flight (embedding)"] = engine_bytes(cfg, shape["embedding"]) / GB
    reserves = {"CUDA context": CONTEXT_GB} | ({"NCCL": NCCL_GB} if gpus > 1 else {})
    for phase in (plan.rollout, plan.update, plan.sync):
        phase.update(reserves)
    if not cfg.enforce_eager:  # inside vLLM's share while it runs
        plan.update["vLLM's CUDA graphs (asleep)"] = plan.sync["vLLM's CUDA graphs"] = CUDA_GRAPHS_GB
    plan.kv_tokens = max(0, int((share - engine_bytes(cfg, p) / GB - VLLM_WORK_SPACE_GB) * GB / kv_bytes_per_token(shape)))
    plan.group_tokens = cfg.group_size * cfg.max_model_len
    plan.tokens_in_flight = cfg.problems_per_step // gpus * cfg.group_size * cfg.max_model_len
    state_gb = weights + adamw + grads
    advice = (lambda: gpus_needed(cfg, shape, gpu_gb, per_node)) if advise else (lambda: "")
    if state_gb > gpu_gb:
        plan.problems.append(f"the trainer state ({state_gb:.1f} GB a GPU: 16 bytes a parameter, "
                             f"{'sharded over ' + str(shard) if shard > 1 else 'unsharded'}) does not fit a "
                             f"{gpu_gb:.0f} GB GPU; {advice()}")
    for phase, parts in (("rollout", plan.rollout), ("update", plan.update), ("weight sync", plan.sync)):
        if sum(parts.values()) > gpu_gb and not plan.problems:
            plan.problems.append(f"the {phase} needs {sum(parts.values()):.1f} GB a GPU, more than its {gpu_gb:.0f} GB"
                                 + (": lower gpu_memory_utilization" if phase == "rollout" else
                                    ": lower micro_batch_size, turn on gradient_checkpointing, or shard the trainer"
                                    f" over more GPUs ({advice()})" if cfg.strategy == "fsdp" else
                                    ": lower micro_batch_size or turn on gradient_checkpointing"))
    if plan.kv_tokens < plan.group_tokens:
        plan.problems.append(f"vLLM's KV cache ({plan.kv_tokens:,} tokens at gpu_memory_utilization "
                             f"{cfg.gpu_memory_utilization}) cannot hold one group ({cfg.group_size} x "
                             f"{cfg.max_model_len} tokens)")
    return plan


def gpus_needed(cfg, shape: dict, gpu_gb: float, per_node: int = 8) -> str:
    """What makes the plan fit: the fewest GPUs of a node under FSDP2 (more nodes replicate it), or that none do."""
    sharded, largest = replace(cfg, strategy="fsdp"), max(per_node, PLAN_GPUS["gpu"])
    for n in range(2, largest + 1):
        plan = memory_plan(sharded, shape, n, gpu_gb, per_node=largest, advise=False)
        if not any(p.startswith(("the trainer state", "the rollout", "the update", "the weight sync"))
                   for p in plan.problems):
            return ("it needs strategy fsdp over " if cfg.strategy != "fsdp" else "it needs ") + f"at least {n} GPUs"
    return (f"no node of {largest} GPUs makes it fit (FSDP2 shards within a node) at gpu_memory_utilization "
            f"{cfg.gpu_memory_utilization} and micro_batch_size {cfg.micro_batch_size}")


def plan_table(cfg, plan: MemoryPlan, shape: dict) -> str:
    rows = [f"  model {cfg.model}: {plan.parameters / 1e9:.2f}B parameters ({shape['source']})",
            f"  memory per GPU, GB ({cfg.strategy}{', trainer sharded over ' + str(plan.shard) if cfg.strategy == 'fsdp' else ''}"
            f"{', replicated across ' + str(plan.gpus // plan.shard) + ' nodes (HSDP)' if plan.gpus > plan.shard > 1 else ''}):"]
    for phase, parts in (("rollout", plan.rollout), ("update (vLLM asleep)", plan.update),
                         ("weight sync (vLLM's weights awake)", plan.sync)):
        rows.append(f"    {phase}: " + ", ".join(f"{name} {gb:.1f}" for name, gb in parts.items())
                    + f" = {sum(parts.values()):.1f} of {plan.gpu_gb:.0f}")
    fits = "all fit" if plan.kv_tokens >= plan.tokens_in_flight else "the rest wait (preempted) while others finish"
    rows.append(f"    KV cache: {plan.kv_tokens:,} tokens; one group needs {plan.group_tokens:,}; this rank's "
                f"trajectories at their longest {plan.tokens_in_flight:,} ({fits})")
    rows += [f"  refused: {line}" for line in plan.problems]
    return "\n".join(rows)


def layout_line(cfg, gpus: int) -> str:
    per_rank = cfg.problems_per_step // gpus if cfg.problems_per_step % gpus == 0 else cfg.problems_per_step / gpus
    trajectories = per_rank * cfg.group_size
    return (f"ranks: {gpus} x {cfg.strategy}; a step: {cfg.problems_per_step} problems x {cfg.group_size} samples; "
            f"per rank {per_rank} problems ({trajectories} trajectories) in {cfg.num_minibatches} mini-batch(es), "
            f"micro-batches of {cfg.micro_batch_size}")


def model_shape(model: str) -> dict | None:
    """The numbers the plan needs, from the model's config.json (on this machine) or bench_train.SHAPES, else None."""
    from transformers import AutoConfig

    try:
        config, source = AutoConfig.from_pretrained(model, local_files_only=True), "its config.json"
    except Exception:
        from bench_train import SHAPES
        from transformers import Qwen2Config

        name = model.rsplit("/", 1)[-1].lower()
        if name not in SHAPES:
            return None
        config, source = Qwen2Config(**SHAPES[name]), "bench_train.SHAPES: the model is not on this machine"
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # counts parameters without allocating them
        counted = AutoModelForCausalLM.from_config(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"parameters": sum(t.numel() for t in counted.parameters()), "source": source,
            "num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "num_key_value_heads": config.num_key_value_heads, "head_dim": head_dim,
            "vocab_size": config.vocab_size, "embedding": config.vocab_size * config.hidden_size,
            "tied": bool(getattr(config, "tie_word_embeddings", False))}


def _data_counts(cfg) -> dict[str, int]:
    """Print each data file's problems (and the prompt filter's count where the tokenizer is here); return them."""
    from lab_cli import shown  # absolute outside the lab's folder: a dry run says where the data would go
    from prepare_data import DataError, load_problems
    from problems_and_policy import drop_long_prompts, task_files, tasks_to_write

    counts, written = {}, {str(p) for task in tasks_to_write(cfg) for p in task_files(task)}
    for name in ("train_file", "eval_file"):
        path = getattr(cfg, name)
        try:
            rows, _ = load_problems(path) if Path(path).exists() else ([], {})
        except DataError:
            continue  # already refused above, with 01-data's message
        counts[name] = len(rows)
        print(f"  {name} {shown(path)}: " + (f"{len(rows)} problems" if Path(path).exists() else
                                      "written at the run's start" if path in written else "missing"))
        if name == "train_file" and rows and cfg.max_prompt_tokens:
            try:
                print("  prompt filter: ", end="")
                drop_long_prompts(rows, cfg.model, cfg)
            except OSError:
                print(f"needs the tokenizer of {cfg.model}, which is not on this machine; skipped")
    return counts


def rows_evaluated(cfg, eval_file_rows: int) -> int:
    """The problems an evaluation samples: eval_problems, else every row of the eval file (0 where it is not here)."""
    if cfg.eval_problems and eval_file_rows:
        return min(cfg.eval_problems, eval_file_rows)
    return cfg.eval_problems or (eval_file_rows if cfg.eval_every else 0)


MIN_DRIVER = 580  # the Makefile's MIN_DRIVER: libcudart.so.13, which the CUDA 13 wheels load, needs it


def driver_problem() -> str | None:
    """Where nvidia-smi reports a driver older than the CUDA 13 wheels need: what to do, in one line; else None."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None  # no NVIDIA GPU here: the plan is for another machine
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        found = []
    driver = found[0] if found else "(none reported by nvidia-smi)"
    major = driver.split(".")[0]
    if major.isdigit() and int(major) >= MIN_DRIVER:
        return None
    return (f"NVIDIA driver {driver} is older than {MIN_DRIVER}, which the CUDA 13 build of torch and vLLM needs "
            "(torch would see no GPU): update the driver")


def _cuda() -> tuple[int, float]:
    """(the GPUs CUDA sees here, the first one's GB); (0, 0.0) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0, 0.0
    return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / GB
