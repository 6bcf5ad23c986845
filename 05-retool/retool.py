"""Chapter 05: the training loop, a plain Python loop that turns the earlier chapters into RL.

    make run-05                      # cpu-demo: cold start + RL on the toy task, on the CPU
    make run-05 PRESET=smollm2       # SmolLM2-135M learns to hand arithmetic to Python, on the CPU
    make run-05 PRESET=torl-1.5b     # Qwen2.5-Math-1.5B with ToRL's recipe, on a GPU
    .venv/bin/python 05-retool/retool.py --steps 60 --lr 1e-5     # every Config field is a flag
    .venv/bin/python 05-retool/retool.py --resume RUN_DIR         # (--plot RUN_DIR redraws plots.png)

One step (`train_step`): sample groups with the sandbox in the loop (03, 02),
score them (04), turn rewards into group advantages and update the policy
(06), copy the new weights into vLLM (06). Key decisions: the trainer and vLLM
share one process and the weights are copied in memory after every update;
the update is on-policy, at the sampling temperature; the run folder, resume,
stops, evaluations and trackers are one object, `RunRecord` (run_record.py),
and data parallel one object, `dp` (06's distributed.py), so the loop shows
the method. The story: docs/05-retool.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

try:  # the lab's folders are on the path only in its own Python (the venv's tool_rl_lab.pth)
    from lab_cli import at_least, private_tmp, refuse_chapter_folder, run_script
except ModuleNotFoundError:
    sys.exit(f"error: {sys.executable} is not the lab's Python: run .venv/bin/python {sys.argv[0]}, or make")
from batch_filters import excluded_from_loss, extra_seed, keep_informative_groups
from configuration import check_config, cuda_available, parse_with_field_flags, sandbox_config
from dry_run import add_plan_flags, check_memory_plan, dry_run, fill_plan_defaults
from plots import plot_run
from presets import GPU_PRESETS, PRESETS
from problems_and_policy import first_policy, fit_prompts, load_data, trainer_threads
from run_folders import check_new_run_dir, resume_config, stopped_before_training
from run_record import RunRecord, outcome_metrics, remove_if_unstarted
from stopping import STOPPER, StopRequested


@dataclass
class Config:
    # --- the recipe: what ToRL sets (the torl-* presets take its script's values) ---
    model: str = ""  # hub id or local folder; "" with cold_start "scratch": a tiny model trained first
    train_file: str = "data/toy_train.jsonl"  # 01-data's schema; the toy task is made if missing
    eval_file: str = "data/toy_test.jsonl"  # held-out problems, same schema (or ToRL's test set)
    template: str = "torl"  # prompt template (03-rollout's table)
    max_prompt_tokens: int = 0  # training prompts longer than this (rendered, in tokens) are dropped at load; 0 = keep all
    steps: int = 20  # RL steps
    problems_per_step: int = 8  # problems sampled per step, each a group
    group_size: int = 8  # samples per problem: GRPO's group
    max_response_tokens: int = 96  # model + observation tokens per response (ToRL: 3072)
    max_model_len: int = 512  # the sampler's context: prompt + response must fit
    tool_budget: int = 1  # code executions per response (ToRL: 1)
    temperature: float = 1.0  # the trainer divides logits by the same value
    exec_error_penalty: float = 0.0  # ToRL's optional -0.5 for failed code; off, as in its script
    scorer: str = "lab"  # the reward's rule: the lab's, or ToRL's own (04-reward/torl_scorer.py), in training and eval
    lr: float = 2e-5  # the tiny model (2e-4 learned in 3 steps, then collapsed and recovered twice); a 1.5B model wants 1e-6
    eps_low: float = 0.2  # the clip band's lower side: ratio at least 1 - eps_low where the advantage is negative
    eps_high: float = 0.28  # its upper side, 1 + eps_high where the advantage is positive (DAPO's clip-higher)
    scale_advantages: bool = False  # divide by the group's std (original GRPO; ToRL's verl does)
    num_minibatches: int = 2  # optimizer steps per RL step (ToRL: 1)
    micro_batch_size: int = 16  # sequences per forward/backward pass: memory and speed, not the update (GRPOConfig's 4 is torl-1.5b's)
    eval_every: int = 10  # steps; 0 = only before and after training
    eval_problems: int = 100  # held-out problems per evaluation; 0 = all
    eval_k: int = 1  # samples per problem
    eval_temperature: float = 1.0  # sampled, so the demo's tool-use rate shows in it; ToRL evaluates greedily (0)
    eval_max_response_tokens: int = 96  # the response budget in evaluations
    save_every: int = 1  # steps between checkpoints
    # --- the starting policy: one explicit rule (problems_and_policy.py) ---
    cold_start: str = "scratch"  # scratch: train a tiny model first (model ""); finetune: tune `model` on tool traces; none
    cold_start_steps: int = 300  # supervised steps on tool traces before RL
    cold_start_tool_fraction: float = 0.3  # share of traces that call the tool (the rest box a guess)
    cold_start_tool_only_steps: int = 200  # the first steps on tool traces alone
    cold_start_lr: float = 2e-3  # the cold start's learning rate
    cold_start_batch_size: int = 32  # traces per cold-start step
    cold_start_kv_heads: int = 1  # scratch: key-value heads of the tiny model (1: its heads share one)
    cold_start_rounds: int = 1  # chained task: schedules run until the base passes the moves check, at most
    cold_start_cache: bool = True  # reuse a base cold-started before from the same inputs (~/.cache/tool-rl-lab)
    # ===== Below: how the lab runs the recipe, and options beyond it. A first read can stop here. =====
    # --- the same method, run another way (rollout and update mechanics) ---
    seed: int = 0  # the data order, the sampler and the trainer's random state
    observation_style: str = "torl"  # ToRL's rule; on the toy task "short" would show the same text
    rollout_schedule: str = "overlap"  # rollout's default; "rounds": one generate call per turn of the batch (docs/03)
    seed_rollouts: bool = False  # per-request seeds: reproducible rollouts, but vLLM's slow sampling path on a GPU
    aggregation: str = "token-mean"  # how token losses add up: token-mean, sequence-mean or token-sum (docs/06)
    skip_zero_advantage: bool = True  # no forward/backward for rows without gradient: the same update, faster
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more time
    train_layers: int = 0  # train only the top N decoder layers (0 = all)
    # --- the sandbox (02-sandbox) ---
    sandbox_backend: str = "local"  # where model code runs: local (fork server), docker, or sandboxfusion (02-sandbox)
    sandbox_urls: str = ""  # sandboxfusion: run_code URLs, comma-separated (the token from $SANDBOX_TOKEN)
    sandbox_timeout: float = 10.0  # seconds a tool call may run (ToRL: 10)
    sandbox_isolation: str = "namespaces"  # local backend: namespaces (contained) or plain (weaker; docs/02)
    sandbox_preload: str = "math,numpy,sympy"  # modules the warm interpreter imports once, comma-separated; "" for none
    # --- the engines: vLLM and the trainer on this machine's devices ---
    strategy: str = "ddp"  # under torchrun: a full trainer replica per GPU (ddp) or 1/N of it (fsdp)
    trainer_threads: int = 0  # CPU torch threads for training (-1 = every core; 0 = torch's default, which vLLM's CPU engine keeps)
    dtype: str = "float32"  # the sampler's dtype (the trainer always keeps float32 weights)
    gpu_memory_utilization: float = 0.3  # vLLM's share of the GPU for weights and KV cache
    cpu_kv_cache_gib: float = 2.0  # on a CPU: host memory for vLLM's KV cache (a GPU's comes from the share above)
    enforce_eager: bool = True  # vLLM without compilation (torch.compile, CUDA graphs): starts in seconds, decodes slower
    # --- what the run records ---
    eval_text: bool = False  # also evaluate without the tool, before and after RL
    keep_checkpoints: int = 2  # the newest checkpoints kept in the run folder
    log: str = ""  # also log to tensorboard, wandb or "tensorboard,wandb" (metrics.jsonl is always written)
    # --- options from the field since ToRL (batch_filters.py, docs/06-beyond-torl.md); off in the torl-* presets ---
    tis_cap: float = 0.0  # truncated importance sampling, min(pi_old / pi_sampler, cap) per token; 0 = off
    dynamic_sampling: bool = False  # DAPO: sample more problems until every group of the step is informative
    dynamic_sampling_rounds: int = 4  # the most extra rollout rounds a step may take for that
    mask_truncated: bool = False  # DAPO's overlong filtering: budget-truncated trajectories get no gradient
    filter_void_turns: bool = False  # SimpleTIR: a turn with neither complete code nor an answer keeps its trajectory out
    # --- the objectives after DAPO (06-train/objectives.py, docs/06-objectives.md) ---
    objective: str = "ppo-clip"  # ppo-clip, gspo (one ratio per sequence: its eps ~1000x narrower, the paper's 3e-4 / 4e-4) or cispo
    force_gspo_clip: bool = False  # let gspo run with a PPO-sized clip band (above 0.01), refused otherwise
    tis_mode: str = "truncate"  # with tis_cap: truncate, or weight 0 outside [1/cap, cap] per token-mask or sequence-mask


def train(cfg: Config, run_dir: Path, resume: bool = False, dp=None) -> None:
    """The sandbox, the run folder, problems, the first policy and vLLM; then `train_step` once per step, each step recorded."""
    if cfg.trainer_threads:  # before torch starts: it reads this once; vLLM's engine then leaves it
        os.environ["OMP_NUM_THREADS"] = str(trainer_threads(cfg))
    from distributed import DataParallel
    from grpo import make_optimizer

    dp = dp or DataParallel()  # a world of one unless torchrun started several ranks
    sandbox = start_sandbox(cfg)  # first: where code cannot be contained, the run stops before any model loads
    run_record = RunRecord(cfg, run_dir, resume, dp, sandbox_isolation_used=sandbox.isolation)  # the folder, resume, records
    if run_record.finished:
        sandbox.close()
        return
    train_problems, eval_problems = load_data(cfg, dp)

    # The policy to train: the latest checkpoint, or the first policy (cold-started or as given).
    model_path = run_record.state["path"] if run_record.state else first_policy(cfg, run_dir, dp)
    train_problems = fit_prompts(train_problems, eval_problems, model_path, cfg)  # --max-prompt-tokens, or refused
    policy = dp.load_policy(model_path)  # FSDP2 under torchrun: weights read on rank 0 only
    if cfg.train_layers:
        from cold_start import freeze_all_but_top

        print(f"training the top {cfg.train_layers} layers: {freeze_all_but_top(policy, cfg.train_layers):,} weights")
    model = dp.wrap(policy)  # under torchrun: gradients averaged over ranks (DDP) or the trainer sharded (FSDP2)
    grpo_cfg = grpo_config(cfg)
    optimizer = make_optimizer(model, grpo_cfg)
    run_record.restore_optimizer(model, optimizer)

    # The sampler runs the same weights.
    llm = start_sampler(cfg, model_path, run_record.state, dp)
    llm.weight_version = run_record.start_step
    trajectories = []
    with sandbox, run_record.stops_saved(model, optimizer, llm):
        run_record.evaluate_if_due(run_record.start_step, llm, sandbox, eval_problems, resumed=True)
        for step in run_record.steps():
            problems = batch_at(train_problems, step, cfg.problems_per_step, cfg.seed)
            metrics, trajectories = train_step(
                llm, model, optimizer, dp.shard(problems, cfg.num_minibatches), sandbox, rollout_config(cfg, step, dp),
                grpo_cfg, cfg, dp=dp, more_problems=partial(extra_problems, train_problems, step, cfg, dp))
            run_record.record_step(step + 1, metrics, problems, model, optimizer, llm)
            run_record.evaluate_if_due(step + 1, llm, sandbox, eval_problems)
    run_record.finish(trajectories, llm)  # the last step's batch, plots.png


def train_step(llm, model, optimizer, problems, sandbox, rollout_cfg, grpo_cfg, cfg: Config, dp=None,
               more_problems=None):
    """One RL step: sample, score, compare within groups, update, sync. Returns (metrics, trajectories).

    Under torchrun `problems` are this rank's share, and the metrics are this rank's.
    `more_problems(r)` gives the problems of extra round r (1, 2, ...) for dynamic sampling.
    """
    from grpo import group_advantages, grpo_step, sleep_sampler, sync_weights

    timing = {"rollout_s": 0.0, "generate_s": 0.0, "sandbox_s": 0.0, "reward_s": 0.0}
    # 1-2. Sample groups, the sandbox in the loop, and score each trajectory +1 or -1.
    trajectories, results = sample_and_score(llm, problems, sandbox, rollout_cfg, cfg, timing)
    outcome = outcome_metrics(trajectories, results)  # the step's own problems, with or without dynamic sampling
    dynamic_sampling_metrics: dict = {}
    if cfg.dynamic_sampling:  # DAPO (batch_filters.py): more problems until every group differs in reward
        def sample_extra_round(extra_round):
            extra_cfg = dataclasses.replace(rollout_cfg, seed=extra_seed(rollout_cfg.seed, extra_round))
            return sample_and_score(llm, more_problems(extra_round), sandbox, extra_cfg, cfg, timing)

        trajectories, results, dynamic_sampling_metrics = keep_informative_groups(
            trajectories, results, sample_extra_round, cfg.group_size, cfg.dynamic_sampling_rounds)
    # 3. Advantages: each reward against its group's mean.
    advantages, degenerate = group_advantages([t.reward for t in trajectories], cfg.group_size, scale=cfg.scale_advantages)
    for t, advantage in zip(trajectories, advantages):
        t.advantage = advantage
    excluded, exclusions = excluded_from_loss(trajectories, llm.get_tokenizer(), cfg.mask_truncated, cfg.filter_void_turns)

    # 4. The clipped policy-gradient update.
    t0 = time.perf_counter()
    STOPPER.hold()  # from here the weights change: a stop waits until the loop has recorded this step
    sleep_sampler(llm)  # CUDA: hand vLLM's KV cache memory to the trainer
    update = grpo_step(model, optimizer, trajectories, grpo_cfg, exclude=excluded,
                       global_normalizer=dp.global_normalizer if dp else None)  # the whole batch's token count
    timing["update_s"] = time.perf_counter() - t0
    # 5. The new weights back into the sampler.
    t0 = time.perf_counter()
    sync_weights(model, llm)
    timing["sync_s"] = time.perf_counter() - t0
    metrics = {**outcome, "degenerate_groups": degenerate, **dynamic_sampling_metrics, **exclusions,
               **update, **timing, "weight_version": llm.weight_version}
    return metrics, trajectories


def sample_and_score(llm, problems, sandbox, rollout_cfg, cfg: Config, timing: dict):
    """Rollouts of `problems` (03) with their rewards set (04): (trajectories, reward results); adds to `timing`."""
    from reward import score_batch, total_reward
    from rollout import rollout

    t0 = time.perf_counter()
    spent: dict = {}
    trajectories = rollout(llm, problems, sandbox, rollout_cfg, spent=spent)
    timing["rollout_s"] += time.perf_counter() - t0
    timing["generate_s"] += spent["generate_s"]
    timing["sandbox_s"] += spent["sandbox_s"]
    t0 = time.perf_counter()
    results = score_batch([t.text for t in trajectories], [t.reference for t in trajectories], scorer=cfg.scorer)
    for t, result in zip(trajectories, results):
        t.reward = total_reward(result, t.execution_pass, cfg.exec_error_penalty)
    timing["reward_s"] += time.perf_counter() - t0
    return trajectories, results


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


def extra_problems(problems: list[dict], step: int, cfg: Config, dp, extra_round: int) -> list[dict]:
    """Dynamic sampling's further problems for `step`, round `extra_round`: this rank's share, as for the step's own."""
    extra = batch_at(problems, step, cfg.problems_per_step, extra_seed(cfg.seed, extra_round))
    return dp.shard(extra, cfg.num_minibatches)


