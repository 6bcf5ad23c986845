"""`retool.py --dry-run`: everything a run can check without loading a model, in seconds, and a memory plan per GPU.

    .venv/bin/python 05-retool/retool.py --preset torl-1.5b --dry-run                 # 8 x 80 GB GPUs planned
    .venv/bin/python 05-retool/retool.py --preset torl-7b --dry-run --plan-gpus 1     # refused: say why

It checks the configuration, the data files (and, where the model's tokenizer is
on this machine, the prompt filter's counts), the sandbox with one real call, the
rank layout and batch split, and plans memory per GPU from the model's shape
(config.json where the model is on this machine, else bench_train.SHAPES):
the trainer's state, the update's peak (logits of one micro-batch, layer inputs),
vLLM's share and the KV cache tokens it leaves. A real run on CUDA makes the
same memory checks before it loads anything (`check_memory_plan`). The
arithmetic is the one docs/06-scaling.md explains; GB = 10^9 bytes.
"""
from __future__ import annotations

import contextlib
import io
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9
VLLM_WORK_SPACE_GB = 2.0  # vLLM's activations and graphs beside weights and KV cache (an estimate)
# per logit value at the update's backward peak: bf16 output (2), its float32 copy (4), the float32 gradient (4),
# the softmax of logsumexp's backward (4), the gradient cast back to bf16 for the output layer's backward (2)
LOGIT_BYTES = 16


@dataclass
class MemoryPlan:
    gpus: int
    gpu_gb: float
    parameters: int
    rollout: dict[str, float] = field(default_factory=dict)  # GB per GPU while sampling
    update: dict[str, float] = field(default_factory=dict)  # GB per GPU during grpo_step (vLLM asleep)
    kv_tokens: int = 0  # what vLLM's share leaves for the KV cache
    tokens_in_flight: int = 0  # this rank's trajectories at their longest
    group_tokens: int = 0  # one group at its longest
    problems: list[str] = field(default_factory=list)


def dry_run(cfg, preset: str, gpus: int, gpu_gb: float, start_sandbox) -> int:
    """Print every check and the memory plan; 0 when a real run would start, 2 when it would be refused.

    `start_sandbox(cfg)` is the loop's own (retool.py): the same start, with one real call.
    """
    from configuration import config_problems

    cuda = _cuda_gpus()
    if cuda:
        gpus, gpu_gb = int(os.environ.get("WORLD_SIZE", cuda)), _cuda_gb()
    print(f"dry run of preset {preset}: {gpus} x {gpu_gb:.0f} GB GPU(s)"
          + ("" if cuda else " planned (no CUDA here: --plan-gpus, --plan-gpu-gb)"))
    problems = config_problems(cfg, world=gpus)
    for line in problems:
        print(f"  refused: {line}")
    print(f"  configuration: {'ok' if not problems else f'{len(problems)} problem(s) above'}")
    _data_counts(cfg)
    problems += _sandbox_check(cfg, start_sandbox)
    print("  " + layout_line(cfg, gpus))
    shape = model_shape(cfg.model) if cfg.model else None
    if shape is None:
        print(f"  memory plan: the shape of '{cfg.model or 'the cold-started tiny model'}' is unknown here; skipped")
    else:
        plan = memory_plan(cfg, shape, gpus, gpu_gb)
        print(plan_table(cfg, plan, shape))
        problems += plan.problems
    print(f"dry run: {'a real run would start' if not problems else f'{len(problems)} problem(s): a real run is refused'}")
    return 2 if problems else 0


def check_memory_plan(cfg) -> None:
    """Before a real run on CUDA loads anything: refuse, in one line, a plan that cannot fit."""
    gpus = _cuda_gpus()
    shape = model_shape(cfg.model) if cfg.model and gpus else None
    if shape is None:
        return
    plan = memory_plan(cfg, shape, int(os.environ.get("WORLD_SIZE", "1")), _cuda_gb())
    if plan.problems:
        raise SystemExit(f"error: {plan.problems[0]} (see --dry-run)")


