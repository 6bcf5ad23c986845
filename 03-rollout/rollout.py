"""Chapter 03: token-exact tool-integrated rollouts with vLLM. The story: docs/03-rollout.md; siblings: README.md.

The model writes until it asks for a code block's output (STOP); the sandbox runs it; the output joins the context.
What the trainer needs is recorded while generating, never rebuilt: vLLM's token ids and log-probs, and the loss mask.

    .venv/bin/python 03-rollout/rollout.py demo --out runs/rollout-demo.jsonl   # tiny model, CPU, about a minute

Key decisions (docs/03 gives the reasons and compares each with ToRL's code):
1. Nothing is re-tokenized: model tokens are vLLM's; an observation is tokenized once; later turns go as token ids.
2. ToRL's protocol: its prompt, stop string, code extraction and observation text.
3. Only the model's own stop ends a trajectory as "eos"; any other end is a named truncation.
4. The log-probs are those of the distribution sampled from (vllm_engine.py: make_llm, check_on_policy).
5. Each trajectory moves on its own (`run_overlapped`, the default): its code runs while the others decode.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from prompt_templates import TEMPLATES, render_prompt  # rollout.TEMPLATES and rollout.render_prompt too
from rounds_schedule import run_rounds
from trajectory import ToolCall, Trajectory, load_trajectories, save_trajectories  # rollout.Trajectory etc. too
from vllm_engine import check_logprobs_mode, check_on_policy, make_llm  # rollout.make_llm etc. too

STOP = "```output"  # the model asks for the tool's answer by writing this: vLLM's stop string


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8  # samples per problem (GRPO's group)
    temperature: float = 1.0  # the recorded log-probs are at this temperature; the trainer divides by it too
    top_p: float = 1.0  # below 1.0 only for evaluation: the trainer does not reproduce it (check_on_policy)
    max_response_tokens: int = 3072  # response budget: model and observation tokens together (ToRL: 3072)
    tool_budget: int = 1  # code executions per response (ToRL: 1); 0 = plain chain of thought, STOP never stops
    observation_style: str = "torl"  # one of OBSERVATION_STYLES: how a result is shown to the model
    template: str = "torl"  # key of TEMPLATES
    seed: int | None = None  # per-request seeds derived from it (reproducible, slower); None = the engine's stream
    schedule: str = "overlap"  # one of SCHEDULES: "overlap" is run_overlapped below, "rounds" rounds_schedule.py
    force_turns: tuple[str, ...] = ()  # a regex per turn (structured outputs): a tiny random model writes no code
    extra_sampling: dict[str, Any] = field(default_factory=dict)  # more SamplingParams fields for every turn

    def __post_init__(self) -> None:
        _check_config(self)


@dataclass(eq=False)  # one object per trajectory: identity, not equal fields, tells two apart
class _InFlight:
    """One trajectory while it is being sampled: the record plus where its sampling stands. Either schedule drives
    it with three calls: `next_params`, `append_turn` (what vLLM returned), `append_observation` (the sandbox's)."""

    traj: Trajectory
    problem_index: int  # the problem's place in the batch, or in the whole set it was dealt from (for seeds)
    limit: int  # the most tokens the response may hold: budget or context, whichever is smaller
    cfg: RolloutConfig
    tokenizer: Any = field(repr=False)  # the engine's, which tokenizes each observation once
    wants_tool: bool = False  # the last turn ended on STOP with a block to run: its observation must follow
    code: str = ""  # what that turn asks to run
    done: bool = False

    @property
    def room(self) -> int:
        return self.limit - len(self.traj.token_ids)

    @property
    def turn(self) -> int:
        return len(self.traj.tool_calls)

    def next_params(self, n: int = 1):
        """The sampling of this trajectory's next turn; n > 1 (rounds' first turn) samples the whole group in one request."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        cfg = self.cfg
        extra = dict(cfg.extra_sampling)
        if self.turn < len(cfg.force_turns):
            extra["structured_outputs"] = StructuredOutputsParams(regex=cfg.force_turns[self.turn])
        return SamplingParams(
            n=n, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=self.room,
            seed=request_seed(cfg.seed, self.problem_index, self.traj.group_index, self.turn),
            stop=[STOP] if self.turn < cfg.tool_budget else None,  # no call left: ```output is just text
            logprobs=0,  # the sampled token's own log-prob (of the distribution sampled from: see make_llm)
            flat_logprobs=True,  # a few flat lists per sample instead of one dict per token: less garbage
            **extra,
        )

    def append_turn(self, sample) -> None:
        """Append one model turn exactly as vLLM returned it, and decide what comes next."""
        t = self.traj
        t.token_ids += sample.token_ids
        t.logprobs += _sampled_logprobs(sample)
        t.loss_mask += [1] * len(sample.token_ids)
        if sample.finish_reason == "stop" and sample.stop_reason == STOP:
            if self.room <= 0:
                self._end()  # no room left for an observation: the code is not run
            elif code := extract_code(sample.text):  # sample.text is cut at the stop string: the code comes from it
                self.code, self.wants_tool = code, True
            else:
                self.append_observation(None)  # asked for output without a complete block: nothing runs
        elif sample.finish_reason == "stop":  # EOS or another stop token: the model's own decision
            t.finish_reason, self.done = "eos", True
        elif sample.finish_reason == "length":
            self._end()
        else:  # "abort", "error", "repetition": vLLM ended it, not the model and not a budget
            self._end(str(sample.finish_reason))

    def append_observation(self, result) -> None:
        """Append the observation for the code this turn asked to run (result None: nothing ran)."""
        t, ran = self.traj, result is not None
        text = observation_text(result, self.cfg.observation_style) if ran else f"\n{NO_CODE_OUTPUT}\n```\n"
        ids = encode_plain(self.tokenizer, text)
        if len(ids) > self.room:
            ids = ids[: self.room]
            text = self.tokenizer.decode(ids)
        start = len(t.token_ids)
        t.token_ids += ids
        t.logprobs += [0.0] * len(ids)
        t.loss_mask += [0] * len(ids)
        t.tool_calls.append(ToolCall(
            code=self.code, ok=bool(ran and result.ok), timed_out=bool(ran and result.timed_out),
            returncode=result.returncode if ran else None, latency=result.latency if ran else 0.0,
            observation=text, start=start, end=len(t.token_ids), passed=bool(ran and execution_pass(result))))
        self.code, self.wants_tool = "", False
        if self.room == 0:
            self._end()

    def _end(self, reason: str | None = None) -> None:
        limit_is_context = self.limit < self.cfg.max_response_tokens  # the limit comes from max_model_len
        self.traj.finish_reason = reason or ("length" if limit_is_context else "budget")
        self.traj.truncated = self.done = True


def rollout(llm, problems: list[dict], sandbox, cfg: RolloutConfig | None = None, spent: dict | None = None,
            indices: list[int] | None = None) -> list[Trajectory]:
    """Sample `group_size` tool-integrated responses per problem {id, question, answer, source}, grouped by problem.
    `sandbox` runs the code: `run(code)` from several threads (overlapped) or `run_many(codes)` (rounds); chapter 02's
    Sandbox has both. A `spent` dict receives what docs/03-rollout.md lists. `indices`: each problem's place in the
    whole set it was dealt from (a rank's share of an evaluation), which the seeds follow [default: its position]."""
    cfg = cfg or RolloutConfig()
    if not problems:
        return []
    check_logprobs_mode(llm)
    started = time.perf_counter()
    tokenizer = llm.get_tokenizer()
    version, model = getattr(llm, "weight_version", 0), str(llm.model_config.model)  # chapter 06's sync bumps it
    in_flight: list[_InFlight] = []  # group_size per problem, in the order they are returned
    for position, problem in enumerate(problems):
        problem_index = position if indices is None else indices[position]
        prompt_ids, limit = _tokenize_prompt(problem, problem_index, tokenizer, cfg, llm.model_config.max_model_len)
        for group_index in range(cfg.group_size):
            traj = Trajectory(problem_id=str(problem["id"]), group_index=group_index, reference=str(problem["answer"]),
                              prompt_ids=list(prompt_ids), token_ids=[], logprobs=[], loss_mask=[], text="",
                              weight_version=version, model=model)
            in_flight.append(_InFlight(traj=traj, problem_index=problem_index, limit=limit, cfg=cfg, tokenizer=tokenizer))
    spent = {} if spent is None else spent  # what the rollout spent: seconds, rounds or steps, tokens, tool calls
    spent.update(generate_s=0.0, sandbox_s=0.0)

    if cfg.schedule == "rounds":  # the whole batch turn by turn, the code of each round in one batch
        run_rounds(llm, in_flight, sandbox.run_many, spent, cfg.group_size)  # rounds_schedule.py
    else:  # the default: each trajectory moves on its own, its code running while the others decode
        run_overlapped(llm.llm_engine, in_flight, sandbox.run, spent)

    trajectories = [state.traj for state in in_flight]
    for t in trajectories:
        t.text = tokenizer.decode(t.token_ids, skip_special_tokens=True)
    spent["wall_s"] = time.perf_counter() - started
    spent["model_tokens"] = sum(sum(t.loss_mask) for t in trajectories)
    spent["observation_tokens"] = sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajectories)
    spent["tool_calls"] = sum(t.num_tool_calls for t in trajectories)
    return trajectories


_REQUEST_IDS = itertools.count()  # unique in the process: the engine may be shared


def run_overlapped(engine, in_flight: list[_InFlight], run_code: Callable, spent: dict) -> None:
    """Sample every trajectory in `in_flight` to its end, each on its own: a turn that stops on ```output hands its code
    to `run_code` in a sandbox thread at once, and its continuation joins the running batch when the result is back.
    `spent["sandbox_s"]` counts the waits with nothing to decode, `spent["steps"]` the engine steps."""
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind

    # Every output engine.step() returns is taken for one of ours: another caller's would be lost to it.
    if engine.has_unfinished_requests():
        raise RuntimeError(f"rollout: the engine already has {engine.get_num_unfinished_requests()} request(s) "
                           f"in flight; the overlapped schedule steps it and needs it to itself")
    sampling: dict[str, _InFlight] = {}  # request id -> the trajectory whose turn the engine is sampling
    running: dict[concurrent.futures.Future, _InFlight] = {}  # sandbox call -> the trajectory waiting for it
    spent["steps"] = 0

    # The threads only wait on the sandbox, which admits `concurrency` calls at a time itself.
    with concurrent.futures.ThreadPoolExecutor(min(len(in_flight), 64), thread_name_prefix="rollout-sandbox") as pool:
        def advance(state: _InFlight) -> None:
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


SCHEDULES = ("rounds", "overlap")  # how the turns and tool calls of a batch interleave (docs/03-schedules.md)
# "torl" is ToRL's rule (torl_observation); "short" and "full" are sandbox.format_observation's.
OBSERVATION_STYLES = ("torl", "short", "full")


def _check_config(cfg: RolloutConfig) -> None:
    """Refuse a RolloutConfig value the rollout cannot use, in one line naming the field."""
    for name, allowed in (("template", sorted(TEMPLATES)), ("schedule", SCHEDULES), ("observation_style", OBSERVATION_STYLES)):
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"RolloutConfig.{name}: {getattr(cfg, name)!r} is not one of {allowed}")
    for name, low in (("group_size", 1), ("max_response_tokens", 1), ("tool_budget", 0)):
        if getattr(cfg, name) < low:
            raise ValueError(f"RolloutConfig.{name} must be at least {low}, got {getattr(cfg, name)}")


