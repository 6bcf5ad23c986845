"""The records chapter 03's rollout returns, and their JSONL file. The story: docs/03-rollout.md."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


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
    # "eos" (the model stopped), "budget", "length" (max_model_len), or vLLM's own word ("abort", ...): truncated too
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


def save_trajectories(trajectories: list[Trajectory], path: str | os.PathLike) -> None:
    """Write one JSON object per line, atomically (01-data's writer): a failed write leaves no partial file."""
    from prepare_data import write_jsonl

    write_jsonl([asdict(t) for t in trajectories], Path(path))


def load_trajectories(path: str | os.PathLike) -> list[Trajectory]:
    """Read save_trajectories' file back; a line that is not a record fails naming file and line."""
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
