"""Each option from the field since ToRL against the baseline, on the CPU demo, from one base model.

    .venv/bin/python 05-retool/cold_start.py --out runs/abl/base               # once, a few minutes
    .venv/bin/python 06-train/ablation.py run --base runs/abl/base --out runs/abl --seeds 0 1
    .venv/bin/python 06-train/ablation.py report --out runs/abl --img docs/img

On the chained task (docs/06-experiments.md) the same with `--preset cpu-chained` and that task's base. `run` trains
one retool.py run per (arm, seed) from the same base with seeded rollouts, changing only the arm's flags; a finished
run is not redone. `report` draws one plot per option against its comparator and prints docs/06-beyond-torl.md's table.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from lab_cli import run_script, script_parser

RETOOL = Path(__file__).resolve().parent.parent / "05-retool" / "retool.py"

# name -> (flags, what it changes, the arm it is compared with, metrics worth a column)
ARMS: dict[str, tuple[list[str], str, str, list[str]]] = {
    "baseline": ([], "ToRL's loss, the preset's settings (float32 sampler)", "",
                 ["degenerate_groups", "rows_skipped", "grad_norm"]),
    "dynamic": (["--dynamic-sampling", "true"], "dynamic sampling (DAPO), at most 4 extra rounds", "baseline",
                ["problems_drawn", "dynamic_rounds", "degenerate_groups", "rows_skipped"]),
    "mask-truncated": (["--mask-truncated", "true"], "truncated trajectories get no gradient (DAPO)", "baseline",
                       ["truncated_masked", "truncation_rate"]),
    "void-filter": (["--filter-void-turns", "true"], "void-turn filter (SimpleTIR)", "baseline", ["void_filtered"]),
    "budget-3": (["--tool-budget", "3", "--filter-void-turns", "true"], "3 tool calls, void-turn filter", "baseline",
                 ["tool_calls", "void_filtered"]),
    "token-sum": (["--aggregation", "token-sum"], "Dr. GRPO: sum / (response budget x sequences)", "baseline",
                  ["grad_norm", "response_length"]),
    # the tool budget C (docs/06-experiments.md): against the baseline's 4 on the chained task
    "calls-1": (["--tool-budget", "1"], "one tool call (C = 1, ToRL's)", "baseline", ["tool_calls", "code_pass_ratio"]),
    "calls-2": (["--tool-budget", "2"], "two tool calls (C = 2)", "baseline", ["tool_calls", "code_pass_ratio"]),
    "bf16": (["--dtype", "bfloat16"], "bf16 sampler, no correction", "", ["mismatch_abs"]),
    "bf16-tis": (["--dtype", "bfloat16", "--tis-cap", "2.0"], "bf16 sampler + truncated IS, cap 2", "bf16",
                 ["tis_weight_mean", "tis_capped_frac", "mismatch_abs"]),
    # the objectives after DAPO (docs/06-beyond-torl.md: its predictions were written before these ran)
    "gspo": (["--objective", "gspo", "--eps-low", "3e-4", "--eps-high", "4e-4"], "GSPO, sequence ratio clipped at 3e-4 / 4e-4",
             "baseline", ["clip_high_frac", "clip_low_frac", "entropy"]),
    "fast": (["--num-minibatches", "8", "--lr", "5e-5"], "8 mini-batches x lr 5e-5: the clip fires (docs/06-train)",
             "baseline", ["clip_high_frac", "clip_low_frac", "entropy"]),
    "fast-cispo": (["--num-minibatches", "8", "--lr", "5e-5", "--objective", "cispo"],
                   "CISPO at 8 x 5e-5: clipped tokens keep a clipped weight", "fast",
                   ["clip_high_frac", "clip_low_frac", "entropy"]),
    "bf16-token-mask": (["--dtype", "bfloat16", "--tis-mode", "token-mask", "--tis-cap", "1.1"],
                        "bf16 sampler + token mask outside [1/1.1, 1.1]", "bf16",
                        ["tis_masked_frac", "tis_masked_seq_frac", "mismatch_max"]),
    "bf16-sequence-mask": (["--dtype", "bfloat16", "--tis-mode", "sequence-mask", "--tis-cap", "1.1"],
                           "bf16 sampler + sequence mask outside [1/1.1, 1.1]", "bf16",
                           ["tis_masked_seq_frac", "tis_masked_frac", "mismatch_abs"]),
}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "run":
        run(args)
    else:
        print(report(args.out, args.img, args.results, args.differences))


def run(args) -> None:
    if not (Path(args.base) / "config.json").exists():
        raise SystemExit(f"error: --base {args.base}: not a model folder (cold-start one with 05-retool/cold_start.py)")
    for seed in args.seeds:
        for arm in args.arms:
            print(f"{Path(args.out) / f'{arm}-s{seed}'}: {arm}, seed {seed}", flush=True)
            run_arm(args.base, Path(args.out) / f"{arm}-s{seed}", arm, seed, args.steps, args.preset)


SAVE_EVERY = 10  # steps between an arm's checkpoints: Ctrl-C loses at most these (a tiny model's save: a fraction of a second)


def run_arm(base: str, run_dir: Path, arm: str, seed: int, steps: int, preset: str | None, flags=()) -> None:
    """One RL run of `arm` from `base` (retool.py, its console quiet), unless it finished before; `flags` are
    retool.py's, before the arm's own."""
    if finished(run_dir):
        print(f"{run_dir}: done already")
        return
    if list((run_dir / "checkpoints").glob("step-*")):  # a run cut short goes on from its last checkpoint
        print(f"{run_dir}: going on from its last checkpoint")
        subprocess.run([sys.executable, str(RETOOL), "--resume", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
        return
    shutil.rmtree(run_dir, ignore_errors=True)  # cut short before its first checkpoint: it starts over
    cmd = [sys.executable, str(RETOOL), *(["--preset", preset] if preset else []), "--model", base, "--cold-start",
           "none", "--run-dir", str(run_dir), "--seed", str(seed), "--steps", str(steps), "--eval-every", "0",
           "--keep-checkpoints", "1", "--save-every", str(min(SAVE_EVERY, steps)), "--seed-rollouts", "true", *flags,
           *ARMS[arm][0]]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def finished(run_dir: Path) -> bool:
    return any(r["tag"] == "after RL" for r in read_jsonl(run_dir / "eval.jsonl"))


def load_runs(out: Path, arms) -> dict:
    """(arm, seed) -> (metric rows, eval rows) of every finished run in `out` (ARM-sSEED) of one of `arms`."""
    runs = {}
    for run_dir in sorted(out.glob("*-s*")):
        arm, seed = run_dir.name.rsplit("-s", 1)
        if arm in arms and finished(run_dir):
            runs[arm, int(seed)] = (read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl"))
    return runs


def results_key(name: str) -> str:
    """A name as a results file's key takes it: a word ("calls-1" -> "calls_1", "2step-padded" -> "2step_padded")."""
    return name.replace("-", "_")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def report(out: Path, img: Path | None, results: str | None = None, differences: Path | None = None) -> str:
    runs = load_runs(out, ARMS)
    if not runs:
        raise SystemExit(f"error: {out}: no finished ablation runs in it")
    seeds = sorted({s for _, s in runs})
    lines = ["| arm | what changes | held-out accuracy after RL | reward, last 5 steps | s / step | its own metrics (mean over steps) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for arm, (_, what, _, keys) in ARMS.items():
        have = [s for s in seeds if (arm, s) in runs]
        if not have:
            continue
        acc = " / ".join(f"{after_accuracy(runs[arm, s][1]):.2f}" for s in have)
        reward = " / ".join(f"{last_reward(runs[arm, s][0]):+.2f}" for s in have)
        cost = " / ".join(f"{step_seconds(runs[arm, s][0]):.1f}" for s in have)
        own = ", ".join(f"{k} {mean_of(runs[arm, s][0], k):.3g}" for k in keys for s in have[:1])
        lines.append(f"| {arm} | {what} | {acc} | {reward} | {cost} | {own} |")
    if img:
        for arm, (_, _, against, _) in ARMS.items():
            if against and any((arm, s) in runs for s in seeds):
                plot(arm, against, ARMS[arm][3][0], runs, seeds, img / f"06-ablation-{arm}.png")
    if differences:
        plot_differences(runs, seeds, differences)
    if results:  # every figure of the table, per arm and seed, in one results file (results.py)
        import results as results_files

        results_files.save(results, " ".join(["06-train/ablation.py", *sys.argv[1:]]), figures(runs))
    seeds_note = f"seeds {' / '.join(map(str, seeds))}" if len(seeds) > 1 else f"seed {seeds[0]}"
    return f"({seeds_note}; before RL {before_accuracy(runs):.2f}, the mean over seeds)\n\n" + "\n".join(lines)


def figures(runs) -> dict:
    """Per arm and seed: held-out accuracy before and after RL, reward of the last 5 steps, seconds a step, its own
    metrics."""
    out = {"before_rl": round(before_accuracy(runs), 3)}
    for (arm, seed), (rows, evals) in sorted(runs.items()):
        at = f"{results_key(arm)}_s{seed}"
        out.update({f"{at}_held_out": round(after_accuracy(evals), 3), f"{at}_before_rl": round(accuracy_at(evals, "before RL"), 3),
                    f"{at}_reward_last5": round(last_reward(rows), 3), f"{at}_s_per_step": round(step_seconds(rows), 2)})
        out.update({f"{at}_{key}": float(f"{mean_of(rows, key):.3g}") for key in ARMS[arm][3]})
        # what the predictions (appendix/06-ablation.md) name: the first step of reward 0.8 or 0, entropy, clip
        out[f"{at}_first_step_reward_08"], out[f"{at}_first_step_reward_0"] = first_step(rows, 0.8), first_step(rows, 0)
        out[f"{at}_entropy_mean"] = float(f"{mean_of(rows, 'entropy'):.3g}")
        step3 = rows[2].get("entropy") if len(rows) > 2 else None  # null: that step ran no row (every group degenerate)
        out[f"{at}_entropy_step3"] = float("nan") if step3 is None else float(f"{step3:.3g}")
        out[f"{at}_ratio_max_peak"] = float(f"{max(r.get('ratio_max') or 0 for r in rows):.3g}")  # a collapse's mark
        out.update({f"{at}_{kind}": score for kind, score in kind_accuracies(evals).items()})
        out[f"{at}_clip_step1"] = float(f"{rows[0].get('clip_low_frac', 0) + rows[0].get('clip_high_frac', 0):.3g}")
    return out


def kind_accuracies(evals: list[dict]) -> dict[str, float]:
    """After RL, each kind of held-out problem on its own, where there are several (the chained task's sources are
    chained-heldout-KIND); {} where there is one."""
    sets = next(r for r in evals if r["tag"] == "after RL")["sets"]
    return {results_key(source.removeprefix("chained-heldout-")): round(score["avg@1"], 3)
            for source, score in sets.items() if source != "all" and len(sets) > 1}


def first_step(rows: list[dict], reward: float) -> int:
    """The first step whose mean reward reaches `reward` (0 if none does)."""
    return next((r["step"] for r in rows if r["reward_mean"] >= reward), 0)


def after_accuracy(evals: list[dict]) -> float:
    return accuracy_at(evals, "after RL")


def accuracy_at(evals: list[dict], tag: str) -> float:
    """Held-out accuracy of a run's evaluation tagged `tag` ("before RL", "after RL")."""
    sets = next(r for r in evals if r["tag"] == tag)["sets"]  # one entry per data source, plus "all" when several
    return (sets.get("all") or next(iter(sets.values())))["avg@1"]


def before_accuracy(runs) -> float:
    """Held-out accuracy before RL, the mean over seeds: each seed samples its own answers from the same base (the
    baseline's evaluation where it ran, else any arm's of that seed)."""
    by_seed = {}
    for (arm, seed), (_, evals) in sorted(runs.items(), key=lambda item: item[0][0] != "baseline"):
        by_seed.setdefault(seed, accuracy_at(evals, "before RL"))
    return sum(by_seed.values()) / len(by_seed)


def last_reward(rows: list[dict], n: int = 5) -> float:
    tail = [r["reward_mean"] for r in rows[-n:]]
    return sum(tail) / len(tail)


def step_seconds(rows: list[dict]) -> float:
    """Mean wall seconds of a step's rollout, reward, update and sync."""
    return sum(r["rollout_s"] + r["reward_s"] + r["update_s"] + r["sync_s"] for r in rows) / len(rows)


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]  # null: undefined that step (no NaN in JSON)
    return sum(values) / len(values) if values else float("nan")


