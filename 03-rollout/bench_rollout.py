"""What the tool loop costs on top of bare generation, measured on one engine.

    make bench-rollout                                   # tiny random model on CPU, a few minutes
    python 03-rollout/bench_rollout.py --model Qwen/Qwen2.5-Math-1.5B --dtype bfloat16 --max-response-tokens 3072

The workload: `--problems` toy questions, `--group-size` samples each. Every
sample's first turn writes a code block and stops on ```output (forced with
structured outputs: a random model never writes code by itself), the sandbox
runs it, the output is appended, and the second turn samples freely up to the
response budget (EOS ignored, so that every sample is as long as the budget
allows and the count of tokens is the same from run to run).

The baseline is ONE bare `llm.generate` on the same prompts with `n=group_size`,
the same sampling parameters and log-probs, producing as many tokens per sample
as the rollout's samples wrote on average. The ratio

    overhead = rollout wall time / baseline wall time, scaled to equal token counts

is shown with the sandbox's time excluded (the cost of the loop itself: two
rounds instead of one, the wait for the round's slowest sample, prefilling the
observations, the bookkeeping) and included. The wait is also counted in
decode steps, which no other load on the machine changes: each round decodes
until its longest turn ends. A third run, `rollout()` with no
tool and the same number of tokens, is one round: its ratio is the cost of the
bookkeeping alone (log-probs, masks, decoding). Each figure is shown as the best and
the median of `--repeats` runs after one warm-up run of each kind: on a machine
shared with other work, the fastest run is the least disturbed one.

The forced first turn carries a grammar the baseline does not; it is a few
dozen tokens of the budget, and real models do not need it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# A code block with the problem's product, then ```output: the shape ToRL's model writes.
FORCED_CODE_TURN = r"```python\nprint\([1-9][0-9]{0,2} \* [1-9][0-9]{0,2}\)\n```\n```output"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the figures, not the engine's log
    from rollout import RolloutConfig, make_llm, rollout
    from sandbox import Sandbox, SandboxConfig

    model = args.model or str(_tiny_model())
    llm = make_llm(model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    problems = [{"id": f"toy-{i}", "question": f"What is {101 + 37 * i} * {211 + 53 * i}?",
                 "answer": str((101 + 37 * i) * (211 + 53 * i)), "source": "bench"} for i in range(args.problems)]
    tool = RolloutConfig(group_size=args.group_size, max_response_tokens=args.max_response_tokens,
                         force_turns=(FORCED_CODE_TURN,), extra_sampling={"ignore_eos": True})
    samples = args.problems * args.group_size

    runs: dict[str, list[dict]] = {"tool": [], "plain": [], "bare": []}
    load = os.getloadavg()
    with Sandbox(SandboxConfig()) as sandbox:
        for run in range(args.repeats + 1):  # run 0 warms up compilation, the grammar and the sandbox
            row = {}
            for kind in ("tool", "plain", "bare"):
                stats: dict = {}
                if kind == "tool":
                    trajs = rollout(llm, problems, sandbox, tool, stats)
                    per_sample = round(stats["model_tokens"] / samples)
                    stats["decode_steps"] = _decode_steps(trajs)
                elif kind == "plain":
                    # The same number of tokens without the tool: one round, the loop's bookkeeping alone.
                    rollout(llm, problems, sandbox, replace(tool, tool_budget=0, force_turns=(), max_response_tokens=per_sample), stats)
                else:
                    stats = bare_generate(llm, problems, tool, per_sample)
                row[kind] = stats
            if run:
                for kind in runs:
                    runs[kind].append(row[kind])
            print(f"run {run}{' (warm-up)' if not run else ''}: " + ", ".join(
                f"{kind} {r['wall_s']:.2f} s" for kind, r in row.items()), file=sys.stderr, flush=True)

    def time_of(kind: str, sandbox_too: bool = True) -> tuple[float, float]:
        """Best and median seconds per token of one kind of run."""
        per_token = [(r["wall_s"] - (0.0 if sandbox_too else r["sandbox_s"])) / r["model_tokens"] for r in runs[kind]]
        return min(per_token), statistics.median(per_token)

    def line(kind: str) -> str:
        r = runs[kind][-1]
        best, med = time_of(kind)
        return (f"{r['model_tokens']} tokens, best {best * r['model_tokens']:.2f} s (median {med * r['model_tokens']:.2f} s)"
                f" = {1 / best:.0f} tokens/s")

    def ratio(kind: str, sandbox_too: bool) -> str:
        (best, med), (bare_best, bare_med) = time_of(kind, sandbox_too), time_of("bare")
        return f"{best / bare_best:.3f} (median {med / bare_med:.3f})"

    t = runs["tool"][-1]
    own = statistics.median(r["wall_s"] - r["generate_s"] - r["sandbox_s"] for r in runs["tool"])
    print(f"bench-rollout: {args.problems} problems x {args.group_size} samples, response budget "
          f"{args.max_response_tokens} tokens, EOS ignored; best and median of {args.repeats} runs")
    print(f"  model: {model if args.model else 'tiny random Qwen2 (tiny_model.py)'}, dtype {args.dtype}")
    print(f"  rollout(), one tool call each: {line('tool')}")
    print(f"      {t['observation_tokens']} observation tokens, {t['rounds']} rounds; "
          f"sandbox {statistics.median(r['sandbox_s'] for r in runs['tool']):.3f} s, "
          f"outside generate and sandbox {own:.3f} s (medians)")
    print(f"      a round lasts as long as its longest turn: {t['decode_steps'][0]} + {t['decode_steps'][1]} = "
          f"{sum(t['decode_steps'])} sequential decode steps, against {per_sample} for bare generate")
    print(f"  rollout(), no tool (1 round):  {line('plain')}")
    print(f"  bare llm.generate:             {line('bare')}")
    print("  overhead ratio vs bare generate, equal token counts, best/best:")
    print(f"    rollout() with tool, sandbox time excluded: {ratio('tool', False)}   target <= 1.15")
    print(f"    rollout() with tool, sandbox time included: {ratio('tool', True)}")
    print(f"    rollout() without tool (bookkeeping only):  {ratio('plain', True)}")
    print(f"  machine load (1-minute average) at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f}, "
          f"on {os.cpu_count()} cores: other work on the machine slows runs at random")
    return 0


def _decode_steps(trajs) -> tuple[int, int]:
    """Longest first turn and longest second turn: each round decodes until its longest turn ends."""
    first = max(t.tool_calls[0].start if t.tool_calls else len(t.token_ids) for t in trajs)
    second = max((len(t.token_ids) - t.tool_calls[0].end) if t.tool_calls else 0 for t in trajs)
    return first, second


def bare_generate(llm, problems: list[dict], cfg, tokens_per_sample: int) -> dict:
    """One generate call on the same prompts: n=group_size, same sampling, no stop, fixed length."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rollout import render_prompt

    tok = llm.get_tokenizer()
    prompts = [TokensPrompt(prompt_token_ids=tok.encode(render_prompt(p["question"], cfg.template), add_special_tokens=False))
               for p in problems]
    params = [SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=tokens_per_sample,
                             ignore_eos=True, logprobs=0, flat_logprobs=True, seed=cfg.seed + i) for i in range(len(problems))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return {"wall_s": elapsed, "sandbox_s": 0.0, "model_tokens": sum(len(o.token_ids) for out in outs for o in out.outputs)}


def _tiny_model() -> Path:
    from tiny_model import build_tiny_model

    return build_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-model-")), seed=0)


def parse_args(argv):
    p = argparse.ArgumentParser(description="Overhead of rollout() over one bare llm.generate of the same token count.")
    p.add_argument("--model", help="model folder or name (default: build the tiny random model)")
    p.add_argument("--dtype", default="float32", help="float32 for the tiny model on CPU; bfloat16 on a GPU")
    p.add_argument("--problems", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-response-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args(argv)
    for name in ("problems", "group_size", "max_response_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


if __name__ == "__main__":
    sys.exit(main())
