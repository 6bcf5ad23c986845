"""Counter problems of one or two steps, some with a reading that makes the first call fail: calls that chain.

The cpu-chained preset's task: a reading keeps its leading zero (0482), so the taught first call fails. Its four kinds
and the design's reasons: docs/06-experiments.md. A row's source names its kind ("chained-heldout-2step-padded").

    .venv/bin/python 01-data/chained_problems.py --out-dir data     # data/chained_train.jsonl, data/chained_test.jsonl
"""
from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Callable

# One operation: a 2-layer model trained from scratch never learned to carry an operation's symbol into its call
# (06-experiments), and the calls' chaining, not the arithmetic, is what this task is for.
STEP_PHRASES = {"+": "add {n}"}
STEP_NUMBERS = (100, 999)  # three digits each: every number keeps its distance from the prompt's end
FIRST_RESULTS = (1000, 9999)  # four digits: the call after it finds the second step at one distance (06-experiments)
TWO_STEP_SHARE = 0.5  # of the problems, the rest have one step
PADDED_SHARE = 1 / 3  # readings 100 to 999, shown with one leading zero
SIZES = (20_000, 200)  # training, held-out: the cold start's copy generalises only from many problems (06-experiments)

# (opening, question): the problem is the question, the opening, then the steps. {reading} is the counter's four digits.
TRAIN_FRAMES = [
    ("A counter shows {reading}.", "What number do you get?"),
    ("The meter reads {reading}.", "What is the result?"),
    ("A display shows {reading}.", "What number is shown at the end?"),
    ("The odometer says {reading}.", "Which number do you end with?"),
]
# Held out: each opening with a question sentence no training problem pairs it with. Unseen sentences would move
# every number, and a 2-layer model trained from scratch copies by position (docs/06-experiments.md).
TEST_FRAMES = [(TRAIN_FRAMES[i][0], TRAIN_FRAMES[(i + 2) % len(TRAIN_FRAMES)][1]) for i in range(len(TRAIN_FRAMES))]


def make_chained_problems(n_train: int, n_test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """`n_train` training-frame problems and `n_test` held-out ones (drawn first, sharing no numbers), seeded."""
    used = set()  # the numbers drawn so far: the held-out problems' are left out of training
    test = _make(TEST_FRAMES, n_test, random.Random(f"{seed}-heldout"), "chained-heldout", used)
    return _make(TRAIN_FRAMES, n_train, random.Random(seed), "chained", used), test


# --- the moves: what a tool call of the taught shape runs at each point ----------------------

def parse(question: str) -> tuple[str, list[tuple[str, int]]]:
    """(the reading as written, [(operation, number) per step]) of a question this module writes; ValueError otherwise."""
    for opening, ask in TRAIN_FRAMES + TEST_FRAMES:
        head = re.escape(opening).replace(r"\{reading\}", r"(?P<reading>\d{4})")
        match = re.fullmatch(f"{re.escape(ask)} {head} (?P<steps>.+)\\.", question)
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
    `run(code)`: the printed text, stripped (None if it raised). `decide(what)`: "fix" an error, or "chain" a call
    on a printed number with a step left? Always True is the multi-call solution, always False the single-call one."""
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
        reading = rng.randint(100, 999) if padded else rng.randint(FIRST_RESULTS[0], FIRST_RESULTS[1] - STEP_NUMBERS[0])
        first = rng.randint(max(STEP_NUMBERS[0], FIRST_RESULTS[0] - reading), min(STEP_NUMBERS[1], FIRST_RESULTS[1] - reading))
        steps = [(rng.choice(list(STEP_PHRASES)), n)
                 for n in [first, rng.randint(*STEP_NUMBERS)][:2 if rng.random() < TWO_STEP_SHARE else 1]]
        values = [reading]
        for op, number in steps:
            values.append(_apply(values[-1], op, number))
        if not FIRST_RESULTS[0] <= values[1] <= FIRST_RESULTS[1] or (reading, *steps) in used:
            continue
        opening, ask = frames[rng.randrange(len(frames))]
        said = ", then ".join(STEP_PHRASES[op].format(n=number) for op, number in steps)
        question = f"{ask} {opening.format(reading=f'{reading:04d}')} {said[0].upper()}{said[1:]}."
        if len(steps) == 2 and values[-1] in single_programs(question):
            continue  # one program of the taught shape would do: not a two-call problem
        used.add((reading, *steps))
        kind = f"{len(steps)}step" + ("-padded" if padded else "")
        rows.append({"id": f"{source}-{len(rows)}-{reading}" + "".join(f"{op}{n}" for op, n in steps),
                     "question": question, "answer": str(values[-1]), "source": f"{source}-{kind}"})
    return rows


def _step(text: str) -> tuple[str, int] | None:
    for op, phrase in STEP_PHRASES.items():
        match = re.fullmatch(re.escape(phrase).replace(r"\{n\}", r"(\d+)"), text[0].lower() + text[1:])
        if match:
            return op, int(match[1])
    return None


def _apply(x: int, op: str, y: int) -> int:
    return {"*": x * y, "+": x + y, "-": x - y}[op]


if __name__ == "__main__":
    from lab_cli import script_parser
    from prepare_data import write_jsonl

    parser = script_parser(__doc__)
    parser.add_argument("--out-dir", default="data", help="folder of chained_train.jsonl and chained_test.jsonl (default data)")
    parser.add_argument("--sizes", type=int, nargs=2, default=list(SIZES), metavar=("TRAIN", "TEST"),
                        help=f"problems in the training frames and in the held-out ones (default {SIZES[0]} {SIZES[1]})")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args()
    for split, rows, frames in zip(("train", "test"), make_chained_problems(*args.sizes, seed=args.seed),
                                   (TRAIN_FRAMES, TEST_FRAMES)):
        write_jsonl(rows, Path(args.out_dir) / f"chained_{split}.jsonl")
        print(f"{Path(args.out_dir) / f'chained_{split}.jsonl'}: {len(rows)} problems in {len(frames)} frames")
