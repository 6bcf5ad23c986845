"""Counter problems of one or two steps, some with a reading that makes the first call fail: calls that chain.

The task of the cpu-chained preset, built so that the tool budget and reading
the tool's output matter (the design and its reasons: docs/06-experiments.md).
A counter shows four digits, so a reading below 1000 keeps its leading zeros;
one or two operations follow, each one of *, + or - with a number:

    A counter shows 0482. Apply * 37, then apply + 905. What number do you get?      (answer 18739)

The program the cold start teaches is one operation on two numbers copied from
the text. Here that first call, `print(0482 * 37)`, fails, and the observation
says why (SyntaxError: leading zeros ...); the same call without the zeros
prints 17834, and only with that printed number can the second step be written,
`print(17834 + 905)`. So the four kinds need one to three calls of that shape:

    one step (easy)                   1 call
    one step, padded reading          2: the error, then the fix (1 if the zeros are dropped at once)
    two steps                         2: the second uses the first's output
    two steps, padded reading         3

No single program of that shape over a two-step problem's numbers gives its
answer (the generator redraws the few where one would). Held-out problems pair
each opening with a question sentence no training problem pairs it with, and use
number tuples never used in training; the step phrases are shared, because a model trained from scratch
has no other words for the operations. A row's source names its kind
("chained-2step-padded", "chained-heldout-1step"), so an evaluation reports
each kind on its own.

    .venv/bin/python 01-data/chained_problems.py --out-dir data     # data/chained_train.jsonl, data/chained_test.jsonl
"""
from __future__ import annotations

import argparse
import random
import re
from pathlib import Path
from typing import Callable

# A step names its operation by its symbol, so the call's `op n` is the problem's own tokens: a tiny model copies a
# run of tokens it has seen (an induction head) long before it learns that "multiply it by" means `*` (06-experiments).
STEP_PHRASES = {"*": "apply * {n}", "+": "apply + {n}", "-": "apply - {n}"}
TWO_STEP_SHARE = 0.5  # of the problems, the rest have one step
PADDED_SHARE = 1 / 3  # readings below 1000, shown with leading zeros
LARGEST_ANSWER = 10**8 - 1  # answers and intermediate values stay positive and below this
SIZES = (20_000, 200)  # training, held-out: the cold start's copy generalises only from many problems (06-experiments)

# (opening, question): the sentences around the steps. {reading} is the counter's four digits.
TRAIN_FRAMES = [
    ("A counter shows {reading}.", "What number do you get?"),
    ("The meter reads {reading}.", "What is the result?"),
    ("A display shows {reading}.", "What number is shown at the end?"),
    ("The odometer says {reading}.", "Which number do you end with?"),
]
# Held out: each opening with a question sentence no training problem pairs it with. Sentences never seen at all
# would test what a 2-layer model trained from scratch cannot do: it copies by position, and a new sentence of
# another length moves every number (docs/06-experiments.md).
TEST_FRAMES = [(TRAIN_FRAMES[i][0], TRAIN_FRAMES[(i + 2) % len(TRAIN_FRAMES)][1]) for i in range(len(TRAIN_FRAMES))]


