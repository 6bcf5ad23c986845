"""The trainer's new weights into the running vLLM engine, in memory; see docs/06-scaling.md, "The weight sync"."""
from __future__ import annotations

import gc

import torch

from distributed import full_tensor, unwrap


def sync_weights(model, llm) -> int:
    """Copy the trainer's weights into the running vLLM engine, as tensors (no checkpoint is written); return the
    new version. vLLM's in-place reload also redoes any kernel-specific repacking."""
    from vllm.v1.engine.core_client import InprocClient

    if not isinstance(llm.llm_engine.engine_core, InprocClient):
        raise RuntimeError("sync_weights needs the vLLM engine in this process: build it with make_llm "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    asleep = llm.llm_engine.is_sleeping()
    if asleep:
        llm.wake_up(tags=["weights"])  # the weights' memory first; the KV cache after the copy
    weights = engine_weights(model, llm.llm_engine.vllm_config.model_config.dtype)
    failure = None
    try:
        llm.collective_rpc(reload_weights_in_worker, args=(weights,))
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        failure = e
        for _ in weights:  # the gathers the other ranks still wait in: join them, so no rank hangs
            pass
    if any_rank_failed(failure is not None):
        raise RuntimeError("sync_weights: vLLM's loader failed on a rank; every rank stops here") from failure
    if asleep:
        gc.collect()
        torch.cuda.empty_cache()  # hand the trainer's cached blocks back before vLLM maps its KV cache
        llm.wake_up(tags=["kv_cache"])
    if not llm.reset_prefix_cache():  # its blocks hold keys and values of the old weights
        raise RuntimeError("vLLM refused to reset its prefix cache: requests are still running")
    llm.weight_version = getattr(llm, "weight_version", 0) + 1  # rollout stamps this on trajectories
    return llm.weight_version


def engine_weights(model, dtype):
    """(Hugging Face name, full tensor in the engine's dtype) per parameter, lazily, as vLLM's loader asks.
    Each shard is cast before it is gathered (FSDP2's `full_tensor` is a collective): the gather then moves bf16 on a
    GPU, half the bytes of float32."""
    return ((name, full_tensor(param.detach().to(dtype))) for name, param in unwrap(model).named_parameters())


def any_rank_failed(failed: bool) -> bool:
    """Whether any rank failed (a collective under torchrun; this rank's own answer otherwise)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return failed
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def sleep_sampler(llm) -> bool:
    """On CUDA, put vLLM to sleep for the update: its KV cache (most of its memory) is freed for the trainer, and
    level 1 moves its weights to host memory (3 GB at 1.5B); `sync_weights` wakes it. Returns whether it slept: on
    CPU, vLLM has no sleep mode."""
    config = llm.llm_engine.vllm_config.model_config
    if not (torch.cuda.is_available() and config.enable_sleep_mode):
        return False
    llm.sleep(level=1)
    return True


def reload_weights_in_worker(worker, weights) -> None:
    """Runs inside vLLM's worker (in this process): in-place reload, then the CPU fix-up."""
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    # vLLM's CPU backend keeps a pre-packed copy of the output projection for its matmul kernel. A tied lm_head (Qwen's
    # small models) receives no weights of its own during a reload, so that copy would keep the old embedding matrix:
    # repack it. On a GPU there is no such copy (lm_head *is* the embedding tensor).
    lm_head = getattr(worker.model_runner.get_model(), "lm_head", None)
    if lm_head is not None and hasattr(lm_head, "cpu_linear"):
        lm_head.quant_method.process_weights_after_loading(lm_head)
