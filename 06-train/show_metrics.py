"""Chosen metrics of one or more runs, step by step, from their metrics.jsonl: a table, and a plot if asked.

    .venv/bin/python 06-train/show_metrics.py runs/demo --keys reward_mean degenerate_groups informative_frac grad_norm
    .venv/bin/python 06-train/show_metrics.py runs/demo runs/clip --keys clip_high_frac ratio_max --plot clip.png

The exercises of docs/06-train.md (the clip) and docs/06-beyond-torl.md (the degenerate groups) read a CPU-demo
run this way. Each run gets one column per key; the last row is the mean over steps.
"""
from __future__ import annotations

import math
from pathlib import Path

from ablation import label, mean_of, pyplot, read_jsonl, save_figure
from lab_cli import run_script, script_parser


def table(runs: dict[str, list[dict]], keys: list[str]) -> str:
    """A markdown table: one row per step, one column per (run, key), then the mean over steps."""
    columns = [(name, key) for name in runs for key in keys]
    header = ["step"] + [f"{name}: {key}" if len(runs) > 1 else key for name, key in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    steps = sorted({r["step"] for rows in runs.values() for r in rows})
    by_step = {name: {r["step"]: r for r in rows} for name, rows in runs.items()}
    for step in steps:
        cells = [_cell(by_step[name].get(step, {}).get(key)) for name, key in columns]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    means = [_cell(mean_of(runs[name], key)) for name, key in columns]
    lines.append("| mean | " + " | ".join(means) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], keys: list[str], path: Path) -> None:
    """One panel per key, one line per run."""
    fig, axes = pyplot().subplots(1, len(keys), figsize=(3.6 * len(keys), 2.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, rows in runs.items():
            have = [r for r in rows if key in r]
            ax.plot([r["step"] for r in have], [math.nan if r[key] is None else r[key] for r in have], marker=".",
                    label=name)
        label(ax, key)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def _number(value) -> bool:
    """A step's value a table can show: a number, or null (undefined that step)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _cell(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}"


def main(argv: list[str] | None = None) -> None:
    p = script_parser(__doc__)
    p.add_argument("runs", nargs="+", help="run folders (each with a metrics.jsonl)")
    p.add_argument("--keys", nargs="+", required=True, help="metrics.jsonl fields to show, e.g. clip_high_frac ratio_max")
    p.add_argument("--plot", metavar="PNG", help="also draw one panel per key into this file")
    args = p.parse_args(argv)
    if args.plot and not Path(args.plot).parent.is_dir():
        raise SystemExit(f"error: --plot {args.plot}: the folder {Path(args.plot).parent} does not exist")
    runs = {}
    for folder in map(Path, args.runs):
        rows = read_jsonl(folder / "metrics.jsonl")
        if not rows:
            raise SystemExit(f"error: {folder}: no metrics.jsonl with steps in it")
        runs[folder.name] = rows
    if missing := [k for k in args.keys if not any(k in r for rows in runs.values() for r in rows)]:
        raise SystemExit(f"error: no run has {', '.join(missing)} in its metrics.jsonl")
    if lists := [k for k in args.keys if any(not _number(r[k]) for rows in runs.values() for r in rows if k in r)]:
        raise SystemExit(f"error: --keys {', '.join(lists)}: not a number per step (e.g. a list of ids); choose numeric keys")
    print(table(runs, args.keys))
    if args.plot:
        plot(runs, args.keys, Path(args.plot))


if __name__ == "__main__":
    run_script(main)
