"""Evaluate a model with (tir) or without (text) the Python tool on held-out problems. It takes vLLM's start (half a
minute on a 2-core CPU for a small model, more for a large one) and then a rollout of every problem's k samples.

    .venv/bin/python 05-retool/eval.py --model Qwen/Qwen2.5-Math-1.5B --dtype bfloat16   # ToRL's protocol
    .venv/bin/python 05-retool/eval.py --model ... --data data/torl_data/test.parquet     # ToRL's test file
    .venv/bin/python 05-retool/eval.py --model ... --k 16 --temperature 1.0              # avg@16, pass@16
    .venv/bin/python 05-retool/eval.py --model ... --mode text      # same model, no tool: the tool's contribution
    .venv/bin/python 05-retool/eval.py --model runs/cpu-demo-.../checkpoints/step-000020 --data data/toy_test.jsonl

The default is ToRL's protocol, the paper's numbers beside; the loop calls `evaluate` too. The story:
docs/05-torl.md, "Evaluation: eval.py".
"""
from __future__ import annotations

import itertools
import json
import math
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

DEFAULT_TEMPLATE = {"tir": "torl", "text": "cot"}  # each mode's prompt unless one is given: the tool's, or none of it
# ToRL's reported accuracy (%, greedy, one sample), from its paper's main table.
PAPER = {"aime24": {"ToRL-1.5B": 26.7, "ToRL-7B": 43.3}, "aime25": {"ToRL-1.5B": 26.7, "ToRL-7B": 30.0},
         "math500": {"ToRL-1.5B": 77.8, "ToRL-7B": 82.2}}
PAPER_SET_SIZE = {"aime24": 30, "aime25": 30, "math500": 500}  # what they are over (ToRL's test file: 134 of MATH500)


def evaluate(llm, problems: list[dict], sandbox, samples_path: Path | None = None, dp=None, **settings) -> dict | None:
    """Sample k responses per problem, score them, summarise per source and overall (`settings`: sample_scored's).
    Under torchrun each rank samples its share and rank 0 gets what one process would; other ranks get None."""
    from distributed import DataParallel

    dp = dp or DataParallel()  # a world of one unless torchrun started several ranks
    indices, share = dp.share(problems)
    settings, samples = sample_scored(llm, share, sandbox, indices=indices, **settings)
    k = settings["k"]  # the samples come k per problem, in the share's order
    per_problem = dp.gather_in_order([samples[i * k: (i + 1) * k] for i in range(len(share))], indices)
    if not dp.is_main:
        return None
    samples = [sample for rows in per_problem for sample in rows]
    if samples_path is not None:
        from prepare_data import write_jsonl

        write_jsonl(samples, Path(samples_path))
    by_source = defaultdict(list)
    for sample in samples:
        by_source[sample["source"]].append(sample)
    summary = {source: summarise(rows, k) for source, rows in sorted(by_source.items())}
    if len(by_source) > 1:
        summary["all"] = summarise(samples, k)
    return {**settings, "sets": summary}


def sample_scored(llm, problems: list[dict], sandbox, k: int = 1, mode: str = "tir", template: str | None = None,
                  max_response_tokens: int = 3072, tool_budget: int = 1, temperature: float = 0.0,
                  seed: int | None = 0, rollout_overrides: dict | None = None, scorer: str = "lab",
                  indices: list[int] | None = None) -> tuple[dict, list[dict]]:
    """The evaluation's settings and its samples, k per problem in order, scored; `temperature` 0 is greedy (k 1).
    `rollout_overrides`: more RolloutConfig fields; `indices`: a rank's share's places in the whole, for the seeds."""
    from reward import score_batch
    from rollout import RolloutConfig, rollout

    if mode not in ("tir", "text"):
        raise ValueError(f"mode must be 'tir' or 'text', got {mode!r}")
    if temperature == 0 and k > 1:
        raise ValueError(f"k={k} with greedy decoding (temperature 0) gives {k} identical samples; sample with a temperature")
    template = template or DEFAULT_TEMPLATE[mode]
    cfg = RolloutConfig(group_size=k, temperature=temperature, max_response_tokens=max_response_tokens, seed=seed,
                        tool_budget=tool_budget if mode == "tir" else 0, template=template, **(rollout_overrides or {}))
    trajectories = rollout(llm, problems, sandbox, cfg, indices=indices)
    results = score_batch([t.text for t in trajectories], [t.reference for t in trajectories], scorer=scorer)
    source_of = {str(p["id"]): p.get("source", "data") for p in problems}
    samples = [{"problem_id": t.problem_id, "source": source_of[t.problem_id], "sample": t.group_index,
                "reference": t.reference, "answer": r.answer, "correct": r.correct, "valid_format": r.valid_format,
                "tool_calls": t.num_tool_calls, "code_ok": [c.ok for c in t.tool_calls], "truncated": t.truncated,
                "response_tokens": len(t.token_ids), "text": t.text}
               for t, r in zip(trajectories, results)]
    return {"mode": mode, "k": k, "temperature": temperature, "template": template, "scorer": scorer}, samples