def rollout_config(cfg: Config, step: int, dp=None):
    """The sampler's settings for one step: unseeded unless cfg.seed_rollouts, refused if not on-policy."""
    from rollout import RolloutConfig, check_on_policy

    seed = cfg.seed * 100_003 + step if cfg.seed_rollouts else None  # a new seed each step, the same on resume
    rollout_cfg = RolloutConfig(
        group_size=cfg.group_size, temperature=cfg.temperature, max_response_tokens=cfg.max_response_tokens,
        tool_budget=cfg.tool_budget, observation_style=cfg.observation_style, template=cfg.template,
        seed=dp.rank_seed(seed) if dp else seed, schedule=cfg.rollout_schedule,
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
        objective=cfg.objective, force_gspo_clip=cfg.force_gspo_clip, tis_mode=cfg.tis_mode,
    )


def start_sandbox(cfg: Config):
    """Chapter 02's sandbox with the run's settings, or a one-line refusal saying why it cannot contain code here."""
    from sandbox import Sandbox, SandboxError

    if cfg.sandbox_backend == "sandboxfusion":  # the preflight: every member of the pool answers, or say which not
        from sandboxfusion_backend import unreachable

        if dead := unreachable(sandbox_config(cfg)):
            raise SystemExit(f"error: the sandbox pool is not whole: {'; '.join(dead)}")
    try:
        sandbox = Sandbox(sandbox_config(cfg))
        sandbox.run("pass")  # one real call: the backend and its containment are ready, or say why not
        print(f"sandbox: {cfg.sandbox_backend}, isolation {sandbox.isolation}")
    except SandboxError as e:
        raise SystemExit(f"error: the sandbox cannot start: {e}; see docs/02-sandbox.md") from None
    return sandbox


