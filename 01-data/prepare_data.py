"""Chapter 01: verifiable problems in, one schema {id, question, answer, source} out. The story: docs/01-data.md.

Only problems a program can check are kept, each drop counted by its reason; any source (NAMED_SOURCES, a hub id, a
.jsonl/.parquet in this schema or ToRL's) gives the one schema, written atomically. The toy task is made here too.

    .venv/bin/python 01-data/prepare_data.py                    # toy task + default train and AIME sets
    .venv/bin/python 01-data/prepare_data.py --train my.jsonl --eval aime24 aime25 --no-toy
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
from collections import Counter
from pathlib import Path

try:  # the lab's folders are on the path only in its own Python (the venv's tool_rl_lab.pth)
    from lab_cli import at_least, cannot_write, one_line_errors, refuse_chapter_folder
except ModuleNotFoundError:
    sys.exit(f"error: {sys.executable} is not the lab's Python: run .venv/bin/python {sys.argv[0]}, or make")

NAMED_SOURCES = {
    "deepscaler": {"path": "agentica-org/DeepScaleR-Preview-Dataset", "split": "train"},
    "math500": {"path": "HuggingFaceH4/MATH-500", "split": "test"},
    "aime24": {"path": "HuggingFaceH4/aime_2024", "split": "train"},
    "aime25": {"path": "math-ai/aime25", "split": "test"},
}
DEFAULT_TRAIN = "deepscaler"
DEFAULT_EVAL = ["aime24", "aime25"]

QUESTION_COLUMNS = ["question", "problem", "Problem", "Question", "prompt"]
ANSWER_COLUMNS = ["answer", "Answer", "final_answer", "ground_truth", "expected_answer", "reward_model"]

PROOF = re.compile(r"\b(prove|show that|proof)\b", re.IGNORECASE)  # in the answer, or opening the question
MULTI_PART = re.compile(r"(^|\s)\(a\)\s.*\s\(b\)\s", re.DOTALL)  # "(a) ... (b) ..." parts, not "(A)" labels
MULTI_ANSWER = re.compile(r";|\\text\{\s*(and|or)\s*\}|\\quad|\\boxed\{.*\\boxed\{")


class DataError(Exception):
    """Bad input: the message is one line naming the file and the row or column."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refuse_chapter_folder()
    out = Path(args.out)
    if why := cannot_write(out):  # before any data set is read or made
        print(f"error: --out {out}: cannot write there ({why}); choose a folder on a writable disk", file=sys.stderr)
        return 2
    jobs = []  # (kind, source, named: asked for by its own flag, so it must load)
    if not args.no_toy:
        jobs.append(("toy", None, False))
    # Evaluation sets first, so that the training set can leave out their questions.
    for source in args.eval if args.eval is not None else ([] if args.no_eval else DEFAULT_EVAL):
        jobs.append(("eval", source, args.eval is not None))
    if not args.no_train:
        jobs.append(("train", args.train or DEFAULT_TRAIN, args.train is not None))

    failed, eval_questions = 0, set()
    for kind, source, named in jobs:
        try:
            if kind == "toy":
                train, test = make_toy_task(args.toy_train, args.toy_test, seed=args.seed, digits=args.toy_digits)
                write_jsonl(train, out / "toy_train.jsonl")
                write_jsonl(test, out / "toy_test.jsonl")
                print(f"toy: {len(train)} train and {len(test)} test problems -> {out}/toy_{{train,test}}.jsonl")
                continue
            rows, dropped = load_problems(source)
            if kind == "eval":
                eval_questions |= {question_key(r) for r in rows}
            else:
                rows, leaked = drop_eval_questions(rows, eval_questions)
                if leaked:
                    dropped["in an evaluation set"] = leaked
            rows = rows[: args.limit] if args.limit else rows  # after every filter, the overlap's included
            path = out / f"{'train' if kind == 'train' else source_name(source)}.jsonl"
            write_jsonl(rows, path)
            print(f"{source}: kept {len(rows)} rows -> {path}" + "".join(f"; dropped {n} ({why})" for why, n in dropped.items()))
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except HubUnreachable as e:
            # A source asked for by name must load; the default run goes on offline (the toy task).
            print(f"{'error' if named else 'skipped'}: {e}", file=sys.stderr)
            failed += named
    return 1 if failed else 0


