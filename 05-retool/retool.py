"""Chapter 05: the training loop, a plain Python loop that turns the earlier chapters into RL.

    make run-05                      # cpu-demo: RL on the toy task from its released base, on the CPU
    make run-05 PRESET=smollm2       # SmolLM2-135M learns to hand arithmetic to Python, on the CPU
    make run-05 PRESET=torl-1.5b     # Qwen2.5-Math-1.5B with ToRL's recipe, on a GPU
    .venv/bin/python 05-retool/retool.py --steps 60 --lr 1e-5     # every Config field is a flag (configuration.py)
    .venv/bin/python 05-retool/retool.py --resume RUN_DIR         # (--plot RUN_DIR redraws plots.png)

`train` runs `train_step` once a step: sample with the sandbox in the loop (03, 02), score (04), group advantages,
the on-policy update and the weights copied into vLLM in the same process (06). The story: docs/05-retool.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

try:  # the lab's folders are on the path only in its own Python (the venv's tool_rl_lab.pth)
    from lab_cli import private_tmp, refuse_chapter_folder, run_script
except ModuleNotFoundError:
    sys.exit(f"error: {sys.executable} is not the lab's Python: run .venv/bin/python {sys.argv[0]}, or make")
from batch_filters import excluded_from_loss, extra_seed, keep_informative_groups
from configuration import (Config, check_config, check_preload, cuda_available, make_config, parse_with_field_flags,
                           sandbox_config)
from dry_run import add_plan_flags, check_memory_plan, dry_run, fill_plan_defaults
from plots import plot_run
from presets import GPU_PRESETS, PRESETS
from problems_and_policy import first_policy, fit_prompts, load_data, trainer_policy, trainer_threads
from run_folders import check_new_run_dir, resume_config, stopped_before_training
from run_record import RunRecord, failure_line, measured_counterparts, outcome_metrics, start_memory_peak
from stopping import STOPPER, Stopped, StopRequested


def train(cfg: Config, run_dir: Path, resume: bool = False, dp=None) -> None:
    """The sandbox, the run folder, problems, the first policy and vLLM; then `train_step` once per step, each step recorded."""
    from distributed import DataParallel
    from grpo import make_optimizer

    dp = dp or DataParallel()  # a world of one unless torchrun started several ranks
    sandbox = start_sandbox(cfg)  # first: where code cannot be contained, the run stops before any model loads
    run = RunRecord(cfg, run_dir, resume, dp, sandbox_isolation_used=sandbox.isolation)  # the folder, resume, records
    if run.finished:
        return sandbox.close()
    train_problems, eval_problems = load_data(cfg, dp)

    # The policy to train: the latest checkpoint, or the first policy (released, cold-started or as given).
    model_path = run.state["path"] if run.state else first_policy(cfg, run_dir, dp)
    train_problems = fit_prompts(train_problems, eval_problems, model_path, cfg)  # --max-prompt-tokens, or refused
    model = trainer_policy(cfg, model_path, dp)  # float32; under torchrun DDP's replica or FSDP2's shard
    grpo_cfg = grpo_config(cfg)
    optimizer = make_optimizer(model, grpo_cfg)
    run.restore_optimizer(model, optimizer)
    llm = start_sampler(cfg, model_path, run.state, dp)  # the sampler runs the same weights
    llm.weight_version = run.start_step

    trajectories = []
    with sandbox, run.stops_saved(model, optimizer, llm):
        for step in run.steps(llm, sandbox, eval_problems):  # the held-out evaluations fall between the steps
            problems = batch_at(train_problems, step, cfg.problems_per_step, cfg.seed)
            metrics, trajectories = train_step(
                llm, model, optimizer, dp.shard(problems, cfg.num_minibatches), sandbox, rollout_config(cfg, step, dp),
                grpo_cfg, cfg, dp=dp, more_problems=partial(extra_problems, train_problems, step, cfg, dp))
            run.record_step(step + 1, metrics, problems, model, optimizer, llm)
    run.finish(trajectories, llm)  # the last step's batch, plots.png


def train_step(llm, model, optimizer, problems, sandbox, rollout_cfg, grpo_cfg, cfg: Config, dp=None,
               more_problems=None):
    """One RL step: sample, score, compare within groups, update, sync. Returns (metrics, trajectories), this rank's
    under torchrun; `more_problems(r)` gives dynamic sampling's extra round r's problems."""
    from grpo import group_advantages, grpo_step, sleep_sampler, sync_weights

    start_memory_peak()  # so that this step's peak_memory_gb is its own
    timing = dict.fromkeys(("rollout_s", "generate_s", "sandbox_s", "reward_s", "generated_tokens"), 0.0)
    sample = partial(sample_and_score, llm, sandbox, cfg, timing)
    # 1-2. Sample groups, the sandbox in the loop, and score each trajectory +1 or -1.
    trajectories, results = sample(problems, rollout_cfg)
    outcome = outcome_metrics(trajectories, results)  # the step's own problems, with or without dynamic sampling
    # DAPO's dynamic sampling, if on: more problems until every group differs in reward (batch_filters.py).
    trajectories, results, resampled = keep_informative_groups(trajectories, results, sample, rollout_cfg,
                                                               more_problems, cfg)
    # 3. Advantages: each reward against its group's mean.
    advantages, degenerate = group_advantages([t.reward for t in trajectories], cfg.group_size, scale=cfg.scale_advantages)
    for t, advantage in zip(trajectories, advantages):
        t.advantage = advantage
    excluded, exclusions = excluded_from_loss(trajectories, llm.get_tokenizer(), cfg.mask_truncated, cfg.filter_void_turns)

    # 4. The clipped policy-gradient update.
    with timed(timing, "update_s"):
        STOPPER.hold()  # from here the weights change: a stop waits until the loop has recorded this step
        sleep_sampler(llm)  # CUDA: vLLM's KV cache and weights leave GPU memory to the trainer
        update = grpo_step(model, optimizer, trajectories, grpo_cfg, exclude=excluded,
                           global_normalizer=dp.global_normalizer if dp else None)  # torchrun: the whole batch's count
    # 5. The new weights back into the sampler.
    with timed(timing, "sync_s"):
        sync_weights(model, llm)
    metrics = {**outcome, "degenerate_groups": degenerate, **resampled, **exclusions,
               **update, **timing, **measured_counterparts(timing),  # the memory peak and decode rate the dry run assumed
               "weight_version": llm.weight_version}
    return metrics, trajectories


def sample_and_score(llm, sandbox, cfg: Config, timing: dict, problems, rollout_cfg):
    """Rollouts of `problems` (03) with their rewards set (04): (trajectories, reward results); adds to `timing`."""
    from reward import score_batch, total_reward
    from rollout import rollout

    spent: dict = {}
    with timed(timing, "rollout_s"):
        trajectories = rollout(llm, problems, sandbox, rollout_cfg, spent=spent)
    timing["generate_s"] += spent["generate_s"]
    timing["sandbox_s"] += spent["sandbox_s"]
    timing["generated_tokens"] += spent["model_tokens"]  # the model's tokens, not the tool outputs
    with timed(timing, "reward_s"):
        results = score_batch([t.text for t in trajectories], [t.reference for t in trajectories], scorer=cfg.scorer)
        for t, result in zip(trajectories, results):
            t.reward = total_reward(result, t.execution_pass, cfg.exec_error_penalty)
    return trajectories, results


@contextmanager
def timed(timing: dict, key: str):
    """Adds the block's wall-clock seconds to timing[key]."""
    start = time.perf_counter()
    yield
    timing[key] = timing.get(key, 0.0) + time.perf_counter() - start


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
        seed=dp.rank_seed(seed) if dp else seed, schedule=cfg.rollout_schedule)
    check_on_policy(rollout_cfg)
    return rollout_cfg