def start_sampler(cfg: Config, model_path: str, state: dict | None, dp=None):
    """The vLLM engine over `model_path`, then the random state: the checkpoint's, or fresh from the seed.

    In that order because vLLM seeds Python's, numpy's and torch's global
    generators when its engine starts: a state restored before would be
    silently replaced. Under torchrun (`dp`, 06's DataParallel) each rank's engine
    gets a seed of its own and joins torchrun's world.
    """
    import numpy as np
    import torch

    from checkpoints import restore_rng
    from rollout import make_llm

    seed = dp.rank_seed(cfg.seed) if dp else cfg.seed  # one seed for every rank would draw the same samples
    llm = make_llm(model_path, dtype=cfg.dtype, max_model_len=cfg.max_model_len, seed=seed,
                   gpu_memory_utilization=cfg.gpu_memory_utilization, cpu_kv_cache_gib=cfg.cpu_kv_cache_gib,
                   enforce_eager=cfg.enforce_eager, **(dp.engine_kwargs() if dp else {}))
    saved_its_rng = dp is None or dp.is_main  # rank 0 alone writes rng.pt into a checkpoint
    if state is not None and saved_its_rng:  # its stream goes on where the checkpoint left it
        restore_rng(torch.load(Path(state["path"]) / "rng.pt", weights_only=False))
    else:  # a fresh start, or another rank's resume: a stream of this rank's own
        seed += state["step"] if state is not None else 0
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
    return llm


