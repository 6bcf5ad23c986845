r"""What the reward's worker process costs: its start, one check after it, a check killed at the deadline, a batch (about 20 s).

    make bench-reward                                           # 3 rounds
    make bench-reward ARGS="--rounds 5"
    make bench-reward ARGS="--results 04-bench-reward"          # also write docs/results/04-bench-reward.json

Each round stops the workers first, as a fresh process has none. What each figure times: docs/04-reward.md.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import reward
from lab_cli import at_least, script_parser
from results import make_command, name_argument, save

BATCH = [f"so \\boxed{{\\frac{{{i}}}{{4}}}}" for i in range(400)], [str(i / 4) for i in range(400)]
TOWER = "\\boxed{9^{9^{9^{9}}}}"  # 9^(9^(9^9)): math-verify would compute it for ever


def seconds(call, *args, **kwargs) -> float:
    start = time.perf_counter()
    call(*args, **kwargs)
    return time.perf_counter() - start


def one_round() -> dict[str, float]:
    for worker in reward._workers:  # as in a fresh process: the next call starts its worker anew
        worker._stop()
    first = seconds(reward.score_answer, "so \\boxed{1/2}", "0.5")
    after = seconds(reward.score_answer, "so \\boxed{1/2}", "0.5")
    reward.score_batch(["\\boxed{1}"] * 2, ["1"] * 2, workers=2)  # start the second worker outside the timing
    batch = seconds(reward.score_batch, *BATCH, workers=2)
    return {"first_score_answer_s": first, "next_score_answer_ms": 1000 * after,
            "score_batch_400_s": batch, "deadline_s": seconds(reward.score_answer, TOWER, "1")}


def main(argv: list[str] | None = None) -> None:
    p = script_parser(__doc__)
    p.add_argument("--rounds", type=at_least(1), default=3, help="rounds to time (default: %(default)s)")
    p.add_argument("--results", metavar="NAME", type=name_argument,
                   help="also write the figures to docs/results/NAME.json, for the docs")
    args = p.parse_args(argv)
    if not all(r.correct for r in reward.score_batch(*BATCH)):  # also a first start, before the timing
        sys.exit("error: the batch's answers are not all scored right: its timing would not be the usual work")
    rounds = [one_round() for _ in range(args.rounds)]
    figures = {"rounds": args.rounds, "cpus": os.cpu_count()}
    print(f"{args.rounds} rounds on {os.cpu_count()} CPUs\n{'what':<22} {'best':>8} {'median':>8}")
    for what in rounds[0]:
        times = [r[what] for r in rounds]
        best, median = round(min(times), 2), round(statistics.median(times), 2)
        print(f"{what:<22} {best:>8} {median:>8}")
        figures.update({f"best_{what}": best, f"median_{what}": median})
    if args.results:
        command = make_command("bench-reward", sys.argv[1:] if argv is None else argv)
        print(f"wrote {save(args.results, command, figures)}")


if __name__ == "__main__":
    main()