def _tokenize_prompt(problem: dict, problem_index: int, tokenizer, cfg: RolloutConfig, context: int) -> tuple[list[int], int]:
    """Check one problem and tokenize its prompt; return the ids with the response's token limit."""
    if not isinstance(problem, dict):
        raise ValueError(f"rollout: problem #{problem_index} is a {type(problem).__name__}, not a dict")
    for key in ("id", "question", "answer"):
        if key not in problem:
            raise ValueError(f"rollout: problem #{problem_index} has no {key!r} (keys: {sorted(problem)})")
    prompt_ids = tokenizer.encode(render_prompt(problem["question"], cfg.template), add_special_tokens=False)
    limit = min(cfg.max_response_tokens, context - len(prompt_ids))
    if limit < 1:
        raise ValueError(f"rollout: problem {problem['id']!r}: its prompt is {len(prompt_ids)} tokens, "
                         f"no room for a response within max_model_len {context}")
    return prompt_ids, limit


def request_seed(seed: int | None, problem_index: int, group_index: int, turn: int) -> int | None:
    """A request's own seed, from the run's seed and its place: problem, sample, turn. A first turn's is its problem's
    plus the sample's index, what vLLM gives sample j of one n-sample request (rounds): both schedules draw alike."""
    if seed is None:
        return None
    if turn == 0:
        return zlib.crc32(f"{seed}/{problem_index}/0/0".encode()) + group_index
    return zlib.crc32(f"{seed}/{problem_index}/{group_index}/{turn}".encode())


