"""05-retool: the loop runs for real, survives a kill, and refuses bad configuration in one line."""
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import checkpoints
import retool
import problems_and_policy
import stopping
from configuration import check_config
from eval import markdown_table, paper_table, pass_at_k, summarise
from prepare_data import make_toy_task, write_jsonl
from retool import Config, batch_at, make_config, parse_args, rollout_config
from tiny_model import KV_CACHE_GIB

REPO = Path(__file__).resolve().parent.parent
RETOOL = REPO / "05-retool" / "retool.py"


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 4)


def test_summary_reports_avg_and_pass_per_problem():
    samples = [
        {"problem_id": "a", "correct": True, "valid_format": True, "tool_calls": 1, "code_ok": [True], "response_tokens": 10},
        {"problem_id": "a", "correct": False, "valid_format": True, "tool_calls": 0, "code_ok": [], "response_tokens": 20},
        {"problem_id": "b", "correct": False, "valid_format": False, "tool_calls": 1, "code_ok": [False], "response_tokens": 30},
        {"problem_id": "b", "correct": False, "valid_format": True, "tool_calls": 0, "code_ok": [], "response_tokens": 40},
    ]
    s = summarise(samples, k=2)
    assert s["avg@2"] == 0.25 and s["pass@1"] == 0.25 and s["pass@2"] == 0.5
    assert s["format_rate"] == 0.75 and s["code_ratio"] == 0.5 and s["code_pass_ratio"] == 0.5
    assert s["response_length"] == 25 and s["problems"] == 2
    assert "| toy | 2 | 0.250 |" in markdown_table({"mode": "tir", "k": 2, "sets": {"toy": s}})


def test_data_order_is_fixed_by_seed_and_step_so_resume_sees_the_same_batches():
    problems = [{"id": str(i)} for i in range(10)]
    first = [batch_at(problems, s, 4, seed=1) for s in range(5)]
    assert first == [batch_at(problems, s, 4, seed=1) for s in range(5)]
    seen = [p["id"] for b in first[:2] for p in b] + [p["id"] for p in first[2][:2]]
    assert sorted(seen) == sorted(p["id"] for p in problems)  # one epoch covers every problem once
    assert first != [batch_at(problems, s, 4, seed=2) for s in range(5)]


def test_training_rollouts_are_unseeded_unless_asked():
    assert rollout_config(Config(), 3).seed is None  # vLLM's fast path: one random stream for the batch
    seeded = Config(seed_rollouts=True)
    assert rollout_config(seeded, 3).seed == rollout_config(seeded, 3).seed != rollout_config(seeded, 4).seed


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(max_response_tokens=600, max_model_len=512), "leaves no room for the prompt"),
        (dict(model="no/such/folder", cold_start="none"), "is neither a folder nor a hub id"),
        (dict(group_size=1), "a group of one"),
        (dict(train_file="data/nope.jsonl"), "does not exist"),
        (dict(steps=0), "steps must be at least 1"),
        (dict(rollout_schedule="async"), "rollout_schedule must be rounds or overlap"),
        (dict(tool_budget=0), "tool_budget 0 with template 'torl', which asks for programs: no code block would ever "
                              "run; pass --tool-budget 1 or more, or a text-only template (cot or qwen-chat-cot)"),
    ],
)
def test_bad_configuration_fails_at_start_with_one_line(change, message):
    with pytest.raises(SystemExit) as e:
        check_config(Config(**change))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_preset_and_unknown_field_are_one_line_errors():
    with pytest.raises(SystemExit, match="unknown preset 'gpt-5'"):
        make_config("gpt-5", {})
    with pytest.raises(SystemExit, match="unrecognized arguments: --learning-rate"):
        parse_args(["--learning-rate", "1"])


def test_the_chapters_readme_names_every_preset():
    from presets import PRESETS

    readme = (Path(__file__).parent / "README.md").read_text()
    listed = re.search(r"`presets\.py` \(([^)]*)\)", readme)[1].split(", ")
    assert sorted(listed) == sorted(PRESETS), "05-retool/README.md: list the presets presets.py defines"


def test_every_field_is_overridable_from_the_command_line():
    args, overrides = parse_args(["--lr", "0.5", "--group-size", "4", "--scale-advantages", "true"])
    cfg = make_config(args.preset, overrides)
    assert (cfg.lr, cfg.group_size, cfg.scale_advantages) == (0.5, 4, True)
    assert make_config("torl-1.5b", {}).model == "Qwen/Qwen2.5-Math-1.5B"


