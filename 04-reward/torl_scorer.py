r"""ToRL's own scorer (GAIR-NLP/ToRL, reward type "default"), for comparison with the lab's.
The rule in words, and where and why the two disagree, with measured counts: docs/04-torl-scorer.md.

Written anew from reading ToRL's source, not copied: the answer is the last complete
`\boxed{...}` anywhere (braces nested up to BOX_DEPTH levels; a deeper or unclosed
box is skipped, so an earlier one counts), where the lab reads only the last 300
characters and never falls back. A string match, else Minerva's normaliser (with
ToRL's edits) and math-verify UNWRAPPED: the lab wraps both sides in `$...$`, without
which parse returns [] for much LaTeX and only the leading number of `12\pi`.
Anything that raises scores -1 (ToRL's fallback to Hendrycks' string equality never
decides: math-verify does not raise by default).

math-verify runs with its signal timeouts off, so the verdict is the same from any
thread; `torl_score` sets no deadline, `reward.score_batch(..., scorer="torl")` runs it under one.
"""
from __future__ import annotations

import re

BOX_DEPTH = 4  # levels of braces ToRL's regex reads, the box's own included


def _braces(levels: int) -> str:
    r"""A regex for `{...}` holding up to `levels` - 1 more levels of braces; escaped `\{`, `\}` count as text."""
    if levels == 1:
        return r"\{[^{}]*\}"
    return r"\{(?:[^{}]|\\\{|\\\}|" + _braces(levels - 1) + r")*\}"


# The same alternatives in the same order as ToRL's regex, so that backtracking picks the same match.
_BOX = re.compile(r"\\boxed\{((?:[^{}]|\\\{|\\\}|" + _braces(BOX_DEPTH - 1) + r")*)\}")


def last_complete_box(response: str) -> str | None:
    r"""Content of the last `\boxed{...}` ToRL's regex matches anywhere in `response`, or None.

    >>> last_complete_box("\\boxed{1} then \\boxed{\\frac{a}{b}} and a check paragraph")
    '\\frac{a}{b}'
    >>> last_complete_box("\\boxed{1} then \\boxed{2")  # unclosed: the earlier box counts
    '1'
    """
    boxes = _BOX.findall(response)
    return boxes[-1] if boxes else None


# Lewkowycz et al. 2022 ("Solving Quantitative Reasoning Problems with Language Models", Minerva), appendix D: the
# published normaliser's data, applied in order.
MINERVA_SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]
MINERVA_REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km",
    "units", "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents",
    "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}",
    "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
]
# ToRL's edits: it deletes neither "a " nor "ft" (which would mangle \infty and
# \left), and appends these substitutions after Minerva's.
TORL_EXTRA_SUBSTITUTIONS = [
    ("\\left", ""), ("\\right", ""), ("\u2236", ":"), ("\uff0c", ","), ("$", ""),
    ("\\approx", "="), ("\\simeq", "="), ("\\sim", "="), ("^\\prime", "'"), ("^{\\prime}", "'"),
    ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^\\circ", ""), ("%", ""),
    ("\u221a", "\\sqrt"), ("\u221e", "\\infty"), ("\u222a", "\\cup"),
]
SUBSTITUTIONS = [pair for pair in MINERVA_SUBSTITUTIONS if pair != ("a ", "")] + TORL_EXTRA_SUBSTITUTIONS
REMOVED_EXPRESSIONS = [expr for expr in MINERVA_REMOVED_EXPRESSIONS if expr != "ft"]

# Commands whose braces are dropped, keeping what they held (the first closing brace ends it).
_UNWRAP = [re.compile(r"\\text\{(.*?)\}"), re.compile(r"\\textbf\{(.*?)\}"), re.compile(r"\\overline\{(.*?)\}"),
           re.compile(r"\\boxed\{(.*)\}")]


def _drop_math_delimiters(text: str) -> str:
    r"""Remove one leading `\(` or `\[` and one trailing `\)` or `\]`."""
    if text[:2] in ("\\(", "\\["):
        text = text[2:]
    if text[-2:] in ("\\)", "\\]"):
        text = text[:-2]
    return text


def normalize_final_answer(answer: str) -> str:
    r"""Minerva's normaliser as ToRL runs it: `"\\dfrac12 \\text{ cm}"` -> `"\\frac{1}{2}"`. Minerva's first step,
    keeping what follows the last `=`, ToRL leaves out. Its `$...$` extraction is left out here too: every `$` is gone
    by then."""
    answer = _drop_math_delimiters(answer.strip())
    for before, after in SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        answer = answer.replace(expr, "")
    for command in _UNWRAP:
        answer = command.sub(r"\1", answer)
    answer = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", answer)  # \frac12 -> \frac{1}{2}
    answer = re.sub(r"sqrt([^{])", r"sqrt{\1}", answer)  # \sqrt2 -> \sqrt{2}
    if answer.replace(",", "").isdigit():  # 100,000 -> 100000
        answer = answer.replace(",", "")
    return _drop_math_delimiters(answer).strip()


def torl_equivalent(answer: str, reference: str) -> bool:
    """ToRL's verdict on a box's content: string match, else math-verify on the normalised, unwrapped strings."""
    from math_verify import parse, verify

    if answer.strip().lower() == reference.strip().lower():
        return True
    guess = parse(normalize_final_answer(answer), parsing_timeout=None)
    gold = parse(normalize_final_answer(reference), parsing_timeout=None)
    # ToRL passes the response's answer as verify's first ("gold") argument: kept.
    return bool(verify(guess, gold, timeout_seconds=None))


def torl_score(response: str, reference: str) -> float:
    r"""+1.0 if ToRL's scorer counts `response` right against `reference`, else -1.0.

    >>> torl_score("\\boxed{\\frac{1}{2}} Check: " + "x" * 350, "0.5")
    1.0
    >>> torl_score("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")  # unwrapped, parse reads 2 and nothing
    -1.0
    >>> torl_score("\\boxed{12\\pi}", "12")  # and 12 from 12\\pi
    1.0
    """
    try:
        answer = last_complete_box(response)
        return 1.0 if answer is not None and torl_equivalent(answer, reference) else -1.0
    except Exception:
        return -1.0
