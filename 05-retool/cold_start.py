"""The cold start: supervised learning on tool traces, so that RL has a behaviour to reinforce.

It trains the CPU demo's tiny model from scratch (or fine-tunes a pretrained one with `--model`, as the smollm2
preset does) on synthetic traces of 01-data's problems: a share `--tool-fraction` runs code and boxes the sandbox's
real output, the rest box a guess; only the model's tokens carry loss. The story: docs/05-retool.md, "The CPU demo".

    .venv/bin/python 05-retool/cold_start.py --out runs/demo/base                 # the cpu-demo preset's base
    .venv/bin/python 05-retool/cold_start.py --model ~/.cache/tool-rl-lab/SmolLM2-135M-Instruct --train-file data/word_train.jsonl \\
        --template smollm2-chat --steps 60 --tool-only-steps 20 --batch-size 8 --lr 1e-4 --warmup-steps 10 --train-layers 8 --threads 2 --out runs/sft
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from pathlib import Path

try:  # the lab's folders are on the path only in its own Python (the venv's tool_rl_lab.pth)
    from lab_cli import at_least, one_line_errors, progress, run_script
except ModuleNotFoundError:
    sys.exit(f"error: {sys.executable} is not the lab's Python: run .venv/bin/python {sys.argv[0]}, or make")
from prepare_data import DataError, read_problems
from rollout import encode_plain, observation_text, render_prompt
from sandbox import Sandbox, SandboxConfig
from tool_traces import DIRECT_OPENING, TOOL_CLOSING, TOOL_OPENING, call_segments, sandboxed_calls


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    import torch  # after the flags: a mistaken one is refused before torch's two seconds of import

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return build_base_policy(args)
    finally:
        torch.set_num_threads(threads)


def build_base_policy(args) -> Path:
    import torch
    from tiny_model import build_tiny_model

    torch.manual_seed(args.seed)
    random.seed(args.seed)  # the batches' draw: the same settings give the same base (and its cache key means it)
    rng = random.Random(args.seed)
    try:
        problems = read_problems(args.train_file)
    except DataError as e:
        raise SystemExit(f"error: {e} (make it with 01-data/prepare_data.py, or pass --train-file)") from None
    out = Path(args.out)
    traces = drawn_traces(problems, args, rng)
    print(f"cold start: {len(traces)} traces, {sum(t['tool'] for t in traces)} with a tool call")
    source = args.model or out
    if not args.model:  # a tiny random-init Qwen2, its tokenizer trained on the traces
        corpus = ["".join(text for _, text in t["segments"]) for t in traces[:2000]]
        build_tiny_model(out, corpus=corpus, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         num_layers=args.num_layers, num_heads=args.hidden_size // 64, num_kv_heads=args.kv_heads,
                         intermediate_size=4 * args.hidden_size, max_position_embeddings=args.max_len * 4, seed=args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    examples = [tokenize_trace(t, tokenizer) for t in traces]

    # First tool traces alone, so the model learns the tool's grammar; then the mix, which sets how often it reaches
    # for the tool. On the chained task the first part trains on drills: every move, no decision.
    tool_examples = [tokenize_trace({"segments": t["drill"]}, tokenizer) if "drill" in t else e
                     for e, t in zip(examples, traces) if t["tool"]]
    if args.drills_in_mix and any("drill" in t for t in traces):  # the moves kept while the decisions are learned
        examples = examples + tool_examples
    moves = {}
    for round_ in range(1, args.rounds + 1):  # the chained task: the schedule again, until the base has the moves
        args.round = round_  # part of a partial checkpoint's settings: a restart never mixes two rounds
        if args.train_layers:
            freeze_all_but_top(model, args.train_layers)
        losses = train(model, examples, tool_examples, tokenizer.pad_token_id, args)
        model.requires_grad_(True)  # a checkpoint of the whole model; the RL trainer freezes its own way
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        print(f"cold start: final loss {losses[-1]:.3f}; base policy saved to {out}")
        if not is_chained_task(problems):
            break
        from moves_check import check_base  # RL can only amplify moves the base makes: checked before any RL

        moves = {"moves": check_base(out, args.template, args.seed), "rounds": round_}
        if moves["moves"]["passed"]:
            break
    (out / "cold_start.json").write_text(json.dumps({**vars(args), "final_loss": losses[-1], **moves}, indent=2))
    return out


_DRAWN: dict = {}  # the traces of this process's cold starts: the schedules of one base draw the same ones


def drawn_traces(problems: list[dict], args, rng: random.Random) -> list[dict]:
    """The traces of `problems`, drawn once per process and inputs: a base of several schedules draws them once."""
    path = Path(args.train_file)
    key = (str(path.resolve()), path.stat().st_mtime_ns, args.tool_fraction, args.template, args.seed)
    if key not in _DRAWN:
        _DRAWN.clear()  # one set kept at a time
        _DRAWN[key] = (chained_traces(problems, args.tool_fraction, rng, args.template) if is_chained_task(problems)
                       else make_traces(problems, args.tool_fraction, rng, args.template, code_for=trace_code))
    return _DRAWN[key]


def make_traces(problems: list[dict], tool_fraction: float, rng: random.Random, template: str,
                code_for) -> list[dict]:
    """One trace per problem (integer answers); a tool trace's code `code_for(question)` runs in the real sandbox."""
    traces = draw_traces(problems, tool_fraction, rng, template, code_for)
    tool_jobs = [t for t in traces if t["tool"]]
    # The traces' code is one print: a warm interpreter without numpy and sympy forks in about half the time.
    with Sandbox(SandboxConfig(preload=())) as sandbox:
        results = sandbox.run_many([t["code"] for t in tool_jobs])
    for t, result in zip(tool_jobs, results):
        t["segments"] += [("observation", observation_text(result)), ("model", TOOL_CLOSING.format(answer=t["answer"]))]
    return traces


