"""Chapter 03's command line: `demo`, `sample` and `view` (run as `.venv/bin/python 03-rollout/rollout.py ...`).

    .venv/bin/python 03-rollout/rollout.py demo --out runs/rollout-demo.jsonl    # tiny model, CPU, ~1 min
    .venv/bin/python 03-rollout/rollout.py sample --model M --problems P.jsonl --out T.jsonl
    .venv/bin/python 03-rollout/rollout.py view runs/rollout-demo.jsonl > page.html
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from lab_cli import at_least, one_line_errors, script_parser
from prepare_data import DataError, load_problems
from rollout import SCHEDULES, TEMPLATES, RolloutConfig, load_trajectories, make_llm, rollout, save_trajectories
from trajectory_view import draw_tokens, render_html


# The demo's forced turns: a random tiny model writes this shape only when told to.
DEMO_TURNS = (
    r"Let me compute it with Python\.\n```python\nprint\(123 \* 456\)\n```\n```output",
    r"The answer is \\boxed\{56088\}\.",
)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    view = sub.add_parser("view", help="write a standalone HTML page of saved trajectories to stdout")
    view.add_argument("file", help="a .jsonl file written by save_trajectories")
    view.add_argument("--tokenizer", help="model folder or name for the tokenizer (default: the one each trajectory records)")
    view.add_argument("--limit", type=at_least(1), default=50, help="show at most this many trajectories (default 50)")
    view.add_argument("--no-score", action="store_true", help="do not run chapter 04's reward on trajectories without one")

    demo = sub.add_parser("demo", help="one real rollout with the tiny random model, its tool call forced (CPU, about a minute)")
    demo.add_argument("--out", default="runs/rollout-demo.jsonl", help="where to save the trajectories")
    demo.add_argument("--model", help="a model folder (default: build the tiny model in a temporary folder)")
    demo.add_argument("--group-size", type=at_least(1), default=2)

    sample = sub.add_parser("sample", help="roll out a model on a problems file and save the trajectories")
    sample.add_argument("--model", required=True, help="model folder or name (e.g. Qwen/Qwen2.5-Math-1.5B)")
    sample.add_argument("--problems", required=True, help="a .jsonl or .parquet file in chapter 01's schema (or ToRL's)")
    sample.add_argument("--out", required=True, help="where to save the trajectories (.jsonl)")
    sample.add_argument("--limit", type=at_least(1), help="use only the first N problems")
    sample.add_argument("--group-size", type=at_least(1), default=8)
    sample.add_argument("--max-response-tokens", type=at_least(1), default=3072)
    sample.add_argument("--tool-budget", type=at_least(0), default=1)
    sample.add_argument("--template", default="torl", choices=sorted(TEMPLATES))
    sample.add_argument("--max-model-len", type=at_least(2), default=4096)
    sample.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--schedule", default=RolloutConfig.schedule, choices=SCHEDULES,
                        help=f"how turns and tool calls interleave (docs/03) [default: {RolloutConfig.schedule}]")

    for one in (view, demo, sample):
        one_line_errors(one)
    args = parser.parse_args(argv)
    try:
        if args.command == "view":
            sys.stdout.write(_cmd_view(args))
        elif args.command == "demo":
            _cmd_demo(args)
        else:
            _cmd_sample(args)
    except (OSError, ValueError, DataError) as e:
        print(f"rollout.py {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_view(args) -> str:
    every = load_trajectories(args.file)
    trajs = every[: args.limit]
    if not trajs:
        raise ValueError(f"{args.file}: no trajectories in it")
    source = args.tokenizer or trajs[0].model
    if not source:
        raise ValueError(f"{args.file}: the trajectories do not name their model; pass --tokenizer PATH")
    from reward import score_batch
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # a missing folder, no hub, a broken file: one line, naming what
        raise ValueError(f"cannot load a tokenizer from {source!r} ({type(e).__name__}); pass --tokenizer PATH") from None
    rewards = None if args.no_score else score_batch([t.text for t in trajs], [t.reference for t in trajs])
    return render_html(trajs, tokenizer, rewards, title=Path(args.file).name, total=len(every))


def _cmd_demo(args) -> None:
    from tiny_model import temp_tiny_model

    llm = make_llm(str(temp_tiny_model()) if args.model is None else args.model, dtype="float32", max_model_len=2048)
    cfg = RolloutConfig(group_size=args.group_size, max_response_tokens=256, force_turns=DEMO_TURNS, seed=0)
    problems = [{"id": "demo-1", "question": "What is 123 * 456?", "answer": "56088", "source": "demo"}]
    _roll_out_and_save(llm, problems, cfg, args.out, draw=True)


def _cmd_sample(args) -> None:
    problems = load_problems(args.problems)[0][: args.limit]  # chapter 01's reader: .jsonl or .parquet, a bad row named
    llm = make_llm(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed)
    cfg = RolloutConfig(group_size=args.group_size, max_response_tokens=args.max_response_tokens,
                        tool_budget=args.tool_budget, template=args.template, seed=args.seed, schedule=args.schedule)
    _roll_out_and_save(llm, problems, cfg, args.out)


def _roll_out_and_save(llm, problems: list[dict], cfg: RolloutConfig, out: str, draw: bool = False) -> None:
    """Roll out with chapter 02's sandbox, save the trajectories, print what was spent (and each trajectory, drawn)."""
    from sandbox import Sandbox, SandboxConfig

    spent: dict = {}
    with Sandbox(SandboxConfig()) as sandbox:
        trajs = rollout(llm, problems, sandbox, cfg, spent)
    save_trajectories(trajs, out)  # its folder made if need be
    if draw:
        tokenizer = llm.get_tokenizer()
        for t in trajs:
            print(f"--- problem {t.problem_id}, sample {t.group_index}: {t.finish_reason}, {t.num_tool_calls} tool call(s)")
            print(draw_tokens(t, tokenizer))
    print(json.dumps({"out": out, "trajectories": len(trajs), **{k: round(v, 3) for k, v in spent.items()}}))


if __name__ == "__main__":
    sys.exit(main())