@pytest.mark.vllm
def test_loop_runs_is_stopped_killed_and_resumes_where_it_stopped(tiny_model_path, tmp_path, preloaded_python):
    """A real run (vLLM, sandbox, reward, GRPO, sync) stopped by SIGTERM, resumed and killed, resumed to the end.

    The run signals itself as a given step begins (RETOOL_TEST_SIGNAL), so
    nothing here races it. 5 steps, a checkpoint every 3, an evaluation every 2:
      run 1: SIGTERM as step 3 begins -> it saves step 2 (not a save_every step) and exits 143
      run 2: resumes at 2, does 3 (checkpoint) and 4 (evaluation), SIGKILL as step 5 begins
      run 3: resumes at 3: cuts metrics and evaluation of step 4, redoes 4 and 5, evaluates
      run 4: the run is finished: says so, exits 0
    """
    train, test = make_toy_task(12, 4, seed=3)
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(test, tmp_path / "test.jsonl")
    run_dir = tmp_path / "run"
    argv = [RETOOL, "--run-dir", str(run_dir), "--model", str(tiny_model_path), "--cold-start", "none",
            "--train-file", str(tmp_path / "train.jsonl"), "--eval-file", str(tmp_path / "test.jsonl"),
            "--steps", "5", "--problems-per-step", "2", "--group-size", "2", "--micro-batch-size", "2",
            "--save-every", "3", "--eval-every", "2", "--eval-problems", "2", "--lr", "1e-3",
            "--max-response-tokens", "12", "--eval-max-response-tokens", "12", "--max-model-len", "256",
            "--enforce-eager", "true", "--cpu-kv-cache-gib", str(KV_CACHE_GIB),
            "--sandbox-preload", ""]  # the random model's code imports nothing: a sandbox start without numpy, sympy
    import importlib.util

    tensorboard = importlib.util.find_spec("tensorboard") is not None  # optional: checked when installed
    argv += ["--log", "tensorboard"] if tensorboard else []
    resume = [RETOOL, "--resume", str(run_dir)]

    def run(args, signal_at=None):
        env = dict(os.environ)
        env.pop("RETOOL_TEST_SIGNAL", None)
        if signal_at:
            env["RETOOL_TEST_SIGNAL"] = signal_at
        return preloaded_python.run(args, cwd=REPO, env=env, timeout=900)

    def steps(name):
        return [json.loads(l)["step"] for l in (run_dir / name).read_text().splitlines()]

    def checkpoints():
        return sorted(p.name for p in (run_dir / "checkpoints").iterdir())

    first = run(argv, signal_at="TERM@3")
    assert first.returncode == 128 + 15, first.stderr[-3000:]
    assert f"stopped by SIGTERM after step 2: checkpoint {run_dir / 'checkpoints' / 'step-000002'}" in first.stderr
    assert checkpoints() == ["step-000002"] and steps("metrics.jsonl") == [1, 2] and steps("eval.jsonl") == [0, 2]

    second = run(resume, signal_at="KILL@5")
    assert second.returncode == -9, second.stderr[-3000:]
    assert "resuming" in second.stdout and "from step 2" in second.stdout
    assert checkpoints() == ["step-000002", "step-000003"]
    assert steps("metrics.jsonl") == [1, 2, 3, 4] and steps("eval.jsonl") == [0, 2, 4]  # 4: work the kill lost

    third = run(resume)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "from step 3" in third.stdout
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # no step lost, none counted twice
    expected = [[p["id"] for p in batch_at(train, s, 2, seed=0)] for s in range(5)]
    assert [r["problem_ids"] for r in rows] == expected  # the data position continued
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4, 5]
    evals = [json.loads(l) for l in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["tag"]) for e in evals] == [(0, "before RL"), (2, "step 2"), (4, "step 4"), (5, "after RL")]
    for key in ("reward_mean", "accuracy", "format_rate", "code_ratio", "degenerate_groups", "grad_norm",
                "mismatch_abs", "clip_low_frac", "rollout_s", "sandbox_s", "reward_s", "update_s", "sync_s"):
        assert key in rows[-1]
    # the dry run's assumptions as measured: the process's peak (CPU: its resident memory), the decode rate
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    for row in rows:
        assert 0.1 < row["peak_memory_gb"] < memory_gb
        assert row["generated_tokens"] > 0 and row["generate_s"] > 0 and row["update_s"] > 0
        assert row["decode_tokens_per_s"] == pytest.approx(row["generated_tokens"] / row["generate_s"])
        assert 0.0 <= row["informative_frac"] <= 1.0
    assert (run_dir / "plots.png").stat().st_size > 0
    assert "<html" in (run_dir / "last_step.html").read_text()[:200].lower()
    final = run_dir / "checkpoints" / "step-000005"
    assert (final / "config.json").exists() and (final / "optimizer.pt").exists()
    assert checkpoints() == ["step-000003", "step-000005"]

    if tensorboard:  # the same rows, each step once: the resumes dropped the events of the steps they redid
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        logged = events.Scalars("reward_mean")
        assert [e.step for e in logged] == [1, 2, 3, 4, 5]
        assert [e.value for e in logged] == pytest.approx([r["reward_mean"] for r in rows])  # float32 in the file
        assert [e.step for e in events.Scalars("eval/toy/avg@1")] == [0, 2, 4, 5]

    fourth = run(resume)
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    assert "already finished" in fourth.stdout and "resuming" not in fourth.stdout
    assert steps("metrics.jsonl") == [1, 2, 3, 4, 5]


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["tir", "text"])
def test_evaluate_writes_one_line_per_sample_and_text_mode_never_runs_code(tiny_llm, sandbox, tmp_path, mode):
    from eval import evaluate

    problems = [dict(p, source=s) for p, s in zip(make_toy_task(4, 0, seed=5)[0], ["a", "a", "b", "b"])]
    # Force every response to open and close a code block, so tir mode must run it.
    forced = {"force_turns": (r"```python\nprint\(1\)\n```\n```output",)}
    result = evaluate(tiny_llm, problems, sandbox, k=2, mode=mode, max_response_tokens=24, temperature=1.0,
                      samples_path=tmp_path / "samples.jsonl", rollout_overrides=forced)
    lines = [json.loads(l) for l in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and {l["source"] for l in lines} == {"a", "b"}
    assert set(result["sets"]) == {"a", "b", "all"} and result["sets"]["all"]["samples"] == 8
    calls = [l["tool_calls"] for l in lines]
    assert calls == ([1] * 8 if mode == "tir" else [0] * 8)
    assert result["template"] == {"tir": "torl", "text": "cot"}[mode]  # text mode: no word of a tool


# --------------------------------------------------------------------------- the torl-1.5b preset


def test_torl_preset_is_torl_script(tmp_path, monkeypatch):
    """scripts/torl_1.5b.sh, value by value (docs/05-retool.md has the table)."""
    cfg = make_config("torl-1.5b", {})
    assert cfg.model == "Qwen/Qwen2.5-Math-1.5B" and cfg.template == "torl"
    assert (cfg.problems_per_step, cfg.group_size) == (128, 16)  # data.train_batch_size, rollout.n
    assert cfg.num_minibatches == 1  # ppo_mini_batch_size 1024 prompts: the whole step is one update
    assert (cfg.eps_low, cfg.eps_high) == (0.2, 0.2) and cfg.scale_advantages  # clip_ratio 0.2; GRPO's std
    assert cfg.lr == 1e-6 and cfg.temperature == 1.0 and cfg.exec_error_penalty == 0.0
    assert (cfg.max_prompt_tokens, cfg.max_response_tokens, cfg.tool_budget) == (390, 3072, 1)
    assert cfg.max_model_len == 400 + 3072
    assert (cfg.eval_every, cfg.save_every) == (4, 20)  # trainer.test_freq, trainer.save_freq
    assert (cfg.eval_k, cfg.eval_temperature, cfg.eval_problems) == (1, 0.0, 0)  # greedy, all problems
    assert cfg.train_file.endswith("torl_data/train.parquet") and cfg.gradient_checkpointing
    assert cfg.scorer == "torl" and cfg.cold_start == "none" and cfg.sandbox_timeout == 10  # ToRL's scorer, base, run_timeout
    import prepare_data

    monkeypatch.setattr(prepare_data, "hub_unreachable", lambda: None)  # as on a machine that reaches the hub
    data = tmp_path / "problems.jsonl"
    write_jsonl(make_toy_task(128, 0)[0], data)  # a step's problems
    check_config(dataclass_replace(cfg, train_file=str(data), eval_file=str(data)))


def dataclass_replace(cfg, **change):
    import dataclasses

    return dataclasses.replace(cfg, **change)


def test_torl_update_is_one_on_policy_step_where_the_clip_never_fires(tiny_model_path):
    """The preset's update through chapter 06's grpo_step: one optimizer step, ratio exactly 1, nothing clipped."""
    import torch

    from grpo import GRPOConfig, group_advantages, grpo_step, load_policy, make_optimizer
    from rollout import Trajectory

    cfg = make_config("torl-1.5b", {})
    grpo_cfg = GRPOConfig(lr=cfg.lr, eps_low=cfg.eps_low, eps_high=cfg.eps_high, aggregation=cfg.aggregation,
                          num_minibatches=cfg.num_minibatches, micro_batch_size=2, temperature=cfg.temperature)
    model = load_policy(tiny_model_path, device="cpu")
    g = torch.Generator().manual_seed(0)
    rewards = [1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0]
    advantages, _ = group_advantages(rewards, 4, scale=cfg.scale_advantages)
    assert advantages[:4] == pytest.approx([1.5, -0.5, -0.5, -0.5])  # std of [1, -1, -1, -1] is 1
    trajectories = []
    for i, a in enumerate(advantages):
        n = 5 + i
        trajectories.append(Trajectory(
            problem_id=str(i // 4), group_index=i % 4, reference="1", prompt_ids=[1, 2, 3],
            token_ids=torch.randint(5, 100, (n,), generator=g).tolist(), logprobs=[-1.0] * n,
            loss_mask=[1] * n, text="", advantage=a))
    before = [p.detach().clone() for p in model.parameters()]
    metrics = grpo_step(model, make_optimizer(model, grpo_cfg), trajectories, grpo_cfg)
    assert metrics["optimizer_steps"] == 1.0
    assert metrics["ratio_max"] == 1.0 and metrics["clip_low_frac"] == 0.0 and metrics["clip_high_frac"] == 0.0
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_gpu_preset_is_refused_up_front_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as e:
        retool.main(["--preset", "torl-1.5b"])
    message = str(e.value)
    assert "needs a CUDA GPU" in message and "cpu-demo" in message and "\n" not in message


def test_long_training_prompts_are_dropped_at_load_with_a_count(tiny_model_path, tmp_path, capsys):
    """ToRL's parquet schema in, prompts over max_prompt_tokens out, and the count said."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from transformers import AutoTokenizer

    from rollout import render_prompt

    questions = [f"What is {i} + {i}?" for i in range(5)] + ["Add these numbers: " + " + ".join(["7"] * 300)]
    rows = [{"data_source": "toy", "ability": "math",
             "prompt": [{"role": "system", "content": "Please reason step by step."}, {"role": "user", "content": q}],
             "reward_model": {"ground_truth": str(i), "style": "rule"}} for i, q in enumerate(questions)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    cfg = Config(train_file=str(tmp_path / "train.parquet"), max_prompt_tokens=64, problems_per_step=4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    lengths = [len(tokenizer.encode(render_prompt(q, "torl"), add_special_tokens=False)) for q in questions]
    assert max(lengths[:5]) <= 64 < lengths[5]
    train_rows, _ = problems_and_policy.load_data(dataclass_replace(cfg, eval_file=cfg.train_file))
    kept = problems_and_policy.drop_long_prompts(train_rows, str(tiny_model_path), cfg)
    assert [p["question"] for p in kept] == questions[:5]
    assert "kept 5 of 6 problems; dropped 1 whose prompt is over 64 tokens" in capsys.readouterr().out


# --------------------------------------------------------------------------- resume and stop


def test_resuming_a_finished_run_says_so_and_exits_cleanly(tmp_path, capsys):
    import dataclasses

    import torch

    from test_run_folders import SAFETENSORS

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-000003").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-000003" / "state.json").write_text('{"step": 3}')
    (run_dir / "checkpoints" / "step-000003" / "model.safetensors").write_bytes(SAFETENSORS)  # whole, if small
    for name in ("optimizer.pt", "rng.pt"):
        torch.save({}, run_dir / "checkpoints" / "step-000003" / name)
    config = {**dataclasses.asdict(Config()), "steps": 3, "sandbox_preload": ""}  # a sandbox start of 0.2 s
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "eval.jsonl").write_text(json.dumps({"step": 3, "tag": "after RL", "sets": {}}) + "\n")
    assert retool.main(["--resume", str(run_dir)]) == run_dir
    assert "already finished: 3 of 3 steps done and evaluated" in capsys.readouterr().out


def test_metrics_and_eval_lines_after_the_checkpoint_are_cut(tmp_path):
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 2, 4, 6)))
        checkpoints.truncate_jsonl(path, 4)
        assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [0, 2, 4]
    assert not list(tmp_path.glob(".*tmp*"))


def test_random_state_is_restored_after_the_engine_reseeds_it(tmp_path, monkeypatch):
    """vLLM seeds the global generators when its engine starts; the checkpoint's state must win."""
    import torch

    import rollout

    random.seed(123)
    torch.manual_seed(123)
    torch.save(checkpoints.capture_rng(), tmp_path / "rng.pt")
    expected = (random.random(), torch.rand(1).item())

    def engine_that_reseeds(*args, **kwargs):  # what vLLM's worker does at start
        random.seed(0)
        torch.manual_seed(0)
        return object()

    monkeypatch.setattr(rollout, "make_llm", engine_that_reseeds)
    retool.start_sampler(Config(), "model", {"path": str(tmp_path), "step": 1})
    assert (random.random(), torch.rand(1).item()) == expected


def test_checkpoint_files_reach_the_disk_before_the_folder_is_renamed(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    import torch

    from grpo import GRPOConfig, load_policy, make_optimizer

    model = load_policy(tiny_model_path, device="cpu")
    optimizer = make_optimizer(model, GRPOConfig())
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = checkpoints.save_checkpoint(tmp_path, 7, model, optimizer, tiny_tokenizer, keep=2)
    rename = events.index(("rename", str(tmp_path / "checkpoints" / ".step-000007.tmp")))
    synced = {Path(path).name for kind, path in events[:rename] if kind == "fsync"}
    files = {p.name for p in final.iterdir()}
    assert {"optimizer.pt", "rng.pt", "state.json", "config.json"} <= files
    assert files <= synced  # every file of the checkpoint, before the rename
    assert ("fsync", str(tmp_path / "checkpoints")) in events[rename:]  # and the rename itself

    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("map_location")) or real_load(*a, **k))
    checkpoints.load_optimizer({"path": str(final)}, make_optimizer(model, GRPOConfig()))
    assert loads == ["cpu"]  # onto the CPU first, never straight to the device it was saved from


def test_a_model_too_short_for_max_model_len_is_one_line_naming_both_numbers(tiny_model_path):
    with pytest.raises(SystemExit) as e:
        check_config(Config(model=str(tiny_model_path), cold_start="none", max_model_len=8192))
    assert "max_model_len 8192 is above the position limit" in str(e.value) and "4096 tokens" in str(e.value)
    assert "\n" not in str(e.value)
    import eval as evaluation

    with pytest.raises(SystemExit) as e:
        evaluation.main(["--model", str(tiny_model_path), "--max-model-len", "8192", "--data", "toy.jsonl"])
    assert "--max-model-len 8192 is above the position limit" in str(e.value) and "4096" in str(e.value)


# --------------------------------------------------------------------------- evaluation protocol


def test_greedy_is_the_default_and_several_greedy_samples_are_refused():
    import eval as evaluation

    args = evaluation.parse_args(["--model", "m"])
    assert (args.k, args.temperature, args.data, args.template) == (1, 0.0, ["aime24", "aime25", "math500"], None)
    with pytest.raises(SystemExit, match="identical samples"):
        evaluation.main(["--model", "org/model", "--k", "4"])
    with pytest.raises(ValueError, match="identical samples"):
        evaluation.evaluate(None, [], None, k=4)


def test_text_mode_prompt_never_mentions_a_tool():
    from eval import DEFAULT_TEMPLATE
    from rollout import TEMPLATES, render_prompt

    text = render_prompt("What is 2 + 2?", DEFAULT_TEMPLATE["text"])
    assert "Please reason step by step, and put your final answer within \\boxed{}." in text
    assert "program" not in text.lower() and "code" not in text.lower() and "python" not in text.lower()
    tool = render_prompt("What is 2 + 2?", DEFAULT_TEMPLATE["tir"])
    assert tool.replace("integrate natural language reasoning with programs to solve the problem above",
                        "reason step by step") == text  # the same frame: only the instruction differs
    assert "Please reason step by step" in TEMPLATES["qwen-chat-cot"]


def test_summary_puts_the_papers_numbers_beside_the_measured_ones():
    s = {"problems": 30, "avg@1": 0.2}
    table = paper_table({"mode": "tir", "k": 1, "temperature": 0.0, "sets": {"aime24": s, "toy": s, "math500": s}})
    assert "| aime24 | 30 | 20.0 | 26.7 | 43.3 | yes |" in table
    assert "| math500 | 30 | 20.0 | 77.8 | 82.2 | no: the paper used all 500 problems |" in table  # e.g. ToRL's 134 rows
    assert "toy" not in table and "not ToRL's protocol" not in table
    sampled = paper_table({"mode": "tir", "k": 4, "temperature": 1.0, "sets": {"aime25": {"problems": 30, "avg@4": 0.5}}})
    assert "| aime25 | 30 | 50.0 | 26.7 | 30.0 | yes |" in sampled and "not ToRL's protocol" in sampled
    assert paper_table({"mode": "tir", "k": 1, "temperature": 0.0, "sets": {"toy": s}}) == ""


# --------------------------------------------------------------------------- logs


def test_unknown_logger_is_a_one_line_error():
    with pytest.raises(SystemExit, match="log 'mlflow' is not one of tensorboard, wandb"):
        check_config(Config(log="tensorboard,mlflow"))


@pytest.mark.parametrize("name,module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_a_missing_logger_package_says_how_to_install_it_before_anything_loads(name, module, tmp_path, monkeypatch):
    from trackers import open_trackers

    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit) as e:
        check_config(Config(log=name))  # at start, before the model and the engine
    assert f"--log {name} needs the {name} package" in str(e.value) and "pip install" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:
        open_trackers(name, tmp_path, {})
    assert f"--log {name} needs the {name} package" in str(e.value)


ROW = {"step": 3, "reward_mean": 0.25, "accuracy": 0.5, "problem_ids": ["a"], "mismatch_abs": float("nan")}
EVAL_ROW = {"step": 3, "tag": "step 3", "mode": "tir", "k": 1, "sets": {"toy": {"problems": 4, "avg@1": 0.75}}}


def test_tensorboard_gets_the_metrics_under_the_same_keys(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trackers import open_trackers

    trackers = open_trackers("tensorboard", tmp_path, {})
    trackers.log(ROW)
    trackers.log_eval(EVAL_ROW)
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward_mean", "accuracy", "eval/toy/problems", "eval/toy/avg@1"}
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(3, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/toy/avg@1")] == [(3, 0.75)]


def test_wandb_writes_an_offline_run_without_a_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from trackers import open_trackers

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr("trackers._wandb_reachable", lambda wandb: False)
    trackers = open_trackers("wandb", tmp_path, {"lr": 1e-6})
    trackers.log(ROW)
    trackers.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_make_refuses_a_gpu_preset_before_installing_anything():
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    done = subprocess.run(["make", "--no-print-directory", "-n", "run-05", "PRESET=torl-1.5b", "DEVICE=cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and done.stdout == ""  # -n: nothing would have run, not even the install
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0] and "make run-05" in lines[0]


def test_a_stop_during_the_update_waits_for_the_step_to_be_recorded():
    import signal

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stopper = stopping.Stopper()
    stopper.install()
    try:
        with pytest.raises(stopping.StopRequested) as e:  # during the rollout: at once
            os.kill(os.getpid(), signal.SIGINT)
        assert e.value.signum == signal.SIGINT
        stopper.hold()  # the update began
        os.kill(os.getpid(), signal.SIGTERM)  # waits
        assert stopper.pending == signal.SIGTERM
        with pytest.raises(stopping.StopRequested) as e:
            stopper.release()  # the step is recorded: now
        assert e.value.signum == signal.SIGTERM
        stopper.hold()
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C gives up on the step
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stopper.uninstall()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.vllm
def test_greedy_evaluation_is_the_default_and_repeats_itself(tiny_llm, sandbox, tmp_path):
    from eval import evaluate

    problems = make_toy_task(3, 0, seed=6)[0]
    first = evaluate(tiny_llm, problems, sandbox, max_response_tokens=16, samples_path=tmp_path / "a.jsonl")
    again = evaluate(tiny_llm, problems, sandbox, max_response_tokens=16, samples_path=tmp_path / "b.jsonl", seed=7)
    assert first["temperature"] == 0 and first["k"] == 1 and first["sets"]["toy"]["samples"] == 3
    texts = [[json.loads(l)["text"] for l in (tmp_path / f).read_text().splitlines()] for f in ("a.jsonl", "b.jsonl")]
    assert texts[0] == texts[1]  # greedy: the seed changes nothing


@pytest.mark.vllm
def test_a_share_of_the_problems_samples_what_the_whole_evaluation_samples_for_them(tiny_llm, sandbox):
    """A rank's share (every other problem) is seeded by each problem's index in the whole set, not its place in the share."""
    from eval import sample_scored

    problems = make_toy_task(3, 0, seed=8)[0]
    settings = dict(k=2, max_response_tokens=12, temperature=1.0, seed=3)
    _, whole = sample_scored(tiny_llm, problems, sandbox, **settings)
    _, share = sample_scored(tiny_llm, problems[1:], sandbox, indices=[1, 2], **settings)
    _, by_place = sample_scored(tiny_llm, problems[1:], sandbox, **settings)
    assert [s["text"] for s in share] == [s["text"] for s in whole[2:]]
    assert [s["text"] for s in by_place] != [s["text"] for s in whole[2:]]  # seeded by place: other samples


# --------------------------------------------------------------------------- run folders: nothing lost


def folder_snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_new_run_into_a_used_folder_is_refused_and_leaves_it_unchanged(tmp_path, capsys):
    import dataclasses

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(Config())))
    before = folder_snapshot(run_dir)
    with pytest.raises(SystemExit) as e:
        retool.main(["--run-dir", str(run_dir), "--steps", "1"])
    message = str(e.value)
    assert f"--resume {run_dir}" in message and "--run-dir" in message and "--overwrite" in message
    assert "\n" not in message and folder_snapshot(run_dir) == before


def test_overwrite_replaces_a_used_folder_unless_a_live_run_holds_it(tmp_path):
    import dataclasses

    from run_folders import check_new_run_dir
    from run_folders import hold_lock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(Config())))
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    lock = hold_lock(run_dir)  # a live run
    with pytest.raises(SystemExit, match=f"run folder {run_dir} is in use by another run \\(pid {os.getpid()}\\)"):
        check_new_run_dir(run_dir, overwrite=True)
    assert (run_dir / "metrics.jsonl").exists()
    lock.close()  # the run ended
    check_new_run_dir(run_dir, overwrite=True)
    assert not run_dir.exists()
    check_new_run_dir(tmp_path / "fresh", overwrite=False)  # a new or empty folder needs nothing