def draw_traces(problems: list[dict], tool_fraction: float, rng: random.Random, template: str,
                code_for) -> list[dict]:
    """The traces without their observations: which problems get a tool trace, its code, a direct trace's guess."""
    traces = []
    for p in problems:
        prompt = render_prompt(p["question"], template)
        if rng.random() < tool_fraction:
            code = code_for(p["question"])
            traces.append({"tool": True, "segments": [("prompt", prompt), ("model", TOOL_OPENING.format(code=code))],
                           "code": code, "answer": p["answer"]})
        else:
            traces.append({"tool": False, "segments": [("prompt", prompt), ("model", DIRECT_OPENING.format(guess=guess(int(p["answer"]), rng)))]})
    return traces


def traces_problem(train_file: str, tool_fraction: float, template: str, seed: int, batch_size: int,
                   tool_only_steps: int) -> str | None:
    """Why the cold start cannot use `train_file`, in one line, or None: `build_base_policy`'s draw without the
    sandbox (a question it cannot write code for, an answer not an integer, fewer traces than one batch)."""
    problems, rng, traces = read_problems(train_file), random.Random(seed), []
    instead = "or pass --cold-start none --model MODEL to start RL from a model as it is"
    from chained_problems import parse, step_call

    # a chained trace opens with its first step on the reading as written
    code_for = (lambda question: step_call(question, 0, parse(question)[0])) if is_chained_task(problems) else trace_code
    for number, problem in enumerate(problems, 1):
        try:
            traces += draw_traces([problem], tool_fraction, rng, template, code_for=code_for)
        except ValueError as e:
            return (f"train_file {train_file}, row {number}: the cold start cannot write a trace for it ({e}); its "
                    f"traces are for the toy task, 01-data's word problems and its chained task: use one of those, "
                    f"{instead}")
    tools = sum(t["tool"] for t in traces)
    if len(traces) < batch_size or (tool_only_steps and tools < batch_size):
        return (f"train_file {train_file}: {len(traces)} problems give {tools} tool traces, fewer than a cold-start "
                f"batch ({batch_size}): pass a larger file, a smaller --cold-start-batch-size, {instead}")
    return None


def trace_code(question: str) -> str:
    """The code a tool trace runs, for the toy task's questions and for 01-data's word problems."""
    if question.startswith("What is "):
        a, b = (int(x) for x in question.removeprefix("What is ").removesuffix("?").split(" * "))
        return f"print({a} * {b})"
    from word_problems import solution_code

    return solution_code(question)


FURTHER_CALL_RATE = 0.25  # the chained task: the share of points where a further call is possible that make it


def is_chained_task(problems: list[dict]) -> bool:
    from chained_problems import parse

    try:
        parse(problems[0]["question"])
    except (IndexError, ValueError):  # no problems, or not the chained task's
        return False
    return True


def chained_traces(problems: list[dict], tool_fraction: float, rng: random.Random, template: str) -> list[dict]:
    """Traces of the chained task: a direct guess, or the taught calls run in the real sandbox, each further call
    made at FURTHER_CALL_RATE; its "drill" makes every call, no decision trained (docs/06-experiments.md)."""
    traces = []
    with Sandbox(SandboxConfig(preload=())) as sandbox:
        for p in progress(problems, desc="cold start (traces)"):  # their calls run one by one: a minute or more
            prompt = ("prompt", render_prompt(p["question"], template))
            if rng.random() >= tool_fraction:
                traces.append({"tool": False, "segments": [prompt, ("model", DIRECT_OPENING.format(guess=guess(int(p["answer"]), rng)))]})
                continue
            results: dict = {}  # code -> what the sandbox printed: the drill reruns the trace's calls

            def play(decide) -> tuple[list, int]:
                calls, answer = sandboxed_calls(p["question"], decide, sandbox, results)
                boxed = answer if answer is not None else guess(int(p["answer"]), rng)
                return [prompt, *call_segments(calls, results), ("model", TOOL_CLOSING.format(answer=boxed))], len(calls)

            segments, calls = play(lambda move: rng.random() < FURTHER_CALL_RATE)
            drill = [("move" if kind == "model" else kind, text) for kind, text in play(lambda move: True)[0]]
            traces.append({"tool": True, "segments": segments, "calls": calls, "answer": p["answer"], "drill": drill})
    return traces


