r"""ToRL's own scorer (GAIR-NLP/ToRL, reward type "default"), written anew from its source, rule by rule as
docs/04-torl-scorer.md numbers them. math-verify's signal timeouts are off, so the verdict is the same from any thread;
`torl_score` sets no deadline, `reward.score_batch(..., scorer="torl")` runs it under one."""
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
    r"""Rule 1: content of the last `\boxed{...}` ToRL's regex matches anywhere in `response`, or None. A last box
    that is unclosed or nested deeper than BOX_DEPTH is not matched, so an earlier box counts."""
    boxes = _BOX.findall(response)
    return boxes[-1] if boxes else None


# Minerva's published normaliser (Lewkowycz et al. 2022, appendix D): its data, applied in order.
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
# ToRL's edits: it deletes neither "a " nor "ft" (they would mangle \infty and \left), and appends these.
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
    return re.sub(r"\\[)\]]\Z", "", re.sub(r"\A\\[(\[]", "", text))


def normalize_final_answer(answer: str) -> str:
    r"""Rule 3, Minerva's normaliser as ToRL runs it: `"\\dfrac12 \\text{ cm}"` -> `"\\frac{1}{2}"`. Minerva's
    `$...$` extraction is left out too: every `$` is gone by then."""
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
    """Rules 2 to 4: a string match, else math-verify on the normalised (rule 3), unwrapped strings."""
    from math_verify import parse, verify

    if answer.strip().lower() == reference.strip().lower():
        return True
    guess = parse(normalize_final_answer(answer), parsing_timeout=None)
    gold = parse(normalize_final_answer(reference), parsing_timeout=None)
    # ToRL passes the response's answer as verify's first ("gold") argument: kept.
    return bool(verify(guess, gold, timeout_seconds=None))


def torl_score(response: str, reference: str) -> float:
    """+1.0 if ToRL's scorer counts `response` right against `reference`, else -1.0 (rule 5: also if it raises)."""
    try:
        answer = last_complete_box(response)
        return 1.0 if answer is not None and torl_equivalent(answer, reference) else -1.0
    except Exception:
        return -1.0
