"""What the tool loop costs on top of bare generation, for both schedules, measured on one engine.

    make bench-rollout                                   # tiny random model on CPU, about 4 minutes
    .venv/bin/python 03-rollout/bench_rollout.py --model Qwen/Qwen2.5-Math-1.5B --dtype bfloat16 --max-response-tokens 3072

Both schedules and a tool that takes no CPU (SleepingTool) against a bare `llm.generate` of the same tokens, on equal
and long-tailed lengths: the best (the least disturbed on a shared machine) and the median of `--repeats` seeded runs.
The workloads and a reading of the figures: docs/appendix/03-schedules-benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import string
import sys
import time
from dataclasses import replace

# A code block with the problem's product, then ```output: the shape ToRL's model writes.
FORCED_CODE_TURN = r"```python\nprint\([1-9][0-9]{0,2} \* [1-9][0-9]{0,2}\)\n```\n```output"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from prepare_data import make_toy_task
    from rollout import SCHEDULES, RolloutConfig, make_llm
    from sandbox import Sandbox, SandboxConfig
    from tiny_model import temp_tiny_model

    model = args.model or str(temp_tiny_model())
    llm = make_llm(model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    default = RolloutConfig().schedule
    tail = heavy_tail(args.tail_shortest, args.tail_classes)
    # Run k uses seed k: within a run every kind samples the same tokens, and each run draws the lengths anew.
    equal = RolloutConfig(group_size=args.group_size, max_response_tokens=args.max_response_tokens, seed=0,
                          force_turns=(FORCED_CODE_TURN,), extra_sampling={"ignore_eos": True})
    longtail = RolloutConfig(group_size=args.group_size, max_response_tokens=args.max_model_len - 256, seed=0,  # never binds
                             force_turns=(tail + tool_call_regex(args.tool_sleep), tail))
    load = os.getloadavg()
    runs = {}
    with Sandbox(SandboxConfig()) as quick, Sandbox(SandboxConfig(concurrency=args.tail_problems * args.group_size)) as slow:
        runs["equal"] = measure(llm, make_toy_task(args.problems, 0)[0], quick, equal, args.repeats, "equal", plain=True)
        runs["tail"] = measure(llm, make_toy_task(args.tail_problems, 0)[0], slow, longtail, args.repeats, "long-tailed")

    t = runs["tail"]["rounds"]
    tokens = statistics.mean(r["model_tokens"] for r in t)
    print(f"bench-rollout: best and median of {args.repeats} runs; model "
          f"{model if args.model else 'tiny random Qwen2 (tiny_model.py)'}, dtype {args.dtype}")
    print(f"  equal lengths: {args.problems} problems x {args.group_size} samples, one tool call, then to the "
          f"{args.max_response_tokens}-token budget with EOS ignored")
    print(f"  long-tailed:   {args.tail_problems} problems x {args.group_size} samples, turns of "
          f"{args.tail_shortest}..{args.tail_shortest * 2 ** (args.tail_classes - 1)} tokens (P(length >= x) ~ 1/x), "
          f"one tool call of {args.tool_sleep} s each; {tokens:.0f} model tokens a run, a sample {tokens / (args.tail_problems * args.group_size):.0f} on average")
    print(f"  the barrier, in sequential decode steps (medians): rounds {statistics.median(r['round_steps'] for r in t):.0f}"
          f" (longest first turn + longest second turn), the longest sample {statistics.median(r['longest'] for r in t):.0f}")
    print(f"  {'workload':14} {'rollout':26} {'tokens':>6} {'best s':>7} {'median s':>9}  "
          f"{'vs bare, sandbox excluded':>26}  {'sandbox included':>16}  {'engine idle':>11}")
    for name, label in (("equal", "equal lengths"), ("tail", "long-tailed")):
        for kind in [kind for kind in (*SCHEDULES, "cpu-free", "plain", "bare") if kind in runs[name]]:
            rows = runs[name][kind]
            tokens = statistics.mean(r["model_tokens"] for r in rows)  # seconds below: per token, times this
            best, med = (x * tokens for x in per_token(rows))
            title = {"plain": "rollout, no tool", "bare": "bare llm.generate", "cpu-free": "overlap, tool without CPU"
                     }.get(kind, f"rollout, {kind}" + (" (default)" if kind == default else ""))
            line = f"  {label:14} {title:26} {tokens:>6.0f} {best:>7.2f} {med:>9.2f}"
            if kind != "bare":
                line += (f"  {ratio(runs[name], kind, False):>26}  {ratio(runs[name], kind, True):>16}"
                         f"  {statistics.median(r['sandbox_s'] for r in rows):>9.2f} s")
            print(line)
    print("  engine idle: seconds with nothing to decode while code ran (median)")
    # The machine's load goes with the progress lines, to stderr: it qualifies this run, not the figures.
    print(f"machine load (1-minute average) {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end, "
          f"on {os.cpu_count()} cores", file=sys.stderr)
    print(f"long-tailed workload, default rollout ({default}) over bare llm.generate, sandbox included: "
          f"{ratio(runs['tail'], default, True)}")
    return 0


def measure(llm, problems: list[dict], sandbox, cfg, repeats: int, name: str, plain: bool = False) -> dict[str, list[dict]]:
    """`repeats` runs of each kind after one warm-up: both schedules, the tool without CPU, (no tool,) and bare."""
    from rollout import SCHEDULES, rollout

    runs: dict[str, list[dict]] = {}
    for run in range(repeats + 1):  # run 0 warms up compilation, the grammars and the sandbox
        row = {}
        cfg = replace(cfg, seed=run)
        for schedule in SCHEDULES:
            row[schedule] = spent = {}
            trajs = rollout(llm, problems, sandbox, replace(cfg, schedule=schedule), spent)
            spent["longest"] = max(sum(t.loss_mask) for t in trajs)
            spent["round_steps"] = sum(map(max, zip(*(turn_lengths(t) for t in trajs))))
        lengths = [sum(t.loss_mask) for t in trajs]  # both schedules sample the same tokens: same seeds
        row["cpu-free"] = {}
        free = rollout(llm, problems, SleepingTool(), replace(cfg, schedule="overlap"), row["cpu-free"])
        if [t.token_ids for t in free] != [t.token_ids for t in trajs]:
            raise RuntimeError("the stand-in tool's answers led to other tokens than the sandbox's")
        if plain:
            # The same number of tokens without the tool: one turn each, the loop's bookkeeping alone.
            row["plain"] = {}
            rollout(llm, problems, sandbox, replace(cfg, tool_budget=0, force_turns=(), max_response_tokens=round(
                statistics.mean(lengths))), row["plain"])
        row["bare"] = bare_generate(llm, problems, cfg, lengths, grammar=not cfg.extra_sampling.get("ignore_eos"))
        if run:
            for kind, spent in row.items():
                runs.setdefault(kind, []).append(spent)
        print(f"{name} run {run}{' (warm-up)' if not run else ''}: " + ", ".join(
            f"{kind} {r['wall_s']:.2f} s" for kind, r in row.items()), file=sys.stderr, flush=True)
    return runs


class SleepingTool:
    """The sandbox's stand-in in this bench: it sleeps and prints as the forced code asks, with no process or CPU."""

    def run(self, code: str, timeout: float | None = None):
        from sandbox import ExecResult

        sleep = re.search(r"time\.sleep\(([0-9.]+)\)", code)
        seconds = float(sleep.group(1)) if sleep else 0.0
        a, b = re.search(r"print\(([0-9]+)(?: \* ([0-9]+))?\)", code).groups()
        time.sleep(seconds)
        return ExecResult(ok=True, stdout=f"{int(a) * int(b or 1)}\n", stderr="", returncode=0, timed_out=False,
                          truncated=False, latency=seconds)


