"""The lab's reading budget: each chapter's core reads in one sitting, main function early; each page is one sitting.

A core past its budget, a main function pushed down by machinery, or a page
that grew into several sittings fails here, in the change that caused it.
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent
# The README's table: each chapter's core module and its main function, with its budget in code lines.
CORES = {
    "01-data/prepare_data.py": [],
    "02-sandbox/sandbox.py": [],
    "03-rollout/rollout.py": [("rollout", 60)],
    "04-reward/reward.py": [],
    "05-retool/retool.py": [("train", 60), ("train_step", 40)],
    "06-train/grpo.py": [("grpo_step", 60)],
}
MAIN_FUNCTION = {"03-rollout/rollout.py": "rollout", "05-retool/retool.py": "train", "06-train/grpo.py": "grpo_step"}
CORE_LINES = 350  # non-blank lines
PAGE_LINES = 450


def code_lines(source: str, node: ast.AST) -> int:
    """Lines of `node` that hold code: not blank, not a comment, not a docstring."""
    docstrings = set()
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    with_code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
            continue
        with_code.update(range(token.start[0], token.end[0] + 1))
    return len({n for n in with_code if node.lineno <= n <= node.end_lineno} - docstrings)


def test_code_lines_skip_docstrings_comments_and_blanks():
    source = 'def f(x):\n    """Doc\n    string."""\n    # why\n\n    y = (x +\n         1)\n    return y\n'
    assert code_lines(source, ast.parse(source).body[0]) == 4  # def, the two lines of y, return


@pytest.mark.parametrize("core", CORES)
def test_each_core_reads_in_one_sitting(core):
    source = (REPO / core).read_text()
    non_blank = sum(1 for line in source.splitlines() if line.strip())
    assert non_blank <= CORE_LINES, f"{core}: {non_blank} non-blank lines, budget {CORE_LINES}"
    functions = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    for name, budget in CORES[core]:
        lines = code_lines(source, functions[name])
        assert lines <= budget, f"{core}: {name} has {lines} code lines, budget {budget}"
    if core in MAIN_FUNCTION:
        start = functions[MAIN_FUNCTION[core]].lineno
        total = len(source.splitlines())
        assert start <= 0.4 * total, f"{core}: {MAIN_FUNCTION[core]} starts at line {start} of {total}"


@pytest.mark.parametrize("page", sorted(p.name for p in (REPO / "docs").glob("*.md")))
def test_each_page_is_one_sitting(page):
    lines = len((REPO / "docs" / page).read_text().splitlines())
    assert lines <= PAGE_LINES, f"docs/{page}: {lines} lines, budget {PAGE_LINES}"


def test_every_page_is_linked_from_the_readme_or_another_page():
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    texts = [(REPO / "README.md").read_text()] + [(REPO / "docs" / p).read_text() for p in pages]
    for page in pages:
        linked = sum(page in text for text in texts) - (page in (REPO / "docs" / page).read_text())
        assert linked, f"docs/{page} is linked from nowhere"
