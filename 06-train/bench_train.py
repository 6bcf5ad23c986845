"""Speed and memory of one GRPO step and of one weight sync into vLLM.
About a minute on a 2-core CPU with the tiny model, half of it vLLM's start.

    make bench-train                                   # CPU: tiny random model; CUDA: --shape qwen2.5-math-1.5b
    make bench-train ARGS="--model /models/Qwen2.5-Math-1.5B --sequences 64 --response-len 3072"
    make bench-train ARGS="--shape qwen2.5-math-7b --sequences 8"      # one 7B replica: does it fit?
    make bench-train ARGS="--results 06-bench-train"    # also write the figures to docs/results/06-bench-train.json

Prints the tokens a second and peak memory of `grpo_step`, the time skipping zero-advantage rows saves, and the
time of one `sync_weights`, in the loop's order. Prompts are random tokens and rewards ±1 in groups: the numbers
measure the machinery, not learning. `--shape` measures the trainer alone at the torl-1.5b preset's lengths, the
memory plan of docs/06-scaling.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lab_cli import at_least, quiet_console, run_script, script_parser

if __name__ == "__main__":  # before torch loads: the libraries' bars and torch's C++ warnings off
    quiet_console()
import torch

import results
from configuration import model_problem  # the run's check of --model (05-retool)
from grpo import (GRPOConfig, build_batch, group_advantages, grpo_step, load_policy, make_optimizer, sleep_sampler,
                  sync_weights, token_logprobs)
from update_metrics import sampler_mismatch


# Config numbers of the lab's target models (their config.json), for random-init models of the same shape.
_QWEN_MATH = dict(num_hidden_layers=28, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6)
SHAPES = {
    "qwen2.5-math-1.5b": dict(_QWEN_MATH, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                              num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-math-7b": dict(_QWEN_MATH, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                            num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
# the base model SimpleTIR starts from: Qwen2.5-Math-7B's shape with a 131,072-token context
SHAPES["qwen2.5-7b"] = dict(SHAPES["qwen2.5-math-7b"], max_position_embeddings=131072, rope_theta=1000000.0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.shape is None and args.model is None and torch.cuda.is_available():
        args.shape = "qwen2.5-math-1.5b"
    shaped = args.shape is not None
    if shaped and args.results:
        raise SystemExit("error: --results records the tiny model's run (the figures docs/06-scaling.md quotes), not --shape")
    for name, real, tiny in (("prompt_len", 400, 128), ("response_len", 3072, 384), ("micro_batch_size", 8, 4),
                             ("num_minibatches", 1, 2), ("gradient_checkpointing", True, False)):
        if getattr(args, name) is None:
            setattr(args, name, real if shaped else tiny)
    if shaped:
        return run_shape(args)
    if args.model:
        return run(args, args.model)
    with tempfile.TemporaryDirectory(prefix="tiny-model-") as tmp:
        from tiny_model import build_tiny_model

        run(args, str(build_tiny_model(tmp, seed=0)))


def run(args, model_path: str) -> None:
    from rollout import make_llm

    on_cuda = torch.cuda.is_available()
    cfg = step_config(args)
    llm = None
    if not args.no_sync:
        t = time.perf_counter()
        llm = make_llm(model_path, dtype="auto" if on_cuda else "float32",
                       max_model_len=args.prompt_len + args.response_len + 16,
                       gpu_memory_utilization=args.gpu_memory_utilization, cpu_kv_cache_gib=1.0)
        engine_s = time.perf_counter() - t

    model = load_policy(model_path)
    n_params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    shape = (args.sequences, args.group_size, args.prompt_len, args.response_len)
    if llm is not None:  # real samples, so the sampler/trainer mismatch means something
        trajectories = sampled_trajectories(llm, *shape, degenerate_frac=args.degenerate_frac)
    else:
        trajectories = synthetic_trajectories(*shape, vocab, degenerate_frac=args.degenerate_frac)
    all_tokens, model_tokens = token_counts(trajectories)
    optimizer = make_optimizer(model, cfg)
    asleep = sleep_sampler(llm) if llm is not None else False
    # sampler and trainer at the same weights, over every row (grpo_step's own figure covers the rows it trains)
    first = sampler_gap(model, build_batch(trajectories), cfg) if llm is not None else {}
    grpo_step(model, optimizer, trajectories, cfg)  # warm-up: allocates optimizer state, first kernels
    reset_peak_memory()
    before = memory()
    times = timed_steps(model, optimizer, trajectories, cfg, args.steps)
    peak = memory(peak=True)
    step_s = statistics.median(times)
    no_skip_s = statistics.median(timed_steps(model, optimizer, trajectories,
                                              dataclasses.replace(cfg, skip_zero_advantage=False), args.steps))
    zero_rows = sum(t.advantage == 0 for t in trajectories)

    print(f"device              : {'cuda ' + torch.cuda.get_device_name() if on_cuda else 'cpu'} ({torch.get_num_threads()} threads)")
    name = args.model or "the tests' tiny random model"  # not its temporary folder, gone after the run
    print(f"model               : {name} ({n_params / 1e6:.1f} M parameters, vocab {vocab})")
    print(f"batch               : {args.sequences} sequences x ({args.prompt_len} prompt + {args.response_len} response) tokens"
          f" = {all_tokens} tokens, {model_tokens} model tokens ({'sampled by vLLM' if llm else 'synthetic'})")
    print(f"step                : {args.num_minibatches} mini-batches, micro-batch {args.micro_batch_size},"
          f" gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}")
    print(f"grpo_step           : {step_s:.3f} s (median of {args.steps}; min {min(times):.3f} s)")
    print(f"training throughput : {all_tokens / step_s:,.0f} tokens/s ({model_tokens / step_s:,.0f} model tokens/s)")
    print(f"skip zero advantage : {step_s:.3f} s with, {no_skip_s:.3f} s without (median of {args.steps}; "
          f"{skip_saving(step_s, no_skip_s, zero_rows)}; {zero_rows} of {len(trajectories)} rows have advantage 0)")
    if on_cuda:
        print(f"peak memory         : {peak / 2**30:.2f} GiB allocated by torch during the steps"
              f" (weights+grads+AdamW alone: {16 * n_params / 2**30:.2f} GiB)")
    else:
        print(f"peak memory         : {peak / 2**20:,.0f} MiB peak resident, {max(peak - before, 0) / 2**20:,.0f} MiB above"
              f" the resident before the steps (weights+grads+AdamW: {16 * n_params / 2**20:,.0f} MiB)")
    figures = {"grpo_step_s": round(step_s, 3), "tokens_per_s": round(all_tokens / step_s),
               "model_tokens_per_s": round(model_tokens / step_s), "skip_with_s": round(step_s, 3),
               "skip_without_s": round(no_skip_s, 3), "skip_saves_percent": round(100 * (1 - step_s / no_skip_s)),
               "peak_mib": round(peak / 2**20), "peak_above_before_mib": round(max(peak - before, 0) / 2**20)}
    if llm is not None:
        print(f"mismatch, same wts  : mean |dlogp| {first['mismatch_abs']:.3e}, max {first['mismatch_max']:.3e},"
              f" KL {first['mismatch_kl']:.2e} (vLLM's recorded log-probs vs the trainer's, before any update)")
        sync_times = []
        for i in range(args.syncs):
            if i and on_cuda:
                asleep = sleep_sampler(llm)  # the loop's cycle: sleep, (update), sync
            t = time.perf_counter()
            sync_weights(model, llm)
            synchronize()
            sync_times.append(time.perf_counter() - t)
        print(f"vLLM engine start   : {engine_s:.1f} s")
        print(f"sync_weights        : {statistics.median(sync_times) * 1e3:.1f} ms (median of {args.syncs};"
              f" {'includes waking the slept engine' if asleep else 'engine was awake'})")
        fresh = sampled_trajectories(llm, args.group_size, args.group_size, args.prompt_len, args.response_len, seed=1)
        gap = sampler_gap(model, build_batch(fresh), cfg)
        print(f"mismatch after sync : mean |dlogp| {gap['mismatch_abs']:.3e}, max {gap['mismatch_max']:.3e}"
              f" (new samples after {2 * args.steps + 1} GRPO steps and the sync)")
        figures.update({"mismatch_mean": float(f"{first['mismatch_abs']:.3e}"),
                        "mismatch_max": float(f"{first['mismatch_max']:.3e}"), "engine_start_s": round(engine_s, 1),
                        "sync_ms": round(statistics.median(sync_times) * 1e3, 1),
                        "mismatch_after_sync_mean": float(f"{gap['mismatch_abs']:.3e}"),
                        "mismatch_after_sync_max": float(f"{gap['mismatch_max']:.3e}")})
    if args.results:  # the figures of this run into docs/results/NAME.json, with the command that measured them
        print(f"wrote {results.save(args.results, results.make_command('bench-train', sys.argv[1:]), figures)}")


def skip_saving(with_s: float, without_s: float, zero_rows: int) -> str:
    """The share of the step's time skipping saves, or why there is none to state: no row to skip, or a
    difference the machine's noise made (skipping never adds work)."""
    if zero_rows == 0:
        return "nothing to skip, so no saving"
    if with_s >= without_s:
        return f"no saving measured: the {with_s / without_s - 1:.0%} difference is the machine's noise"
    return f"saves {1 - with_s / without_s:.0%}"