def plot(arm: str, against: str, own: str, runs, seeds, path: Path) -> None:
    """Reward per step (the option in blue, what it is compared with in grey) and the option's own metric."""
    plt = pyplot()
    fig, (ax, side) = plt.subplots(1, 2, figsize=(8, 2.6), gridspec_kw={"width_ratios": [3, 2]})
    for name, colour in ((against, "0.55"), (arm, "tab:blue")):
        for seed, style in zip(seeds, ("-", "--", ":")):
            if (name, seed) in runs:
                rows = runs[name, seed][0]
                steps = [r["step"] for r in rows]
                ax.plot(steps, [r["reward_mean"] for r in rows], style, color=colour,
                        label=f"{name}, seed {seed}: held-out {after_accuracy(runs[name, seed][1]):.2f}")
                side.plot(steps, [float("nan") if r.get(own) is None else r[own] for r in rows], style, color=colour)
    ax.set(ylabel="mean reward", ylim=(-1.05, 1.05))
    ax.legend(fontsize=7, loc="lower right")
    label(ax, f"{arm} vs {against}")
    label(side, own)
    save_figure(fig, path)


def plot_differences(runs, seeds, path: Path) -> None:
    """Each arm's held-out accuracy after RL minus that of the arm it is compared with, seed by seed (a seed's runs
    share their base's answers before RL), with the band within which one run's noise, about 0.05, leaves it."""
    plt = pyplot()
    pairs = [(arm, against or "baseline") for arm, (_, _, against, _) in ARMS.items() if arm != "baseline"]
    pairs = [(arm, against) for arm, against in pairs if any((arm, s) in runs and (against, s) in runs for s in seeds)]
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.axhspan(-0.05, 0.05, color="0.9", label="within 0.05: not claimed")
    ax.axhline(0, color="0.5", linewidth=0.8)
    for x, (arm, against) in enumerate(pairs):
        for seed, marker in zip(seeds, "os^"):
            if (arm, seed) in runs and (against, seed) in runs:
                diff = after_accuracy(runs[arm, seed][1]) - after_accuracy(runs[against, seed][1])
                ax.scatter(x, diff, marker=marker, color="tab:blue", s=18, label=f"seed {seed}" if x == 0 else None)
    ax.set_xticks(range(len(pairs)), [f"{a} - {b}" for a, b in pairs], fontsize=7, rotation=35, ha="right")
    ax.set_ylabel("held-out after RL,\ndifference", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    save_figure(fig, path)


def pyplot():
    """matplotlib's pyplot without a display (imported only when a plot is asked for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label(ax, title: str, xlabel: str = "RL step") -> None:
    """A panel's title and x label, in the size and grid every plot of this chapter uses."""
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    pyplot().close(fig)


def parse_args(argv):
    p = script_parser(__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train the runs that are not done yet")
    r.add_argument("--base", required=True, help="the cold-started base model folder every run starts from")
    r.add_argument("--out", default="runs/ablation", help="folder of the run folders (default runs/ablation)")
    r.add_argument("--seeds", type=int, nargs="+", default=[0], help="RL seeds (default 0)")
    r.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="which arms (default all)")
    r.add_argument("--preset", help="05-retool's preset the runs start from (default: the CPU demo's settings; "
                                    "cpu-chained for docs/06-experiments.md)")
    r.add_argument("--steps", type=int, default=30, help="RL steps per run (default 30, docs/06-beyond-torl's)")
    s = sub.add_parser("report", help="plots and the markdown table from finished runs")
    s.add_argument("--out", type=Path, default="runs/ablation", help="folder of the run folders (default runs/ablation)")
    s.add_argument("--img", type=Path, help="write one PNG per option here (e.g. docs/img)")
    s.add_argument("--differences", metavar="PNG", type=Path,
                   help="also plot each arm's held-out accuracy minus its comparator's, seed by seed, to this file")
    s.add_argument("--results", metavar="NAME", help="also write the figures to docs/results/NAME.json (results.py)")
    return p.parse_args(argv)


if __name__ == "__main__":
    run_script(main)
