"""plots.png of a run, drawn from its metrics.jsonl: reward, accuracy, tool use, response length per RL step.

Drawn from the record alone, so `retool.py --plot RUN_DIR` redraws any run,
finished, stopped or still going. The story: docs/05-retool.md.
"""
from __future__ import annotations

import json
from pathlib import Path


def plot_run(run_dir: Path) -> Path:
    """plots.png from metrics.jsonl: reward, accuracy, code ratio and pass ratio, response length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path}: no metrics to plot")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
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
            values = [float("nan") if r.get(key) is None else r[key] for r in rows]  # null: undefined that step
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
