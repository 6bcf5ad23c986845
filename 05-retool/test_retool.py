"""05-retool: the loop runs for real, survives a kill, and refuses bad configuration in one line."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval import markdown_table, pass_at_k, summarise
from prepare_data import make_toy_task, write_jsonl
from retool import Config, batch_at, check_config, make_config, parse_args, rollout_config

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
        (dict(model="no/such/folder"), "is neither a folder nor a hub id"),
        (dict(group_size=1), "a group of one"),
        (dict(train_file="data/nope.jsonl"), "does not exist"),
        (dict(steps=0), "steps must be at least 1"),
    ],
)
def test_bad_configuration_fails_at_start_with_one_line(change, message):
    with pytest.raises(SystemExit) as e:
        check_config(Config(**change), resuming=False)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_preset_and_unknown_field_are_one_line_errors():
    with pytest.raises(SystemExit, match="unknown preset 'gpt-5'"):
        make_config("gpt-5", {})
    with pytest.raises(SystemExit, match="unrecognized arguments: --learning-rate"):
        parse_args(["--learning-rate", "1"])


def test_every_field_is_overridable_from_the_command_line():
    args, overrides = parse_args(["--lr", "0.5", "--group-size", "4", "--scale-advantages", "true"])
    cfg = make_config(args.preset, overrides)
    assert (cfg.lr, cfg.group_size, cfg.scale_advantages) == (0.5, 4, True)
    assert make_config("torl-1.5b", {}).model == "Qwen/Qwen2.5-Math-1.5B"


@pytest.mark.vllm
def test_loop_runs_is_killed_and_resumes_where_it_stopped(tiny_model_path, tmp_path):
    """A real run (vLLM, sandbox, reward, GRPO, sync) killed after step 2, then resumed to step 4."""
    train, test = make_toy_task(12, 4, seed=3)
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(test, tmp_path / "test.jsonl")
    run_dir = tmp_path / "run"
    common = ["--max-response-tokens", "12", "--eval-max-response-tokens", "12", "--max-model-len", "256"]
    argv = [sys.executable, str(RETOOL), "--run-dir", str(run_dir), "--model", str(tiny_model_path),
            "--train-file", str(tmp_path / "train.jsonl"), "--eval-file", str(tmp_path / "test.jsonl"),
            "--steps", "4", "--problems-per-step", "2", "--group-size", "2", "--micro-batch-size", "2",
            "--eval-every", "0", "--eval-problems", "2", "--lr", "1e-3", *common]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600
        while not (run_dir / "checkpoints" / "step-000002").exists():
            assert proc.poll() is None, f"the run ended early: {proc.stderr.read()[-2000:]}"
            assert time.time() < deadline, "no checkpoint of step 2 within 10 minutes"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)  # no chance to clean up: as a crash or a pulled plug
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    steps_before = [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps_before[:2] == [1, 2]

    done = subprocess.run([sys.executable, str(RETOOL), "--resume", str(run_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming" in done.stdout and "from step" in done.stdout
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # no step lost, none counted twice
    expected = [[p["id"] for p in batch_at(train, s, 2, seed=0)] for s in range(4)]
    assert [r["problem_ids"] for r in rows] == expected  # the data position continued
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4]
    for key in ("reward_mean", "accuracy", "format_rate", "code_ratio", "degenerate_groups", "grad_norm",
                "mismatch_abs", "clip_low_frac", "rollout_s", "sandbox_s", "reward_s", "update_s", "sync_s"):
        assert key in rows[-1]
    assert (run_dir / "plots.png").stat().st_size > 0
    assert "<html" in (run_dir / "last_step.html").read_text()[:200].lower()
    final = run_dir / "checkpoints" / "step-000004"
    assert (final / "config.json").exists() and (final / "optimizer.pt").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000003", "step-000004"]
    evals = [json.loads(l) for l in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["tag"] == "before RL" and evals[-1]["tag"] == "after RL"


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["tir", "text"])
def test_evaluate_writes_one_line_per_sample_and_text_mode_never_runs_code(tiny_llm, tmp_path, mode):
    from eval import evaluate
    from sandbox import Sandbox

    problems = [dict(p, source=s) for p, s in zip(make_toy_task(4, 0, seed=5)[0], ["a", "a", "b", "b"])]
    # Force every response to open and close a code block, so tir mode must run it.
    forced = {"force_turns": (r"```python\nprint\(1\)\n```\n```output",)}
    with Sandbox() as sandbox:
        result = evaluate(tiny_llm, problems, sandbox, k=2, mode=mode, max_response_tokens=24,
                          samples_path=tmp_path / "samples.jsonl", rollout_overrides=forced)
    lines = [json.loads(l) for l in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and {l["source"] for l in lines} == {"a", "b"}
    assert set(result["sets"]) == {"a", "b", "all"} and result["sets"]["all"]["samples"] == 8
    calls = [l["tool_calls"] for l in lines]
    assert calls == ([1] * 8 if mode == "tir" else [0] * 8)
