"""eval.py's output folders become the figures the docs quote (eval_figures.py)."""
from __future__ import annotations

import json

import pytest

from eval_figures import figures, folder_of

CODE = "```python\nprint(6 * 7)\n```\n"


def test_an_evaluation_gives_its_accuracy_tool_use_and_what_its_responses_hold(tmp_path):
    folder = tmp_path / "step20-text-torl"
    folder.mkdir()
    summary = {"mode": "text", "k": 1, "sets": {"toy": {"avg@1": 0.3333, "code_ratio": 0.0}}}
    (folder / "summary.json").write_text(json.dumps(summary))
    texts = [(CODE + "```output\n42\n```\n\\boxed{42}", True), (CODE + "no output", False), ("```output\n1\n```", False)]
    (folder / "samples.jsonl").write_text("".join(json.dumps({"text": t, "valid_format": v}) + "\n" for t, v in texts))
    assert figures(folder) == {"step20_text_torl_accuracy": 0.333, "step20_text_torl_code_ratio": 0.0,
                               "step20_text_torl_boxed": 1, "step20_text_torl_code_block": 2,
                               "step20_text_torl_code_then_output": 1}  # an output with no code before it is not one
    with pytest.raises(SystemExit, match="not an eval.py folder"):
        figures(tmp_path)


def test_the_folders_read_are_the_eval_commands_out_folders():
    assert folder_of('make run-05 ARGS="--run-dir runs/cpu-demo"') is None
    assert str(folder_of("X=1 .venv/bin/python 05-retool/eval.py --model m --out runs/e/a --mode tir")) == "runs/e/a"
    with pytest.raises(SystemExit, match="names not one --out"):
        folder_of(".venv/bin/python 05-retool/eval.py --model m")