def memory_plan(cfg, shape: dict, gpus: int, gpu_gb: float) -> MemoryPlan:
    """GB per GPU during the rollout and during the update, and what cannot fit (one line each)."""
    p = shape["parameters"]
    shard = gpus if cfg.strategy == "fsdp" else 1  # FSDP2 keeps 1/N of the trainer state per GPU
    plan = MemoryPlan(gpus=gpus, gpu_gb=gpu_gb, parameters=p)
    weights, adamw, grads = 4 * p / shard / GB, 8 * p / shard / GB, 4 * p / shard / GB
    share = cfg.gpu_memory_utilization * gpu_gb
    plan.rollout = {"trainer weights, float32": weights, "AdamW m and v": adamw}
    if cfg.strategy == "ddp" and gpus > 1:  # the gradients are views of DDP's buckets, which live as long as it does
        plan.rollout["DDP's gradient buckets, float32"] = grads
    plan.rollout[f"vLLM ({cfg.gpu_memory_utilization} of the GPU)"] = share
    tokens = cfg.micro_batch_size * cfg.max_model_len
    plan.update = {"trainer weights, float32": weights, "AdamW m and v": adamw, "gradients, float32": grads,
                   f"logits of a micro-batch of {cfg.micro_batch_size}": tokens * shape["vocab_size"] * LOGIT_BYTES / GB}
    if cfg.gradient_checkpointing:
        plan.update["checkpointed layer inputs"] = tokens * shape["num_hidden_layers"] * shape["hidden_size"] * 4 / GB
    else:  # every layer's activations are kept for backward: about 16 float32 values per hidden unit (a rough bound)
        plan.update["layer activations (no checkpointing)"] = (
            tokens * shape["num_hidden_layers"] * shape["hidden_size"] * 16 * 4 / GB)
    if cfg.strategy == "fsdp":
        plan.update["gathered bf16 layers"] = 2 * (p / shape["num_hidden_layers"] + shape["embedding"]) / GB
    engine_weights = (2 if cfg.dtype in ("bfloat16", "float16", "auto") else 4) * p / GB
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2
    plan.kv_tokens = max(0, int((share - engine_weights - VLLM_WORK_SPACE_GB) * GB / kv_per_token))
    plan.group_tokens = cfg.group_size * cfg.max_model_len
    plan.tokens_in_flight = cfg.problems_per_step // gpus * cfg.group_size * cfg.max_model_len
    state_gb = weights + adamw + grads
    if state_gb > gpu_gb:
        plan.problems.append(f"the trainer state ({state_gb:.1f} GB a GPU: 16 bytes a parameter, "
                             f"{'sharded over ' + str(shard) if shard > 1 else 'unsharded'}) does not fit a "
                             f"{gpu_gb:.0f} GB GPU; {gpus_needed(cfg, shape, gpu_gb)}")
    for phase, parts in (("rollout", plan.rollout), ("update", plan.update)):
        if sum(parts.values()) > gpu_gb and not plan.problems:
            plan.problems.append(f"the {phase} needs {sum(parts.values()):.1f} GB a GPU, more than its {gpu_gb:.0f} GB"
                                 + (": lower gpu_memory_utilization" if phase == "rollout"
                                    else ": lower micro_batch_size or turn on gradient_checkpointing"))
    if plan.kv_tokens < plan.group_tokens:
        plan.problems.append(f"vLLM's KV cache ({plan.kv_tokens:,} tokens at gpu_memory_utilization "
                             f"{cfg.gpu_memory_utilization}) cannot hold one group ({cfg.group_size} x "
                             f"{cfg.max_model_len} tokens)")
    return plan


def gpus_needed(cfg, shape: dict, gpu_gb: float) -> str:
    """What makes the plan fit: the fewest GPUs under FSDP2 whose rollout and update both fit, or that none do."""
    import dataclasses

    sharded = dataclasses.replace(cfg, strategy="fsdp")
    for n in range(2, 1025):
        plan = memory_plan(sharded, shape, n, gpu_gb)
        if not plan.problems or not any(p.startswith(("the trainer state", "the rollout", "the update"))
                                        for p in plan.problems):
            return ("it needs strategy fsdp over " if cfg.strategy != "fsdp" else "it needs ") + f"at least {n} GPUs"
    return (f"no number of GPUs makes it fit at gpu_memory_utilization {cfg.gpu_memory_utilization} and "
            f"micro_batch_size {cfg.micro_batch_size}")


def plan_table(cfg, plan: MemoryPlan, shape: dict) -> str:
    rows = [f"  model {cfg.model}: {plan.parameters / 1e9:.2f}B parameters ({shape['source']})",
            f"  memory per GPU, GB ({cfg.strategy}{', trainer sharded over ' + str(plan.gpus) if cfg.strategy == 'fsdp' else ''}):"]
    for phase, parts in (("rollout", plan.rollout), ("update (vLLM asleep)", plan.update)):
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
            "vocab_size": config.vocab_size, "embedding": config.vocab_size * config.hidden_size}


def _data_counts(cfg) -> None:
    """Problems per data file, and the prompt filter's count where the model's tokenizer is on this machine."""
    from prepare_data import DataError, load_problems
    from problems_and_policy import drop_long_prompts

    for name in ("train_file", "eval_file"):
        path = getattr(cfg, name)
        try:
            rows, _ = load_problems(path) if Path(path).exists() else ([], {})
        except DataError:
            continue  # already refused above, with 01-data's message
        print(f"  {name} {path}: " + (f"{len(rows)} problems" if Path(path).exists() else "missing"))
        if name == "train_file" and rows and cfg.max_prompt_tokens:
            try:
                print("  prompt filter: ", end="")
                drop_long_prompts(rows, cfg.model, cfg)
            except OSError:
                print(f"needs the tokenizer of {cfg.model}, which is not on this machine; skipped")


def _sandbox_check(cfg, start_sandbox) -> list[str]:
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the run's own start line; the plan says it indented below
            start_sandbox(cfg).close()
    except SystemExit as refusal:
        print(f"  refused: {str(refusal.code).removeprefix('error: ')}")
        return [str(refusal.code)]
    print(f"  sandbox: ok ({cfg.sandbox_backend}, {cfg.sandbox_isolation}; started and one call in "
          f"{time.perf_counter() - t0:.1f} s)")
    return []


def _cuda_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_gb() -> float:
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GB
