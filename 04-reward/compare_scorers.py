r"""Where the lab's scorer and ToRL's disagree: one table, one row per kind of answer (docs/04-torl-scorer.md).

    .venv/bin/python 04-reward/compare_scorers.py
    .venv/bin/python 04-reward/compare_scorers.py --answers data/torl_data/test.parquet --dump cases.jsonl
    .venv/bin/python 04-reward/compare_scorers.py --answers data/torl_data/test.parquet --results 04-compare-scorers
"""
from __future__ import annotations

import math
import re
import shlex
import sys
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

# Answers in the shapes MATH and AIME use, written for this lab.
SAMPLE_ANSWERS = [
    "42", "2718", "-7", "\\frac{5}{8}", "-\\frac{3}{20}", "\\dfrac{9}{4}", "3\\sqrt{3}", "\\sqrt{5}",
    "a + b", "x = 7", "y = -2x + 5", "(0, 3]", "(-\\infty, -1) \\cup (2, \\infty)", "\\{4, 5\\}",
    "6\\pi", "75^\\circ", "3 - 4i", "2 \\pm \\sqrt{6}", "7.5", "\\$4.20", "12 \\text{ inches}", "n^2 + n",
]

CHECK = (" Check: substituting the value back into the original equation, both sides agree, and the"
         " constraint from the first paragraph holds as well; the tool's output printed the same number,"
         " so nothing is left to fix. Every case above has been covered, the boundary values included,"
         " and no other candidate satisfies all of the conditions at once, so the result is final.")

# (kind, response, reference): what no rewrite of a reference makes.
HAND_CASES = [
    ("equal value, other form", "so \\boxed{2\\sqrt2}", "\\sqrt8"),
    ("equal value, other form", "so \\boxed{\\frac{1}{2}}", "0.5"),
    ("equal value, other form", "so \\boxed{2^{10}}", "1024"),
    ("box nested 4 deep", "so \\boxed{a^{b^{c^{d}}}}", "a^{b^{c^{d}}}"),
    ("box nested 5 deep", "so \\boxed{a^{b^{c^{d^{e}}}}}", "a^{b^{c^{d^{e}}}}"),
    ("box nested 5 deep", "first \\boxed{16}, no: \\boxed{2^{2^{2^{2^{1}}}}}", "16"),
    ("no box", "the answer is 42", "42"),
]


def say(content: str) -> str:
    return f"so the answer is $\\boxed{{{content}}}$."


def rewrites(answer: str) -> list[tuple[str, str]]:
    """(kind, response) pairs: the ways a model may write `answer` (a right one, unless the kind says wrong)."""
    forms = [("same string", answer), ("spacing", _respace(answer)), ("$ inside the box", f"${answer}$")]
    if "\\frac" in answer or "\\dfrac" in answer:
        forms.append(("\\dfrac vs \\frac", answer.replace("\\dfrac", "\\frac") if "\\dfrac" in answer
                      else answer.replace("\\frac", "\\dfrac")))
    number = re.fullmatch(r"(-?)\\d?frac\{(\d+)\}\{(\d+)\}", answer)
    if number:
        sign, top, bottom = number.groups()
        forms.append(("a/b for \\frac{a}{b}", f"{sign}{top}/{bottom}"))
        if _terminates(int(top), int(bottom)):
            forms.append(("decimal", f"{sign}{Decimal(top) / Decimal(bottom)}"))
    if answer.lstrip("-").isdigit():
        forms += [("decimal", f"{answer}.0"), ("unit in \\text", f"{answer} \\text{{ cm}}"),
                  ("wrong (reference + 1)", str(int(answer) + 1))]
        if int(answer):  # 0 times anything is still right
            forms.append(("wrong: the number times \\sqrt{2}", f"{answer}\\sqrt{{2}}"))
        if len(answer.lstrip("-")) > 3:
            forms.append(("thousands comma", f"{int(answer):,}"))
    if "=" not in answer and "," not in answer:
        forms.append(("x = answer", f"x = {answer}"))
    leading = re.match(r"(-?\d+) ?(?!\\text)\\?[a-zA-Z]", answer)  # 12\pi, 70 \sqrt{2}, 3R^2; not a unit
    if leading:
        forms.append(("wrong: only the leading number", leading.group(1)))
    if re.search(r"\\sqrt\{\w\}", answer):
        forms.append(("\\sqrt2 shorthand", re.sub(r"\\sqrt\{(\w)\}", r"\\sqrt\1", answer)))
    out = [(kind, say(form)) for kind, form in forms if form != answer or kind == "same string"]
    return out + [("check paragraph after the box", say(answer) + CHECK),
                  ("unclosed box after the box", say(answer) + " Or, rounding, \\boxed{" + answer),
                  ("\\boxed with a space, no braces", f"so the answer is $\\boxed {answer}$.")]


