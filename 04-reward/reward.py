r"""Chapter 04: the outcome-only reward, +1 for a right final answer and -1 otherwise. The story: docs/04-reward.md.

Key decisions:
1. The answer is the LAST `\boxed{` of the last ANSWER_WINDOW_CHARS characters; unclosed, it is none (no fallback).
2. Right means math-verify finds it equivalent to the reference; any error or overrun counts as not equivalent.
3. Every check runs in a worker process with a deadline, so the verdict is the same from any thread.
4. `scorer="torl"` swaps in ToRL's own rule (torl_scorer.py, docs/04-torl-scorer.md), run the same way.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from torl_scorer import last_complete_box, torl_equivalent

ANSWER_WINDOW_CHARS = 300
BOXED = "\\boxed{"
DEFAULT_TIMEOUT_S = 5.0
_STARTUP_TIMEOUT_S = 120.0
SCORERS = ("lab", "torl")  # this file's rule; ToRL's own (torl_scorer.py)


@dataclass(frozen=True)
class RewardResult:
    reward: float  # +1.0 if correct, else -1.0
    correct: bool  # the answer is math-equivalent to the reference
    valid_format: bool  # a closed \boxed{...} was found in the answer window (torl: anywhere)
    answer: str | None  # raw content of that box (not stripped), None if none


NO_ANSWER = RewardResult(reward=-1.0, correct=False, valid_format=False, answer=None)


def score_answer(
    text: str, reference: str, timeout: float = DEFAULT_TIMEOUT_S, scorer: str = "lab"
) -> RewardResult:
    """Score one response against its reference answer (`scorer`: "lab" or "torl")."""
    answer = extract_answer(text, scorer)
    if answer is None:
        return NO_ANSWER
    correct = _pool(1)[0].equivalent(answer, reference, timeout, scorer)  # is_equivalent, in a worker, within `timeout`
    return _result(answer, correct)


def score_batch(texts: list[str], references: list[str], workers: int = 2, timeout: float = DEFAULT_TIMEOUT_S,
                scorer: str = "lab") -> list[RewardResult]:
    """Score many responses in `workers` processes, in input order; one pathological answer delays only its worker."""
    if len(texts) != len(references):
        raise ValueError(f"score_batch: {len(texts)} texts but {len(references)} references")
    answers = [extract_answer(t, scorer) for t in texts]
    todo = [i for i, a in enumerate(answers) if a is not None]
    verdicts: dict[int, bool] = {}
    if todo:
        n = max(1, min(workers, len(todo)))
        verifiers = _pool(n)

        def check(j: int) -> None:
            i = todo[j]
            verdicts[i] = verifiers[j % n].equivalent(answers[i], references[i], timeout, scorer)

        # One thread per worker process, each walking its own stride of the list.
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda w: [check(j) for j in range(w, len(todo), n)], range(n)))
    return [NO_ANSWER if a is None else _result(a, verdicts[i]) for i, a in enumerate(answers)]


def total_reward(result: RewardResult, execution_pass: bool, exec_error_penalty: float = 0.0) -> float:
    """ToRL's R = R_answer + R_exec: less `exec_error_penalty` unless `execution_pass`; off by default (docs/04)."""
    return result.reward - (exec_error_penalty if not execution_pass else 0.0)


def extract_answer(text: str, scorer: str = "lab") -> str | None:
    """The box `scorer` reads: the lab's in the last ANSWER_WINDOW_CHARS, ToRL's anywhere."""
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}: choose from {', '.join(SCORERS)}")
    if scorer == "torl":
        return last_complete_box(text)
    return extract_last_boxed(text[-ANSWER_WINDOW_CHARS:])