def make_chained_problems(n_train: int, n_test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """`n_train` problems in the training frames and `n_test` in the held-out ones; deterministic under `seed`.

    The held-out problems are drawn first, from a generator of their own, so they do
    not depend on `n_train`; no training problem shares their numbers (reading and operands).
    """
    test = _make(TEST_FRAMES, n_test, random.Random(f"{seed}-heldout"), "chained-heldout", used=set())
    return _make(TRAIN_FRAMES, n_train, random.Random(seed), "chained", used={_numbers(r) for r in test}), test


# --- the moves: what a tool call of the taught shape runs at each point ----------------------

def parse(question: str) -> tuple[str, list[tuple[str, int]]]:
    """(the reading as written, [(operation, number) per step]) of a question this module writes; ValueError otherwise."""
    for opening, ask in TRAIN_FRAMES + TEST_FRAMES:
        head = re.escape(opening).replace(r"\{reading\}", r"(?P<reading>\d{4})")
        match = re.fullmatch(f"{head} (?P<steps>.+)\\. {re.escape(ask)}", question)
        if match:
            steps = [_step(text) for text in match["steps"].split(", then ")]
            if None not in steps and 1 <= len(steps) <= 2:
                return match["reading"], steps
    raise ValueError(f"not a question this task writes: {question[:60]!r}")


def step_call(question: str, step: int, value: str) -> str:
    """The program for step `step` (0, 1) applied to `value`, as text: the reading as written, or a printed result."""
    op, n = parse(question)[1][step]
    return f"print({value} {op} {n})"


def without_leading_zeros(code: str) -> str:
    """The same program with each integer's leading zeros dropped: the fix the SyntaxError asks for."""
    return re.sub(r"\b0+(?=\d)", "", code)


def scripted_calls(question: str, run: Callable[[str], str | None], decide: Callable[[str], bool],
                   budget: int = 4) -> tuple[list[str], str | None]:
    """A scripted policy of taught-shape calls: (the programs it ran, the number it boxes, None if it gives up).

    `run(code)` gives what the program printed (stripped), or None when it
    raised. The first call copies the reading as written. After an error,
    `decide("fix")` says whether to run the fix; after a result with a step
    left, `decide("chain")` whether to call again on that printed number (else
    the result is boxed). `decide` always True is the multi-call solution;
    always False, the single-call policy.
    """
    reading, steps = parse(question)
    code, step, calls = step_call(question, 0, reading), 0, []
    while len(calls) < budget:
        calls.append(code)
        printed = run(code)
        if printed is None:
            if code == without_leading_zeros(code) or not decide("fix"):
                return calls, None
            code = without_leading_zeros(code)
        elif step + 1 < len(steps) and decide("chain"):
            step += 1
            code = step_call(question, step, printed)
        else:
            return calls, printed
    return calls, None


def single_programs(question: str) -> set[int]:
    """Every value one taught-shape program over the question's numbers prints: x op y, x and y two of them."""
    reading, steps = parse(question)
    numbers = [int(reading)] + [n for _, n in steps]
    return {_apply(x, op, y) for i, x in enumerate(numbers) for j, y in enumerate(numbers) if i != j for op in "*+-"}


# --- generation ---------------------------------------------------------------------------

def _make(frames, n: int, rng: random.Random, source: str, used: set) -> list[dict]:
    rows = []
    while len(rows) < n:
        padded = rng.random() < PADDED_SHARE
        reading = rng.randint(10, 999) if padded else rng.randint(1000, 9999)
        steps = [(rng.choice("*+-"), rng.randint(12, 999)) for _ in range(2 if rng.random() < TWO_STEP_SHARE else 1)]
        values = [reading]
        for op, number in steps:
            values.append(_apply(values[-1], op, number))
        if not all(0 < v <= LARGEST_ANSWER for v in values) or (reading, *steps) in used:
            continue
        opening, ask = frames[rng.randrange(len(frames))]
        said = ", then ".join(STEP_PHRASES[op].format(n=number) for op, number in steps)
        question = f"{opening.format(reading=f'{reading:04d}')} {said[0].upper()}{said[1:]}. {ask}"
        if len(steps) == 2 and values[-1] in single_programs(question):
            continue  # one program of the taught shape would do: not a two-call problem
        used.add((reading, *steps))
        kind = f"{len(steps)}step" + ("-padded" if padded else "")
        rows.append({"id": f"{source}-{len(rows)}-{reading}" + "".join(f"{op}{n}" for op, n in steps),
                     "question": question, "answer": str(values[-1]), "source": f"{source}-{kind}"})
    return rows


def _numbers(row: dict) -> tuple:
    reading, steps = parse(row["question"])
    return (int(reading), *steps)


def _step(text: str) -> tuple[str, int] | None:
    for op, phrase in STEP_PHRASES.items():
        match = re.fullmatch(re.escape(phrase).replace(r"\{n\}", r"(\d+)"), text[0].lower() + text[1:])
        if match:
            return op, int(match[1])
    return None


def _apply(x: int, op: str, y: int) -> int:
    return {"*": x * y, "+": x + y, "-": x - y}[op]


if __name__ == "__main__":
    from prepare_data import write_jsonl

    parser = argparse.ArgumentParser(description="Write counter problems of one or two steps, training and held-out.")
    parser.add_argument("--out-dir", default="data", help="folder of chained_train.jsonl and chained_test.jsonl (default data)")
    parser.add_argument("--sizes", type=int, nargs=2, default=list(SIZES), metavar=("TRAIN", "TEST"),
                        help=f"problems in the training frames and in the held-out ones (default {SIZES[0]} {SIZES[1]})")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args()
    for split, rows, frames in zip(("train", "test"), make_chained_problems(*args.sizes, seed=args.seed),
                                   (TRAIN_FRAMES, TEST_FRAMES)):
        write_jsonl(rows, Path(args.out_dir) / f"chained_{split}.jsonl")
        print(f"{Path(args.out_dir) / f'chained_{split}.jsonl'}: {len(rows)} problems in {len(frames)} frames")
