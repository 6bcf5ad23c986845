"""The overlapped schedule of chapter 03's rollout, the default: every trajectory moves on its own. The story: docs/03-schedules.md.

What a turn or an observation appends, the budgets and the seeds stay the core's
(`_InFlight`'s three calls), so for a seed this gives the trajectories rounds give;
only the order of events differs.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import time
from typing import Callable

_REQUEST_IDS = itertools.count()  # unique in the process: the engine may be shared


def run_overlapped(engine, in_flight: list, run_code: Callable, spent: dict) -> None:
    """Sample every trajectory in `in_flight` to its end, each on its own: no trajectory waits for another.
    The engine steps continuously (vLLM's in-process `llm.llm_engine`: `add_request`, `step`); a turn that stops on
    ```output hands its code to `run_code` in a sandbox thread at once, and its continuation joins the running batch
    when the result is back. The loop blocks only when nothing is left to decode; `spent["sandbox_s"]` counts that wait
    and `spent["steps"]` the engine steps."""
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind

    # Every output engine.step() returns is taken for one of ours: another caller's would be lost to it.
    if engine.has_unfinished_requests():
        raise RuntimeError(f"rollout: the engine already has {engine.get_num_unfinished_requests()} request(s) "
                           f"in flight; the overlapped schedule steps it and needs it to itself")
    sampling: dict[str, object] = {}  # request id -> the trajectory whose turn the engine is sampling
    running: dict[concurrent.futures.Future, object] = {}  # sandbox call -> the trajectory waiting for it
    spent["steps"] = 0

    # The threads only wait on the sandbox, which admits `concurrency` calls at a time itself.
    with concurrent.futures.ThreadPoolExecutor(min(len(in_flight), 64), thread_name_prefix="rollout-sandbox") as pool:
        def advance(state) -> None:
            """Hand a trajectory to whoever acts next: the sandbox, the engine, or nobody (done)."""
            if state.done:
                return
            if state.wants_tool:
                running[pool.submit(run_code, state.code)] = state
                return
            request_id = f"rollout-{next(_REQUEST_IDS)}"
            params = state.next_params()
            params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per turn, when it ends (as LLM.generate sets)
            # add_request takes the engine's own form of a token prompt (LLM.generate's TokensPrompt is rendered to it).
            engine.add_request(request_id, tokens_input(state.traj.prompt_ids + state.traj.token_ids), params)
            sampling[request_id] = state

        try:
            for state in in_flight:
                advance(state)
            while sampling or running:
                t0 = time.perf_counter()
                if sampling:
                    for out in engine.step():
                        if out.finished:
                            state = sampling.pop(out.request_id)
                            state.append_turn(out.outputs[0])
                            advance(state)
                    spent["generate_s"] += time.perf_counter() - t0
                    spent["steps"] += 1
                    ready = [call for call in running if call.done()]
                else:  # every unfinished trajectory waits for its code
                    ready = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED).done
                    spent["sandbox_s"] += time.perf_counter() - t0
                for call in ready:
                    state = running.pop(call)
                    state.append_observation(call.result())
                    advance(state)
        finally:
            if sampling:  # an error left turns in the shared engine: take them out
                engine.abort_request(list(sampling))