def turn_lengths(t) -> tuple[int, int]:
    """Model tokens before the first tool call and after it: a round decodes until its longest turn ends."""
    if not t.tool_calls:
        return sum(t.loss_mask), 0
    return t.tool_calls[0].start, sum(t.loss_mask[t.tool_calls[0].end:])


def per_token(rows: list[dict], sandbox_too: bool = True) -> tuple[float, float]:
    """Best and median seconds per model token of one kind of run."""
    values = [(r["wall_s"] - (0.0 if sandbox_too else r["sandbox_s"])) / r["model_tokens"] for r in rows]
    return min(values), statistics.median(values)


def ratio(runs: dict[str, list[dict]], kind: str, sandbox_too: bool) -> str:
    """Seconds per token of `kind` over those of the bare baseline, best/best and median/median."""
    (best, med), (bare_best, bare_med) = per_token(runs[kind], sandbox_too), per_token(runs["bare"])
    return f"{best / bare_best:.3f} (median {med / bare_med:.3f})"


def heavy_tail(shortest: int, classes: int) -> str:
    """A regex whose first token picks a length class of `shortest` * 2**k digits, one token each: a random model picks
    the marker letters about uniformly, and class k has half as many as the class before (the last two share)."""
    letters = iter(string.ascii_letters)  # 2**(classes-1) of them: 32 for 6 classes
    parts = []
    for k in range(classes):
        count = 2 ** (classes - 2 - k) if k < classes - 1 else 1
        parts.append(f"[{''.join(next(letters) for _ in range(count))}][0-9]{{{shortest * 2 ** k}}}")
    return "(" + "|".join(parts) + ")"