def summarise(samples: list[dict], k: int) -> dict:
    outcomes = defaultdict(list)  # problem id -> right or wrong, one per sample
    for s in samples:
        outcomes[s["problem_id"]].append(s["correct"])
    calls = [ok for s in samples for ok in s["code_ok"]]
    out = {"problems": len(outcomes), "samples": len(samples), f"avg@{k}": mean([s["correct"] for s in samples])}
    for j in sorted({2**i for i in range(k.bit_length())} | {k}):  # 1, 2, 4, ... up to k, and k itself
        out[f"pass@{j}"] = mean([pass_at_k(len(o), sum(o), j) for o in outcomes.values()])
    return {**out, "format_rate": mean([s["valid_format"] for s in samples]),
            "code_ratio": mean([s["tool_calls"] > 0 for s in samples]), "code_pass_ratio": mean(calls),
            "tool_calls": mean([s["tool_calls"] for s in samples]),
            "response_length": mean([s["response_tokens"] for s in samples])}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c right: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def summary_line(result: dict) -> str:
    k = result["k"]
    return " | ".join(f"{name}: avg@{k} {summary[f'avg@{k}']:.3f} pass@{k} {summary[f'pass@{k}']:.3f} "
                      f"code {summary['code_ratio']:.2f} format {summary['format_rate']:.2f}"
                      for name, summary in result["sets"].items())


