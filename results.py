"""Measured figures, each in one results file written by the one command that measured it; pages quote them.

A results file is docs/results/NAME.json: {"command": the command that writes it, "figures": {key: value}}. A page
(README.md, docs/*.md, docs/appendix/*.md) quotes it in a block that names the command, inline before a one-word
value (it ends at a space, a closing full stop or punctuation), or in a table after a line that names its columns
(the last cells of each row; one key per data row, `{}` standing for the column's piece):

    <!-- results NAME -->    (or <!-- results NAME key key ... -->), then the block the file rewrites
    <!-- /results -->
    <!-- r NAME.key -->0.94
    <!-- results-table NAME NAME.piece ...; key {}_key ... -->

`python results.py` rewrites every quote from the files; test_results.py fails when a page and its file differ, or
one file is quoted on two pages or on none.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "docs" / "results"
NAME = re.compile(r"[\w-]+")
# A marker in backticks is an example of one (README.md shows them), not a quote.
BLOCK = re.compile(r"(?<!`)<!-- results ([\w-]+)((?: \w+)*) -->\n(.*?)<!-- /results -->", re.S)
QUOTE = re.compile(r"(?<!`)<!-- r ([\w-]+)\.(\w+) -->")
SHA256 = re.compile(r"[0-9a-f]{64}")  # a released file's hash (05-retool/released_base.py): the one long string
TABLE = re.compile(r"(?<!`)<!-- results-table ([\w.\- ]+); ([\w{} ]+) -->\n((?:\|.*\n)+)")
WORD = re.compile(r"[^\s|<>()\[\]*,;:%]*[^\s|<>()\[\]*,;:%.]")  # a value in prose, without a closing full stop or %


def save(name: str, command: str, figures: dict) -> Path:
    """Write docs/results/NAME.json (sorted keys, atomically: a reader sees the old file or the new one)."""
    check(name, figures)
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"command": command, "figures": figures}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def check(name: str, figures: dict) -> None:
    """Refuse what a results file may not hold: a name that is not a plain word, a figure that is not small."""
    if not NAME.fullmatch(name):
        raise ValueError(f"results name {name!r}: letters, digits, '-' and '_' only")
    for key, value in figures.items():
        if not re.fullmatch(r"\w+", key) or not isinstance(value, (int, float, str)) or isinstance(value, bool) \
                or (isinstance(value, str) and len(value) > 40 and not SHA256.fullmatch(value)):
            raise ValueError(f"results {name}: figure {key}={value!r}: keys are words, values numbers or short strings")


def name_argument(text: str) -> str:
    """An argparse type for `--results NAME`: a bad name is refused before anything is measured."""
    if not NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: a name (docs/results/NAME.json), letters, digits, '-' and '_'")
    return text


def figure_key(words: str) -> str:
    """A figure's name from words: lower case, each run of other characters one `_` ("$ inside the box" -> inside_the_box)."""
    return re.sub(r"\W+", "_", words).strip("_").lower()


def make_command(target: str, args: list[str]) -> str:
    """`make TARGET ARGS='...'`: how a bench's results file records the run, so that it can be typed again."""
    return f"make {target} ARGS={shlex.quote(shlex.join(args))}"


