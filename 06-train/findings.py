"""ToRL's findings in miniature, from the chained task's runs: the tool budget, self-correction, code use.

    .venv/bin/python 06-train/experiment.py --out runs/released --seeds 5 6 7 --results 06-experiments-released
    .venv/bin/python 06-train/findings.py --out runs/released      # the figures again, from the run folders alone

Reads the run folders `ablation.py run` wrote (ARM-sSEED); draws the tool budget, self-correction and code use
plots of docs/06-experiments.md, and writes the figures it quotes (per seed, and their mean).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import results
from ablation import (accuracy_at, after_accuracy, before_accuracy, kind_accuracies, label, load_runs as load_arm_runs,
                      mean_of, pyplot, read_jsonl, results_key, save_figure, step_seconds)
from lab_cli import run_script, script_parser

BUDGETS = {"calls-1": 1, "calls-2": 2, "baseline": 4}  # arm -> C
SELF_CORRECTION = ("error_then_call_ok", "error_then_correct")
CODE_USE = ("code_ratio", "code_pass_ratio", "response_length")


def main(argv: list[str] | None = None) -> dict:
    p = script_parser(__doc__)
    p.add_argument("--out", default="runs/experiment-06", help="the run folders' folder (default experiment.py's)")
    p.add_argument("--img", help="write the three plots here (e.g. docs/img)")
    p.add_argument("--results", metavar="NAME", help="also write the figures to docs/results/NAME.json (results.py)")
    args = p.parse_args(argv)
    runs = load_runs(Path(args.out))
    figures = summarise(runs, Path(args.out))
    if args.img:
        plot_all(runs, Path(args.img))
    if args.results:
        results.save(args.results, " ".join(["06-train/findings.py", *(argv if argv is not None else sys.argv[1:])]),
                     figures)
    print(json.dumps(figures, indent=1))
    return figures


PLOTS = ("06-experiments-budget.png", "06-experiments-self-correction.png", "06-experiments-code-use.png")


def plot_all(runs: dict, folder: Path) -> None:
    """The three plots of docs/06-experiments.md, named PLOTS, into `folder`."""
    plot_budget(runs, folder / PLOTS[0])
    plot_over_training(runs, SELF_CORRECTION, folder / PLOTS[1])
    plot_over_training(runs, CODE_USE, folder / PLOTS[2])


def load_runs(out: Path) -> dict:
    """(arm, seed) -> (metric rows, eval rows) of every finished run of the arms above."""
    runs = load_arm_runs(out, BUDGETS)
    if not any(arm == "baseline" for arm, _ in runs):
        raise SystemExit(f"error: {out}: no finished baseline run in it (06-train/ablation.py run --preset cpu-chained ...)")
    return runs


def summarise(runs: dict, out: Path) -> dict:
    """Flat figures: per arm and seed, and the mean over seeds; before RL also once, the mean over seeds, for the plot."""
    figures = {"before_rl": round(before_accuracy(runs), 3)}
    for arm in BUDGETS:
        seeds = sorted(s for a, s in runs if a == arm)
        per_seed = [run_figures(*runs[arm, s]) for s in seeds]
        for name in per_seed[0] if per_seed else ():
            for s, run in zip(seeds, per_seed):
                figures[f"{results_key(arm)}_s{s}_{name}"] = round(run[name], 3)
            figures[f"{results_key(arm)}_mean_{name}"] = round(sum(run[name] for run in per_seed) / len(per_seed), 3)
        for s in seeds:  # each kind of problem on its own after RL, and the shares of ANSWER_KINDS
            own = {**kind_accuracies(runs[arm, s][1]), **answer_shares(out / f"{arm}-s{s}")}
            figures.update({f"{results_key(arm)}_s{s}_{name}": value for name, value in own.items()})
    return figures


# Read from the held-out answers themselves: a two-step problem answered after one call that ran (the next call not
# tried), and a one-step problem answered after a second call (the next call tried where no step is left).
ANSWER_KINDS = {"2step_one_call": ("2step", lambda code_ok: code_ok == [True]),
                "1step_second_call": ("1step", lambda code_ok: len(code_ok) >= 2)}


def answer_shares(run_dir: Path) -> dict[str, float]:
    """Before and after RL, the share of each of ANSWER_KINDS among its kind's held-out answers ({} without the
    evaluations' samples)."""
    files = sorted((run_dir / "eval_samples").glob("step-*.jsonl"))
    shares = {}
    for when, path in zip(("before", "after"), [files[0], files[-1]] if len(files) > 1 else []):
        rows = read_jsonl(path)
        for name, (kind, counts) in ANSWER_KINDS.items():
            of_kind = [r["code_ok"] for r in rows if r["source"].endswith(f"-{kind}")]
            shares[f"{name}_{when}"] = round(sum(map(counts, of_kind)) / len(of_kind), 3) if of_kind else float("nan")
    return shares


def run_figures(rows: list[dict], evals: list[dict]) -> dict:
    """One run's figures: held-out accuracy before and after RL and the gain, seconds a step, each curve's mean
    over its first 5 and last 10 steps."""
    after, before = after_accuracy(evals), accuracy_at(evals, "before RL")  # each seed samples its own answers
    figures = {"held_out": after, "before_rl": before, "gain": after - before, "s_per_step": step_seconds(rows)}
    for key in SELF_CORRECTION + CODE_USE:
        figures[f"{key}_first5"] = mean_of(rows[:5], key)
        figures[f"{key}_last10"] = mean_of(rows[-10:], key)
    return figures


def plot_budget(runs: dict, path: Path) -> None:
    plt = pyplot()
    fig, (acc, cost) = plt.subplots(1, 2, figsize=(7, 2.6))
    for arm, budget in BUDGETS.items():
        seeds = sorted(s for a, s in runs if a == arm)
        for ax, values, colour in ((acc, [after_accuracy(runs[arm, s][1]) for s in seeds], "tab:blue"),
                                   (cost, [step_seconds(runs[arm, s][0]) for s in seeds], "tab:orange")):
            ax.scatter([budget] * len(seeds), values, color=colour, s=14)  # each seed, and a bar at their mean
            if seeds:
                ax.plot([budget - 0.2, budget + 0.2], [sum(values) / len(seeds)] * 2, color="k")
    acc.axhline(before_accuracy(runs), color="0.6", linestyle=":", label="before RL, mean of seeds")
    for ax, title in ((acc, "held-out accuracy after RL"), (cost, "seconds per RL step")):
        ax.set_xticks(list(BUDGETS.values()))
        label(ax, title, "tool budget C")
    acc.set_ylim(0, 1)
    acc.legend(fontsize=7)
    save_figure(fig, path)


def plot_over_training(runs: dict, keys: tuple[str, ...], path: Path) -> None:
    """One panel per metric: the baseline's value per step, one line per seed."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 2.6))
    for ax, key in zip(axes, keys):
        for (arm, seed), (rows, _) in sorted(runs.items()):
            if arm == "baseline":
                ax.plot([r["step"] for r in rows], [float("nan") if r.get(key) is None else r[key] for r in rows],
                        ("-", "--", ":")[seed % 3], color="tab:blue", label=f"seed {seed}")
        label(ax, key)
    axes[0].legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    run_script(main)