def run_shape(args) -> None:
    """The trainer alone on a random-init model of a named shape: throughput and the memory budget, measured."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    cfg = step_config(args)
    config = Qwen2Config(**SHAPES[args.shape], attn_implementation="sdpa")
    reset_peak_memory()
    base = memory()
    with device:  # initialise on the device: random init of 1.5B parameters on a CPU takes minutes
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    weights = memory() - base
    trajectories = synthetic_trajectories(args.sequences, args.group_size, args.prompt_len, args.response_len,
                                          config.vocab_size)
    all_tokens, model_tokens = token_counts(trajectories)
    optimizer = make_optimizer(model, cfg)

    (warmup_s,) = timed_steps(model, optimizer, trajectories, cfg, 1)  # warm-up: creates AdamW's moments
    state = memory() - base  # weights + AdamW moments (gradients are freed after each update)
    reset_peak_memory()
    times = timed_steps(model, optimizer, trajectories, cfg, args.steps)
    peak = memory(peak=True) - base
    step_s = statistics.median(times)
    gib = 2**30

    print(f"device              : {torch.cuda.get_device_name() if on_cuda else 'cpu'}")
    print(f"model               : random-init {args.shape} shape ({n_params:,} parameters, vocab {config.vocab_size})")
    print(f"batch               : {args.sequences} sequences x ({args.prompt_len} prompt + {args.response_len} response)"
          f" = {all_tokens} tokens, {model_tokens} model tokens (synthetic)")
    print(f"step                : {args.num_minibatches} mini-batches, micro-batch {args.micro_batch_size},"
          f" gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}")
    print(f"grpo_step           : {step_s:.2f} s (median of {args.steps}; warm-up {warmup_s:.1f} s)")
    print(f"training throughput : {all_tokens / step_s:,.0f} tokens/s ({model_tokens / step_s:,.0f} model tokens/s)")
    unit = "GiB allocated by torch" if on_cuda else "GiB resident (CPU: process RSS)"
    print(f"memory, measured    : {unit}")
    print(f"  weights float32   : {weights / gib:6.2f}   (computed: {4 * n_params / gib:.2f})")
    print(f"  + AdamW m and v   : {(state - weights) / gib:6.2f}   (computed: {8 * n_params / gib:.2f})")
    print(f"  peak of a step    : {peak / gib:6.2f}   (of which above weights+AdamW: {(peak - state) / gib:.2f}:"
          f" gradients {4 * n_params / gib:.2f} computed, the rest logits and activations)")
    if on_cuda:
        print(f"  reserved by torch : {torch.cuda.max_memory_reserved() / gib:6.2f}   of"
              f" {torch.cuda.get_device_properties(0).total_memory / gib:.1f} on the device")
    print(f"vLLM imported       : {'yes' if 'vllm' in sys.modules else 'no'}")


def sampler_gap(model, batch, cfg) -> dict[str, float]:
    """vLLM's recorded log-probs of `batch` against the trainer's, over every row's model tokens (sampler_mismatch)."""
    with torch.no_grad():
        trainer = token_logprobs(model, batch, cfg.temperature, cfg.micro_batch_size).cpu()
    return sampler_mismatch(trainer, torch.zeros_like(trainer), batch)


