"""The rounds schedule of chapter 03's rollout: the whole batch moves turn by turn. The story: docs/03-schedules.md.

Turns, observations, budgets and seeds stay the core's (`_InFlight` in rollout.py): only the order of events differs.
"""
from __future__ import annotations

import time
from typing import Callable


def run_rounds(llm, in_flight: list, run_many: Callable, spent: dict, group_size: int) -> None:
    """Sample every trajectory in `in_flight` (`group_size` per problem, in order) to its end, round by round: one
    `generate` with every unfinished turn, then their code in one `run_many`. `spent["rounds"]` counts the rounds."""
    spent["rounds"] = 0
    # Round 0: one request per problem, n=group_size; its samples share the prompt's prefill.
    firsts = in_flight[::group_size]
    for position, out in enumerate(_generate(llm, firsts, spent, n=group_size)):
        for sample in out.outputs:
            in_flight[position * group_size + sample.index].append_turn(sample)
    while True:  # each later round: all the code the last turns asked for in one batch, then every next turn
        waiting = [state for state in in_flight if state.wants_tool]
        if waiting:
            t0 = time.perf_counter()
            results = run_many([state.code for state in waiting])
            spent["sandbox_s"] += time.perf_counter() - t0  # the engine waits for the round's slowest call
            for state, result in zip(waiting, results):
                state.append_observation(result)
        unfinished = [state for state in in_flight if not state.done]
        if not unfinished:
            return
        for state, out in zip(unfinished, _generate(llm, unfinished, spent)):
            state.append_turn(out.outputs[0])


def _generate(llm, states: list, spent: dict, n: int = 1) -> list:
    """One round: one generate call with each trajectory's next turn, sent as token ids (never re-rendered text)."""
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=s.traj.prompt_ids + s.traj.token_ids) for s in states],
                        [s.next_params(n) for s in states], use_tqdm=False)
    spent["generate_s"] += time.perf_counter() - t0
    spent["rounds"] += 1
    return outs