def extract_last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`, or None if there is none or it never closes."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth = 1
    begin = start + len(BOXED)
    for pos in range(begin, len(text)):
        ch = text[pos]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[begin:pos]
    return None


def _result(answer: str, correct: bool) -> RewardResult:
    return RewardResult(reward=1.0 if correct else -1.0, correct=correct, valid_format=True, answer=answer)


def is_equivalent(answer: str, reference: str) -> bool:
    """math-verify's verdict on both sides wrapped in `$...$`, its signal timeouts off: the caller bounds time."""
    from math_verify import parse, verify

    try:
        gold = parse(f"${reference.strip()}$", parsing_timeout=None)
        guess = parse(f"${answer.strip()}$", parsing_timeout=None)
        return bool(verify(gold, guess, timeout_seconds=None))
    except Exception:
        return False


_CHECKS = {"lab": is_equivalent, "torl": torl_equivalent}  # what a worker runs for each scorer


class _Verifier:
    """A worker process (this file, --serve-fd; why not forked: docs/04), replaced when it overruns its deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc = self._conn = None

    def equivalent(self, answer: str, reference: str, timeout: float, scorer: str = "lab") -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._conn.send((scorer, answer, reference))
                if self._conn.poll(timeout):
                    return bool(self._conn.recv())
            except (EOFError, OSError):  # the worker died (e.g. out of memory): not equivalent
                pass
            self._stop()  # overran the deadline or died: the next call starts a fresh one
            return False

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--serve-fd", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        # The warm-up is outside any answer's deadline: a slow start on a busy machine must not be a wrong verdict.
        if not self._conn.poll(_STARTUP_TIMEOUT_S):
            self._stop()
            raise RuntimeError(f"reward: the math-verify worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        self._conn.recv()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._conn.close()
        self._proc = self._conn = None


def _serve(fd: int) -> None:
    """The worker's loop: (scorer, answer, reference) in, verdict out, until the parent closes the socket."""
    import logging

    # Ctrl-C reaches the whole process group; the parent decides what to do, and the worker ends when it closes its end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # math-verify warns, once per process, that its own timeouts are off: they are meant to be.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    conn = Connection(fd)
    is_equivalent("0", "0")  # import and warm math-verify before the first deadline starts
    conn.send("ready")
    while True:
        try:
            scorer, answer, reference = conn.recv()
        except (EOFError, OSError):
            return
        try:
            verdict = _CHECKS[scorer](answer, reference)
        except Exception:  # any error while checking counts as not equivalent
            verdict = False
        conn.send(verdict)


# Worker processes live as long as this process: a training loop scores every step, and each start imports math-verify.
_workers: list[_Verifier] = []
_workers_lock = threading.Lock()


def _pool(n: int) -> list[_Verifier]:
    """The first n shared workers, started on first use; each serialises its own calls."""
    with _workers_lock:
        while len(_workers) < n:
            _workers.append(_Verifier())
        return _workers[:n]


def main(argv: list[str] | None = None) -> None:
    from lab_cli import at_least, one_line_errors

    p = one_line_errors(argparse.ArgumentParser(
        description="Score one response against its reference answer (+1 right, -1 otherwise), or every row of a file."))
    p.add_argument("text", nargs="?", help="the response, e.g. 'so \\boxed{1/2}'")
    p.add_argument("reference", nargs="?", help="the reference answer, e.g. 0.5")
    p.add_argument("--scorer", choices=SCORERS, default="lab", help="lab: this file's rule; torl: ToRL's own (torl_scorer.py)")
    p.add_argument("--jsonl", metavar="FILE", help="score each row {response, reference} of FILE; print it with reward and correct added")
    p.add_argument("--workers", type=at_least(1), default=2, help="worker processes for --jsonl")
    p.add_argument("--serve-fd", type=int, help=argparse.SUPPRESS)  # how a worker process is started
    args = p.parse_args(argv)
    if args.serve_fd is not None:
        _serve(args.serve_fd)
        return
    if args.jsonl is not None:
        if args.text is not None:
            p.error("give --jsonl FILE or a response and a reference, not both")
        rows = _read_rows(args.jsonl)
        results = score_batch([r["response"] for r in rows], [r["reference"] for r in rows],
                              workers=args.workers, scorer=args.scorer)
        for row, result in zip(rows, results):
            print(json.dumps({**row, "reward": result.reward, "correct": result.correct}, ensure_ascii=False))
        return
    if args.text is None or args.reference is None:
        p.error("give a response and a reference answer")
    print(score_answer(args.text, args.reference, scorer=args.scorer))


def _read_rows(path: str) -> list[dict]:
    """The rows of a JSONL file, each with string `response` and `reference`; a bad one ends the program in one line."""
    def refuse(where: str, message: str):
        print(f"error: {where}: {message}", file=sys.stderr)
        sys.exit(2)

    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")  # not splitlines: JSON strings may hold U+2028
    except (OSError, UnicodeDecodeError) as e:
        refuse(path, f"cannot read: {getattr(e, 'strerror', None) or e}")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            refuse(f"{path}:{number}", f"not JSON ({e.msg})")
        missing = [key for key in ("response", "reference") if not isinstance(row, dict) or not isinstance(row.get(key), str)]
        if missing:
            refuse(f"{path}:{number}", f"the row needs string fields {' and '.join(missing)}")
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
