"""findings.py on run folders written as ablation.py's runs write them: the figures, the plots, the results file."""
import json
import subprocess
import sys

import pytest

import findings


def write_run(folder, accuracy: float, seconds: float, kinds: dict, before: float = 0.1):
    folder.mkdir(parents=True)
    rows = [{"step": s, "reward_mean": 0.0, "rollout_s": seconds, "reward_s": 0.0, "update_s": 0.0, "sync_s": 0.0,
             "error_then_call_ok": s / 20, "error_then_correct": None if s == 20 else 0.1, "code_ratio": 0.5,
             "code_pass_ratio": 0.8, "response_length": 40 + s, "ratio_max": 1 + s / 10} for s in range(1, 21)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = {f"chained-heldout-{k}": {"avg@1": v} for k, v in kinds.items()}
    evals = [{"tag": "before RL", "step": 0, "sets": {"all": {"avg@1": before}, **sets}},
             {"tag": "after RL", "step": 20, "sets": {"all": {"avg@1": accuracy}, **sets}}]
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


def test_figures_hold_each_seed_and_their_mean_and_the_plots_and_results_file_are_written(tmp_path, monkeypatch):
    import results

    monkeypatch.setattr(results, "RESULTS", tmp_path / "docs" / "results")
    write_run(tmp_path / "runs" / "baseline-s0", 0.6, 5.0, {"1step": 0.9, "2step-padded": 0.2})
    write_run(tmp_path / "runs" / "baseline-s1", 0.4, 7.0, {"1step": 0.7, "2step-padded": 0.0}, before=0.3)
    samples = tmp_path / "runs" / "baseline-s1" / "eval_samples"
    samples.mkdir()
    answers = {"000000": [[True], [], [False, True]], "000020": [[True], [True], [True, True]]}  # code_ok per answer
    for step, calls in answers.items():  # two-step problems, and one-step ones that do not count
        rows = [{"source": "chained-heldout-2step", "code_ok": c} for c in calls] + \
               [{"source": "chained-heldout-1step", "code_ok": [True]}, {"source": "chained-heldout-2step-padded", "code_ok": [True]}]
        (samples / f"step-{step}-tir.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_run(tmp_path / "runs" / "calls-1-s0", 0.3, 3.0, {"1step": 0.8, "2step-padded": 0.0})
    write_run(tmp_path / "runs" / "dynamic-s0", 0.9, 9.0, {})  # another arm: not a finding of this script
    (tmp_path / "runs" / "calls-2-s0").mkdir()  # a run cut short: no "after RL" evaluation, left out
    figures = findings.main(["--out", str(tmp_path / "runs"), "--img", str(tmp_path / "img"), "--results", "experiments"])
    assert figures["before_rl"] == 0.2  # the mean over seeds: each samples its own answers before RL
    assert (figures["baseline_s0_held_out"], figures["baseline_s1_held_out"], figures["baseline_mean_held_out"]) == (0.6, 0.4, 0.5)
    assert figures["baseline_mean_s_per_step"] == 6.0 and figures["calls_1_mean_held_out"] == 0.3
    assert (figures["baseline_s0_before_rl"], figures["baseline_s0_gain"], figures["baseline_mean_gain"]) == (0.1, 0.5, 0.3)
    assert figures["baseline_s0_error_then_call_ok_last10"] == pytest.approx(sum(range(11, 21)) / 20 / 10, abs=1e-3)
    assert figures["baseline_s0_error_then_correct_last10"] == pytest.approx(0.1)  # a null step is left out
    assert figures["baseline_s0_error_then_call_ok_first5"] == pytest.approx(0.15)  # steps 1 to 5: 3 / 20
    assert (figures["baseline_s0_response_length_first5"], figures["baseline_mean_response_length_last10"]) == (43.0, 55.5)
    assert figures["baseline_s1_2step_padded"] == 0.0 and not any(k.startswith(("calls_2", "dynamic")) for k in figures)
    # two-step answers after one call that ran: 1 of 3 before RL, 2 of 3 after; a run without samples has none
    assert (figures["baseline_s1_2step_one_call_before"], figures["baseline_s1_2step_one_call_after"]) == (0.333, 0.667)
    assert "baseline_s0_2step_one_call_after" not in figures
    assert figures["baseline_s1_1step_second_call_after"] == 0.0  # its one-step answer made one call
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        "06-experiments-budget.png", "06-experiments-code-use.png", "06-experiments-self-correction.png"]
    saved = json.loads((tmp_path / "docs" / "results" / "experiments.json").read_text())
    assert saved["figures"] == figures and saved["command"].startswith("06-train/findings.py --out ")


def test_a_folder_without_a_finished_baseline_is_refused_in_one_line(tmp_path):
    write_run(tmp_path / "calls-1-s0", 0.3, 3.0, {})
    with pytest.raises(SystemExit, match="no finished baseline run in it"):
        findings.main(["--out", str(tmp_path)])
    # as a script: that line alone, with the exit status of a refusal (2)
    done = subprocess.run([sys.executable, findings.__file__, "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no finished baseline run" in done.stderr


def test_the_ablation_report_writes_every_figure_of_its_table_to_one_results_file(tmp_path, monkeypatch):
    import ablation
    import results

    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    write_run(tmp_path / "runs" / "baseline-s0", 0.6, 5.0, {"1step": 0.9, "2step-padded": 0.2})
    write_run(tmp_path / "runs" / "gspo-s0", 0.5, 4.0, {}, before=0.5)  # a bf16 arm's sampler may score otherwise
    write_run(tmp_path / "runs" / "gspo-s1", 0.5, 4.0, {}, before=0.3)
    table = ablation.report(tmp_path / "runs", None, "objectives", tmp_path / "img" / "differences.png")
    saved = json.loads((tmp_path / "results" / "objectives.json").read_text())["figures"]
    assert saved["baseline_s0_held_out"] == 0.6 and saved["gspo_s1_s_per_step"] == 4.0
    # before RL: the mean over seeds of the baseline's, or where it did not run, another arm's
    assert (saved["before_rl"], saved["gspo_s0_before_rl"]) == (0.2, 0.5) and "before RL 0.20" in table
    # each kind of problem where the held-out set has several; the largest ratio of any step (a collapse's mark)
    assert (saved["baseline_s0_1step"], saved["baseline_s0_2step_padded"], saved["baseline_s0_ratio_max_peak"]) == (0.9, 0.2, 3.0)
    assert not any(k.startswith("gspo_s0_1step") for k in saved)
    assert (tmp_path / "img" / "differences.png").stat().st_size > 0  # gspo - baseline on seed 0
    assert "| gspo |" in table and "0.50" in table
