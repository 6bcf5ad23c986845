"""How long chapter 06's experiment takes, stage by stage: `make run-06` from nothing, the base cache unused.

    make bench-06                                # the default experiment (one seed, C = 1, 2, 4) in a fresh folder
    make bench-06 ARGS="--results 06-bench-experiment"   # also docs/results/06-bench-experiment.json
    make bench-06 ARGS="--out runs/bench-06 --ignore-moves-check"   # keep the runs; RL even from a base that fails the check

The issue's budget on two idle cores: the base at most 20 min, a 60-step run at most 4, the whole at most 45.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import experiment


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", metavar="NAME", help="also write the figures to docs/results/NAME.json (results.py)")
    p.add_argument("--out", help="the experiment's folder, kept (default: a temporary one, removed after)")
    p.add_argument("--ignore-moves-check", action="store_true", help="time RL even from a base that fails the moves check")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-06-") as temporary:
        folder = args.out or temporary
        start = time.time()
        experiment.main(["--out", folder, *(["--ignore-moves-check"] if args.ignore_moves_check else []),
                         "--", "--cold-start-cache", "false"])
        stages = json.loads((Path(folder) / "timings.json").read_text())
    runs = len(experiment.BUDGET_ARMS)
    figures = {"base_min": round(stages["base"] / 60, 1), "run_min": round(stages["runs"] / runs / 60, 1),
               "total_min": round((time.time() - start) / 60, 1), "runs": runs}
    print(json.dumps(figures))
    if args.results:
        import results

        results.save(args.results, " ".join(["06-train/bench_experiment.py", *sys.argv[1:]]), figures)
    return figures


if __name__ == "__main__":
    main()