def markdown_table(result: dict) -> str:
    k = result["k"]
    passes = [key for key in next(iter(result["sets"].values())) if key.startswith("pass@")]
    cols = ["problems", f"avg@{k}", *passes, "format_rate", "code_ratio", "code_pass_ratio", "tool_calls", "response_length"]
    lines = [f"| set ({result['mode']}) | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, summary in result["sets"].items():
        cells = [f"{summary[c]:.3f}" if isinstance(summary[c], float) else str(summary[c]) for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paper_table(result: dict) -> str:
    """Measured accuracy (%) beside ToRL's, for the sets the paper reports ("" if none); one on fewer problems than the
    paper's full set, or not greedy with one sample, is marked not comparable."""
    k = result["k"]
    rows = [(name, summary) for name, summary in result["sets"].items() if name in PAPER]
    if not rows:
        return ""
    models = list(next(iter(PAPER.values())))
    lines = [f"| set | problems | measured avg@{k} ({result['mode']}) | " + " | ".join(f"{m} (paper)" for m in models)
             + " | comparable |", "|---" * (len(models) + 4) + "|"]
    for name, summary in rows:
        full = summary["problems"] == PAPER_SET_SIZE[name]
        lines.append(f"| {name} | {summary['problems']} | {100 * summary[f'avg@{k}']:.1f} | "
                     + " | ".join(f"{PAPER[name][m]:.1f}" for m in models)
                     + f" | {'yes' if full else f'no: the paper used all {PAPER_SET_SIZE[name]} problems'} |")
    greedy = result.get("temperature") == 0 and k == 1
    lines.append("" if greedy else f"(measured with k={k}, temperature {result.get('temperature')}: "
                 "not ToRL's protocol, which is greedy with one sample)")
    if result.get("scorer", "lab") != "torl":
        lines.append("(scored with the lab's rule; the paper's with ToRL's own: --scorer torl)")
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> dict:
    from checkpoints import json_safe
    from configuration import TEXT_TEMPLATES, model_problem, position_limit

    from lab_cli import private_tmp, refuse_chapter_folder
    from run_folders import check_eval_out, take_run_settings

    args = parse_args(argv)
    refuse_chapter_folder()
    private_tmp()  # vLLM's and the sandbox's temporary files go with this process
    out = Path(args.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    check_eval_out(out, args.overwrite)  # first: an earlier evaluation is replaced only when asked
    if args.temperature == 0 and args.k > 1:
        sys.exit(f"error: --k {args.k} with greedy decoding gives {args.k} identical samples; add --temperature 1.0 (or another)")
    if problem := model_problem(args.model):
        sys.exit(f"error: --{problem}")
    take_run_settings(args)
    from rollout import TEMPLATES

    if args.template is not None and args.template not in TEMPLATES:  # a run's, recorded by an older lab
        sys.exit(f"error: --template {args.template} (the run's) is not one of {', '.join(TEMPLATES)}: pass --template")
    limit = position_limit(args.model)
    max_model_len = args.max_model_len or limit or 4096  # the model's own context by default
    if args.max_response_tokens >= max_model_len:
        room = "" if limit is not None and max_model_len >= limit else " or a larger --max-model-len"
        sys.exit(f"error: --max-response-tokens {args.max_response_tokens} leaves no room for the prompt in "
                 f"--max-model-len {max_model_len}: pass a smaller --max-response-tokens (e.g. {max_model_len // 2}){room}")
    if limit is not None and max_model_len > limit:
        sys.exit(f"error: --max-model-len {max_model_len} is above the position limit of {args.model}, "
                 f"{limit} tokens (max_position_embeddings)")
    template = args.template or DEFAULT_TEMPLATE[args.mode]
    if args.mode == "text" and template not in TEXT_TEMPLATES:
        print(f"note: --mode text with the tool prompt '{template}': the model is told to write code that never runs",
              file=sys.stderr)
    if args.mode == "tir" and template in TEXT_TEMPLATES:
        print(f"note: --mode tir with the prompt '{template}', which never mentions the tool: the model is not told "
              "it may write code (a tool prompt: --template torl)", file=sys.stderr)
    problems = load_sets(args.data, args.limit)

    from rollout import make_llm
    from sandbox import Sandbox, SandboxConfig

    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    print(f"eval: vLLM over {args.model}, then {len(problems)} problems x {args.k} sample(s); the table comes at the end",
          file=sys.stderr)
    try:
        llm = make_llm(args.model, dtype=args.dtype, max_model_len=max_model_len, seed=args.seed,
                       gpu_memory_utilization=args.gpu_memory_utilization)
        with Sandbox(SandboxConfig(timeout=args.sandbox_timeout)) as sandbox:
            result = evaluate(llm, problems, sandbox, k=args.k, mode=args.mode, template=template, scorer=args.scorer,
                              max_response_tokens=args.max_response_tokens, tool_budget=args.tool_budget,
                              temperature=args.temperature, seed=args.seed, samples_path=out / "samples.jsonl")
    except BaseException:
        if made:  # nothing half-written is left behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    result = {"model": args.model, "data": args.data, **result}
    (out / "summary.json").write_text(json.dumps(json_safe(result), indent=1))
    print(markdown_table(result))
    if line := no_answer_note(result, args):
        print(line, file=sys.stderr)
    if comparison := paper_table(result):
        print("\n" + comparison)
    print(f"samples: {out / 'samples.jsonl'}  summary: {out / 'summary.json'}")
    return result


def no_answer_note(result: dict, args) -> str | None:
    """A note when no response ended in an answer the scorer reads: usually a prompt the model was not trained with."""
    from rollout import TEMPLATES

    if any(summary["format_rate"] > 0 for summary in result["sets"].values()):
        return None
    return (f"note: not one response gave an answer in the form the scorer reads (format_rate 0), so every score is 0: "
            f"was the model trained with the template {result['template']}? pass the one it was trained with "
            f"(--template; one of {', '.join(TEMPLATES)})")


def load_sets(sources: list[str], limit: int | None) -> list[dict]:
    """The problems of every source, at most `limit` per data set (a file of several sets is cut per set)."""
    from prepare_data import DataError, load_problems

    seen = {}
    for source in sources:
        same = str(Path(source).resolve()) if Path(source).exists() else source
        if same in seen:  # its problems would be loaded twice and scored once (their ids are the same)
            sys.exit(f"error: --data names {seen[same]} twice ({source}): pass each data set once")
        seen[same] = source
    problems = []
    for source in sources:
        try:
            rows, dropped = load_problems(source)
        except DataError as e:
            sys.exit(f"error: {e}")
        except Exception as e:  # the hub is unreachable: say which set, in one line
            sys.exit(f"error: {source}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        if limit:  # each set's first `limit` rows, in the file's order
            place_in_set = defaultdict(itertools.count)
            rows = [row for row in rows if next(place_in_set[row["source"]]) < limit]
        # ToRL's test file repeats each AIME problem 4 times; one copy gives the same greedy accuracy.
        print(f"{source}: {len(rows)} problems" + "".join(f"; dropped {n} ({why})" for why, n in dropped.items()),
              file=sys.stderr)
        problems += rows
    return problems


def parse_args(argv):
    from configuration import DTYPES, SEED_LIMIT
    from lab_cli import at_least, script_parser
    from reward import SCORERS
    from rollout import TEMPLATES

    p = script_parser(__doc__)
    p.add_argument("--model", required=True, help="hub id or local model folder (a run's checkpoints/step-NNNNNN)")
    p.add_argument("--data", nargs="+", default=["aime24", "aime25", "math500"],
                   help="data sets: aime24, aime25, math500, a hub id, or .jsonl/.parquet files (01-data's or ToRL's "
                        "schema) [default: aime24 aime25 math500]")
    p.add_argument("--mode", choices=["tir", "text"], default="tir",
                   help="with the Python tool, or plain chain of thought [default: tir]")
    p.add_argument("--k", type=at_least(1), default=1, help="samples per problem (more than 1 needs --temperature above 0) [default: 1]")
    p.add_argument("--temperature", type=at_least(0.0, float), default=0.0, help="0 = greedy, ToRL's protocol [default: 0]")
    p.add_argument("--template", choices=list(TEMPLATES), help="prompt template (03-rollout's table) [default: torl for tir, cot for text]")
    p.add_argument("--tool-budget", type=at_least(0), default=1, help="code executions per response in tir mode [default: 1]")
    p.add_argument("--max-response-tokens", type=at_least(1),
                   help="[default: a run's checkpoint: its run's eval_max_response_tokens; else 3072]")
    p.add_argument("--max-model-len", type=at_least(2), help="the sampler's context [default: a run's checkpoint: its "
                   "run's; else the model's own, else 4096]")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="the sampler's dtype [default: auto]")
    p.add_argument("--gpu-memory-utilization", type=at_least(0.01, float), default=0.8,
                   help="vLLM's share of the GPU (on a CPU: of host memory) [default: 0.8]")
    p.add_argument("--sandbox-timeout", type=at_least(0.01, float), default=10.0, help="seconds per tool call [default: 10]")
    p.add_argument("--scorer", choices=SCORERS, default="lab",
                   help="the reward's rule: the lab's, or ToRL's own (docs/04-torl-scorer.md) [default: lab]")
    p.add_argument("--limit", type=at_least(1), help="at most this many problems per data set [default: all]")
    p.add_argument("--seed", type=at_least(0, int, SEED_LIMIT), default=0, help="[default: 0]")
    p.add_argument("--out", help="output folder [default: runs/eval-TIMESTAMP]")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier evaluation in --out")
    args = p.parse_args(argv)
    if args.gpu_memory_utilization > 1:
        p.error(f"argument --gpu-memory-utilization: a share, at most 1, got {args.gpu_memory_utilization}")
    if args.tool_budget == 0 and args.mode == "tir":
        p.error("argument --tool-budget: 0 in tir mode runs no code; for an evaluation without the tool pass --mode text")
    return args


if __name__ == "__main__":
    try:  # the lab's folders are on the path only in its own Python (the venv's tool_rl_lab.pth)
        from lab_cli import run_script
    except ModuleNotFoundError:
        sys.exit(f"error: {sys.executable} is not the lab's Python: run .venv/bin/python {sys.argv[0]}, or make")
    run_script(main)
