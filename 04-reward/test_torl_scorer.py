"""ToRL's own scorer, one rule per test, each beside the lab's verdict where the two differ."""
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from compare_scorers import build_cases, tally
from doc_pages import says
from reward import ANSWER_WINDOW_CHARS, RewardResult, score_answer, score_batch
from torl_scorer import (
    BOX_DEPTH,
    MINERVA_REMOVED_EXPRESSIONS,
    MINERVA_SUBSTITUTIONS,
    REMOVED_EXPRESSIONS,
    SUBSTITUTIONS,
    last_complete_box,
    normalize_final_answer,
    torl_score,
)

REWARD_PY = Path(__file__).resolve().parent / "reward.py"
CHECK = " Check: " + "substituting back, both sides agree. " * 10  # 378 characters after the box

# (rule, response, reference, ToRL's reward, the lab's reward)
CASES = [
    ("a box followed by a long check counts for torl only", "\\boxed{42}" + CHECK, "42", 1.0, -1.0),
    ("the box's own braces and 3 more levels are read", "\\boxed{a^{b^{c^{d}}}}", "a^{b^{c^{d}}}", 1.0, 1.0),
    ("a box 5 levels deep is skipped by torl", "\\boxed{a^{b^{c^{d^{e}}}}}", "a^{b^{c^{d^{e}}}}", -1.0, 1.0),
    ("torl falls back to the box before a too-deep one", "\\boxed{16} no: \\boxed{2^{2^{2^{2^{1}}}}}", "16", 1.0, -1.0),
    ("torl falls back to the box before an unclosed one", "\\boxed{42} or maybe \\boxed{4", "42", 1.0, -1.0),
    ("\\boxed with a space is no box for either", "so $\\boxed 5$", "5", -1.0, -1.0),
    ("no box scores -1 in both", "the answer is 42", "42", -1.0, -1.0),
    ("an equal string (any case) scores +1 before anything is parsed", "\\boxed{P - Q}", "p - q", 1.0, 1.0),
    ("p-q vs p - q: unwrapped parse reads neither", "\\boxed{p-q}", "p - q", -1.0, 1.0),
    ("2\\sqrt2 vs \\sqrt8: unwrapped parse reads 2 and nothing", "\\boxed{2\\sqrt2}", "\\sqrt8", -1.0, 1.0),
    ("\\frac{1}{2} vs 0.5: both read", "\\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("\\frac12 shorthand is expanded", "\\boxed{\\frac12}", "0.5", 1.0, 1.0),
    ("a unit in \\text is removed", "\\boxed{5 \\text{ cm}}", "5", 1.0, 1.0),
    ("$ around a number is removed", "\\boxed{$5$}", "5", 1.0, 1.0),
    ("$ around LaTeX is removed, and then nothing is read", "\\boxed{$\\sqrt{5}$}", "\\sqrt{5}", -1.0, 1.0),
    ("\\sqrt5 is expanded, and then nothing is read", "\\boxed{\\sqrt5}", "\\sqrt{5}", -1.0, 1.0),
    ("x = before LaTeX: nothing is read", "\\boxed{x = \\sqrt{5}}", "\\sqrt{5}", -1.0, 1.0),
    ("x = before a number is read", "\\boxed{x = 5}", "5", 1.0, 1.0),
    ("\\dfrac is made \\frac", "\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0, 1.0),
    ("a/b is read", "\\boxed{3/4}", "\\frac{3}{4}", 1.0, 1.0),
    ("204.0 is 204", "\\boxed{204.0}", "204", 1.0, 1.0),
    ("a thousands comma is removed", "\\boxed{100,000}", "100000", 1.0, 1.0),
    ("torl reads a leading number: 12\\pi counts as 12", "\\boxed{12\\pi}", "12", 1.0, -1.0),
    ("torl reads a leading number: 2 counts as 2\\sqrt{2}", "\\boxed{2}", "2\\sqrt{2}", 1.0, -1.0),
    ("a choice letter in \\text is not read unwrapped", "\\boxed{\\text{(B)}}", "B", -1.0, 1.0),
    ("a wrong number is wrong in both", "\\boxed{43}", "42", -1.0, -1.0),
]


@pytest.mark.parametrize("rule,response,reference,torl,lab", CASES, ids=[c[0] for c in CASES])
def test_torl_rule_beside_the_lab(rule, response, reference, torl, lab):
    assert torl_score(response, reference) == torl
    assert score_answer(response, reference, scorer="torl").reward == torl
    assert score_answer(response, reference).reward == lab


def test_the_box_regex_nests_up_to_box_depth():
    inner = "x"
    for _ in range(BOX_DEPTH - 1):
        inner = "{" + inner + "}"
    assert last_complete_box(f"\\boxed{{{inner}}}") == inner
    assert last_complete_box(f"\\boxed{{{{{inner}}}}}") is None


def test_an_escaped_brace_can_close_an_unclosed_box():
    # ToRL's regex lets `\{` count as text, so this box, unclosed to a reader, matches.
    assert last_complete_box("\\boxed{\\{1,2\\}") == "\\{1,2\\"
    assert last_complete_box("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"


def test_boxed_with_a_space_is_not_matched():
    assert last_complete_box("\\boxed 5") is None
    assert last_complete_box("\\boxed{3} then \\boxed 5") == "3"


def test_the_normaliser_follows_minerva_with_torls_edits():
    assert normalize_final_answer("\\dfrac12 \\text{ cm}") == "\\frac{1}{2}"
    assert normalize_final_answer("\\(100,000\\)") == "100000"
    assert normalize_final_answer("\\left(2, \\infty\\right)") == "(2,\\infty)"  # "ft" is not removed
    assert normalize_final_answer("a b") == "ab"  # "a " is not removed
    assert ("a ", "") in MINERVA_SUBSTITUTIONS and ("a ", "") not in SUBSTITUTIONS
    assert "ft" in MINERVA_REMOVED_EXPRESSIONS and "ft" not in REMOVED_EXPRESSIONS
    assert SUBSTITUTIONS[:len(MINERVA_SUBSTITUTIONS) - 1] == [p for p in MINERVA_SUBSTITUTIONS if p != ("a ", "")]


def test_an_error_scores_minus_one():
    assert torl_score("\\boxed{1}", None) == -1.0


def test_same_verdict_from_a_worker_thread():
    cases = [(c[1], c[2]) for c in CASES]
    main = [torl_score(t, r) for t, r in cases]
    got = []
    worker = threading.Thread(target=lambda: got.extend(torl_score(t, r) for t, r in cases))
    worker.start()
    worker.join()
    assert got == main == [c[3] for c in CASES]


def test_score_batch_with_torl_reports_the_box_it_read():
    texts = ["\\boxed{42}" + CHECK, "\\boxed{1} or \\boxed{2", "nothing", "\\boxed{7}"]
    assert score_batch(texts, ["42", "1", "1", "8"], scorer="torl") == [
        RewardResult(1.0, True, True, "42"), RewardResult(1.0, True, True, "1"),
        RewardResult(-1.0, False, False, None), RewardResult(-1.0, False, True, "7")]
    assert len(CHECK) > ANSWER_WINDOW_CHARS


def test_an_unknown_scorer_is_refused():
    with pytest.raises(ValueError, match="unknown scorer 'minerva'"):
        score_batch(["\\boxed{1}"], ["1"], scorer="minerva")


def run_cli(*args):
    return subprocess.run([sys.executable, str(REWARD_PY), *args], capture_output=True, text=True, timeout=300)


def test_command_line_scores_a_jsonl_file_in_order(tmp_path):
    rows = [{"id": i, "note": "line\u2028separator", "response": c[1], "reference": c[2]} for i, c in enumerate(CASES)]
    path = tmp_path / "rows.jsonl"
    # Written raw (U+2028 is a line break to str.splitlines, not to JSONL); a blank line is skipped.
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + "\n", encoding="utf-8")
    for scorer, column in (("torl", 3), ("lab", 4)):
        done = run_cli("--scorer", scorer, "--jsonl", str(path))
        assert done.returncode == 0, done.stderr[-2000:]
        out = [json.loads(line) for line in done.stdout.split("\n") if line]
        assert out == [{**r, "reward": c[column], "correct": c[column] > 0} for r, c in zip(rows, CASES)]


@pytest.mark.parametrize("content,where,message", [
    (None, "", "cannot read: No such file or directory"),
    ('{"response": "\\\\boxed{1}", "reference": "1"}\n{"response": "x"}\n', ":2", "needs string fields reference"),
    ('{"response": "\\\\boxed{1}", "reference": 1}\n', ":1", "needs string fields reference"),
    ('\n{"response": "x", oops\n', ":2", "not JSON"),
    ('["a row", "not an object"]\n', ":1", "needs string fields response and reference"),
])
def test_command_line_refuses_bad_input_in_one_line(tmp_path, content, where, message):
    path = tmp_path / "rows.jsonl"
    if content is not None:
        path.write_text(content)
    done = run_cli("--scorer", "torl", "--jsonl", str(path))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"error: {path}{where}: ") and message in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


def test_measured_disagreements_by_kind():
    """compare_scorers' built-in set: the kinds where the two must agree do, and the known ones split."""
    table = tally(build_cases(["42", "-7", "\\frac{5}{8}", "3\\sqrt{3}", "p - q"]))
    for kind in ("same string", "wrong (reference + 1)", "decimal", "a/b for \\frac{a}{b}", "\\dfrac vs \\frac",
                 "unit in \\text", "\\boxed with a space, no braces", "no box"):
        assert table[kind]["lab only"] == table[kind]["torl only"] == 0, kind
    for kind in ("check paragraph after the box", "unclosed box after the box", "wrong: the number times \\sqrt{2}",
                 "wrong: only the leading number"):
        assert table[kind]["torl only"] == table[kind]["rows"] > 0, kind
    assert table["spacing"]["lab only"] == table["spacing"]["unparsed"] == 1  # p-q vs p - q


def test_the_page_states_the_depth_and_window_of_the_code():
    says("04-torl-scorer.md", f"nests braces up to {BOX_DEPTH} levels", f"the last {ANSWER_WINDOW_CHARS} characters")


def test_compare_scorers_results_hold_every_count_the_page_quotes(tmp_path, monkeypatch):
    """--results writes one figure per count the table prints, named as docs/04-torl-scorer.md quotes them."""
    import compare_scorers
    import results

    page = (results.ROOT / "docs" / "04-torl-scorer.md").read_text(encoding="utf-8")
    quoted = {m[2] for m in results.QUOTE.finditer(page)} | {k for m in results.BLOCK.finditer(page) for k in m[2].split()}
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    compare_scorers.main(["--results", "demo"])  # the built-in answers make every kind the page shows
    written = results.load("demo")
    assert written["command"] == ".venv/bin/python 04-reward/compare_scorers.py --results demo"
    assert len(quoted) > 100 and quoted <= set(written["figures"]), quoted - set(written["figures"])
