"""Check, teacher-forced, that a cold-started base makes each move of the chained task (call, box, fix, chain), as
RL assumes; about 20 s a base on two cores, and before any RL.

RL re-weights what the base already samples; it cannot invent a move. Each move is measured teacher-forced on the
multi-call policy's traces; whether to call again is RL's decision, reported as the base's probability of a call after
a result with a step left ("next") and after the last ("last"). The story: docs/06-experiments.md.

    .venv/bin/python 05-retool/moves_check.py runs/chained-base-h --problems data/chained_test.jsonl
"""
from __future__ import annotations

import json
import sys

import results
from lab_cli import run_script, script_parser
from prompt_templates import render_prompt
from rollout import encode_plain
from sandbox import Sandbox, SandboxConfig
from tool_traces import TOOL_CLOSING, TOOL_OPENING, call_segments, sandboxed_calls

MOVES = ("call", "box", "fix", "chain")
DECISIONS = ("next", "last")  # after a result: a step left, or none
MOVES_NEEDED = 0.8  # each move made on at least this share of its occurrences before RL is worth running


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = script_parser(__doc__)
    p.add_argument("models", nargs="+", metavar="model", help="the base model's folder (several: each checked)")
    p.add_argument("--problems", default="data/chained_test.jsonl", help="chained problems to check on")
    p.add_argument("--n", type=int, default=64, help="problems to check on (default 64)")
    p.add_argument("--template", default="torl", help="prompt template (chapter 03's table)")
    p.add_argument("--results", metavar="NAME", type=results.name_argument,
                   help="also write the shares to docs/results/NAME.json, as base1_call, base1_box, ... in the order "
                   "given (results.py)")
    args = p.parse_args(argv)
    from prepare_data import read_jsonl

    problems, figures = read_jsonl(args.problems)[: args.n], {}
    for i, model in enumerate(args.models, 1):
        shares = check_moves(model, problems, args.template)
        print(f"{model}: {json.dumps(shares)}")
        figures.update({f"base{i}_{move}": shares[move] for move in MOVES + DECISIONS})
    if args.results:
        results.save(args.results, " ".join(["05-retool/moves_check.py", *(argv if argv is not None else sys.argv[1:])]),
                      figures)
    return figures


def check_moves(model_dir: str, problems: list[dict], template: str = "torl") -> dict[str, float]:
    """{move: share of its occurrences the base makes, token for token}, "passed" (each >= MOVES_NEEDED), and
    {decision: the base's mean probability of a call there, against the box}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    made = {move: [] for move in MOVES + DECISIONS}
    call, box = (tokenizer(text, add_special_tokens=False)["input_ids"][0]
                 for text in (TOOL_OPENING.format(code=""), TOOL_CLOSING.format(answer="")))
    for ids, spans, decisions in move_spans(problems, tokenizer, template):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        predicted = logits.argmax(-1).tolist()
        for move, start, end in spans:  # token t is predicted at position t - 1
            made[move].append(all(predicted[t - 1] == ids[t] for t in range(start, end)))
        for decision, at in decisions:
            p_call, p_box = logits[at - 1].softmax(-1)[[call, box]].tolist()
            made[decision].append(p_call / (p_call + p_box))
    shares = {move: round(sum(m) / len(m), 3) if m else 0.0 for move, m in made.items()}
    return {**shares, "passed": all(shares[m] >= MOVES_NEEDED for m in MOVES)}


CHECK_PROBLEMS = 64


def check_base(model_dir, template: str, seed: int, said_by: str = "cold start") -> dict:
    """check_moves on CHECK_PROBLEMS fresh held-out-frame problems (another seed than the evaluation's); said."""
    from chained_problems import make_chained_problems

    shares = check_moves(str(model_dir), make_chained_problems(0, CHECK_PROBLEMS, seed=seed + 1000)[1], template)
    said = ", ".join(f"{move} {shares[move]:.2f}" for move in MOVES)
    print(f"{said_by}: moves of the chained task, teacher-forced on {CHECK_PROBLEMS} held-out problems: {said} "
          + ("(each at least %.1f)" % MOVES_NEEDED if shares["passed"] else
             f"(not every move reaches {MOVES_NEEDED}: RL will have little to amplify; docs/06-experiments.md)")
          + f"; it calls after a result with a step left at {shares['next']:.2f}, after the last at {shares['last']:.2f}")
    return shares


def move_spans(problems: list[dict], tokenizer, template: str):
    """Per problem: the token ids of its multi-call trace, [(move, first token, end)] of each move in it, and
    [(decision, position)] of each point after a result, where the model opens a call or the box."""
    with Sandbox(SandboxConfig(preload=())) as sandbox:
        for problem in problems:
            results: dict = {}
            calls, answer = sandboxed_calls(problem["question"], lambda move: True, sandbox, results)
            pieces, ran = [("prompt", render_prompt(problem["question"], template), None, None)], None
            segments = call_segments(calls, results)
            for code, model, observation in zip(calls, segments[0::2], segments[1::2]):
                move = {None: "call", False: "fix", True: "chain"}[ran]  # what the call before did: none, failed, ran
                pieces += [(*model, (move, code), "next" if move == "chain" else None), (*observation, None, None)]
                ran = results[code].ok
            pieces.append(("model", TOOL_CLOSING.format(answer=answer), ("box", answer), "last"))
            yield tokens_with_spans(pieces, tokenizer)


def tokens_with_spans(pieces, tokenizer) -> tuple[list[int], list[tuple[str, int, int]], list[tuple[str, int]]]:
    """Each piece tokenized on its own, as a rollout appends it, with its move's span and its decision's position."""
    ids, spans, decisions = [], [], []
    for kind, text, move, decision in pieces:
        if decision:
            decisions.append((decision, len(ids)))
        if kind == "observation":
            ids += encode_plain(tokenizer, text)
            continue
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if move:
            name, part = move
            begin = text.index(part)
            inside = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < begin + len(part) and b > begin]
            spans.append((name, len(ids) + inside[0], len(ids) + inside[-1] + 1))
        ids += encoded["input_ids"]
    return ids, spans, decisions


if __name__ == "__main__":
    run_script(main)