def freeze_all_but_top(model, layers: int) -> int:
    """Train only the top `layers` decoder layers and the final norm, the embedding frozen (why: docs/05-smollm2.md);
    returns the trainable weights' count."""
    blocks = model.model.layers
    if not 0 < layers <= len(blocks):
        raise ValueError(f"train_layers must be 1..{len(blocks)}, got {layers}")
    model.requires_grad_(False)
    blocks[len(blocks) - layers:].requires_grad_(True)
    model.model.norm.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def guess(product: int, rng: random.Random) -> int:
    """A plausible wrong answer: the right number of digits and first digit, the rest made up."""
    digits = str(product)
    if len(digits) == 1:
        return rng.choice([d for d in range(10) if d != product])
    while True:
        candidate = int(digits[0] + "".join(rng.choice("0123456789") for _ in digits[1:]))
        if candidate != product:
            return candidate


def tokenize_trace(trace: dict, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids and a loss mask: each segment tokenized on its own, as a rollout appends them. A "move" segment is
    the model's, less its first token: that token is the decision, which a drill does not teach."""
    ids, mask = [], []
    for kind, text in trace["segments"]:
        segment_ids = encode_plain(tokenizer, text) if kind == "observation" else tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += segment_ids
        mask += [0] + [1] * (len(segment_ids) - 1) if kind == "move" else [int(kind == "model")] * len(segment_ids)
    return ids + [tokenizer.eos_token_id], mask + [1]  # the model must learn to stop


def train(model, examples, tool_examples, pad_id: int, args) -> list[float]:
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.0, betas=(0.9, 0.95))
    model.train()
    start, losses = resume_partial(model, optimizer, args)
    shared = shared_prompt_length(examples)
    bar = progress(range(start, args.steps), desc="cold start (SFT)", initial=start, total=args.steps)
    for step in bar:
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = random.sample(tool_examples if step < args.tool_only_steps else examples, args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = batch_loss_backward(model, batch, pad_id, shared)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)  # shown with the next step's refresh
        if (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            save_partial(model, optimizer, step + 1, losses, args)
    (Path(args.out) / PARTIAL).unlink(missing_ok=True)
    return losses


def batch_loss_backward(model, batch, pad_id: int, shared: int) -> float:
    """Backpropagate the batch's mean token loss; return it. Two parts, cut where padding wastes least (a tool trace
    is about twice a direct one: one width wasted a third of a mixed step), each weighted by its share of tokens."""
    import torch

    batch = sorted(batch, key=lambda example: len(example[0]))
    widths = [len(ids) - shared for ids, _ in batch]
    cut = min(range(len(batch), 0, -1), key=lambda k: k * widths[k - 1] + (len(batch) - k) * widths[-1])  # ties: whole
    tokens = sum(sum(mask[shared + 1:]) for _, mask in batch)
    loss = 0.0
    for part in filter(None, (batch[:cut], batch[cut:])):
        width = max(len(ids) for ids, _ in part)
        input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in part])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for _, m in part], dtype=torch.float32)
        part_loss = trace_loss(model, input_ids, loss_mask, shared) * (loss_mask[:, shared + 1:].sum() / tokens)
        part_loss.backward()
        loss += part_loss.item()
    return loss


def trace_loss(model, input_ids, loss_mask, shared: int = 0):
    """Mean negative log-likelihood of the model's tokens (loss_mask 1). The `shared` opening tokens run once, their
    keys and values serving the whole batch: the same loss and gradient in about half the time on the toy task."""
    import torch

    prompt_cache = None
    if shared:
        prompt_cache = model(input_ids=input_ids[:1, :shared], use_cache=True).past_key_values
        prompt_cache.batch_repeat_interleave(len(input_ids))
    logits = model(input_ids=input_ids[:, shared:], past_key_values=prompt_cache).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, shared + 1:], reduction="none")
    return (nll * loss_mask[:, shared + 1:]).sum() / loss_mask[:, shared + 1:].sum()


