"""The cold start's traces for the word problems, and the layer freezing the SmolLM2 preset trains with."""
import random
from pathlib import Path

import pytest

from cold_start import freeze_all_but_top, make_traces, tokenize_trace, trace_code
from word_problems import make_word_problems


def test_word_problem_tool_traces_carry_the_sandboxs_real_answer_in_the_chat_format():
    train, _ = make_word_problems(12, 0, seed=1)
    traces = make_traces(train, tool_fraction=0.5, rng=random.Random(0), template="smollm2-chat", code_for=trace_code)
    tool = [t for t in traces if t["tool"]]
    direct = [t for t in traces if not t["tool"]]
    assert tool and direct
    for t in tool:
        kinds = [k for k, _ in t["segments"]]
        assert kinds == ["prompt", "model", "observation", "model"]
        assert t["segments"][0][1].startswith("<|im_start|>system\n") and t["segments"][0][1].endswith("<|im_start|>assistant\n")
        assert t["segments"][1][1] == f"```python\n{t['code']}\n```\n```output"
        assert t["segments"][2][1] == f"\n{t['answer']}\n```\n"  # what the sandbox printed, as a rollout shows it
        assert t["segments"][3][1] == f"The answer is \\boxed{{{t['answer']}}}."
    answers = {r["question"]: r["answer"] for r in train}
    for t in direct:
        boxed = t["segments"][1][1].removeprefix("The answer is \\boxed{").removesuffix("}.")
        question = t["segments"][0][1].split("user\n")[1].split("<|im_end|>")[0]
        assert boxed != answers[question] and len(boxed) == len(answers[question])


def test_only_the_models_segments_carry_loss(tiny_tokenizer):
    trace = {"tool": True, "segments": [("prompt", "Q: 1+1?\n"), ("model", "```python\nprint(1+1)\n```\n```output"),
                                        ("observation", "\n2\n```\n"), ("model", "The answer is \\boxed{2}.")]}
    ids, mask = tokenize_trace(trace, tiny_tokenizer)
    lengths = [len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]) for _, text in trace["segments"]]
    assert mask == [0] * lengths[0] + [1] * lengths[1] + [0] * lengths[2] + [1] * lengths[3] + [1]
    assert ids[-1] == tiny_tokenizer.eos_token_id


def test_freezing_leaves_only_the_top_layers_and_final_norm_trainable(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    n = freeze_all_but_top(model, 1)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith(("model.layers.1.", "model.norm.")) for name in trainable)
    assert n == sum(p.numel() for p in model.model.layers[1].parameters()) + model.model.norm.weight.numel()
    with pytest.raises(ValueError, match="train_layers must be 1..2"):
        freeze_all_but_top(model, 3)


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--hidden-size", "100"], "argument --hidden-size: must be a multiple of 64"),
    (["--tool-only-steps", "600"], "--tool-only-steps 600 is more than --steps 300"),
    (["--tool-fraction", "2"], "argument --tool-fraction: must be a share from 0 to 1"),
    (["--lr", "0"], "argument --lr: must be at least"),
])
def test_cold_start_refuses_each_mistake_in_one_line_before_it_writes(argv, says, tmp_path, capsys):
    import cold_start

    with pytest.raises(SystemExit) as e:
        cold_start.main(argv + ["--out", str(tmp_path / "base")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and says in err and "\n" not in err
    assert not (tmp_path / "base").exists()


def test_a_missing_training_file_is_one_line_naming_it_and_how_to_make_it(tmp_path):
    import cold_start

    with pytest.raises(SystemExit) as e:
        cold_start.main(["--train-file", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "base")])
    assert e.value.code == f"error: {tmp_path / 'none.jsonl'}: no such file (make it with 01-data/prepare_data.py, or pass --train-file)"
    assert not (tmp_path / "base").exists()


def test_the_scripts_defaults_make_the_cpu_demos_base():
    """`cold_start.py --out DIR` alone trains what `make run-05` trains (docs/05-retool.md)."""
    import cold_start
    from retool import Config

    args, cfg = cold_start.parse_args(["--out", "x"]), Config()
    assert (args.steps, args.tool_only_steps, args.tool_fraction, args.lr, args.batch_size, args.template) == (
        cfg.cold_start_steps, cfg.cold_start_tool_only_steps, cfg.cold_start_tool_fraction, cfg.cold_start_lr,
        cfg.cold_start_batch_size, cfg.template)


def test_a_stopped_cold_start_goes_on_from_its_partial_checkpoint_to_the_same_model(tmp_path, monkeypatch):
    """Stopped after step 5 of 8 (partial checkpoints every 2), run again: the same weights as an unbroken run."""
    import torch

    import cold_start
    from prepare_data import make_toy_task, write_jsonl
    from transformers import AutoModelForCausalLM

    write_jsonl(make_toy_task(24, 0, seed=4)[0], tmp_path / "toy.jsonl")
    small = ["--train-file", str(tmp_path / "toy.jsonl"), "--steps", "8", "--tool-only-steps", "2", "--batch-size", "4",
             "--hidden-size", "64", "--num-layers", "1", "--vocab-size", "128", "--max-len", "64",
             "--warmup-steps", "2", "--checkpoint-every", "2"]
    cold_start.main(small + ["--out", str(tmp_path / "whole")])

    clip = torch.nn.utils.clip_grad_norm_
    calls = []

    def stop_in_step_6(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", stop_in_step_6)
    with pytest.raises(KeyboardInterrupt):
        cold_start.main(small + ["--out", str(tmp_path / "stopped")])
    assert torch.load(tmp_path / "stopped" / cold_start.PARTIAL, weights_only=False)["step"] == 4
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    cold_start.main(small + ["--out", str(tmp_path / "stopped")])
    assert not (tmp_path / "stopped" / cold_start.PARTIAL).exists()
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "whole").state_dict()
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "stopped").state_dict()
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)


