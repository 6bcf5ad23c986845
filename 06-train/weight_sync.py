"""The trainer's new weights into the running vLLM engine, in memory; see docs/06-scaling.md, "The weight sync"."""
from __future__ import annotations

import gc

import torch

from distributed import any_rank, full_tensor, unwrap


def sync_weights(model, llm) -> int:
    """Copy the trainer's weights into the running vLLM engine, as tensors (no checkpoint); return the new version."""
    from vllm.v1.engine.core_client import InprocClient

    if not isinstance(llm.llm_engine.engine_core, InprocClient):
        raise RuntimeError("sync_weights needs the vLLM engine in this process: build it with make_llm "
                           "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    asleep = llm.llm_engine.is_sleeping()
    if asleep:  # vLLM maps its memory outside torch's allocator: torch's cached blocks go back to the driver first
        release_trainer_cache()
        llm.wake_up(tags=["weights"])  # level 2: the weights' memory, filled by the load below; buffers restored
    weights = engine_weights(model, llm.llm_engine.vllm_config.model_config.dtype)
    failure = None
    try:
        llm.collective_rpc(reload_weights_in_worker, args=(weights,))
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        failure = e
        for _ in weights:  # the gathers the other ranks still wait in: join them, so no rank hangs
            pass
    if any_rank(failure is not None):
        raise RuntimeError("sync_weights: vLLM's loader failed on a rank; every rank stops here") from failure
    if asleep:  # the KV cache, most of vLLM's share, last: once the weights are whole and the load's copies freed
        release_trainer_cache()
        llm.wake_up(tags=["kv_cache"])
    if not llm.reset_prefix_cache():  # its blocks hold keys and values of the old weights
        raise RuntimeError("vLLM refused to reset its prefix cache: requests are still running")
    llm.weight_version = getattr(llm, "weight_version", 0) + 1  # rollout stamps this on trajectories
    return llm.weight_version


def release_trainer_cache() -> None:
    """Hand torch's cached blocks back to the driver (CUDA): vLLM maps what it wakes outside torch's allocator."""
    gc.collect()  # tensors held only by reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_weights(model, dtype):
    """(Hugging Face name, full tensor in the engine's dtype) per parameter, lazily, as vLLM's loader asks. Each shard
    is cast before FSDP2 gathers it: bf16 on a GPU, half the bytes."""
    return ((name, full_tensor(param.detach().to(dtype))) for name, param in unwrap(model).named_parameters())


def sleep_sampler(llm) -> bool:
    """On CUDA, put vLLM to sleep (level 2: its KV cache and weights dropped, since the sync overwrites every weight)
    for the update; `sync_weights` wakes it. Returns whether it slept: on CPU, vLLM has no sleep mode."""
    config = llm.llm_engine.vllm_config.model_config
    if not (torch.cuda.is_available() and config.enable_sleep_mode):
        return False
    llm.sleep(level=2)
    return True


def reload_weights_in_worker(worker, weights) -> None:
    """Runs inside vLLM's worker (in this process): in-place reload, then the CPU fix-up."""
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    # vLLM's CPU backend keeps a pre-packed copy of the output projection; a tied lm_head receives no weights of its
    # own in a reload, so that copy would keep the old embedding: repack it (a GPU has no such copy).
    lm_head = getattr(worker.model_runner.get_model(), "lm_head", None)
    if lm_head is not None and hasattr(lm_head, "cpu_linear"):
        lm_head.quant_method.process_weights_after_loading(lm_head)