# --------------------------------------------------------------------------- the command line


def main(argv: list[str] | None = None) -> Path:
    args, overrides = parse_args(argv)
    refuse_chapter_folder()
    private_tmp()  # what vLLM and the sandbox leave in /tmp goes with this process; a killed run's at the next start
    if args.plot:  # only redraw: a flag of a run would be ignored, so it is refused
        if overrides or args.resume or args.dry_run:
            raise SystemExit("error: --plot RUN_DIR redraws plots.png from the run's metrics.jsonl and takes no other flag")
        print(f"plots: {plot_run(Path(args.plot))}")
        return Path(args.plot)
    if args.resume:
        run_dir = Path(args.resume)
        cfg = resume_config(Config, run_dir, overrides, argv, args.change_recipe)
    elif args.dry_run:  # every check that needs no model, and a memory plan per GPU (dry_run.py)
        raise SystemExit(dry_run(make_config(args.preset, overrides), args.preset, args, start_sandbox))
    else:
        if args.preset in GPU_PRESETS and not cuda_available():
            raise SystemExit(f"error: preset {args.preset} needs a CUDA GPU and this machine has none; "
                             "on a CPU run the demo: make run-05 (--preset cpu-demo)")
        cfg = make_config(args.preset, overrides)
        run_dir = Path(args.run_dir or f"runs/{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    if not args.resume:  # first: the cheapest check, and the one that protects a folder's records
        check_new_run_dir(run_dir, overwrite=args.overwrite)
    check_config(cfg, resuming=bool(args.resume))
    check_memory_plan(cfg)  # on CUDA: a plan that cannot fit the GPUs is refused before anything loads
    from distributed import setup

    dp = setup(cfg.strategy)  # under torchrun: join its world; otherwise a world of one
    run_dir = Path(dp.broadcast(str(run_dir)))  # one folder: rank 0's timestamp
    STOPPER.install()  # from here SIGTERM and Ctrl-C end the run in one line, resumable
    try:
        train(cfg, run_dir, resume=bool(args.resume), dp=dp)
    except StopRequested as stop:  # before the first step (cold start, model, vLLM): what was made stays
        print(stopped_before_training(stop, run_dir), file=sys.stderr)
        raise SystemExit(128 + stop.signum) from None
    except (Exception, SystemExit) as failure:  # an error or a refusal, not a stop's exit (128 + signal)
        if dp.is_main and not args.resume and not isinstance(getattr(failure, "code", None), int):
            remove_if_unstarted(run_dir, say=not isinstance(failure, SystemExit))  # a refusal says what to do
        raise
    finally:
        STOPPER.uninstall()
        dp.close()
    return run_dir


def parse_args(argv):
    """(args, overrides): the run's own flags, and the Config fields given on the command line."""
    parser = argparse.ArgumentParser(
        description="Tool-integrated RL: rollout with a sandbox, ±1 reward, GRPO, weights back into vLLM.")
    parser.add_argument("--preset", default="cpu-demo", help=f"one of: {', '.join(PRESETS)} [default: cpu-demo]; "
                                                             "the defaults below are the chosen preset's")
    parser.add_argument("--run-dir", help="run folder [default: runs/PRESET-TIMESTAMP]")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    parser.add_argument("--plot", metavar="RUN_DIR", help="only redraw plots.png of an existing run")
    parser.add_argument("--overwrite", action="store_true", help="replace a run folder (only one of this lab's)")
    parser.add_argument("--change-recipe", action="store_true", help="--resume with recipe flags that differ from the run's")
    parser.add_argument("--dry-run", action="store_true", help="check everything that needs no model and plan "
                        "memory per GPU, in seconds; load nothing")
    add_plan_flags(parser)  # --plan-*: the GPUs a dry run plans for; --assume-*: its rates (dry_run.py)
    args, overrides = parse_with_field_flags(parser, Config, argv, PRESETS)
    fill_plan_defaults(args)  # --plan-gpus by the preset (dry_run.py)
    return args, overrides


def make_config(preset: str, overrides: dict) -> Config:
    if preset not in PRESETS:
        raise SystemExit(f"error: unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    return Config(**{**PRESETS[preset], **overrides})


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: its report names the failed rank, with the traceback
        from torch.distributed.elastic.multiprocessing.errors import record

        main = record(main)
    run_script(main)  # a one-line refusal exits 2; a stop keeps 128 + signal
