"""A run's figures for the docs, read from its metrics.jsonl and eval.jsonl into one results file (results.py).

    make run-05 ARGS="--run-dir runs/cpu-demo"
    .venv/bin/python 05-retool/run_figures.py runs/cpu-demo 05-cpu-demo --run-command 'make run-05 ARGS="--run-dir runs/cpu-demo"'

writes docs/results/05-cpu-demo.json, its command the two lines above joined. What each figure means:
docs/05-retool.md (the demo) and docs/06-train.md (its metrics).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
from pathlib import Path

from checkpoints import read_rows
from lab_cli import at_least, run_script, script_parser
from results import save

FIRST_STEP = {"reward_mean": 2, "accuracy": 2, "code_ratio": 2, "code_ratio_correct": 2, "code_ratio_incorrect": 2,
              "degenerate_groups": 0, "tokens": 0, "ratio_max": 3, "clip_low_frac": 3, "clip_high_frac": 3,
              "mismatch_abs": 4, "entropy": 3, "rollout_s": 2, "sandbox_s": 2, "reward_s": 2, "update_s": 2,
              "sync_s": 2}  # the first step's metrics a page reads, with the decimals they are shown with
SECONDS = ("rollout_s", "reward_s", "update_s", "sync_s")  # a step's parts; their medians over the run
STRETCH = {"reward_mean": 2, "degenerate_groups": 1, "informative_frac": 2, "grad_norm": 3, "update_s": 2}  # means


def figures(run_dir: Path, stretches: list[tuple[int, int]] = ()) -> dict:
    """Held-out accuracy and tool use at each evaluation, the reward's climb, the first step, clip, step times."""
    metrics, evals = (run_dir / "metrics.jsonl"), (run_dir / "eval.jsonl")
    if not metrics.exists() or not evals.exists():
        raise SystemExit(f"error: {run_dir}: no metrics.jsonl and eval.jsonl: not a finished run folder")
    rows, out = read_rows(metrics), {}
    for row in read_rows(evals):
        if row.get("mode", "tir") == "tir":
            (summary,) = row["sets"].values()
            out[f"heldout_accuracy_step_{row['step']}"] = round(summary[f"avg@{row['k']}"], 2)
            out[f"heldout_code_ratio_step_{row['step']}"] = round(summary["code_ratio"], 2)
    if not rows:
        raise SystemExit(f"error: {metrics}: no steps recorded")
    rewards = [r["reward_mean"] for r in rows]
    out.update(steps=len(rows), reward_first_5=round(statistics.mean(rewards[:5]), 2),
               reward_last_5=round(statistics.mean(rewards[-5:]), 2),
               ratio_max_highest=round(max(r["ratio_max"] for r in rows), 3),
               clip_frac_highest=round(max(max(r["clip_low_frac"], r["clip_high_frac"]) for r in rows), 3))
    if later := rows[5:]:
        lowest = min(later, key=lambda r: r["reward_mean"])
        out.update(reward_lowest_after_step_5=round(lowest["reward_mean"], 2), reward_lowest_at_step=lowest["step"])
    out["first_step_reward_0_8"] = next((r["step"] for r in rows if r["reward_mean"] >= 0.8), "never")
    # Steps where a token rose past the upper clip bound yet none was clipped there: each such token had a
    # negative advantage, which the clip leaves at its full gradient (docs/06-train.md, the clip table).
    config = run_dir / "config.json"
    high = 1 + (json.loads(config.read_text()).get("eps_high", 0.28) if config.exists() else 0.28)
    rises = [r for r in rows if r["ratio_max"] > high and r["clip_high_frac"] == 0]
    out["unclipped_rise_steps"] = len(rises)
    if rises:
        out.update(first_unclipped_rise_step=rises[0]["step"], first_unclipped_rise_ratio_max=round(rises[0]["ratio_max"], 2))
    if len(rows) >= 3 and rows[2].get("entropy") is not None:
        out["entropy_step_3"] = round(rows[2]["entropy"], 3)
    for key, decimals in FIRST_STEP.items():
        if rows[0].get(key) is not None:
            out[f"step_1_{key}"] = round(rows[0][key], decimals) if decimals else int(rows[0][key])
    for key in SECONDS:
        out[f"median_{key}"] = round(statistics.median(r[key] for r in rows), 2)
    out["median_step_s"] = round(statistics.median(sum(r[k] for k in SECONDS) for r in rows), 2)
    if stretches:
        out.update(dilution(rows, stretches, metrics))
    return out


def dilution(rows: list[dict], stretches: list[tuple[int, int]], metrics: Path) -> dict:
    """Means per stretch of steps, and when degenerate groups appear: how they dilute the step (docs/06-beyond-torl.md)."""
    out = {}
    for first, last in stretches:
        part = [r for r in rows if first <= r["step"] <= last]
        if not part:
            raise SystemExit(f"error: {metrics}: no steps {first}-{last}")
        means = {key: statistics.mean(r[key] for r in part) for key in STRETCH}
        out.update({f"steps_{first}_{last}_{key}": round(means[key], d) for key, d in STRETCH.items()})
        if means["informative_frac"]:
            out[f"steps_{first}_{last}_grad_norm_per_informative"] = round(means["grad_norm"] / means["informative_frac"], 3)
    most = max(r["degenerate_groups"] for r in rows)
    highest = max(rows, key=lambda r: r["grad_norm"])  # before clipping: above max_grad_norm, it was rescaled
    out.update(first_step_with_a_degenerate_group=next((r["step"] for r in rows if r["degenerate_groups"]), "never"),
               degenerate_groups_most=most,
               degenerate_groups_most_at_step=next(r["step"] for r in rows if r["degenerate_groups"] == most),
               grad_norm_highest=round(highest["grad_norm"], 3), grad_norm_highest_at_step=highest["step"])
    return out


def stretch(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    if not (first.isdigit() and last.isdigit() and 0 < int(first) <= int(last)):
        raise argparse.ArgumentTypeError(f"{text!r}: steps FIRST-LAST, e.g. 8-14")
    return int(first), int(last)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("run_dir", type=Path, help="a finished run folder")
    parser.add_argument("name", help="the results file: docs/results/NAME.json")
    parser.add_argument("--run-command", required=True, help="the command that made the run, recorded with the figures")
    parser.add_argument("--stretches", nargs="+", type=stretch, default=[], metavar="FIRST-LAST",
                        help="also the means over these stretches of steps (reward, degenerate groups, informative_frac, "
                        "grad_norm, update_s)")
    parser.add_argument("--wall-s", type=at_least(1, float), help="the run command's wall time in seconds, measured "
                        "around it (e.g. by /usr/bin/time), recorded as wall_s")
    args = parser.parse_args()
    command = (f"{args.run_command}; .venv/bin/python 05-retool/run_figures.py {args.run_dir} {args.name} "
               f"--run-command {shlex.quote(args.run_command)}")
    if args.stretches:
        command += " --stretches " + " ".join(f"{first}-{last}" for first, last in args.stretches)
    found = figures(args.run_dir, args.stretches)
    if args.wall_s:
        command += f" --wall-s {args.wall_s:g}"
        found["wall_s"] = round(args.wall_s)
    print(f"wrote {save(args.name, command, found)}")


if __name__ == "__main__":
    run_script(main)
