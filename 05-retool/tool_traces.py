"""What a tool trace is made of, shared by the cold start (which trains on traces) and the moves check (which
measures a base on them): the model's text around a call, and the chained task's scripted calls run in the sandbox.
"""
from __future__ import annotations

from rollout import observation_text

TOOL_OPENING = "```python\n{code}\n```\n```output"
DIRECT_OPENING = "The answer is \\boxed{{{guess}}}."
TOOL_CLOSING = "The answer is \\boxed{{{answer}}}."


def sandboxed_calls(question: str, decide, sandbox, results: dict) -> tuple[list[str], str | None]:
    """The scripted policy's calls on one problem, each program run in the sandbox once (`results`: code -> result)."""
    from chained_problems import scripted_calls

    def run(code: str) -> str | None:
        if code not in results:
            results[code] = sandbox.run(code)
        return results[code].stdout.strip() if results[code].ok else None

    return scripted_calls(question, run, decide)


def call_segments(calls: list[str], results: dict) -> list[tuple[str, str]]:
    """Each call as the model writes it, then what the sandbox printed, as a rollout appends them."""
    return [segment for code in calls for segment in (("model", TOOL_OPENING.format(code=code)),
                                                      ("observation", observation_text(results[code])))]