def load_problems(source: str) -> tuple[list[dict], dict[str, int]]:
    """Load `source` (a named set, a hub id or a local file) as clean rows, and the drop counts."""
    raw, origin = read_source(source)
    if not raw:
        raise DataError(f"{origin}: no rows")
    rows = [normalise(r, origin, i, default_source=source_name(source)) for i, r in enumerate(raw)]
    return filter_verifiable(rows)


def normalise(row: dict, origin: str, index: int, default_source: str) -> dict:
    """One raw row -> {id, question, answer, source}; raises DataError naming the row if unreadable."""
    if not isinstance(row, dict):
        raise DataError(f"{origin} row {index}: not a record but {type(row).__name__}")
    q_col = next((c for c in QUESTION_COLUMNS if c in row), None)
    a_col = next((c for c in ANSWER_COLUMNS if c in row), None)
    if q_col is None:
        raise DataError(f"{origin} row {index}: no question column (looked for {', '.join(QUESTION_COLUMNS)}; found {', '.join(row) or 'none'})")
    if a_col is None:
        raise DataError(f"{origin} row {index}: no answer column (looked for {', '.join(ANSWER_COLUMNS)}; found {', '.join(row)})")
    question = row[q_col]
    if isinstance(question, list):  # ToRL / chat schema: the user message is the problem
        users = [m.get("content") for m in question if isinstance(m, dict) and m.get("role") == "user"]
        question = users[-1] if users else None
    answer = row[a_col]
    if isinstance(answer, dict):  # ToRL / verl schema: reward_model.ground_truth
        answer = answer.get("ground_truth")
    if not isinstance(question, str):
        raise DataError(f"{origin} row {index}: column '{q_col}' holds no question text")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if answer is not None and not isinstance(answer, str):
        raise DataError(f"{origin} row {index}: column '{a_col}' holds {type(answer).__name__}, not an answer string")
    question = question.strip()
    source = row.get("data_source") or row.get("source") or default_source
    row_id = row.get("id") if isinstance(row.get("id"), str) and row.get("id") else None
    return {
        "id": row_id or f"{source}-{hashlib.sha1(question.encode()).hexdigest()[:10]}",
        "question": question,
        "answer": (answer or "").strip(),
        "source": str(source),
    }


def filter_verifiable(rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """Keep rows the ±1 reward can judge; count each reason a row was dropped."""
    kept, dropped, seen = [], Counter(), set()
    for row in rows:
        reason = unverifiable_reason(row)
        key = question_key(row)
        if reason is None and key in seen:
            reason = "duplicate question"
        if reason:
            dropped[reason] += 1
            continue
        seen.add(key)
        kept.append(row)
    return kept, dict(dropped)


def drop_eval_questions(train: list[dict], eval_questions: set[str]) -> tuple[list[dict], int]:
    """Leave out training rows whose question is in an evaluation set: trained on, they would inflate its score."""
    kept = [row for row in train if question_key(row) not in eval_questions]
    return kept, len(train) - len(kept)


def question_key(row: dict) -> str:
    """A question up to case and spacing: what counts as the same problem."""
    return " ".join(row["question"].lower().split())


def unverifiable_reason(row: dict) -> str | None:
    question, answer = row["question"], row["answer"]
    if not question:
        return "empty question"
    if not answer:
        return "empty answer"
    if PROOF.search(answer) or PROOF.match(question.lstrip()):
        return "proof"
    if MULTI_PART.search(question) or MULTI_ANSWER.search(answer):
        return "multi-part"
    return None


def make_toy_task(n_train: int, n_test: int, seed: int = 0, digits: int = 3) -> tuple[list[dict], list[dict]]:
    """Multiplication problems of two `digits`-digit factors, deterministic under `seed`; no question in both splits."""
    if digits < 2 or n_train < 0 or n_test < 0:
        raise DataError(f"toy task: digits must be at least 2 and counts 0 or more, got {digits}, {n_train}, {n_test}")
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    seen, rows, misses = set(), [], 0
    while len(rows) < n_train + n_test:
        if misses > 100_000:  # every distinct problem of this size is drawn: asking for more would never end
            raise DataError(f"toy task: {digits}-digit factors give fewer than {n_train + n_test} distinct problems")
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) in seen or len(str(a * b)) != 2 * digits:
            misses += 1
            continue
        seen.add((a, b))
        misses = 0
        rows.append({"id": f"toy-{a}x{b}", "question": f"What is {a} * {b}?", "answer": str(a * b), "source": "toy"})
    return rows[:n_train], rows[n_train:]


