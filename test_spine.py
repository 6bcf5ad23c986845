"""The lab's reading budget: each chapter's core reads in one sitting, main function early; each page is one sitting.

A core past its budget, a main function pushed down by machinery, or a page
that grew into several sittings fails here, in the change that caused it.
"""
from __future__ import annotations

import ast
import functools
import io
import json
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

import results

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
PAGE_LINES = 400


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


PAGES = [str(p.relative_to(REPO)) for p in results.pages() if p.parent != REPO]  # the chapters' and the appendix's


@pytest.mark.parametrize("page", PAGES)
def test_each_page_is_one_sitting(page):
    lines = len((REPO / page).read_text().splitlines())
    assert lines <= PAGE_LINES, f"{page}: {lines} lines, budget {PAGE_LINES}"


def test_every_page_is_linked_from_the_readme_or_another_page():
    texts = {page: (REPO / page).read_text() for page in ["README.md", *PAGES]}
    for page in PAGES:
        name = page.rsplit("/", 1)[-1]
        linked = [other for other, text in texts.items() if other != page and name in text]
        assert linked, f"{page} is linked from nowhere"


def prose(text: str) -> str:
    """A page without its fenced blocks: their # lines are not headings, their brackets not links."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def heading_anchors(text: str) -> set[str]:
    """The anchors a Markdown renderer gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = prose(text)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


@functools.cache
def anchors_of(page: Path) -> set[str]:
    return heading_anchors(page.read_text())


def test_heading_anchors_follow_the_renderers_rule():
    assert heading_anchors("## Past one node\nsay ```output\n## `grpo_step`, in full\n```\n# not a heading\n```\n") == {
        "past-one-node", "grpo_step-in-full"}


def test_every_link_between_pages_reaches_a_file_and_its_heading():
    """A page moved, merged or renamed leaves no link behind that leads nowhere, nor to a heading it lost."""
    sources = ["README.md", *PAGES, *sorted(str(p.relative_to(REPO)) for p in REPO.glob("*/README.md"))]
    broken = []
    for source in sources:
        text = prose((REPO / source).read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (REPO / source).parent / path if path else REPO / source
            if not file.exists():
                broken.append(f"{source}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors_of(file.resolve()):
                broken.append(f"{source}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_test_file_is_one_pytest_collects():
    """A test file outside `testpaths` would pass silently in CI by never running."""
    import tomllib

    paths = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    files = [p.relative_to(REPO) for p in REPO.glob("**/test_*.py") if not p.relative_to(REPO).parts[0].startswith(".")]
    lost = [str(f) for f in files if not any(str(f) == t or f.parts[0] == t for t in paths)]
    assert not lost, f"not under pyproject's testpaths: {lost}"


def test_the_end_to_end_tier_names_real_tests_and_make_test_leaves_it_out():
    """A renamed test would silently leave the tier conftest.py lists it in: each name must still be a test of its
    file. `make test` deselects the tier and `make test-all` runs both, the learner's suite first."""

    import conftest

    for path, names in conftest.E2E.items():
        source = (REPO / path).read_text()
        for name in names:
            assert f"def {name.split('[')[0]}(" in source, f"{path}: no test {name}"

    def commands(target):
        said = subprocess.run(["make", "-n", "--no-print-directory", target, "STAMP="], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout
        return [line for line in said.splitlines() if "-m pytest" in line]

    assert [line.split("pytest", 1)[1].split() for line in commands("test")] == [["-m", '"not', 'e2e"']]
    assert [line.split("pytest", 1)[1].split()[:2] for line in commands("test-all")] == [["-m", '"not'], ["-m", "e2e"]]


def test_no_import_circle_among_the_labs_modules():
    """Every import counts, a function's own too: a circle hidden inside functions still ties its modules together,
    so none reads, tests or moves alone. The lab's modules are the non-test files of the root and the chapters."""
    folders = [REPO] + sorted(p for p in REPO.glob("0[0-9]-*") if p.is_dir())
    files = {f.stem: f for folder in folders for f in folder.glob("*.py")
             if not f.name.startswith("test_") and f.name != "conftest.py"}
    imports = {}
    for name, file in files.items():
        found = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        imports[name] = found & files.keys() - {name}
    circles = []
    for start in sorted(files):  # a path from `start` back to itself; each circle found once, from its least module
        paths = [[start]]
        seen = set()
        while paths:
            path = paths.pop()
            for nxt in sorted(imports[path[-1]]):
                if nxt == start:
                    circles.append(" -> ".join(path + [start]))
                elif nxt > start and nxt not in seen:
                    seen.add(nxt)
                    paths.append(path + [nxt])
    assert len(files) > 20 and imports["grpo"] and imports["retool"]  # the scan found the lab and its imports
    assert not circles, f"import circles: {circles}"


# Modules with a __main__ that only the lab itself starts: the preloaded interpreter, and the runner in a container
STARTED_BY_THE_LAB = {"preloaded_python.py", "runner.py"}


def scripts_with_a_command_line() -> list[Path]:
    """The lab's scripts: each module of the root or a chapter that runs as a command."""
    folders = [REPO] + sorted(p for p in REPO.glob("0[0-9]-*") if p.is_dir())
    return [f for folder in folders for f in sorted(folder.glob("*.py"))
            if not f.name.startswith("test_") and f.name not in {"conftest.py", *STARTED_BY_THE_LAB}
            and 'if __name__ == "__main__":' in f.read_text()]


def test_every_script_refuses_an_unknown_flag_in_one_line(tmp_path, preloaded_python):
    """A mistyped flag is one line naming it, exit status 2, from every script: argparse's own error prints the usage
    first, several lines, which lab_cli.one_line_errors replaces."""
    scripts = scripts_with_a_command_line()
    check = tmp_path / "refusal_of_each.py"
    # Each script runs as __main__ in a fork, its stderr a file: the lab's scripts write to the real descriptors
    check.write_text("import json, os, runpy, sys, tempfile\n"
                     "for script in sys.argv[1:]:\n"
                     "    with tempfile.TemporaryFile() as err:\n"
                     "        if (pid := os.fork()) == 0:\n"
                     "            os.dup2(err.fileno(), 2)\n"
                     "            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)\n"
                     "            sys.argv, code = [script, '--no-such-flag'], 0\n"
                     "            try:\n"
                     "                runpy.run_path(script, run_name='__main__')\n"
                     "            except SystemExit as e:\n"
                     "                code = e.code if isinstance(e.code, int) else print(e.code, file=sys.stderr) or 1\n"
                     "            sys.stderr.flush()\n"
                     "            os._exit(code)\n"
                     "        status = os.waitpid(pid, 0)[1]\n"
                     "        err.seek(0)\n"
                     "        print(json.dumps([script, os.waitstatus_to_exitcode(status), err.read().decode()]))\n")
    fresh = [s for s in scripts if "hold_kernels()" in s.read_text()]  # must import torch itself, after its settings
    done = preloaded_python.run([check, *(s for s in scripts if s not in fresh)], cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [json.loads(line) for line in done.stdout.splitlines()]
    for script in fresh:
        alone = subprocess.run([sys.executable, script, "--no-such-flag"], cwd=REPO, capture_output=True, text=True,
                               timeout=120)
        said.append([str(script), alone.returncode, alone.stderr])
    assert len(scripts) > 25 and sorted(s for s, _, _ in said) == sorted(map(str, scripts))
    wrong = [f"{Path(s).relative_to(REPO)}: exit {code}, {err!r}" for s, code, err in said
             if code != 2 or len(err.splitlines()) != 1 or not err.startswith("error: ")]
    assert not wrong, "\n".join(wrong)