def step_config(args):
    """The GRPO step both measurements time: the flags' batch shape, a small learning rate."""
    return GRPOConfig(lr=1e-6, num_minibatches=args.num_minibatches, micro_batch_size=args.micro_batch_size,
                      gradient_checkpointing=args.gradient_checkpointing)


def token_counts(trajectories) -> tuple[int, int]:
    """(all tokens, model tokens) of a batch: the throughput's two denominators."""
    return sum(len(t.prompt_ids) + len(t.token_ids) for t in trajectories), sum(sum(t.loss_mask) for t in trajectories)


def sampled_trajectories(llm, n: int, group_size: int, prompt_len: int, response_len: int, seed: int = 0,
                         degenerate_frac: float = 0.0):
    """n responses of vLLM to random prompts, group_size per prompt, rewarded and masked as synthetic ones are."""
    from vllm import SamplingParams

    g = torch.Generator().manual_seed(seed)
    high = min(llm.get_tokenizer().vocab_size, llm.llm_engine.vllm_config.model_config.get_vocab_size())
    prompts = [torch.randint(0, high, (prompt_len,), generator=g).tolist() for _ in range(-(-n // group_size))]
    params = SamplingParams(n=group_size, max_tokens=response_len, temperature=1.0, logprobs=0, ignore_eos=True, seed=seed)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rewards, advantages = _rewards(len(prompts) * group_size, group_size, degenerate_frac, g)
    out = []
    for i, (prompt, request) in enumerate(zip(prompts, outputs)):
        for j, sample in enumerate(request.outputs):
            ids = list(sample.token_ids)
            logprobs = [sample.logprobs[k][t].logprob for k, t in enumerate(ids)]
            out.append(_trajectory(i * group_size + j, group_size, prompt, ids, logprobs, rewards, advantages))
    return out[:n]


def synthetic_trajectories(n: int, group_size: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0,
                           degenerate_frac: float = 0.0):
    """Random trajectories with ±1 rewards in groups (`_rewards`), a tenth of each response an observation span."""
    g = torch.Generator().manual_seed(seed)
    rewards, advantages = _rewards(n, group_size, degenerate_frac, g)
    out = []
    for i in range(n):
        tokens = torch.randint(0, vocab, (response_len,), generator=g).tolist()
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        out.append(_trajectory(i, group_size, prompt, tokens, [0.0] * response_len, rewards, advantages))
    return out


def _trajectory(k: int, group_size: int, prompt: list[int], ids: list[int], logprobs: list[float], rewards, advantages):
    """Sample k of the batch, a tenth of its response, from the middle, marked as an observation span (mask 0,
    log-prob 0), as the rollout marks interpreter output."""
    from rollout import Trajectory

    start, span = len(ids) // 2, len(ids) // 10
    mask = [1] * start + [0] * span + [1] * (len(ids) - start - span)
    logprobs = logprobs[:start] + [0.0] * span + logprobs[start + span:]
    return Trajectory(problem_id=str(k // group_size), group_index=k % group_size, reference="", prompt_ids=prompt,
                      token_ids=ids, logprobs=logprobs, loss_mask=mask, text="", reward=float(rewards[k]),
                      advantage=float(advantages[k]))


def _rewards(n: int, group_size: int, degenerate_frac: float, g: torch.Generator) -> tuple[list[float], list[float]]:
    """±1 at random, except the first `degenerate_frac` of groups, which are all -1 (nothing to compare); and their
    advantages (the rewards themselves where n is not whole groups)."""
    rewards = (torch.randint(0, 2, (n,), generator=g) * 2 - 1).tolist()
    flat = round(degenerate_frac * (n // group_size)) * group_size
    rewards[:flat] = [-1] * flat
    if 0 < degenerate_frac < 1:  # a random group can be degenerate by chance: make the others informative
        for start in range(flat, n - group_size + 1, group_size):
            rewards[start], rewards[start + 1] = 1, -1
    rewards = [float(r) for r in rewards]
    return rewards, group_advantages(rewards, group_size)[0] if n % group_size == 0 else rewards


def timed_steps(model, optimizer, trajectories, cfg, steps: int) -> list[float]:
    """Wall seconds of `steps` GRPO steps, each waited for on the device."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        grpo_step(model, optimizer, trajectories, cfg)
        synchronize()
        times.append(time.perf_counter() - t)
    return times


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak resident size (VmHWM)
            f.write("5")


def memory(peak: bool = False) -> int:
    """Bytes allocated by torch on the GPU, else the process's resident size; `peak`: the most since the reset."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["VmHWM" if peak else "VmRSS"].split()[0]) * 1024


def parse_args(argv):
    p = script_parser(__doc__)
    p.add_argument("--model", help="model folder (Hugging Face format); default: build the tiny random model")
    p.add_argument("--shape", choices=sorted(SHAPES),
                   help="random-init model of this shape, trainer only, no vLLM (default on CUDA without --model)")
    p.add_argument("--sequences", type=at_least(1), default=16, help="trajectories per step (default 16)")
    p.add_argument("--group-size", type=at_least(2), default=8, help="trajectories per problem (default 8)")
    p.add_argument("--prompt-len", type=at_least(1), help="prompt tokens per trajectory (default 128; 400 with --shape)")
    p.add_argument("--response-len", type=at_least(1), help="response tokens per trajectory (default 384; 3072 with --shape)")
    p.add_argument("--num-minibatches", type=at_least(1), help="optimizer updates per step (default 2; 1 with --shape)")
    p.add_argument("--micro-batch-size", type=at_least(1), help="sequences per forward/backward (default 4; 8 with --shape)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction,
                   help="recompute activations in backward (default: on with --shape, off otherwise)")
    p.add_argument("--steps", type=at_least(1), default=3, help="timed steps after one warm-up step (default 3)")
    p.add_argument("--degenerate-frac", type=at_least(0.0, float, 1), default=0.5,
                   help="share of groups whose rewards are all equal, so their rows have advantage 0 (default 0.5)")
    p.add_argument("--no-sync", action="store_true", help="do not build vLLM; skip the sync timing")
    p.add_argument("--syncs", type=at_least(1), default=3, help="timed weight syncs (default 3)")
    p.add_argument("--gpu-memory-utilization", type=at_least(0.01, float, 1), default=0.3,
                   help="vLLM's share of the GPU (default 0.3)")
    p.add_argument("--results", metavar="NAME", type=results.name_argument,
                   help="also write the figures to docs/results/NAME.json, for the docs (the tiny model's run)")
    args = p.parse_args(argv)
    if args.sequences % args.group_size:  # the loop's batch is whole groups; a partial one has no advantages
        low = args.sequences - args.sequences % args.group_size
        p.error(f"argument --sequences: {args.sequences} is not whole groups of --group-size {args.group_size}: pass "
                f"--sequences {' or '.join(str(n) for n in (low, low + args.group_size) if n)}")
    if args.model is not None and (problem := model_problem(args.model)):  # the run's check (05-retool), before loading
        raise SystemExit(f"error: --{problem}")
    return args


if __name__ == "__main__":  # vLLM may spawn processes: keep the guard
    run_script(main)  # Ctrl-C is one line
