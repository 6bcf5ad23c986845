"""`make gpu-check`: the trainer's side of the GPU path on one CUDA GPU, in a few minutes, beside the dry run's plan.

    make gpu-check                     # with the lab's venv
    make gpu-check PY=python3 STAMP=   # a machine with torch and transformers but no venv (and no vLLM)

A random-init model of Qwen2.5-Math-1.5B's shape, sharded by FSDP2 on one rank as distributed.py shards it, takes
grpo_step at the torl-1.5b preset's settings: tokens a second and the allocator's peak beside the dry run's plan for
the update, part by part. No vLLM (the sampler's side needs it); without CUDA it refuses in one line.
"""
from __future__ import annotations

import os
import time

from lab_cli import at_least, run_script, script_parser

SHAPE = "qwen2.5-math-1.5b"
PRESET = "torl-1.5b"


def main(argv: list[str] | None = None) -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--sequences", type=at_least(1), default=16,
                        help="trajectories a step: two of the preset's micro-batches [default: 16]")
    parser.add_argument("--steps", type=at_least(1), default=2, help="timed steps after one warm-up [default: 2]")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: make gpu-check needs a CUDA GPU and torch sees none here; on a CPU the tests "
                         "(make test) and the dry run (retool.py --preset torl-1.5b --dry-run) check this path")
    print("\n".join(check(args.sequences, args.steps)))


def check(sequences: int, steps: int) -> list[str]:
    import dataclasses

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config

    from bench_train import SHAPES, reset_peak_memory, synthetic_trajectories, timed_steps, token_counts
    from configuration import make_config
    from distributed import DataParallel
    from dry_run import GB, memory_plan, model_shape
    from grpo import GRPOConfig, make_optimizer

    cfg = dataclasses.replace(make_config(PRESET, {}), strategy="fsdp")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)  # FSDP2 on one rank: its all-gathers and reduce-scatters
    try:
        torch.cuda.set_device(0)
        config = Qwen2Config(**SHAPES[SHAPE])
        t0 = time.perf_counter()
        with torch.device("cuda"):  # random init on the GPU: minutes on a CPU
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = DataParallel(0, 1, strategy="fsdp").fully_shard(model)
        grpo_cfg = GRPOConfig(lr=cfg.lr, num_minibatches=cfg.num_minibatches, micro_batch_size=cfg.micro_batch_size,
                              gradient_checkpointing=cfg.gradient_checkpointing, temperature=cfg.temperature)
        optimizer = make_optimizer(model, grpo_cfg)  # AdamW's moments now, as the loop makes them
        built_s = time.perf_counter() - t0
        prompt = cfg.max_model_len - cfg.max_response_tokens
        trajectories = synthetic_trajectories(sequences, cfg.group_size, prompt, cfg.max_response_tokens,
                                              config.vocab_size)
        tokens = token_counts(trajectories)[0]
        timed_steps(model, optimizer, trajectories, grpo_cfg, 1)  # warm-up: kernels, the allocator's pools
        reset_peak_memory()
        times = timed_steps(model, optimizer, trajectories, grpo_cfg, steps)
        allocated, reserved = torch.cuda.max_memory_allocated() / GB, torch.cuda.max_memory_reserved() / GB
    finally:
        dist.destroy_process_group()
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / GB
    plan = memory_plan(cfg, model_shape(f"Qwen/{SHAPE}"), gpus=1, gpu_gb=gpu_gb, per_node=1).update
    # what the allocator counts: not the CUDA context, nor vLLM's graphs (no vLLM here)
    counted = {name: gb for name, gb in plan.items() if name != "CUDA context" and not name.startswith("vLLM")}
    best = min(times)
    return [f"gpu-check: {torch.cuda.get_device_name(0)}, {gpu_gb:.0f} GB; random-init {SHAPE} built and sharded "
            f"(FSDP2, one rank) in {built_s:.1f} s",
            f"step: {sequences} sequences x ({prompt} prompt + {cfg.max_response_tokens} response) tokens, micro-batch "
            f"{grpo_cfg.micro_batch_size}, gradient checkpointing {'on' if grpo_cfg.gradient_checkpointing else 'off'}",
            f"time: {best:.2f} s a step (best of {steps}), {tokens / best:,.0f} tokens/s",
            "plan for the update phase (dry_run.memory_plan, the parts the allocator counts), GB: "
            + ", ".join(f"{name} {gb:.1f}" for name, gb in counted.items()) + f" = {sum(counted.values()):.1f}",
            f"measured: allocated at most {allocated:.1f} GB, reserved at most {reserved:.1f} GB: "
            + ("within the plan" if allocated <= sum(counted.values()) else
               f"{allocated - sum(counted.values()):.1f} GB over the plan")]


if __name__ == "__main__":
    run_script(main)  # the libraries' console chatter off first