def _terminates(top: int, bottom: int) -> bool:
    """Whether top/bottom is a finite decimal: its reduced denominator, 2**a * 5**b with a, b < its bit length, divides
    10 to that power."""
    return 10 ** bottom.bit_length() % (bottom // math.gcd(top, bottom)) == 0


def _respace(answer: str) -> str:
    """The answer with its spaces removed, or with spaces put around + - = , when it has none."""
    if " " in answer:
        return answer.replace(" ", "")
    return re.sub(r"(?<=[^\s(\[{])([+\-=,])(?=\S)", r" \1 ", answer).replace(" , ", ", ")


def build_cases(answers: list[str]) -> list[dict]:
    """Rows {kind, response, reference}: every rewrite of every answer, then the hand cases."""
    cases = [{"kind": kind, "response": response, "reference": answer}
             for answer in answers for kind, response in rewrites(answer)]
    return cases + [{"kind": kind, "response": response, "reference": ref} for kind, response, ref in HAND_CASES]


def tally(cases: list[dict], workers: int = 2) -> dict[str, dict]:
    """Per kind: rows, each scorer's right ones, the disagreements each way ("unparsed": see the page), an example."""
    from reward import score_batch

    texts, refs = [c["response"] for c in cases], [c["reference"] for c in cases]
    lab, torl = (score_batch(texts, refs, workers=workers, scorer=scorer) for scorer in ("lab", "torl"))
    table: dict[str, dict] = defaultdict(lambda: dict.fromkeys(("rows", "lab", "torl", "lab only", "torl only",
                                                                 "unparsed"), 0) | {"example": None})
    for case, a, b in zip(cases, lab, torl):
        row = table[case["kind"]]
        row["rows"] += 1
        row["lab"] += a.correct
        row["torl"] += b.correct
        row["lab only"] += a.correct and not b.correct
        row["torl only"] += b.correct and not a.correct
        row["unparsed"] += a.correct and b.answer is not None and not b.correct and _unparsed(b.answer, case["reference"])
        if a.correct != b.correct and row["example"] is None:
            row["example"] = (b.answer if b.answer is not None else case["response"], case["reference"])
    return dict(table)


def _unparsed(answer: str, reference: str) -> bool:
    """Whether math-verify reads nothing from either side once normalised and left unwrapped, as ToRL checks it."""
    import logging

    from math_verify import parse
    from torl_scorer import normalize_final_answer

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warning that timeouts are off: they are
    return any(not parse(normalize_final_answer(side), parsing_timeout=None) for side in (answer, reference))


def main(argv: list[str] | None = None) -> None:
    from lab_cli import at_least, script_parser
    from prepare_data import DataError, load_problems, write_jsonl
    from results import figure_key, name_argument, save

    p = script_parser(__doc__)
    p.add_argument("--answers", metavar="SOURCE", help="take the references from a data set chapter 01 reads "
                   "(a .jsonl/.parquet file, ToRL's schema included); default: a built-in handful")
    p.add_argument("--dump", metavar="FILE", help="also write the cases as JSONL (input for reward.py --jsonl)")
    p.add_argument("--workers", type=at_least(1), default=2)
    p.add_argument("--results", metavar="NAME", type=name_argument,
                   help="also write the counts to docs/results/NAME.json, for the docs")
    args = p.parse_args(argv)
    answers = SAMPLE_ANSWERS
    if args.answers:
        try:
            answers = sorted({row["answer"] for row in load_problems(args.answers)[0]})
        except DataError as e:
            p.error(str(e))
    cases = build_cases(answers)
    if args.dump:
        write_jsonl(cases, Path(args.dump))  # chapter 01's writer: whole or not at all
    table = tally(cases, args.workers)
    print(f"{len(answers)} references, {len(cases)} responses; counts of responses scored right:\n")
    print("| kind | rows | lab +1 | torl +1 | lab +1, torl -1 (unparsed) | lab -1, torl +1 | first disagreement: box torl read; reference |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind, row in sorted(table.items(), key=lambda kv: -(kv[1]["lab only"] + kv[1]["torl only"])):
        example = "" if row["example"] is None else f"`{row['example'][0][:60]}`; `{row['example'][1]}`"
        print(f"| {kind} | {row['rows']} | {row['lab']} | {row['torl']} | {row['lab only']} ({row['unparsed']}) "
              f"| {row['torl only']} | {example} |")
    total = sum(r["lab only"] + r["torl only"] for r in table.values())
    print(f"\n{total} of {len(cases)} responses scored differently.")
    if args.results:
        figures = {"references": len(answers), "responses": len(cases), "scored_differently": total}
        for kind, row in table.items():  # "$ inside the box" -> inside_the_box_rows, inside_the_box_lab_only, ...
            figures.update({f"{figure_key(kind)}_{figure_key(column)}": row[column] for column in row if column != "example"})
        command = shlex.join([".venv/bin/python", "04-reward/compare_scorers.py",
                              *(sys.argv[1:] if argv is None else argv)])
        print(f"wrote {save(args.results, command, figures)}")


if __name__ == "__main__":
    main()