def test_a_second_run_into_a_folder_in_use_is_refused_in_one_line(tmp_path):
    """The lock is the kernel's (flock): a second holder is refused even in another process."""
    from run_folders import hold_lock

    lock = hold_lock(tmp_path)
    other = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from run_folders import hold_lock; "
                            f"hold_lock(Path({str(tmp_path)!r}))"], capture_output=True, text=True, timeout=60)
    assert other.returncode == 1 and other.stderr.strip().startswith("error: run folder")
    assert "in use by another run" in other.stderr and len(other.stderr.strip().splitlines()) == 1
    lock.close()


def test_a_file_system_without_flock_warns_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """Lustre without its flock option answers ENOLCK: the guard is lost, the start is not."""
    import errno

    import run_folders

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_folders.fcntl, "flock", no_flock)
    lock = run_folders.hold_lock(tmp_path)
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"warning: {tmp_path} is on a file system without flock (No locks available)")
    assert (tmp_path / ".lock").read_text() == str(os.getpid())
    lock.close()

    def broken(fd, operation):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(run_folders.fcntl, "flock", broken)
    with pytest.raises(OSError, match="Input/output error"):  # any other failure is not a missing flock
        run_folders.hold_lock(tmp_path)


def test_resuming_a_folder_that_is_not_a_run_says_so(tmp_path):
    with pytest.raises(SystemExit, match="not a run folder") as e:
        retool.main(["--resume", str(tmp_path)])
    assert "\n" not in str(e.value)