class HubUnreachable(Exception):
    pass


def read_source(source: str) -> tuple[list[dict], str]:
    """Raw rows of a local file, a named set or a hub id, and a name for error messages."""
    path = Path(source)
    if path.suffix in (".jsonl", ".parquet") or path.exists() or path.is_symlink():
        if path.is_dir():
            raise DataError(f"{source}: a folder, not a data file (pass one of its .jsonl or .parquet files)")
        if path.is_symlink() and not path.exists():
            raise DataError(f"{source}: a symbolic link to {os.readlink(path)}, which does not exist")
        if not path.is_file():
            raise DataError(f"{source}: no such file")
        if path.suffix not in (".jsonl", ".parquet"):
            raise DataError(f"{source}: unsupported file type '{path.suffix}' (use .jsonl or .parquet)")
        return (read_jsonl if path.suffix == ".jsonl" else read_parquet)(path), str(path)
    if source in NAMED_SOURCES:
        spec = NAMED_SOURCES[source]
    elif "/" in source:
        spec = {"path": source, "split": "train"}
    else:
        raise DataError(f"unknown data set '{source}': not a file, a hub id (org/name), or one of {', '.join(NAMED_SOURCES)}")
    return read_hub(spec["path"], spec["split"]), spec["path"]


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:  # a binary file (a .parquet renamed, an archive): not JSON lines
        raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {e.object[e.start]:#04x}); a JSONL file is text, "
                        "one JSON object a line") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
    return rows


def read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq  # installed with `datasets`

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def read_hub(path: str, split: str) -> list[dict]:
    from datasets import load_dataset

    why = hub_unreachable()
    if not why:
        try:
            return list(load_dataset(path, split=split))
        except Exception as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise HubUnreachable(f"could not load '{path}' (split {split}) from the Hugging Face hub: {why}") from None


_hub_probe: dict[str, str | None] = {}  # "unreachable_because": _probe_hub's answer, once per process


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached, asked once per process; None when it answers or HF_HUB_OFFLINE is set."""
    if "unreachable_because" not in _hub_probe:
        _hub_probe["unreachable_because"] = _probe_hub()
    return _hub_probe["unreachable_because"]


def _probe_hub(timeout: float = 5.0) -> str | None:
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return None
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as e:
        return (f"{constants.ENDPOINT} does not answer ({type(e).__name__}); "
                "set HF_HUB_OFFLINE=1 to use data sets already in the local cache")
    return None


def source_name(source: str) -> str:
    path = Path(source)
    return path.stem if path.suffix in (".jsonl", ".parquet") else source.split("/")[-1].lower()


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Write atomically: the rows go to a temporary file that replaces `path` only when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_problems(path: str | os.PathLike) -> list[dict]:
    """Read a file this module wrote (or any file in its schema) back as rows."""
    return load_problems(str(path))[0]


def parse_args(argv):
    p = argparse.ArgumentParser(description="Verifiable math problems in one schema {id, question, answer, source}.")
    p.add_argument("--out", default="data", help="folder the .jsonl files are written to (default: %(default)s)")
    p.add_argument("--train", metavar="SOURCE", help=f"training set: a name ({', '.join(NAMED_SOURCES)}), a hub id or a .jsonl/.parquet file (default: {DEFAULT_TRAIN})")
    p.add_argument("--eval", metavar="SOURCE", nargs="*", help=f"evaluation sets, same kinds of source (default: {' '.join(DEFAULT_EVAL)}; none with --no-eval)")
    p.add_argument("--limit", type=at_least(1), help="keep at most this many rows per source, after filtering (default: all)")
    p.add_argument("--no-train", action="store_true", help="skip the training set")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation sets")
    p.add_argument("--no-toy", action="store_true", help="skip the toy task of the CPU demo")
    p.add_argument("--toy-train", type=at_least(0), default=2000,
                   help="toy task: training problems (default: %(default)s)")
    p.add_argument("--toy-test", type=at_least(0), default=200, help="toy task: test problems (default: %(default)s)")
    p.add_argument("--toy-digits", type=at_least(2), default=3,
                   help="toy task: digits of each factor, 2 or more (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="toy task: random seed (default: %(default)s)")
    return one_line_errors(p).parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
