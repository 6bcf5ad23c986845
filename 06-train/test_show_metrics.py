"""show_metrics reads runs' metrics.jsonl into a per-step table (no model, no vLLM)."""
import json

import pytest

from show_metrics import main


def write_run(folder, rows):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def test_table_has_a_row_per_step_a_column_per_run_and_key_and_the_mean(tmp_path, capsys):
    a = write_run(tmp_path / "a", [{"step": 1, "ratio_max": 1.0}, {"step": 2, "ratio_max": 2.0}])
    b = write_run(tmp_path / "b", [{"step": 1, "ratio_max": 4.0}])
    main([a, b, "--keys", "ratio_max"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| step | a: ratio_max | b: ratio_max |"
    assert lines[2:] == ["| 1 | 1 | 4 |", "| 2 | 2 |  |", "| mean | 1.5 | 4 |"]


def test_a_key_no_run_has_is_a_one_line_error(tmp_path):
    a = write_run(tmp_path / "a", [{"step": 1, "ratio_max": 1.0}])
    with pytest.raises(SystemExit, match="no run has clip_frac"):
        main([a, "--keys", "clip_frac"])
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        main([str(tmp_path), "--keys", "ratio_max"])


def test_a_list_key_and_a_plot_into_a_missing_folder_are_one_line_errors_that_create_nothing(tmp_path):
    a = write_run(tmp_path / "a", [{"step": 1, "ratio_max": 1.0, "problem_ids": ["x", "y"], "code_pass_ratio": None}])
    with pytest.raises(SystemExit, match="--keys problem_ids: not a number per step"):
        main([a, "--keys", "problem_ids"])
    with pytest.raises(SystemExit, match="the folder .*nowhere does not exist"):
        main([a, "--keys", "ratio_max", "--plot", str(tmp_path / "nowhere" / "x.png")])
    assert not (tmp_path / "nowhere").exists()
    main([a, "--keys", "code_pass_ratio", "--plot", str(tmp_path / "ok.png")])  # null (undefined that step) is a gap
    assert (tmp_path / "ok.png").stat().st_size > 0
