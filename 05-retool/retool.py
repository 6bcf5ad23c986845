"""Chapter 05: the training loop. A plain Python loop that turns the chapters into RL.

    make run-05                          # cpu-demo: cold start + RL on the toy task, on the CPU
    make run-05 PRESET=torl-1.5b         # Qwen2.5-Math-1.5B with ToRL's recipe, on one GPU
    .venv/bin/python 05-retool/retool.py --preset cpu-demo --steps 40 --lr 3e-4
    .venv/bin/python 05-retool/retool.py --resume runs/cpu-demo-20261129-1200
    .venv/bin/python 05-retool/retool.py --plot runs/cpu-demo-20261129-1200

One step, top to bottom (the whole of `train_step` below):

    problems     = next batch of problems                      (01-data)
    trajectories = rollout(llm, problems, sandbox, cfg)        (03-rollout, with 02-sandbox)
    rewards      = score_batch(texts, references)              (04-reward)
    advantages   = group_advantages(rewards, group_size)       (06-train)
    metrics      = grpo_step(model, optimizer, trajectories)   (06-train)
    sync_weights(model, llm)                                   (06-train)

Around it: a metrics line per step (metrics.jsonl), a checkpoint every
`save_every` steps that vLLM and transformers load directly, an evaluation on
held-out problems every `eval_every` steps, and plots at the end. Killing the
process at any moment loses at most the steps since the last checkpoint (the
step in progress with the CPU demo's save_every=1); `--resume RUN_DIR` goes on
from there with the same data order and random state.

Decisions worth knowing:
- The trainer (transformers, float32 master weights) and the sampler (vLLM)
  live in one process and hold separate copies of the weights; after every
  update the trainer's are copied into vLLM in memory. On a GPU vLLM sleeps
  during the update so the trainer gets its memory.
- Sampling is at temperature 1.0 and the update is on-policy: the trajectories
  of a step are used for `num_minibatches` updates and then thrown away.
- A group whose rewards are all equal has zero advantages and teaches nothing;
  it is kept (the count is logged as degenerate_groups), not resampled.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PRESETS: dict[str, dict] = {
    # A tiny model trained from scratch (cold_start.py) on the toy task, then RL.
    # Sized to finish, cold start included, in minutes on a 2-core CPU.
    "cpu-demo": {},
    # ToRL's scripts/torl_1.5b.sh, scaled to one GPU; see docs/05-retool.md for
    # every difference and why.
    "torl-1.5b": dict(
        model="Qwen/Qwen2.5-Math-1.5B",
        train_file="data/train.jsonl",
        eval_file="data/aime24.jsonl",
        template="torl",
        steps=500,
        problems_per_step=32,
        group_size=16,
        max_response_tokens=3072,
        max_model_len=4096,
        tool_budget=1,
        temperature=1.0,
        lr=1e-6,
        num_minibatches=2,
        micro_batch_size=4,
        eps_low=0.2,
        eps_high=0.28,
        gradient_checkpointing=True,
        eval_every=20,
        eval_problems=30,
        eval_k=4,
        eval_max_response_tokens=3072,
        save_every=10,
        gpu_memory_utilization=0.35,
        dtype="bfloat16",
    ),
}


@dataclass
class Config:
    # model and data
    model: str = ""  # hub id or local folder; "" = train a tiny base model first (cold start)
    train_file: str = "data/toy_train.jsonl"  # 01-data's schema; the toy task is made if missing
    eval_file: str = "data/toy_test.jsonl"
    template: str = "torl"  # prompt template (03-rollout's table)
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
    # sandbox (02-sandbox)
    sandbox_backend: str = "local"
    sandbox_timeout: float = 10.0
    # evaluation and checkpoints
    eval_every: int = 10  # steps; 0 = only before and after training
    eval_problems: int = 100  # held-out problems per evaluation
    eval_k: int = 1  # samples per problem
    eval_max_response_tokens: int = 96
    save_every: int = 1  # steps between checkpoints
    keep_checkpoints: int = 2
    # cold start (only when model is "")
    cold_start_steps: int = 500
    cold_start_tool_fraction: float = 0.4
    # runtime
    seed: int = 0
    dtype: str = "float32"  # the sampler's dtype (the trainer always keeps float32 weights)
    gpu_memory_utilization: float = 0.3


def main(argv: list[str] | None = None) -> Path:
    args, overrides = parse_args(argv)
    if args.plot:
        plot_run(Path(args.plot))
        return Path(args.plot)
    if args.resume:
        run_dir = Path(args.resume)
        cfg = load_config(run_dir, overrides)
    else:
        cfg = make_config(args.preset, overrides)
        run_dir = Path(args.run_dir or f"runs/{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_config(cfg, resuming=bool(args.resume))
    train(cfg, run_dir, resume=bool(args.resume))
    return run_dir


def train(cfg: Config, run_dir: Path, resume: bool = False) -> None:
    import torch
    from tqdm import tqdm

    from eval import evaluate, summary_line
    from grpo import GRPOConfig, load_policy, make_optimizer
    from rollout import make_llm
    from sandbox import Sandbox, SandboxConfig

    run_dir.mkdir(parents=True, exist_ok=True)
    print(json.dumps(dataclasses.asdict(cfg), indent=1))
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    train_problems, eval_problems = load_data(cfg)

    # The policy: the latest checkpoint, the given model, or a cold-started tiny one.
    state = latest_checkpoint(run_dir) if resume else None
    if state is not None:
        model_path, step = state["path"], state["step"]
        print(f"resuming {run_dir} from step {step}")
    else:
        model_path, step = (cfg.model or cold_start(cfg, run_dir)), 0
    model = load_policy(model_path)
    grpo_cfg = GRPOConfig(
        lr=cfg.lr, eps_low=cfg.eps_low, eps_high=cfg.eps_high, aggregation=cfg.aggregation,
        num_minibatches=cfg.num_minibatches, micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.temperature, gradient_checkpointing=cfg.gradient_checkpointing,
    )
    optimizer = make_optimizer(model, grpo_cfg)
    if state is not None:
        restore_state(state, optimizer)
    else:
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
    llm = make_llm(model_path, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                   gpu_memory_utilization=cfg.gpu_memory_utilization, seed=cfg.seed)
    llm.weight_version = step
    sandbox = Sandbox(SandboxConfig(backend=cfg.sandbox_backend, timeout=cfg.sandbox_timeout))
    metrics_path = run_dir / "metrics.jsonl"
    truncate_metrics(metrics_path, step)

    def run_eval(tag: str, at_step: int) -> dict:
        result = evaluate(llm, eval_problems[: cfg.eval_problems], sandbox, k=cfg.eval_k, mode="tir",
                          template=cfg.template, max_response_tokens=cfg.eval_max_response_tokens,
                          tool_budget=cfg.tool_budget, seed=cfg.seed)
        print(f"eval {tag}: {summary_line(result)}")
        append_jsonl(run_dir / "eval.jsonl", {"step": at_step, "tag": tag, **result})
        return result

    try:
        if step == 0:
            run_eval("before RL", 0)
        bar = tqdm(range(step, cfg.steps), desc="RL", initial=step, total=cfg.steps)
        for step in bar:
            rollout_cfg = rollout_config(cfg, step)
            problems = batch_at(train_problems, step, cfg.problems_per_step, cfg.seed)
            metrics, trajectories = train_step(llm, model, optimizer, problems, sandbox, rollout_cfg, grpo_cfg, cfg)
            metrics = {"step": step + 1, **metrics, "problem_ids": [p["id"] for p in problems]}
            append_jsonl(metrics_path, metrics)
            bar.set_postfix(reward=f"{metrics['reward_mean']:+.2f}", code=f"{metrics['code_ratio']:.2f}")
            tqdm.write(step_line(metrics))
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                save_checkpoint(run_dir, step + 1, model, optimizer, llm.get_tokenizer(), cfg.keep_checkpoints)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                run_eval(f"step {step + 1}", step + 1)
        run_eval("after RL", cfg.steps)
        from rollout import render_html, save_trajectories

        save_trajectories(trajectories, run_dir / "last_step.jsonl")
        (run_dir / "last_step.html").write_text(render_html(trajectories[: 2 * cfg.group_size], llm.get_tokenizer(),
                                                            title=f"{run_dir.name}: last step"))
    finally:
        sandbox.close()
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


def train_step(llm, model, optimizer, problems, sandbox, rollout_cfg, grpo_cfg, cfg: Config):
    """One RL step: sample, score, compare within groups, update, sync. Returns (metrics, trajectories)."""
    from grpo import group_advantages, grpo_step, sleep_sampler, sync_weights
    from reward import score_batch, total_reward
    from rollout import rollout

    timing = {}
    t0 = time.perf_counter()
    stats: dict = {}
    trajectories = rollout(llm, problems, sandbox, rollout_cfg, stats=stats)
    timing["rollout_s"] = time.perf_counter() - t0
    timing["generate_s"], timing["sandbox_s"] = stats["generate_s"], stats["sandbox_s"]

    t0 = time.perf_counter()
    results = score_batch([t.text for t in trajectories], [t.reference for t in trajectories])
    for t, r in zip(trajectories, results):
        t.reward = total_reward(r, t.execution_pass, cfg.exec_error_penalty)
    advantages, degenerate = group_advantages([t.reward for t in trajectories], cfg.group_size, scale=cfg.scale_advantages)
    for t, a in zip(trajectories, advantages):
        t.advantage = a
    timing["reward_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    sleep_sampler(llm)  # CUDA: hand vLLM's KV cache memory to the trainer
    update = grpo_step(model, optimizer, trajectories, grpo_cfg)
    timing["update_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sync_weights(model, llm)
    timing["sync_s"] = time.perf_counter() - t0

    metrics = {**outcome_metrics(trajectories, results), "degenerate_groups": degenerate,
               **update, **timing, "weight_version": llm.weight_version}
    return metrics, trajectories


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
    from prepare_data import make_toy_task, read_problems, write_jsonl

    toy = {str(Path("data/toy_train.jsonl")), str(Path("data/toy_test.jsonl"))}
    if {cfg.train_file, cfg.eval_file} <= toy and not all(Path(f).exists() for f in toy):
        train_rows, test_rows = make_toy_task(2000, 200, seed=0)  # what `make run-01` writes
        write_jsonl(train_rows, Path("data/toy_train.jsonl"))
        write_jsonl(test_rows, Path("data/toy_test.jsonl"))
    return read_problems(cfg.train_file), read_problems(cfg.eval_file)


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


def cold_start(cfg: Config, run_dir: Path) -> str:
    import cold_start as cs

    base = run_dir / "base"
    if (base / "cold_start.json").exists():
        return str(base)
    cs.main(["--train-file", cfg.train_file, "--out", str(base), "--steps", str(cfg.cold_start_steps),
             "--tool-fraction", str(cfg.cold_start_tool_fraction), "--template", cfg.template,
             "--seed", str(cfg.seed)])
    return str(base)


# --------------------------------------------------------------------------- checkpoints


def save_checkpoint(run_dir: Path, step: int, model, optimizer, tokenizer, keep: int) -> Path:
    """Hugging Face weights + tokenizer + optimizer + RNG state, written to a temporary folder then renamed.

    A checkpoint folder either is complete or does not exist: a kill mid-write
    leaves only a `.tmp` folder, which the next save or resume ignores.
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
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    torch.save(rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> dict | None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if (p / "state.json").exists())
    if not done:
        return None
    path = done[-1]
    return {"path": str(path), **json.loads((path / "state.json").read_text())}


