"""Arithmetic word problems with 3- and 4-digit numbers, and phrasings held out for testing. The story: docs/01-data.md.

The SmolLM2 preset's task: the test split's phrasings appear in neither the cold start nor RL. `solution_code`
recovers the Python line that answers any question this module writes (the cold start builds its traces with it).

    .venv/bin/python 01-data/word_problems.py --out-dir data     # data/word_train.jsonl, data/word_test.jsonl
"""
from __future__ import annotations

import random
import re
from pathlib import Path

# (phrasing, operation). {a} and {b} are the numbers in reading order; "-" is a - b.
TRAIN_TEMPLATES = [
    ("A box holds {a} pencils. How many pencils are in {b} boxes?", "*"),
    ("A farm has {a} rows of trees with {b} trees in each row. How many trees are on the farm?", "*"),
    ("One ticket costs {a} dollars. How many dollars do {b} tickets cost?", "*"),
    ("A library had {a} books and bought {b} more. How many books does it have now?", "+"),
    ("Tom walked {a} steps in the morning and {b} steps in the evening. How many steps did he walk in all?", "+"),
    ("A tank held {a} liters of water and {b} liters leaked out. How many liters are left?", "-"),
    ("A store had {a} apples and sold {b} of them. How many apples does it have now?", "-"),
]
TEST_TEMPLATES = [
    ("A machine makes {a} bolts per hour. How many bolts does it make in {b} hours?", "*"),
    ("There are {a} buses and each bus carries {b} people. How many people ride the buses?", "*"),
    ("A school has {a} girls and {b} boys. How many students are at the school?", "+"),
    ("A road is {a} meters long and {b} meters of it are paved. How many meters are not paved?", "-"),
]


def make_word_problems(n_train: int, n_test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """`n_train` problems in the training phrasings and `n_test` in the held-out ones, deterministic under `seed`.
    A difference's first number is the larger, so every answer is a positive integer."""
    rng = random.Random(seed)
    return _make(TRAIN_TEMPLATES, n_train, rng, "word"), _make(TEST_TEMPLATES, n_test, rng, "word-heldout")


def solution_code(question: str) -> str:
    """The Python line that answers a question written by this module: `print(a op b)`; ValueError for any other text."""
    for phrasing, op in TRAIN_TEMPLATES + TEST_TEMPLATES:
        match = re.fullmatch(re.escape(phrasing).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)"), question)
        if match:
            return f"print({match['a']} {op} {match['b']})"
    raise ValueError(f"not a question this task writes: {question[:60]!r}")


def _make(templates, n: int, rng: random.Random, source: str) -> list[dict]:
    rows, seen = [], set()
    while len(rows) < n:
        t = rng.randrange(len(templates))
        phrasing, op = templates[t]
        a, b = _number(rng), _number(rng)
        if op == "-":
            a, b = max(a, b), min(a, b)
        if a == b or (t, a, b) in seen:
            continue
        seen.add((t, a, b))
        answer = {"*": a * b, "+": a + b, "-": a - b}[op]
        rows.append({"id": f"{source}-{t}-{a}-{b}", "question": phrasing.format(a=a, b=b),
                     "answer": str(answer), "source": source})
    return rows


def _number(rng: random.Random) -> int:
    return rng.randint(100, 999) if rng.random() < 0.5 else rng.randint(1000, 9999)


if __name__ == "__main__":
    from lab_cli import at_least, script_parser
    from prepare_data import write_jsonl

    parser = script_parser(__doc__)
    parser.add_argument("--out-dir", default="data", help="folder of the two files (default: %(default)s)")
    parser.add_argument("--train", type=at_least(0), default=2000, help="training problems (default: %(default)s)")
    parser.add_argument("--test", type=at_least(0), default=200, help="held-out problems (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    args = parser.parse_args()
    train, test = make_word_problems(args.train, args.test, args.seed)
    write_jsonl(train, Path(args.out_dir) / "word_train.jsonl")
    write_jsonl(test, Path(args.out_dir) / "word_test.jsonl")
    print(f"{len(train)} training problems ({len(TRAIN_TEMPLATES)} phrasings), {len(test)} held-out ({len(TEST_TEMPLATES)} phrasings) in {args.out_dir}")
