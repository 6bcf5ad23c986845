"""05-retool: failures from the disk, the environment and the data end in one line, checked before the work."""
import errno
import os
import json
from pathlib import Path

import pytest

import checkpoints


class FullDiskModel:
    """A model whose save fails as a full disk makes it fail (control flow only: what is kept, what is said)."""

    def save_pretrained(self, folder):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_checkpoint_time_keeps_the_last_good_checkpoint_and_says_how_to_resume(tmp_path):
    good = tmp_path / "checkpoints" / "step-000001"
    good.mkdir(parents=True)
    (good / "state.json").write_text('{"step": 1}')
    with pytest.raises(SystemExit) as e:
        checkpoints.save_checkpoint(tmp_path, 2, FullDiskModel(), None, None, keep=1)
    assert str(e.value) == (f"error: writing checkpoint {tmp_path}/checkpoints/step-000002 failed (No space left on "
                            f"device); the last good checkpoint, {good}, is kept: free space, then go on with "
                            f"--resume {tmp_path}")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]
    assert checkpoints.latest_checkpoint(tmp_path)["step"] == 1


def test_a_torn_last_line_of_the_record_is_dropped_on_resume_and_a_bad_line_elsewhere_named(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.5}\n{"step": 2, "x": null}\n{"step": 3, "x')
    checkpoints.truncate_jsonl(path, 2)
    assert path.read_text() == '{"step": 1, "x": 1.5}\n{"step": 2, "x": null}\n'
    assert capsys.readouterr().out == f"note: {path}, line 3: half-written when the run stopped; left out\n"
    path.write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    before = path.read_bytes()
    with pytest.raises(SystemExit, match=f"error: {path}, line 2: not a row of the run's record"):
        checkpoints.truncate_jsonl(path, 2)
    assert path.read_bytes() == before


def test_a_full_disk_while_appending_a_record_is_one_line(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints.os, "fsync", full)
    with pytest.raises(SystemExit, match=f"writing {tmp_path}/metrics.jsonl failed \\(No space left on device\\): "
                                         f"free space, then go on with --resume {tmp_path}$"):
        checkpoints.append_jsonl(tmp_path / "metrics.jsonl", {"step": 1})


def test_an_unwritable_cache_folder_means_no_cache_with_one_notice(tmp_path, monkeypatch, capsys):
    import lab_cli

    monkeypatch.setitem(lab_cli._cache, "kept", True)
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc")
    lab_cli.keep_caches_writable(str(tmp_path))
    assert capsys.readouterr().err.startswith("note: the cache folder /proc cannot be written (/proc: ")
    assert os.environ["XDG_CACHE_HOME"] == str(tmp_path / "cache") and not lab_cli.caches_kept()
    monkeypatch.setitem(lab_cli._cache, "kept", True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-yet"))  # made on first use: writable
    lab_cli.keep_caches_writable(str(tmp_path))
    assert capsys.readouterr().err == "" and lab_cli.caches_kept()


@pytest.mark.parametrize("rows, says", [
    ([{"question": f"Solve {n}x = {2 * n}.", "answer": "2"} for n in range(1, 51)],
     ", row 2: the cold start cannot write a trace for it (not a question this task writes: 'Solve 2x = 4.')"),
    ("toy5", "5 problems give 0 tool traces, fewer than a cold-start batch (32)"),
])
def test_a_training_file_the_cold_start_cannot_use_is_refused_at_load(rows, says, tmp_path, monkeypatch):
    import retool
    from prepare_data import make_toy_task, write_jsonl

    monkeypatch.chdir(tmp_path)
    rows = make_toy_task(5, 0, seed=1)[0] if rows == "toy5" else rows
    write_jsonl(rows, tmp_path / "train.jsonl")
    with pytest.raises(SystemExit) as e:
        retool.main(["--train-file", str(tmp_path / "train.jsonl"), "--run-dir", str(tmp_path / "run"),
                     "--problems-per-step", "4", "--cold-start", "scratch"])
    assert says in str(e.value) and "--cold-start none --model MODEL" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_prompts_longer_than_the_context_are_refused_at_load_naming_max_prompt_tokens(tiny_model_path):
    from problems_and_policy import fit_prompts
    from retool import Config

    short = [{"id": str(i), "question": f"What is {i} * {i}?", "answer": str(i * i)} for i in range(3)]
    long = [{"id": "long", "question": "Add these numbers: " + " + ".join(["7"] * 300), "answer": "2100"}]
    cfg = Config(train_file="train.jsonl", eval_file="test.jsonl", max_model_len=256, max_response_tokens=96,
                 eval_max_response_tokens=96)
    with pytest.raises(SystemExit) as e:
        fit_prompts(short + long, short, str(tiny_model_path), cfg)
    assert str(e.value).startswith("error: train_file train.jsonl: 1 of 4 prompts are longer than the 160 tokens "
                                   "max_model_len 256 leaves beside a response of 96 (the longest: ")
    assert str(e.value).endswith("pass --max-prompt-tokens 160 to drop them at load, or a larger --max-model-len")
    cfg.max_prompt_tokens = 160
    assert fit_prompts(short + long, short, str(tiny_model_path), cfg) == short
    with pytest.raises(SystemExit, match="error: eval_file test.jsonl: 1 of 4 prompts are longer than the 160"):
        fit_prompts(short, short + long, str(tiny_model_path), cfg)


@pytest.mark.parametrize("script", ["05-retool/retool.py", "05-retool/eval.py", "05-retool/cold_start.py",
                                    "01-data/prepare_data.py"])
def test_a_python_without_the_labs_path_is_told_which_python_to_use(script):
    """-S: no site-packages, so not the venv's tool_rl_lab.pth, as with the system's Python."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-S", script, "--help"], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"error: {sys.executable} is not the lab's Python: run .venv/bin/python {script}, or make\n"


def test_make_refuses_a_variable_it_would_ignore_and_says_how_to_pass_flags():
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(["make", "--no-print-directory", "-n", "run-05", "STEPS=2"], cwd=root, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and done.stdout == ""  # -n: nothing would have run
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and 'STEPS=2 is not a setting of this Makefile' in lines[0]
    assert 'make run-05 ARGS="--steps 2"' in lines[0]
    done = subprocess.run(["make", "--no-print-directory", "-n", "run-05", "ARGS=--steps 2", "PRESET=smollm2"],
                          cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "retool.py --preset smollm2 --steps 2" in done.stdout


def test_the_demos_dry_run_plans_one_process_and_passes_as_make_run_05_does(tmp_path, monkeypatch, capsys):
    import retool

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        retool.main(["--dry-run", "--sandbox-preload", ""])  # a sandbox start of 0.2 s
    out = capsys.readouterr().out
    assert e.value.code == 0 and "dry run of preset cpu-demo: 1 x" in out and "ranks: 1 x ddp" in out
    assert out.strip().endswith("dry run: a real run would start")
    assert retool.parse_args(["--preset", "torl-1.5b"])[0].plan_gpus == 8


def test_a_stop_in_the_first_second_does_not_advise_resuming_a_folder_never_made(tmp_path, monkeypatch, capsys):
    import signal

    import retool
    import stopping

    def interrupted(cfg):
        raise stopping.StopRequested(signal.SIGINT)

    monkeypatch.setattr(retool, "start_sandbox", interrupted)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        retool.main(["--run-dir", str(tmp_path / "c1")])
    assert e.value.code == 130 and not (tmp_path / "c1").exists()
    assert capsys.readouterr().err == "stopped by SIGINT before the run folder was made: nothing to resume; start it again\n"


def test_a_bar_written_to_a_file_prints_lines_not_frames(monkeypatch):
    import io

    from tqdm import tqdm

    import lab_cli

    log = io.StringIO()  # not a terminal
    monkeypatch.setattr("sys.stderr", log)
    bar = lab_cli.progress(range(3), desc="RL", mininterval=0)
    for step in bar:
        bar.set_postfix(reward="+1.00", refresh=False)
        tqdm.write(f"step {step + 1}", file=log)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and "" not in lines
    assert [line for line in lines if line.startswith("step")] == ["step 1", "step 2", "step 3"]
    assert lines[0].startswith("RL:   0%") and lines[-1].startswith("RL: 100%") and "3/3" in lines[-1]
    assert [line.split("| ")[-1].split(" [")[0] for line in lines if line.startswith("RL")] == ["0/3", "1/3", "2/3", "3/3"]


@pytest.mark.vllm
def test_a_run_written_to_a_file_holds_the_labs_lines_and_nothing_of_the_libraries(tiny_model_path, tmp_path):
    """A real run from a fresh interpreter, as `make run-05 > log 2>&1`: no import-time notices, warnings or frames."""
    import subprocess
    import sys

    from prepare_data import make_toy_task, write_jsonl
    from tiny_model import KV_CACHE_GIB

    root = Path(__file__).resolve().parent.parent
    train, test = make_toy_task(8, 2, seed=3)
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(test, tmp_path / "test.jsonl")
    argv = [sys.executable, str(root / "05-retool" / "retool.py"), "--run-dir", str(tmp_path / "run"),
            "--model", str(tiny_model_path), "--cold-start", "none", "--train-file", str(tmp_path / "train.jsonl"),
            "--eval-file", str(tmp_path / "test.jsonl"), "--steps", "1", "--problems-per-step", "2",
            "--group-size", "2", "--micro-batch-size", "2", "--max-response-tokens", "12",
            "--eval-max-response-tokens", "12", "--max-model-len", "256", "--cpu-kv-cache-gib", str(KV_CACHE_GIB),
            "--sandbox-preload", ""]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TORCH_CPP_LOG_LEVEL")}
    with open(tmp_path / "log", "w") as log:
        done = subprocess.run(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=900)
    text = (tmp_path / "log").read_text()
    assert done.returncode == 0, text[-3000:]
    for noise in ("Triton", "Warning", "NUMA", "checkpoint shards", "Loading weights", "Writing model shards", "\r"):
        assert noise not in text
    lines = text.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("eval ")] == ["eval before RL", "eval after RL"]
    assert any(line.startswith("step    1 | reward") for line in lines)
    assert len(lines) <= 12, text  # sandbox, settings, 2 evaluations, a step, the bar's lines, the run folder


def test_a_refusal_at_load_leaves_no_run_folder_behind(tiny_model_path, tmp_path, monkeypatch):
    import retool
    from prepare_data import make_toy_task, write_jsonl

    monkeypatch.chdir(tmp_path)
    long = {"id": "long", "question": "Add these numbers: " + " + ".join(["7"] * 300), "answer": "2100"}
    write_jsonl([long] + make_toy_task(8, 0, seed=2)[0], tmp_path / "train.jsonl")
    with pytest.raises(SystemExit, match="pass --max-prompt-tokens 160 to drop them at load"):
        retool.main(["--run-dir", str(tmp_path / "run"), "--model", str(tiny_model_path), "--cold-start", "none",
                     "--train-file", str(tmp_path / "train.jsonl"), "--eval-file", str(tmp_path / "train.jsonl"),
                     "--max-model-len", "256", "--sandbox-preload", ""])
    assert not (tmp_path / "run").exists()


def test_ctrl_c_before_the_runs_own_handler_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import lab_cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(lab_cli, "quiet_console", lambda: None)  # the environment of this process stays as it is
    monkeypatch.setattr(lab_cli, "exit_now", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit) as e:
        lab_cli.run_script(interrupted)
    assert e.value.code == 130 and capsys.readouterr().err == "stopped by SIGINT (Ctrl-C)\n"


def test_a_sandbox_that_cannot_contain_code_here_is_refused_naming_the_flags_that_work_around_it(monkeypatch):
    """A node without user namespaces or cgroups: the dry run and the run say which flag runs the code elsewhere."""
    import retool
    import sandbox

    class NoNamespaces:
        def __init__(self, config):
            raise sandbox.SandboxError("isolation='namespaces' cannot be set up here: unshare: Operation not permitted")

    monkeypatch.setattr(sandbox, "Sandbox", NoNamespaces)
    with pytest.raises(SystemExit) as refusal:
        retool.start_sandbox(retool.Config())
    message = str(refusal.value.code)
    assert message.startswith("error: the sandbox cannot start: isolation='namespaces' cannot be set up here")
    assert "\n" not in message and "--sandbox-backend docker" in message and "--sandbox-isolation plain" in message
    assert "--sandbox-backend sandboxfusion --sandbox-urls" in message
    assert "02-sandbox/serve.py on a host that allows namespaces" in message and "docs/06-scaling.md" in message


def test_a_number_flag_refuses_nan_whatever_its_bounds():
    """nan compares false with every number, so `value < low` let it through as a timeout or a rate."""
    import argparse

    import lab_cli

    for kind, at_most in ((float, None), (float, 10.0)):
        with pytest.raises(argparse.ArgumentTypeError, match="got nan"):
            lab_cli.at_least(0.0, kind, at_most)("nan")
    assert lab_cli.at_least(0.0, float)("0.5") == 0.5 and lab_cli.at_least(1, int, 3)("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="must be at most 3, got 4"):
        lab_cli.at_least(1, int, 3)("4")