def restore_state(state: dict, optimizer) -> None:
    import torch

    path = Path(state["path"])
    optimizer.load_state_dict(torch.load(path / "optimizer.pt"))
    rng = torch.load(path / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines of steps after `step`: they belong to work the resume will redo."""
    if not path.exists():
        return
    lines = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= step]
    path.write_text("".join(l + "\n" for l in lines))


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
    problems = []
    if cfg.model and not Path(cfg.model).exists() and cfg.model.count("/") != 1:
        problems.append(f"model '{cfg.model}' is neither a folder nor a hub id (org/name)")
    for name in ("train_file", "eval_file"):
        path = getattr(cfg, name)
        if not Path(path).exists() and "toy_" not in path:
            problems.append(f"{name} '{path}' does not exist (run `make run-01` to prepare data)")
    if cfg.max_response_tokens >= cfg.max_model_len:
        problems.append(f"max_response_tokens ({cfg.max_response_tokens}) leaves no room for the prompt in max_model_len ({cfg.max_model_len})")
    if cfg.eval_max_response_tokens >= cfg.max_model_len:
        problems.append(f"eval_max_response_tokens ({cfg.eval_max_response_tokens}) does not fit in max_model_len ({cfg.max_model_len})")
    if cfg.group_size < 2:
        problems.append(f"group_size {cfg.group_size}: a group of one has no one to be compared with")
    for name in ("steps", "problems_per_step", "num_minibatches", "micro_batch_size", "save_every", "keep_checkpoints", "eval_k"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.problems_per_step * cfg.group_size < cfg.num_minibatches:
        problems.append(f"{cfg.problems_per_step * cfg.group_size} trajectories cannot fill {cfg.num_minibatches} mini-batches")
    if cfg.aggregation not in ("token-mean", "sequence-mean"):
        problems.append(f"aggregation must be token-mean or sequence-mean, got '{cfg.aggregation}'")
    if not 0 < cfg.lr < 1:
        problems.append(f"lr {cfg.lr} is not a learning rate")
    if problems:
        raise SystemExit(f"error: {problems[0]}")


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
    main()