def test_a_failed_start_removes_its_folder_but_keeps_work(tmp_path):
    import os

    from run_record import failure_line
    from test_run_folders import SAFETENSORS

    base = {"base/cold_start.json": "{}", "base/model.safetensors": SAFETENSORS}
    for kept, files in [(False, {"config.json": "{}"}), (True, {"metrics.jsonl": '{"step": 1}\n'}), (True, base),
                        (False, {"base/cold_start.json": "{}"}), (True, {"base/partial.pt": ""})]:
        run_dir = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
        for name, content in {".lock": str(os.getpid()), **files}.items():  # the folder this process made
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        failure_line(SystemExit("error: a refusal"), run_dir, new=True)
        assert run_dir.exists() == kept


def test_help_gives_each_field_its_meaning_and_the_chosen_presets_value():
    import dataclasses

    from configuration import field_comments

    meaning = field_comments(Config)
    assert set(meaning) == {f.name for f in dataclasses.fields(Config)} and all(meaning.values())
    assert meaning["group_size"] == "samples per problem: GRPO's group"
    text = subprocess.run([sys.executable, str(RETOOL), "--preset", "torl-1.5b", "--help"], capture_output=True,
                          text=True, timeout=60).stdout
    flat = " ".join(text.split())
    assert "--lr LR " + meaning["lr"] in flat and "[default: 1e-06]" in flat and "[default: 128]" in flat
    assert "(default: None)" not in flat