def _sampled_logprobs(sample) -> list[float]:
    """The log-prob of each sampled token: for logprobs=0, vLLM's flat lists hold one entry a position, the sampled token's."""
    lp, ids = sample.logprobs, sample.token_ids
    if lp is None or list(getattr(lp, "token_ids", ())) != list(ids):
        raise RuntimeError("rollout: vLLM returned no flat log-prob for some sampled tokens "
                           "(logprobs=0 and flat_logprobs=True were requested)")
    return list(lp.logprobs)


# --- ToRL's protocol: which code runs and what the model reads back --------------------

# What the model reads when it wrote ```output without a complete ```python block.
NO_CODE_OUTPUT = "Error: no complete ```python block to run"

# What ToRL shows when its rule leaves nothing to show (a quiet program too): its sandbox's timeout message.
TORL_EMPTY_OUTPUT = "timeout_decorator.timeout_decorator.TimeoutError: 'Timed Out'"


def extract_code(turn_text: str) -> str | None:
    """The code ToRL would run for one turn's text (its extract_program), or None. Line-based: only the last block
    counts, and an unclosed or empty one runs nothing, even after a complete one."""
    code, inside = "", False
    for line in turn_text.split("\n"):
        if line.startswith("```python") or line.endswith("```python"):
            code, inside = "", True
        elif line.startswith("```"):
            inside = False
        elif inside:
            code += line + "\n"
    return None if inside or not code else code