def test_a_cold_started_base_is_reused_only_while_every_input_is_the_same(tmp_path, monkeypatch):
    import dataclasses

    import cold_start
    import problems_and_policy
    from prepare_data import make_toy_task, write_jsonl
    from retool import Config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    write_jsonl(make_toy_task(16, 0, seed=4)[0], tmp_path / "toy.jsonl")
    trained = []
    real_main = cold_start.main

    def counting_main(argv):
        trained.append(argv)
        small = ["--hidden-size", "64", "--num-layers", "1", "--vocab-size", "128", "--max-len", "64", "--warmup-steps", "1"]
        return real_main(argv + small)

    monkeypatch.setattr(cold_start, "main", counting_main)
    cfg = Config(train_file=str(tmp_path / "toy.jsonl"), cold_start_steps=2, cold_start_tool_only_steps=1,
                 cold_start_batch_size=2)
    first = problems_and_policy.cold_started_model(cfg, tmp_path / "run1")
    second = problems_and_policy.cold_started_model(cfg, tmp_path / "run2")  # same inputs: copied, not trained
    assert len(trained) == 1 and (Path(second) / "cold_start.json").read_text() == (Path(first) / "cold_start.json").read_text()
    problems_and_policy.cold_started_model(dataclasses.replace(cfg, seed=1), tmp_path / "run3")  # a setting changed
    write_jsonl(make_toy_task(16, 0, seed=5)[0], tmp_path / "toy.jsonl")
    problems_and_policy.cold_started_model(cfg, tmp_path / "run4")  # the problems changed
    problems_and_policy.cold_started_model(dataclasses.replace(cfg, cold_start_cache=False), tmp_path / "run5")
    assert len(trained) == 4


def test_tuning_a_given_model_writes_its_partial_checkpoints_into_a_folder_it_makes(tmp_path, tiny_model_path):
    import cold_start
    from prepare_data import make_toy_task, write_jsonl

    write_jsonl(make_toy_task(24, 0, seed=4)[0], tmp_path / "toy.jsonl")
    out = cold_start.main(["--model", str(tiny_model_path), "--train-file", str(tmp_path / "toy.jsonl"), "--steps", "3",
                           "--tool-only-steps", "1", "--batch-size", "2", "--warmup-steps", "1", "--checkpoint-every", "1",
                           "--out", str(tmp_path / "tuned")])
    assert (out / "cold_start.json").exists() and not (out / cold_start.PARTIAL).exists()


def test_a_batch_run_in_two_padded_parts_gives_the_whole_batchs_loss_and_gradient(tiny_model_path, tiny_tokenizer):
    import random

    import torch
    from transformers import AutoModelForCausalLM

    import cold_start

    def trace(a, b, tool):
        prompt = ("prompt", cold_start.render_prompt(f"What is {a} * {b}?", "torl"))
        if not tool:
            return {"segments": [prompt, ("model", cold_start.DIRECT_OPENING.format(guess=cold_start.guess(a * b, random.Random(a))))]}
        return {"segments": [prompt, ("model", cold_start.TOOL_OPENING.format(code=f"print({a} * {b})")),
                             ("observation", f"\n{a * b}\n```\n"), ("model", cold_start.TOOL_CLOSING.format(answer=a * b))]}

    batch = [cold_start.tokenize_trace(trace(a, b, tool), tiny_tokenizer)
             for a, b, tool in [(12, 34, True), (567, 8, False), (9, 99, False), (31, 4, True), (70, 7, False)]]
    shared = cold_start.shared_prompt_length(batch)
    widths = sorted(len(ids) for ids, _ in batch)
    assert widths[-1] - widths[0] > 8  # two lengths: the cut runs the short traces at their own width
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.zero_grad()
    loss = cold_start.batch_loss_backward(model, batch, 0, shared)
    in_parts = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    width = widths[-1]
    input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.float32)
    whole = cold_start.trace_loss(model, input_ids, loss_mask, shared)
    whole.backward()
    assert loss == pytest.approx(whole.item(), rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(in_parts, [p.grad for p in model.parameters()]))


def test_sharing_the_templates_opening_gives_the_same_loss_and_gradient(tiny_model_path, tiny_tokenizer):
    import random

    import torch
    from transformers import AutoModelForCausalLM

    import cold_start

    problems = [{"question": f"What is {a} * {b}?", "answer": str(a * b)} for a, b in [(12, 34), (567, 8), (9, 99), (31, 4)]]
    traces = [{"tool": False, "segments": [("prompt", cold_start.render_prompt(p["question"], "torl")),
                                           ("model", cold_start.DIRECT_OPENING.format(guess=cold_start.guess(int(p["answer"]), random.Random(i))))]}
              for i, p in enumerate(problems)]
    examples = [cold_start.tokenize_trace(t, tiny_tokenizer) for t in traces]
    shared = cold_start.shared_prompt_length(examples)
    first_model_token = min(mask.index(1) for _, mask in examples)
    assert 0 < shared < first_model_token and all(ids[:shared] == examples[0][0][:shared] for ids, _ in examples)
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in examples])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for _, m in examples], dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    grads = []
    for k in (0, shared):
        model.zero_grad()
        loss = cold_start.trace_loss(model, input_ids, loss_mask, k)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[0][1], grads[1][1]))