def shared_prompt_length(examples) -> int:
    """Tokens every example opens with, up to its first model token less one (whose logit predicts that token)."""
    first = examples[0][0]
    shared = min(mask.index(1) for _, mask in examples) - 1
    for ids, _ in examples:
        shared = next((i for i in range(shared) if ids[i] != first[i]), shared)
    if shared < 1:
        raise ValueError("the traces share no opening token: they are not of one template")
    return shared


PARTIAL = "partial.pt"  # the cold start so far: a stopped or killed cold start goes on from it


def save_partial(model, optimizer, step: int, losses: list[float], args) -> None:
    """Weights, optimizer and random state after `step`, written whole or not at all."""
    import torch

    path, tmp = Path(args.out) / PARTIAL, Path(args.out) / f".{PARTIAL}.tmp"
    path.parent.mkdir(parents=True, exist_ok=True)  # a tuned model's folder is made only when it is saved
    torch.save({"settings": _settings(args), "step": step, "losses": losses, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "python": random.getstate(), "torch": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)


def resume_partial(model, optimizer, args) -> tuple[int, list[float]]:
    """(first step, losses so far): from the partial checkpoint of the same settings, else (0, [])."""
    import torch

    path = Path(args.out) / PARTIAL
    if not path.exists():
        return 0, []
    saved = torch.load(path, weights_only=False)
    if saved["settings"] != _settings(args):
        print(f"cold start: {path} was made with other settings; starting over")
        return 0, []
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    random.setstate(saved["python"])
    torch.set_rng_state(saved["torch"])
    print(f"cold start: going on from step {saved['step']} of {args.steps} ({path})")
    return saved["step"], saved["losses"]


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("out", "threads", "checkpoint_every")}


def parse_args(argv):
    p = argparse.ArgumentParser(description="Train the CPU demo's tiny base policy from scratch on synthetic toy-task traces "
                                            "(the demo's: about a minute on two cores).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--train-file", default="data/toy_train.jsonl", help="toy-task problems (01-data's schema)")
    p.add_argument("--out", default="runs/cold-start", help="folder the base model is saved to")
    p.add_argument("--model", default="", help="fine-tune this pretrained model (folder or hub id) instead of a new tiny one")
    p.add_argument("--train-layers", type=at_least(0), default=0, help="train only the top N decoder layers (0 = all)")
    p.add_argument("--template", default="torl", help="prompt template (chapter 03's table)")
    p.add_argument("--tool-fraction", type=fraction, default=0.3, help="share of traces that call the tool")
    p.add_argument("--steps", type=at_least(1), default=300, help="optimizer steps in all")
    p.add_argument("--tool-only-steps", type=at_least(0), default=200, help="first steps on tool traces alone")
    p.add_argument("--threads", type=at_least(1), default=len(os.sched_getaffinity(0)), help="torch threads (every core: nothing else runs yet)")
    p.add_argument("--batch-size", type=at_least(1), default=32)
    p.add_argument("--lr", type=at_least(1e-12, float), default=2e-3)
    p.add_argument("--warmup-steps", type=at_least(1), default=50)
    p.add_argument("--hidden-size", type=multiple_of_64, default=256, help="a multiple of 64 (vLLM's CPU attention wants head_dim 64)")
    p.add_argument("--num-layers", type=at_least(1), default=2)
    p.add_argument("--rounds", type=at_least(1), default=1, help="chained task: at most this many runs of the "
                   "schedule, each from the last one's weights, until the moves check passes (moves_check.py)")
    p.add_argument("--drills-in-mix", action="store_true", help="chained task: the mixed phase draws from the drills "
                   "too (they train no decision), so the moves are not forgotten while the decisions are learned")
    p.add_argument("--kv-heads", type=at_least(1), default=1,
                   help="key-value heads, dividing hidden-size / 64 (1: all heads share one, as the demo's base)")
    p.add_argument("--vocab-size", type=at_least(64), default=384)
    p.add_argument("--max-len", type=at_least(16), default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=at_least(1), default=50,
                   help="steps between partial checkpoints, from which a stopped cold start goes on")
    args = one_line_errors(p).parse_args(argv)
    if (args.hidden_size // 64) % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} does not divide the {args.hidden_size // 64} heads of --hidden-size {args.hidden_size}")
    if args.tool_only_steps > args.steps:
        p.error(f"--tool-only-steps {args.tool_only_steps} is more than --steps {args.steps}")
    return args


def fraction(text: str) -> float:
    value = at_least(0.0, float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a share from 0 to 1, got {text}")
    return value


def multiple_of_64(text: str) -> int:
    value = at_least(64)(text)
    if value % 64:
        raise argparse.ArgumentTypeError(f"must be a multiple of 64 (vLLM's CPU attention wants head_dim 64), got {text}")
    return value


if __name__ == "__main__":
    run_script(main)  # Ctrl-C: "stopped by SIGINT (Ctrl-C)", exit 130; the same command goes on from partial.pt