def observation_text(result, style: str = "torl") -> str:
    """The exact text appended after the model's ```output for one result, in ToRL's framing: `\\n{output}\\n```\\n`."""
    if style == "torl":
        return f"\n{torl_observation(result)}\n```\n"
    from sandbox import format_observation

    output = format_observation(result, style=style).rstrip("\n")  # the fence follows its last line
    return f"\n{output}\n```\n"


def torl_observation(result) -> str:
    """What ToRL shows the model for one result, byte for byte (postproc, postproc_observation): docs/03-torl.md."""
    text = result.stdout if execution_pass(result) else result.stderr.strip()
    if "Error" in text:  # stdout too: a program that prints "Error" shows only its last line
        text = text.strip().split("\n")[-1]
    text = text.strip() or TORL_EMPTY_OUTPUT
    if len(text) >= 256:
        text = text[:128] + "..." + text[-128:]
    return text


def execution_pass(result) -> bool:
    """ToRL's pass: exit status 0, or anything on stdout (a program that printed, then crashed, passed)."""
    return result.returncode == 0 or result.stdout != ""


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as plain text: tool output is data, so a printed "<|im_end|>" stays characters."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


if __name__ == "__main__":  # demo, sample, view: rollout_cli.py, which imports this file as `rollout`, runs as the script
    import runpy

    runpy.run_module("rollout_cli", run_name="__main__")
