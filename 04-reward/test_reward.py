"""The reward's contract, one rule per test."""
import inspect
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from doc_pages import says
from reward import (
    ANSWER_WINDOW_CHARS,
    DEFAULT_TIMEOUT_S,
    NO_ANSWER,
    RewardResult,
    extract_last_boxed,
    score_answer,
    score_batch,
    total_reward,
)


def test_right_answer_scores_plus_one_with_raw_answer():
    assert score_answer("so it is \\boxed{ 42 }.", "42") == RewardResult(1.0, True, True, " 42 ")


def test_wrong_answer_scores_minus_one_but_valid_format():
    assert score_answer("\\boxed{41}", "42") == RewardResult(-1.0, False, True, "41")


def test_no_box_is_no_answer():
    assert score_answer("the answer is 42", "42") == RewardResult(-1.0, False, False, None)


@pytest.mark.parametrize("text", ["\\boxed {42}", "boxed{42}", "\\fbox{42}", "\\boxed42", "\\Boxed{42}"])
def test_only_the_exact_marker_counts(text):
    assert score_answer(text, "42") == NO_ANSWER


def test_last_box_wins():
    assert score_answer("\\boxed{42} no wait \\boxed{7}", "42").answer == "7"
    assert score_answer("\\boxed{7} no wait \\boxed{42}", "42").correct


def test_unclosed_last_box_is_not_rescued_by_an_earlier_one():
    assert score_answer("\\boxed{42} or maybe \\boxed{4", "42") == NO_ANSWER


def test_nested_braces_are_counted():
    assert extract_last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert score_answer("\\boxed{\\frac{1}{2}}", "0.5").correct


def test_empty_box_has_valid_format_but_is_wrong():
    assert score_answer("\\boxed{}", "42") == RewardResult(-1.0, False, True, "")


def test_only_the_last_300_characters_are_read():
    filler = "x" * ANSWER_WINDOW_CHARS
    assert score_answer("\\boxed{42}" + filler, "42") == NO_ANSWER
    # A box that starts before the window is cut: its marker is not in the window.
    text = "\\boxed{42}" + "x" * (ANSWER_WINDOW_CHARS - len("\\boxed{42}"))
    assert len(text) == ANSWER_WINDOW_CHARS and score_answer(text, "42").correct
    assert score_answer(text + "y", "42") == NO_ANSWER  # window now starts at "boxed{42}"


def test_window_is_characters_not_bytes():
    # 299 three-byte characters after the box still leave the box inside the window.
    text = "\\boxed{5}" + "é" * (ANSWER_WINDOW_CHARS - len("\\boxed{5}"))
    assert score_answer(text, "5").correct


@pytest.mark.parametrize(
    "answer,reference",
    [("\\frac{1}{2}", "1/2"), ("0.5", "\\frac{1}{2}"), ("204.0", "204"), ("x=3", "3"),
     ("1,000", "1000"), ("\\{1,2\\}", "\\{2,1\\}"), ("2^{10}", "1024"), (" 7 ", "7 ")],
)
def test_math_equivalence(answer, reference):
    assert score_answer(f"\\boxed{{{answer}}}", reference).correct


@pytest.mark.parametrize("answer,reference", [("(1,2)", "(2,1)"), ("3", "4"), ("\\frac{1}{3}", "0.33")])
def test_math_non_equivalence(answer, reference):
    assert not score_answer(f"\\boxed{{{answer}}}", reference).correct


def test_garbage_answer_is_wrong_not_an_error():
    assert score_answer("\\boxed{\\frac{}{}}}}\\\\{{", "1").reward == -1.0
    assert score_answer("\\boxed{)(*&^%}", "1") == RewardResult(-1.0, False, True, ")(*&^%")


def test_same_verdict_from_a_worker_thread():
    cases = [("\\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{3}", "4"), ("nothing", "1")]
    main = [score_answer(t, r) for t, r in cases]
    got = []
    worker = threading.Thread(target=lambda: got.extend(score_answer(t, r) for t, r in cases))
    worker.start()
    worker.join()
    assert got == main
    assert [g.correct for g in got] == [True, False, False]


def test_pathological_answer_is_bounded_and_the_next_call_still_works():
    start = time.monotonic()
    result = score_answer("\\boxed{9^{9^{9^{9}}}}", "1", timeout=1.0)
    elapsed = time.monotonic() - start
    assert result == RewardResult(-1.0, False, True, "9^{9^{9^{9}}}")
    assert elapsed < 30  # a generous ceiling: unbounded, this would not return at all
    assert score_answer("\\boxed{2}", "2").correct