def tool_call_regex(sleep: float) -> str:
    """A code block that takes `sleep` seconds in the sandbox and prints a number, then ```output."""
    return rf"\n```python\nimport time\ntime\.sleep\({re.escape(str(sleep))}\)\nprint\([1-9][0-9]?\)\n```\n```output"


def bare_generate(llm, problems: list[dict], cfg, lengths: list[int], grammar: bool) -> dict:
    """One generate call on the same prompts: one request per sample, its length fixed (by `max_tokens` with EOS
    ignored, or with `grammar` by n-1 digits and the EOS the grammar forces), no stop string."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    from rollout import render_prompt

    tok = llm.get_tokenizer()
    k = cfg.group_size
    prompts, params = [], []
    for i, p in enumerate(problems):
        ids = tok.encode(render_prompt(p["question"], cfg.template), add_special_tokens=False)
        for j in range(k):
            n = lengths[i * k + j]
            extra = {"structured_outputs": StructuredOutputsParams(regex=f"[0-9]{{{n - 1}}}")} if grammar else {"ignore_eos": True}
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=n, logprobs=0,
                                         flat_logprobs=True, seed=(cfg.seed or 0) + i * k + j, **extra))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    made = [len(o.outputs[0].token_ids) for o in outs]
    if made != lengths:
        raise RuntimeError(f"bare generate made {sum(made)} tokens where the rollout made {sum(lengths)}")
    return {"wall_s": elapsed, "sandbox_s": 0.0, "model_tokens": sum(made)}


def parse_args(argv):
    from configuration import DTYPES, model_problem, position_limit  # the run's own names and checks (05-retool)
    from lab_cli import at_least, script_parser

    p = script_parser(__doc__)
    p.add_argument("--model", help="model folder or name (default: build the tiny random model)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="float32 for the tiny model on CPU; bfloat16 on a GPU")
    p.add_argument("--problems", type=at_least(1), default=4, help="problems of the equal-length workload")
    p.add_argument("--group-size", type=at_least(1), default=8)
    p.add_argument("--max-response-tokens", type=at_least(1), default=256, help="budget of the equal-length workload")
    p.add_argument("--tail-problems", type=at_least(1), default=4, help="problems of the long-tailed workload")
    p.add_argument("--tail-shortest", type=at_least(1), default=64, help="tokens of a turn's shortest length class")
    p.add_argument("--tail-classes", type=at_least(2, at_most=6), default=5,
                   help="length classes, each twice the one before (at most 6)")
    p.add_argument("--tool-sleep", type=at_least(0, float), default=0.2,
                   help="seconds each long-tailed sample's code sleeps")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--repeats", type=at_least(1), default=6)
    args = p.parse_args(argv)
    if 2 * args.tail_shortest * 2 ** (args.tail_classes - 1) + 256 > args.max_model_len - 256:
        p.error("--max-model-len is too small for two turns of the longest length class (raise it or shorten the tail)")
    # --model as the run checks it, before vLLM loads it: one line, not vLLM's traceback.
    if args.model is not None and (problem := model_problem(args.model)):
        raise SystemExit(f"error: --{problem}")
    if args.model is not None and (limit := position_limit(args.model)) is not None and args.max_model_len > limit:
        raise SystemExit(f"error: --max-model-len {args.max_model_len} is above the position limit of {args.model}, "
                         f"{limit} tokens (max_position_embeddings): pass --max-model-len {limit} or less")
    return args


if __name__ == "__main__":
    from lab_cli import run_script

    run_script(main)  # the libraries' bars and warnings off; Ctrl-C is one line