@pytest.mark.parametrize("argv, says", [
    (["--model", "/nonexistent", "--cold-start", "none"], "model '/nonexistent' is not a folder here"),
    (["--model", "05-retool/typo", "--cold-start", "none"], "model '05-retool/typo' is not a folder here"),
    (["--model", "05-retool", "--cold-start", "none"], "model '05-retool' is a folder without config.json"),
    (["--model", "a/b/c", "--cold-start", "none"], "neither a folder nor a hub id"),
    (["--model", "01-data/../docs", "--cold-start", "none"], "a folder without config.json"),
    (["--model", "05-retool"], "cold_start 'released' starts from the lab's tiny model, yet model"),
    (["--model", "05-retool", "--cold-start", "scratch"], "cold_start 'scratch' starts from the lab's tiny model, yet model"),
    (["--cold-start", "released", "--train-file", "data/word_train.jsonl"],
     "cold_start 'released' has no released base for data/word_train.jsonl"),
    (["--cold-start", "finetune"], "cold_start 'finetune' needs a model"),
    (["--cold-start", "maybe"], "cold_start must be released, scratch, finetune or none"),
    (["--template", "nope"], "template 'nope' is not one of torl"),
    (["--temperature", "-1"], "temperature -1.0: training samples must be drawn"),
    (["--eval-temperature", "-1"], "eval_temperature must be 0 (greedy) or more"),
    (["--max-response-tokens", "0"], "max_response_tokens must be at least 1"),
    (["--sandbox-timeout", "0"], "sandbox_timeout must be positive"),
    (["--sandbox-concurrency", "-1"], "sandbox_concurrency must be 0 (a rank's share of the cores) or more, got -1"),
    (["--sandbox-backend", "nope"], "sandbox_backend must be 'local' or 'docker'"),
    (["--sandbox-preload", "numpy sympy"], "sandbox_preload must be a tuple of module names"),
    (["--dtype", "float8"], "dtype must be float32, bfloat16, float16 or auto"),
    (["--scorer", "exact"], "scorer must be lab or torl, got 'exact'"),
    (["--observation-style", "json"], "observation_style must be torl, short or full"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization is a share of the device"),
    (["--eps-low", "1.5"], "the clip band needs 0 < eps_low < 1"),
    (["--trainer-threads", "-2"], "trainer_threads must be -1"),
    (["--group-size", "0"], "a group of one"),
    (["--lr", "-1"], "is not a learning rate"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--preset", "gpt-5"], "unknown preset 'gpt-5'"),
])
def test_retool_refuses_each_mistake_in_one_line_before_loading_anything(argv, says, tmp_path):
    with pytest.raises(SystemExit) as e:
        retool.main(argv + ["--run-dir", str(tmp_path / "run")])
    assert says in str(e.value) and str(e.value).startswith("error: ") and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rows, says", [("", "no rows"), ('{"problem": "2+2?"}\n', "no answer column")])
def test_a_data_file_without_rows_or_fields_is_refused_at_start(rows, says, tmp_path):
    (tmp_path / "train.jsonl").write_text(rows)
    with pytest.raises(SystemExit, match=f"train_file: .*{says}"):
        retool.main(["--train-file", str(tmp_path / "train.jsonl"), "--run-dir", str(tmp_path / "run")])


def test_a_refusal_exits_2_with_one_line_and_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, str(RETOOL), "--dtype", "float8", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["error: dtype must be float32, bfloat16, float16 or auto, got 'float8'"]


@pytest.mark.parametrize("argv, says", [
    (["--temperature", "-1"], "argument --temperature: must be at least 0.0, got -1"),
    (["--tool-budget", "-1"], "argument --tool-budget: must be at least 0, got -1"),
    (["--tool-budget", "0"], "argument --tool-budget: 0 in tir mode runs no code; for an evaluation without the tool "
                             "pass --mode text"),
    (["--template", "nope"], "argument --template: invalid choice: 'nope'"),
    (["--limit", "0"], "argument --limit: must be at least 1, got 0"),
    (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    (["--gpu-memory-utilization", "2"], "a share, at most 1, got 2.0"),
])
def test_eval_refuses_each_flag_mistake_in_one_line_with_status_2(argv, says, capsys):
    import eval as evaluation

    with pytest.raises(SystemExit) as e:
        evaluation.main(["--model", "org/model", *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and says in err and "\n" not in err


def test_eval_refuses_a_run_folder_naming_its_latest_checkpoint(tmp_path):
    import eval as evaluation

    run = tmp_path / "run"
    (run / "checkpoints" / "step-000030").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        evaluation.main(["--model", str(run), "--out", str(tmp_path / "out")])
    assert f"--model {run} is a run folder, not a model: use one of its checkpoints, e.g. {run}/checkpoints/step-000030" \
        in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_eval_limit_is_per_data_set_and_takes_the_context_from_the_model(tiny_model_path, tmp_path, monkeypatch):
    """A file of two sets, --limit 2: two of each; no --max-model-len: the model's own (4096 positions)."""
    import eval as evaluation
    import rollout

    rows = [dict(p, source=s) for p, s in zip(make_toy_task(6, 0, seed=2)[0], "aaabbb")]
    write_jsonl(rows, tmp_path / "two_sets.jsonl")
    seen = {}

    def no_engine(model, max_model_len, **kwargs):  # stop where the engine would start
        seen["max_model_len"] = max_model_len
        raise RuntimeError("no engine in this test")

    monkeypatch.setattr(rollout, "make_llm", no_engine)
    problems = evaluation.load_sets([str(tmp_path / "two_sets.jsonl")], limit=2)
    assert [p["source"] for p in problems] == ["a", "a", "b", "b"]
    with pytest.raises(RuntimeError, match="no engine"):
        evaluation.main(["--model", str(tiny_model_path), "--data", str(tmp_path / "two_sets.jsonl"),
                         "--max-response-tokens", "16", "--out", str(tmp_path / "out")])
    assert seen["max_model_len"] == 4096
    assert not (tmp_path / "out").exists()  # a failed evaluation leaves no folder behind


def test_json_the_lab_writes_has_no_nan():
    from checkpoints import json_safe

    row = {"code_pass_ratio": float("nan"), "sets": {"a": [1.0, float("inf")]}, "n": 3}
    assert json.dumps(json_safe(row), allow_nan=False) == '{"code_pass_ratio": null, "sets": {"a": [1.0, null]}, "n": 3}'


def test_a_sandbox_that_cannot_contain_code_stops_the_run_before_any_model(tmp_path, preloaded_python):
    """As root, plain isolation cannot read the venv's interpreter files: refused at start, no folder made."""
    if os.geteuid() != 0:
        pytest.skip("the refusal shown here is root's")
    done = preloaded_python.run([RETOOL, "--sandbox-isolation", "plain", "--run-dir", tmp_path / "run"], cwd=tmp_path,
                                timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: the sandbox cannot start:")
    assert not (tmp_path / "run").exists() and "cold start" not in done.stdout


# --------------------------------------------------------------------------- the dry run and its memory plan


def shape_of(name):
    from dry_run import model_shape

    return model_shape(name)


def test_the_memory_plan_refuses_torl_7b_on_one_gpu_and_fits_both_presets_on_eight():
    from dry_run import memory_plan

    for preset in ("torl-1.5b", "torl-7b"):
        cfg = make_config(preset, {})
        plan = memory_plan(cfg, shape_of(cfg.model), gpus=8, gpu_gb=80)
        assert plan.problems == [], plan.problems
        assert sum(plan.rollout.values()) <= 80 and sum(plan.update.values()) <= 80
        assert plan.kv_tokens >= plan.group_tokens
    seven_b = make_config("torl-7b", {}), shape_of("Qwen/Qwen2.5-Math-7B")
    one = memory_plan(*seven_b, gpus=1, gpu_gb=80)
    assert one.problems[0].startswith("the trainer state (121.8 GB a GPU") and one.problems[0].endswith("at least 4 GPUs")
    assert memory_plan(*seven_b, gpus=3, gpu_gb=80).problems and not memory_plan(*seven_b, gpus=4, gpu_gb=80).problems
    plan = memory_plan(make_config("torl-1.5b", {}), shape_of("Qwen/Qwen2.5-Math-1.5B"), gpus=8, gpu_gb=80)
    assert plan.parameters == 1_543_714_304 and round(plan.update["gradients, float32"], 1) == 6.2


def test_a_kv_cache_that_cannot_hold_one_group_is_refused():
    from dry_run import memory_plan

    cfg = make_config("torl-1.5b", {"gpu_memory_utilization": 0.06})
    plan = memory_plan(cfg, shape_of(cfg.model), gpus=8, gpu_gb=80)
    assert any("cannot hold one group (16 x 3472 tokens)" in p for p in plan.problems)


def test_the_dry_run_prints_the_plan_and_names_the_missing_data_in_seconds(tmp_path, preloaded_python):
    done = preloaded_python.run([RETOOL, "--preset", "torl-7b", "--dry-run", "--plan-gpus", "1"], cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    out = done.stdout
    assert "train_file 'data/torl_data/train.parquet' does not exist" in out and "sandbox: ok" in out
    assert "memory per GPU" in out and "refused: the trainer state (121.8 GB a GPU" in out
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()  # a dry run writes nothing


def test_the_sandbox_has_the_packages_math_code_imports(sandbox):
    """numpy, sympy, mpmath and scipy: what docs/05-torl.md promises beside SandboxFusion's image (a run's sandbox)."""
    result = sandbox.run("import numpy, sympy, mpmath, scipy.special; print(scipy.special.comb(5, 2, exact=True))")
    assert result.ok and result.stdout == "10\n", result


def test_each_rank_seeds_its_engine_and_numpy_on_its_own_and_a_resume_restores_numpy(tmp_path, monkeypatch):
    """Engines given one seed draw the same noise (vLLM's V2 runner seeds unseeded requests from numpy)."""
    import numpy as np
    import torch

    import rollout
    from distributed import DataParallel

    seeds = {}

    def engine(model, seed, **kwargs):
        seeds[len(seeds)] = seed
        np.random.seed(seed)  # what vLLM's engine does to the global generators at start
        return object()

    monkeypatch.setattr(rollout, "make_llm", engine)
    draws = []
    for rank in (0, 1):
        retool.start_sampler(Config(), "model", None, DataParallel(rank=rank, world_size=2))
        draws.append(np.random.random())
    assert seeds[0] == 0 and seeds[1] != seeds[0] and draws[0] != draws[1]

    np.random.seed(7)
    torch.save(checkpoints.capture_rng(), tmp_path / "rng.pt")
    expected = np.random.random()
    retool.start_sampler(Config(), "model", {"path": str(tmp_path), "step": 3})
    assert np.random.random() == expected  # numpy's stream goes on where the checkpoint left it


def test_plot_redraws_says_where_and_refuses_the_flags_it_would_ignore(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5, "code_pass_ratio": None}) + "\n")
    assert retool.main(["--plot", str(tmp_path)]) == tmp_path
    assert f"plots: {tmp_path / 'plots.png'}" in capsys.readouterr().out and (tmp_path / "plots.png").exists()
    with pytest.raises(SystemExit, match="takes no other flag"):
        retool.main(["--plot", str(tmp_path), "--steps", "3"])


def test_every_script_answers_help_with_help(tmp_path, preloaded_python):
    scripts = ["results.py", "01-data/prepare_data.py", "01-data/word_problems.py", "02-sandbox/sandbox.py", "02-sandbox/bench_sandbox.py",
               "03-rollout/rollout.py", "03-rollout/bench_rollout.py", "04-reward/reward.py", "04-reward/bench_reward.py",
               "05-retool/retool.py", "05-retool/eval.py", "05-retool/cold_start.py", "05-retool/run_figures.py", "06-train/grpo.py", "06-train/show_metrics.py",
               "06-train/ablation.py", "06-train/bench_train.py"]
    # One interpreter runs each script as __main__ with --help, as a shell would (a process each costs 14 starts).
    check = tmp_path / "help_of_each.py"
    check.write_text("import contextlib, io, runpy, sys\n"
                     "for script in sys.argv[1:]:\n"
                     "    sys.argv, out = [script, '--help'], io.StringIO()\n"
                     "    try:\n"
                     "        with contextlib.redirect_stdout(out):\n"
                     "            runpy.run_path(script, run_name='__main__')\n"
                     "        code = 'no exit'\n"
                     "    except SystemExit as e:\n"
                     "        code = e.code\n"
                     "    print(script, code, 'usage:' in out.getvalue())\n")
    done = preloaded_python.run([check, *(REPO / script for script in scripts)], cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [f"{REPO / script} 0 True" for script in scripts], done.stdout + done.stderr[-2000:]


def test_a_killed_runs_temporary_files_are_removed_at_the_next_start(tmp_path, monkeypatch):
    import tempfile

    import getpass

    from lab_cli import private_tmp

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    stale = tmp_path / f"tool-rl-lab-{int(dead)}"
    (stale / "sandbox-server-x").mkdir(parents=True)
    (stale / "vllm_dist_0").write_text("left by a killed run")
    alive = tmp_path / f"tool-rl-lab-{os.getppid()}"  # a live process's: kept
    alive.mkdir()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    own = private_tmp()
    assert not stale.exists() and alive.exists() and tempfile.gettempdir() == own == os.environ["TMPDIR"]
    # torch.compile's cache is shared by every run, where torch keeps it by default: not in this process's folder
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / f"torchinductor_{getpass.getuser()}")


def test_a_stop_before_the_first_step_is_one_line_and_leaves_the_folder_to_resume(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the cold start (here: as it begins) ends in one line, exit 130, the folder kept for --resume."""
    import signal

    import problems_and_policy

    def cold_start_interrupted(cfg, run_dir, dp):
        raise stopping.StopRequested(signal.SIGINT)

    monkeypatch.setattr(retool, "first_policy", cold_start_interrupted)
    monkeypatch.setattr(problems_and_policy, "first_policy", cold_start_interrupted)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        retool.main(["--run-dir", str(tmp_path / "run"), "--sandbox-preload", ""])  # a sandbox start of 0.2 s
    assert e.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"stopped by SIGINT before training began; go on with --resume {tmp_path / 'run'}"]
    assert (tmp_path / "run" / "config.json").exists()


def test_running_from_inside_a_chapter_folder_is_refused_before_it_writes(monkeypatch):
    monkeypatch.chdir(REPO / "05-retool")
    with pytest.raises(SystemExit, match="run from the lab's root folder .*not from 05-retool/"):
        retool.main([])
    assert not (REPO / "05-retool" / "data").exists() and not (REPO / "05-retool" / "runs").exists()


def test_a_run_folder_or_a_folder_without_a_model_type_is_no_model(tmp_path):
    from configuration import model_problem

    (tmp_path / "run" / "checkpoints" / "step-000002").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text("{}")
    assert model_problem(str(tmp_path / "run")).endswith(f"use one of its checkpoints, e.g. {tmp_path}/run/checkpoints/step-000002")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"steps": 3}')
    assert "names no model_type" in model_problem(str(tmp_path / "other"))


def test_the_console_names_the_settings_file_and_only_the_fields_a_run_changed():
    from configuration import settings_changed

    assert settings_changed(Config()) == "; every field at its default"
    assert settings_changed(make_config("cpu-demo", {"seed": 1, "enforce_eager": False, "log": "wandb"})) == (
        "; changed from the defaults: --seed 1 --enforce-eager false --log wandb")


@pytest.mark.parametrize("ending, status", [("return", 0), ("raise SystemExit(143)", 143), ("raise SystemExit(1)", 1)])
def test_a_script_that_ended_runs_its_exit_handlers_and_skips_the_interpreters_teardown(tmp_path, ending, status):
    """A run's end (done, or a stop's 128 + signal) exits once its threads and exit handlers are done, without
    the teardown that frees every object; other exits go the usual way."""
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, pathlib, sys, threading, time\n"
        f"folder = pathlib.Path({str(tmp_path)!r})\n"
        "atexit.register(lambda: (folder / 'atexit').write_text('ran'))\n"
        "threading.Thread(target=lambda: time.sleep(0.2) or (folder / 'thread').write_text('ran')).start()\n"
        "class Teardown:\n"
        "    def __del__(self):\n"
        "        (folder / 'teardown').write_text('ran')\n"
        "kept = Teardown()  # freed by the interpreter's teardown, if it runs\n"
        "from lab_cli import run_script\n"
        "def main():\n"
        f"    {ending}\n"
        "run_script(main)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == status and (tmp_path / "atexit").exists() and (tmp_path / "thread").exists()
    assert (tmp_path / "teardown").exists() == (status == 1)