def grpo_config(cfg: Config):
    """The update's settings (06-train's GRPOConfig): each of its fields that the run's Config has, by name."""
    from grpo import GRPOConfig

    return GRPOConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(GRPOConfig) if hasattr(cfg, f.name)})


def start_sandbox(cfg: Config):
    """Chapter 02's sandbox with the run's settings, or a one-line refusal saying why it cannot contain code here."""
    from sandbox import Sandbox, SandboxError

    if cfg.sandbox_backend == "sandboxfusion":  # the preflight: every member of the pool answers, or say which not
        from sandboxfusion_backend import unreachable

        if dead := unreachable(sandbox_config(cfg)):
            raise SystemExit(f"error: the sandbox pool is not whole: {'; '.join(dead)}")
    try:
        sandbox = Sandbox(sandbox_config(cfg))
        check_preload(sandbox, cfg)  # one real call: the backend is ready and the warm modules imported, or say why not
        print(f"sandbox: {cfg.sandbox_backend}, isolation {sandbox.isolation}")
    except SandboxError as e:
        where = ("" if cfg.sandbox_backend != "local" else "; where namespaces cannot be made (a container without "
                 "root cgroups or unprivileged user namespaces, as most GPU containers), what works: --sandbox-backend "
                 "docker with the host's Docker, a SandboxFusion-compatible service (--sandbox-backend sandboxfusion "
                 "--sandbox-urls URL[,URL...]) such as 02-sandbox/serve.py on a host that allows namespaces, or "
                 "--sandbox-isolation plain (weaker)")
        raise SystemExit(f"error: the sandbox cannot start: {e}{where}; see docs/02-sandbox.md, docs/06-scaling.md") from None
    return sandbox