def load(name: str) -> dict:
    """{"command": ..., "figures": {...}} of docs/results/NAME.json."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise KeyError(f"no results file {path.relative_to(ROOT)}")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path.relative_to(ROOT)}: not a results file ({e})") from None


def names() -> list[str]:
    return sorted(p.stem for p in RESULTS.glob("*.json"))


def block(name: str, keys: list[str], folder: str = "results") -> str:
    """A block's content: the command that measured it, then its figures (all, or `keys`) as a table.
    `folder` is docs/results as the page links it: "results" from docs/, "../results" from docs/appendix/."""
    result = load(name)
    figures = result["figures"]
    if missing := [key for key in keys if key not in figures]:
        raise KeyError(f"results {name} has no figure {', '.join(missing)}")
    rows = [f"| `{key}` | {figures[key]} |" for key in keys or sorted(figures)]
    return (f"Measured by `{result['command']}` ([results/{name}.json]({folder}/{name}.json)):\n\n"
            "| figure | value |\n| --- | --- |\n" + "\n".join(rows) + "\n")


def figure(name: str, key: str) -> str:
    """One figure of a results file as a page quotes it: as the file holds it (the writer rounds), one word."""
    figures = load(name)["figures"]
    if key not in figures:
        raise KeyError(f"results {name} has no figure {key}")
    value = str(figures[key])
    if not WORD.fullmatch(value):
        raise ValueError(f"results {name}.{key} is {value!r}, not one word: quote it in a block")
    return value


def table(columns: list[str], keys: list[str], rows: str) -> str:
    """A table's lines with the last len(columns) cells of data row i rewritten: column NAME.piece's figure keys[i],
    its `{}` replaced by the piece (none: the key as it is)."""
    lines = rows.splitlines()
    if len(lines) - 2 != len(keys):
        raise ValueError(f"results-table {' '.join(columns)}: {len(keys)} keys for {len(lines) - 2} rows")
    for i, key in enumerate(keys, 2):
        cells = lines[i].strip().strip("|").split("|")
        if len(cells) <= len(columns):
            raise ValueError(f"results-table {' '.join(columns)}: row {i - 1} has {len(cells)} cells, no label")
        for j, column in enumerate(columns, len(cells) - len(columns)):
            name, _, piece = column.partition(".")
            cells[j] = f" {figure(name, key.replace('{}', piece))} "
        lines[i] = "|" + "|".join(cells) + "|"
    return "\n".join(lines) + "\n"


def render(text: str, folder: str = "results") -> str:
    """The page with every block, inline quote and table rewritten from its file (`folder`: see block)."""
    text = BLOCK.sub(lambda m: f"<!-- results {m[1]}{m[2]} -->\n{block(m[1], m[2].split(), folder)}<!-- /results -->", text)
    text = TABLE.sub(lambda m: f"<!-- results-table {m[1]}; {m[2]} -->\n{table(m[1].split(), m[2].split(), m[3])}", text)
    out, last = [], 0
    for m in QUOTE.finditer(text):
        out += [text[last:m.end()], figure(m[1], m[2])]
        last = m.end() + len(WORD.match(text, m.end())[0] if WORD.match(text, m.end()) else "")
    return "".join(out) + text[last:]


def pages() -> list[Path]:
    """Every page that may quote a figure: the README, the chapters and the appendix."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "appendix").glob("*.md"))]


def results_folder(page: str) -> str:
    """docs/results as a link from `page` (a path under the repository root): "results", "../results"."""
    return os.path.relpath("docs/results", os.path.dirname(page) or ".").replace(os.sep, "/")


def quotes(text: str) -> set[str]:
    """The results files a page quotes, in blocks, inline or in tables."""
    tables = {column.partition(".")[0] for m in TABLE.finditer(text) for column in m[1].split()}
    return {m[1] for m in BLOCK.finditer(text)} | {m[1] for m in QUOTE.finditer(text)} | tables


def problems(texts: dict[str, str]) -> list[str]:
    """What is wrong between pages ({name: text}) and the results files: one line each, [] when all agree."""
    found, quoted_on = [], {}
    for page, text in texts.items():
        for name in quotes(text):
            quoted_on.setdefault(name, []).append(page)
        try:
            new = render(text, results_folder(page))
        except (KeyError, ValueError) as e:
            found.append(f"{page}: {e.args[0]}")
            continue
        for m in BLOCK.finditer(text):
            if f"`{load(m[1])['command']}`" not in m[3]:
                found.append(f"{page}: the block of results {m[1]} does not show its command")
        old, now = text.splitlines(), new.splitlines()
        for line, (a, b) in enumerate(zip(old, now), 1):
            if a != b:  # shown from a little before the first difference
                at = max(len(os.path.commonprefix([a, b])) - 30, 0)
                found.append(f"{page}:{line}: differs from its results file: {a[at:at + 70]!r} should read {b[at:at + 70]!r}")
        if len(old) != len(now):
            found.append(f"{page}: a results block differs in length from its file")
    for name, where in sorted(quoted_on.items()):
        if len(where) > 1:
            found.append(f"results {name} is quoted on {len(where)} pages, not one: {', '.join(where)}")
    found += [f"results {name} is quoted by no page" for name in names() if name not in quoted_on]
    return found


def main(argv: list[str]) -> int:
    """Rewrite every page's blocks and quotes from the results files."""
    usage = "usage: python results.py   (make docs-results: rewrites every page's figures from docs/results/*.json)"
    if argv in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__}")
        return 0
    if argv:
        print(f"error: results.py takes no arguments, got {' '.join(argv)} (see --help)", file=sys.stderr)
        return 2
    texts, rewritten = {page: page.read_text(encoding="utf-8") for page in pages()}, {}
    for page, text in texts.items():  # every page rendered before one is written: a bad quote changes none
        try:
            rewritten[page] = render(text, results_folder(str(page.relative_to(ROOT))))
        except (KeyError, ValueError) as e:
            print(f"error: {page.relative_to(ROOT)}: {e.args[0]}", file=sys.stderr)
            return 1
    for page, text in rewritten.items():
        if text != texts[page]:
            page.with_suffix(".md.tmp").write_text(text, encoding="utf-8")
            os.replace(page.with_suffix(".md.tmp"), page)
            print(f"rewrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
