"""findings.py on run folders written as ablation.py's runs write them: the figures, the plots, the results file."""
import json

import pytest

import findings


def write_run(folder, accuracy: float, seconds: float, kinds: dict):
    folder.mkdir(parents=True)
    rows = [{"step": s, "reward_mean": 0.0, "rollout_s": seconds, "reward_s": 0.0, "update_s": 0.0, "sync_s": 0.0,
             "error_then_call_ok": s / 20, "error_then_correct": None if s == 20 else 0.1, "code_ratio": 0.5,
             "code_pass_ratio": 0.8, "response_length": 40 + s} for s in range(1, 21)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = {f"chained-heldout-{k}": {"avg@1": v} for k, v in kinds.items()}
    evals = [{"tag": "before RL", "step": 0, "sets": {"all": {"avg@1": 0.1}, **sets}},
             {"tag": "after RL", "step": 20, "sets": {"all": {"avg@1": accuracy}, **sets}}]
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


def test_figures_hold_each_seed_and_their_mean_and_the_plots_and_results_file_are_written(tmp_path):
    write_run(tmp_path / "runs" / "baseline-s0", 0.6, 5.0, {"1step": 0.9, "2step-padded": 0.2})
    write_run(tmp_path / "runs" / "baseline-s1", 0.4, 7.0, {"1step": 0.7, "2step-padded": 0.0})
    write_run(tmp_path / "runs" / "calls-1-s0", 0.3, 3.0, {"1step": 0.8, "2step-padded": 0.0})
    write_run(tmp_path / "runs" / "dynamic-s0", 0.9, 9.0, {})  # another arm: not a finding of this script
    (tmp_path / "runs" / "calls-2-s0").mkdir()  # a run cut short: no "after RL" evaluation, left out
    results = tmp_path / "docs" / "results" / "experiments.json"
    figures = findings.main(["--out", str(tmp_path / "runs"), "--img", str(tmp_path / "img"), "--results", str(results)])
    assert figures["before_rl"] == 0.1
    assert (figures["baseline.s0.held_out"], figures["baseline.s1.held_out"], figures["baseline.mean.held_out"]) == (0.6, 0.4, 0.5)
    assert figures["baseline.mean.s_per_step"] == 6.0 and figures["calls-1.mean.held_out"] == 0.3
    assert figures["baseline.s0.error_then_call_ok_last10"] == pytest.approx(sum(range(11, 21)) / 20 / 10, abs=1e-3)
    assert figures["baseline.s0.error_then_correct_last10"] == pytest.approx(0.1)  # a null step is left out
    assert figures["baseline.s1.2step-padded"] == 0.0 and not any(k.startswith(("calls-2", "dynamic")) for k in figures)
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        "06-experiments-budget.png", "06-experiments-code-use.png", "06-experiments-self-correction.png"]
    saved = json.loads(results.read_text())
    assert saved["figures"] == figures and saved["command"].startswith("06-train/findings.py --out ")


def test_a_folder_without_a_finished_baseline_is_refused_in_one_line(tmp_path):
    write_run(tmp_path / "calls-1-s0", 0.3, 3.0, {})
    with pytest.raises(SystemExit, match="no finished baseline run in it"):
        findings.main(["--out", str(tmp_path)])