def start_sampler(cfg: Config, model_path: str, state: dict | None, dp=None):
    """The vLLM engine over `model_path`, then the random state (the checkpoint's, or fresh from the seed): in that
    order because vLLM's engine seeds the global generators when it starts. Under torchrun a seed per rank."""
    import numpy as np
    import torch

    from checkpoints import restore_rng
    from rollout import make_llm

    seed = dp.rank_seed(cfg.seed) if dp else cfg.seed  # one seed for every rank would draw the same samples
    if dp is None or dp.is_main:  # its start is silent: from seconds (the tiny model) to minutes (a 7B, compiled)
        print(f"sampler: vLLM over {model_path}, starting")
    llm = make_llm(model_path, dtype=cfg.dtype, max_model_len=cfg.max_model_len, seed=seed,
                   gpu_memory_utilization=cfg.gpu_memory_utilization, cpu_kv_cache_gib=cfg.cpu_kv_cache_gib,
                   enforce_eager=cfg.enforce_eager, **(dp.engine_kwargs() if dp else {}))
    if state is not None and (dp is None or dp.is_main):  # rank 0 alone wrote rng.pt: its stream goes on from there
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
    run_dir = Path(args.resume or args.run_dir or f"runs/{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.resume:
        cfg = resume_config(Config, run_dir, overrides, argv, args.change_recipe)
    elif args.dry_run:  # every check that needs no model, and a memory plan per GPU (dry_run.py)
        raise SystemExit(dry_run(make_config(args.preset, overrides), args.preset, args, start_sandbox, run_dir))
    else:
        if args.preset in GPU_PRESETS and not cuda_available():
            raise SystemExit(f"error: preset {args.preset} needs a CUDA GPU and this machine has none; "
                             "on a CPU run the demo: make run-05 (--preset cpu-demo)")
        cfg = make_config(args.preset, overrides)
        check_new_run_dir(run_dir, overwrite=args.overwrite)  # first: the cheapest check, and it protects records
    check_config(cfg)
    check_memory_plan(cfg)  # on CUDA: a plan that cannot fit the GPUs is refused before anything loads
    if cfg.trainer_threads:  # before torch's thread pool starts: it reads this once; vLLM's engine then leaves it
        os.environ["OMP_NUM_THREADS"] = str(trainer_threads(cfg))
    from distributed import setup

    dp = setup(cfg.strategy)  # under torchrun: join its world; otherwise a world of one
    run_dir = Path(dp.broadcast(str(run_dir)))  # one folder: rank 0's timestamp
    STOPPER.install()  # from here SIGTERM and Ctrl-C end the run in one line, resumable
    try:
        train(cfg, run_dir, resume=bool(args.resume), dp=dp)
    except StopRequested as stop:  # before the first step (cold start, model, vLLM): what was made stays
        print(stopped_before_training(stop, run_dir), file=sys.stderr)
        raise Stopped(stop.signum) from None
    except Stopped:  # during training: its checkpoint is saved and its line said
        raise
    except (Exception, SystemExit) as failure:  # an error or a refusal: one line, and no half-made folder
        if dp.is_main and (line := failure_line(failure, run_dir, new=not args.resume)):
            raise SystemExit(line) from None
        raise
    finally:
        STOPPER.uninstall()
        dp.close()
    return run_dir


def parse_args(argv):
    """(args, overrides): the run's own flags, and the Config fields given on the command line."""
    parser = argparse.ArgumentParser(description="Tool-integrated RL: rollout with a sandbox, ±1 reward, GRPO, weights "
                                     f"back into vLLM. {measured_durations()}")
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
    for name in ("run_dir", "resume", "plot"):  # "--run-dir=~/x" reaches the script unexpanded
        setattr(args, name, getattr(args, name) and os.path.expanduser(getattr(args, name)))
    fill_plan_defaults(args)  # --plan-gpus by the preset (dry_run.py)
    return args, overrides


def measured_durations() -> str:
    """The demos' wall times as the pages measured them (docs/results), for --help."""
    import results

    demo, smollm2 = results.load("05-cpu-demo")["figures"], results.load("05-smollm2")["figures"]
    return (f"On a 2-core CPU the cpu-demo preset takes about {demo['wall_s']} s from its released base (docs/05-retool.md), "
            f"smollm2 about {smollm2['wall_min']} min (docs/05-smollm2.md).")


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: its report names the failed rank, with the traceback
        from torch.distributed.elastic.multiprocessing.errors import record

        main = record(main)
    run_script(main)  # a one-line refusal exits 2; a stop keeps 128 + signal
