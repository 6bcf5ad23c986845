"""The rounds schedule of chapter 03's rollout: the whole batch moves turn by turn. The story: docs/03-schedules.md.

`rollout(..., RolloutConfig(schedule="rounds"))` hands its trajectories here.
Each round sends every unfinished trajectory's next turn in one `LLM.generate`
call, then runs all the code those turns asked for in one `run_many` batch. A
trajectory's bookkeeping (what a turn appends, what an observation appends, the
budgets, the seeds) is the core's, as in the default overlapped schedule: for a
seed both give the same trajectories; only the order of events differs.
"""
from __future__ import annotations

import time
from typing import Callable


def run_in_rounds(llm, in_flight: list, run_many: Callable, *, group_size: int, spent: dict,
                  params_for: Callable, observe: Callable) -> None:
    """Sample every trajectory in `in_flight` (group_size per problem, in order) to its end, a round at a time.

    `params_for(state, n)` gives the SamplingParams of a trajectory's next turn
    with n samples, `run_many(codes)` runs a batch of programs, and
    `observe(state, result)` appends an observation (result None: nothing ran).
    `spent["rounds"]` counts the generate calls; `spent["sandbox_s"]` the time
    the engine waited for each round's code.
    """
    spent["rounds"] = 0
    # Round 0: one request per problem, n=group_size; its samples share the prompt's prefill.
    firsts = in_flight[::group_size]
    params = [params_for(state, group_size) for state in firsts]
    for position, out in enumerate(_generate(llm, [state.traj.prompt_ids for state in firsts], params, spent)):
        for sample in out.outputs:
            in_flight[position * group_size + sample.index].append_turn(sample)

    # Later rounds: run this round's code, append the observations, continue every unfinished trajectory.
    while True:
        waiting = [state for state in in_flight if state.wants_tool]
        if waiting:
            t0 = time.perf_counter()
            to_run = {id(state): state.code for state in waiting if state.code}  # "": no complete block, nothing runs
            results = dict(zip(to_run, run_many(list(to_run.values())) if to_run else []))
            spent["sandbox_s"] += time.perf_counter() - t0
            for state in waiting:
                observe(state, results.get(id(state)))
        unfinished = [state for state in in_flight if not state.done]
        if not unfinished:
            return
        requests = [state.traj.prompt_ids + state.traj.token_ids for state in unfinished]
        params = [params_for(state, 1) for state in unfinished]
        for state, out in zip(unfinished, _generate(llm, requests, params, spent)):
            state.append_turn(out.outputs[0])


def _generate(llm, requests: list[list[int]], params: list, spent: dict) -> list:
    """One generate call on token ids (never re-rendered text), timed and counted as a round."""
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in requests], params, use_tqdm=False)
    spent["generate_s"] += time.perf_counter() - t0
    spent["rounds"] += 1
    return outs
