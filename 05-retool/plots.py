"""plots.png of a run, drawn from its metrics.jsonl: reward, accuracy, tool use, response length, entropy per RL step.

Drawn from the record alone, so `retool.py --plot RUN_DIR` redraws any run, finished, stopped or still going.
"""
from __future__ import annotations

from pathlib import Path

from checkpoints import read_rows


PANELS = [  # (title, metrics.jsonl keys drawn in it), left to right
    ("reward (mean, ±1 scale)", ["reward_mean"]),
    ("accuracy", ["accuracy"]),
    ("tool use", ["code_ratio", "code_pass_ratio"]),
    ("response length (tokens)", ["response_length"]),
    ("policy entropy (nats per model token)", ["entropy"]),  # falling to 0: the policy stops exploring
]


def plot_run(run_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {path}: no metrics to plot")
    rows = read_rows(path)  # the run's own reader: a torn last line is left out
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.2))
    for ax, (title, keys) in zip(axes, PANELS):
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