def test_score_batch_matches_score_answer_in_input_order():
    texts = ["\\boxed{1}", "no", "\\boxed{\\frac{2}{4}}", "\\boxed{3}", "\\boxed{5", "\\boxed{10}"]
    refs = ["1", "1", "0.5", "4", "5", "10"]
    batch = score_batch(texts, refs, workers=2)
    assert batch == [score_answer(t, r) for t, r in zip(texts, refs)]
    assert [b.reward for b in batch] == [1.0, -1.0, 1.0, -1.0, -1.0, 1.0]


def test_score_batch_bounds_each_answer():
    """One worker: the pathological answer is cut at its deadline and its worker killed; the answer after it runs in
    a worker started in its place. The pathological answer never finishes whatever the bound, so its deadline can be
    short; the right answer's is generous, since on a busy machine (two suites at once) even "2" = "2" overran 2 s,
    and its verdict, not its speed, is the contract (speed is the bench's)."""
    import reward

    assert [r.correct for r in score_batch(["\\boxed{3}"], ["3"], workers=1, timeout=60.0)] == [True]
    first = reward._pool(1)[0]._proc
    assert [r.correct for r in score_batch(["\\boxed{9^{9^{9^{9}}}}"], ["1"], workers=1, timeout=1.0)] == [False]
    assert first.poll() is not None  # killed at the deadline, not left computing
    assert [r.correct for r in score_batch(["\\boxed{2}"], ["2"], workers=1, timeout=60.0)] == [True]
    assert reward._pool(1)[0]._proc.pid != first.pid  # a fresh worker took its place


def test_score_batch_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 texts but 1 references"):
        score_batch(["a", "b"], ["1"])


def test_exec_error_penalty_is_off_by_default():
    right = RewardResult(1.0, True, True, "1")
    assert total_reward(right, execution_pass=False) == 1.0
    assert total_reward(right, execution_pass=False, exec_error_penalty=0.5) == 0.5
    assert total_reward(right, execution_pass=True, exec_error_penalty=0.5) == 1.0


def test_a_plain_script_without_a_main_guard_can_score(tmp_path):
    """A learner's first try: import and call at the top level of a script, no `if __name__` guard."""
    script = tmp_path / "first_try.py"
    script.write_text(
        "from reward import score_answer, score_batch\n"
        "print(score_answer('so \\\\boxed{1/2}', '0.5').correct)\n"
        "print([r.correct for r in score_batch(['\\\\boxed{2}', '\\\\boxed{3}'], ['2', '2'])])\n"
    )
    chapter = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([chapter, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["True", "[True, False]"]  # printed once: the script ran once


def test_command_line_scores_one_answer():
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "reward.py"), "\\boxed{1/2}", "0.5"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "correct=True" in done.stdout


def test_the_page_states_the_window_the_deadline_and_the_penalty_of_the_code():
    """docs/04 restates the window, the per-answer deadline and the penalty's default: read from reward.py."""
    window, box = ANSWER_WINDOW_CHARS, "\\boxed{42}"
    says("04-reward.md", f"in the last {window} characters", f"### The window: the last {window} characters",
         f"Only `text[-{window}:]` is read", f"`\\boxed{{42}}` followed by {window} more characters",
         f'`"{box}" + "x"*{window - len(box)}` is read whole', f"{window} characters of text are {window} characters")
    says("04-reward.md", f"stopped after {DEFAULT_TIMEOUT_S:g} s", f"a deadline of {DEFAULT_TIMEOUT_S:g} s per answer",
         f"(killed at the {DEFAULT_TIMEOUT_S:g} s deadline) |")
    assert inspect.signature(total_reward).parameters["exec_error_penalty"].default == 0.0
    says("04-reward.md", "## The execution-error penalty, off by default")


def test_the_page_s_main_line_is_reward_py_s_own_code():
    """docs/04-reward.md's main line is reward.py's lines, in order, docstrings and other functions left out."""
    import reward
    from doc_pages import DOCS

    page = (DOCS / "04-reward.md").read_text(encoding="utf-8")
    main_line = page.split("## The main line", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    source = iter(Path(reward.__file__).read_text(encoding="utf-8").splitlines())
    for line in filter(str.strip, main_line.splitlines()):
        assert line in source, f"docs/04-reward.md's main line: {line!r} is not the next such line of reward.py"
