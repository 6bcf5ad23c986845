"""How long chapter 06's experiment takes, stage by stage: `make run-06` from nothing but the released base.

    make bench-06                                # the default experiment (one seed, C = 1 and 4) in a fresh folder
    make bench-06 ARGS="--results 06-bench-experiment"   # also docs/results/06-bench-experiment.json
    make bench-06 ARGS="--out runs/bench-06"     # keep the runs

The lab aims at 12 minutes at most (the last measure: docs/results/06-bench-experiment.json).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import experiment
import results
from lab_cli import run_script, script_parser


def main(argv: list[str] | None = None) -> dict:
    p = script_parser(__doc__)
    p.add_argument("--results", metavar="NAME", type=results.name_argument, help="also write the figures to docs/results/NAME.json (results.py)")
    p.add_argument("--out", help="the experiment's folder, kept (default: a temporary one, removed after)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-06-") as temporary:
        folder = args.out or temporary
        start = time.time()
        experiment.main(["--out", folder])
        stages = json.loads((Path(folder) / "timings.json").read_text())
    runs = len(experiment.DEFAULT_ARMS)
    figures = {"base_s": round(stages["base"]), "run_min": round(stages["runs"] / runs / 60, 1),
               "total_min": round((time.time() - start) / 60, 1), "runs": runs}
    print(json.dumps(figures))
    if args.results:
        results.save(args.results, " ".join(["06-train/bench_experiment.py", *sys.argv[1:]]), figures)
    return figures


if __name__ == "__main__":
    run_script(main)
