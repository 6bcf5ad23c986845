"""A run folder's record becomes the figures the docs quote (run_figures.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import results
from run_figures import figures


def write_run(run_dir, rewards):
    """A record as a run writes it: one metrics row per step, evaluations before RL and after."""
    run_dir.mkdir()
    keys = dict(accuracy=0.5, code_ratio=0.3, code_ratio_correct=1.0, code_ratio_incorrect=0.02, degenerate_groups=1,
                tokens=1430, informative_frac=0.5, grad_norm=0.2, clip_low_frac=0.0, clip_high_frac=0.0, mismatch_abs=0.0, rollout_s=1.6, sandbox_s=0.0,
                reward_s=0.1, update_s=1.7, sync_s=0.04)
    rows = [{"step": i + 1, "reward_mean": r, "ratio_max": 1.0 + i / 100, "entropy": 0.3 - i / 100, **keys,
             "degenerate_groups": int(r > 0.8) + int(r > 0.9)} for i, r in enumerate(rewards)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": s, "tag": "", "mode": "tir", "k": 1, "sets": {"toy": {"avg@1": a, "code_ratio": c}}}
             for s, a, c in ((0, 0.281, 0.26), (len(rewards), 0.94, 0.97))]
    evals.append({"step": 0, "tag": "before RL (text only)", "mode": "text", "k": 1,
                  "sets": {"toy": {"avg@1": 0.0, "code_ratio": 0.0}}})
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


def test_a_runs_record_gives_its_held_out_figures_reward_climb_and_first_step(tmp_path):
    write_run(tmp_path / "run", [-0.4, -0.2, 0.0, 0.2, 0.4, 0.5, 0.9, 0.3, 0.85, 0.95])
    out = figures(tmp_path / "run")
    assert out["heldout_accuracy_step_0"] == 0.28 and out["heldout_code_ratio_step_0"] == 0.26  # tool loop only
    assert out["heldout_accuracy_step_10"] == 0.94 and out["steps"] == 10
    assert out["reward_first_5"] == 0.0 and out["reward_last_5"] == 0.7 and out["first_step_reward_0_8"] == 7
    assert out["reward_lowest_after_step_5"] == 0.3 and out["reward_lowest_at_step"] == 8
    assert out["step_1_ratio_max"] == 1.0 and out["ratio_max_highest"] == 1.09 and out["entropy_step_3"] == 0.28
    assert out["step_1_tokens"] == 1430 and out["median_step_s"] == 3.44
    assert out["unclipped_rise_steps"] == 0  # ratio_max at most 1.09 (no config.json: eps_high 0.28)


def test_a_ratio_past_the_upper_bound_with_no_token_clipped_there_is_counted(tmp_path):
    write_run(tmp_path / "run", [0.1] * 3)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows[1]["ratio_max"], rows[2]["ratio_max"], rows[2]["clip_high_frac"] = 1.5, 2.0, 0.01  # step 3's was clipped
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run" / "config.json").write_text(json.dumps({"eps_high": 0.6}))
    assert figures(tmp_path / "run")["unclipped_rise_steps"] == 0  # 1.5 is inside 1 + 0.6
    (tmp_path / "run" / "config.json").write_text(json.dumps({"eps_high": 0.28}))
    out = figures(tmp_path / "run")
    assert (out["unclipped_rise_steps"], out["first_unclipped_rise_step"], out["first_unclipped_rise_ratio_max"]) == (1, 2, 1.5)


def test_stretches_of_steps_give_the_means_that_show_degenerate_groups_diluting_the_step(tmp_path):
    write_run(tmp_path / "run", [-0.4, -0.2, 0.0, 0.2, 0.4, 0.5, 0.9, 0.3, 0.85, 0.95])
    out = figures(tmp_path / "run", [(1, 5), (6, 10)])
    assert out["steps_1_5_reward_mean"] == 0.0 and out["steps_6_10_reward_mean"] == 0.7
    assert out["steps_1_5_degenerate_groups"] == 0 and out["steps_6_10_degenerate_groups"] == 0.8
    assert out["steps_6_10_grad_norm_per_informative"] == 0.4 and out["first_step_with_a_degenerate_group"] == 7
    assert (out["degenerate_groups_most"], out["degenerate_groups_most_at_step"]) == (2, 10)
    assert (out["grad_norm_highest"], out["grad_norm_highest_at_step"]) == (0.2, 1)
    with pytest.raises(SystemExit, match="no steps 11-12"):
        figures(tmp_path / "run", [(11, 12)])


def test_the_figures_save_as_a_results_file(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    write_run(tmp_path / "run", [0.1] * 3)
    results.save("demo", "make run-05", figures(tmp_path / "run"))
    assert results.load("demo")["figures"]["heldout_accuracy_step_3"] == 0.94
    assert results.load("demo")["figures"]["first_step_reward_0_8"] == "never"


def test_a_folder_without_a_record_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="not a finished run folder"):
        figures(tmp_path)
    # as a script: that line alone, and the exit status of a refusal (2), as every script of the lab
    script = Path(__file__).with_name("run_figures.py")
    done = subprocess.run([sys.executable, script, str(tmp_path), "x", "--run-command", "y"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr == f"error: {tmp_path}: no metrics.jsonl and eval.jsonl: not a finished run folder\n"
