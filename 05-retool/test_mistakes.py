"""05-retool: the mistake table. Each case a newcomer made ends in the one line it must print, exits non-zero, and
leaves nothing half-made where the lab's advice would trip over it; where the advice is --resume, following it works.

Most cases run in-process and are refused before any model loads: a real run is not needed to see them.
"""
import errno
import json
import os
import re
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

import checkpoints
import eval as evaluation
import retool
from prepare_data import make_toy_task, write_jsonl
from test_run_folders import SAFETENSORS, make_run

ROOT = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0))


@pytest.fixture
def lab(tmp_path, monkeypatch, tiny_model_path):
    """A folder to run in, with data files good and bad; {tmp}, {tiny}, {cores} and {python} for the expected lines."""
    monkeypatch.chdir(tmp_path)
    train, test = make_toy_task(40, 10, seed=3)
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(test, tmp_path / "test.jsonl")
    write_jsonl(train[:1], tmp_path / "one.jsonl")
    (tmp_path / "binary.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (tmp_path / "folder").mkdir()
    return {"tmp": str(tmp_path), "tiny": str(tiny_model_path), "cores": CORES, "python": sys.executable}


# A run of the tiny model as given: every case below is refused before it would load.
TINY = ["--model", "{tiny}", "--cold-start", "none", "--train-file", "train.jsonl", "--eval-file", "test.jsonl",
        "--max-model-len", "256", "--sandbox-preload", ""]
SEED_LINE = ("error: seed must be from 0 to 4294967275 (vLLM and numpy take 32-bit seeds; each rank and step adds to "
             "the run's), got {}")

RUN_MISTAKES = {
    # values vLLM checks only after the cold start (item 2 of the issue)
    "a negative seed": (["--seed", "-1"], SEED_LINE.format(-1)),
    "a seed past 32 bits": ([*TINY, "--seed", str(2**32)], SEED_LINE.format(2**32)),
    "a context longer than the released base's": (
        ["--max-model-len", "100000"],
        "error: max_model_len 100000 is above the position limit of the released base 05-retool/base, 1024 tokens "
        "(max_position_embeddings): pass --max-model-len 1024 or less"),
    "a context longer than the cold-started model's": (
        ["--cold-start", "scratch", "--max-model-len", "100000"],
        "error: max_model_len 100000 is above the position limit of the tiny model the cold start builds, 1024 tokens "
        "(max_position_embeddings): pass --max-model-len 1024 or less"),
    "a context longer than the given model's": (
        [*TINY, "--max-model-len", "100000"],
        "error: max_model_len 100000 is above the position limit of {tiny}, 4096 tokens (max_position_embeddings): "
        "pass --max-model-len 4096 or less"),
    "a KV cache larger than the machine's memory": (
        [*TINY, "--cpu-kv-cache-gib", "100000"],
        re.compile(r"error: --cpu-kv-cache-gib 100000: vLLM's KV cache on the CPU would take 100000 GiB, and this "
                   r"machine has [0-9.]+ GiB available now; pass a smaller --cpu-kv-cache-gib \(the demo takes 2\)")),
    "more problems a step than the data holds": (
        [*TINY, "--problems-per-step", "100000"],
        "error: problems_per_step 100000 is more than the 40 problems of train_file train.jsonl: a step would hold one "
        "problem twice; pass --problems-per-step 40 or less, or a larger --train-file"),
    "one problem with 8 a step": (
        [*TINY, "--train-file", "one.jsonl"],
        "error: problems_per_step 8 is more than the 1 problem of train_file one.jsonl: a step would hold one problem "
        "twice; pass --problems-per-step 1 or less, or a larger --train-file"),
    "more trainer threads than cores": (
        [*TINY, "--trainer-threads", "1000"],
        "error: trainer_threads 1000 is more than the {cores} cores this process may use: more threads than cores only "
        "wait on each other; pass --trainer-threads {cores} or less (-1: every core)"),
    "a preload module that does not exist": (
        [*TINY, "--sandbox-preload", "math,nosuchmodule"],
        "error: sandbox_preload: nosuchmodule cannot be imported by the sandbox's Python ({python}): install it there, "
        "or leave it out of --sandbox-preload"),
    # data files (item 5)
    "a typo in --train-file": (
        ["--train-file", "data/toy_trian.jsonl"],
        "error: train_file 'data/toy_trian.jsonl' does not exist (run `make run-01` to prepare data, or pass "
        "--train-file)"),
    "a typo in --eval-file": (
        ["--eval-file", "data/toy_tset.jsonl"],
        "error: eval_file 'data/toy_tset.jsonl' does not exist (run `make run-01` to prepare data, or pass "
        "--eval-file)"),
    "a binary training file": (
        [*TINY, "--train-file", "binary.jsonl"],
        "error: train_file: binary.jsonl:1: not UTF-8 text (byte 0x89); a JSONL file is text, one JSON object a line"),
    "a folder as the training file": (
        [*TINY, "--train-file", "folder"],
        "error: train_file: folder: a folder, not a data file (pass one of its .jsonl or .parquet files)"),
    # the fourth round (issue 67)
    "more steps than a 32-bit seed can count": (
        [*TINY, "--steps", "99999999999"],
        "error: steps 99999999999 is more than a run can take: each step adds one to the 32-bit seed (vLLM and numpy "
        "take 32 bits); pass --steps 4294967295 or less"),
    "a run folder name past the file system's limit": (
        [*TINY, "--run-dir", "x" * 300],
        re.compile(r"error: --run-dir x{40}\.\.\.: the name x{24}\.\.\. is 300 bytes long, and this file system allows "
                   r"at most \d+; choose a shorter --run-dir")),
    # disks (item 6)
    "runs/ a dangling symbolic link": (
        [*TINY, "--run-dir", "runs/x"],
        "error: --run-dir runs/x: cannot write there ({tmp}/runs is a symbolic link to {tmp}/gone, which does not "
        "exist); choose a folder on a writable disk"),
}


def expected(line, lab):
    return line if isinstance(line, re.Pattern) else line.format(**lab)


@pytest.mark.parametrize("case", list(RUN_MISTAKES))
def test_each_mistake_of_a_run_is_its_one_line_before_any_model_loads(case, lab, tmp_path):
    argv, line = RUN_MISTAKES[case]
    (tmp_path / "runs").symlink_to(tmp_path / "gone")
    with pytest.raises(SystemExit) as refusal:
        retool.main([arg.format(**lab) for arg in argv] + ([] if "--run-dir" in argv else ["--run-dir", "r"]))
    said = expected(line, lab)
    assert (said.fullmatch(refusal.value.code) if isinstance(said, re.Pattern) else refusal.value.code == said), \
        refusal.value.code
    assert not (tmp_path / "r").exists()  # nothing made


def test_the_dry_run_refuses_what_the_run_refuses_the_run_folder_too(lab, tmp_path, capsys):
    (tmp_path / "runs").symlink_to(tmp_path / "gone")
    with pytest.raises(SystemExit) as e:
        retool.main([*(arg.format(**lab) for arg in TINY), "--dry-run", "--run-dir", "runs/x"])
    out = capsys.readouterr().out
    assert e.value.code == 2 and out.strip().endswith("dry run: 1 problem(s): a real run is refused")
    assert "  refused: " + expected(RUN_MISTAKES["runs/ a dangling symbolic link"][1], lab)[len("error: "):] in out


def test_a_run_folder_given_as_tilde_is_the_home_folder():
    """`--run-dir=~/x` reaches the script unexpanded (the shell expands ~ only at a word's start)."""
    args, overrides = retool.parse_args(["--run-dir=~/x", "--train-file=~/t.jsonl"])
    assert args.run_dir == os.path.expanduser("~/x")
    assert retool.make_config("cpu-demo", overrides).train_file == os.path.expanduser("~/t.jsonl")


# --------------------------------------------------------------------------- checkpoints and eval.py (item 4)


def checkpoint(folder: Path, step: int) -> Path:
    """A checkpoint as save_checkpoint leaves it, its files real (torch.save's zips), its weights one number."""
    import torch

    path = folder / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    (path / "model.safetensors").write_bytes(SAFETENSORS)
    torch.save({"state": {}, "param_groups": []}, path / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, path / "rng.pt")
    (path / "state.json").write_text(json.dumps({"step": step}))
    return path


@pytest.mark.parametrize("damage, why", [
    (lambda c: (c / "model.safetensors").unlink(), "it has no weights (model.safetensors)"),
    (lambda c: os.truncate(c / "model.safetensors", 40), "its model.safetensors is cut short at 40 bytes"),
    (lambda c: os.truncate(c / "optimizer.pt", 300), "its optimizer.pt is cut short at 300 bytes"),
])
def test_a_damaged_last_checkpoint_is_one_line_and_its_advice_resumes_from_the_one_before(damage, why, tmp_path):
    run = make_run(tmp_path / "run")
    checkpoint(run, 3)
    last = checkpoint(run, 4)
    damage(last)
    with pytest.raises(SystemExit) as refusal:
        checkpoints.resume_point(run)
    assert refusal.value.code == (f"error: --resume {run}: its latest checkpoint, {last}, cannot be read back: {why}; "
                                  f"remove it with rm -r {last}, then resume again to go on from the one before, "
                                  f"{run}/checkpoints/step-000003")
    subprocess.run(["rm", "-r", str(last)], check=True)  # the advice, as given
    assert checkpoints.resume_point(run)["step"] == 3


def test_a_finished_run_whose_last_checkpoint_lost_its_weights_is_not_called_finished(lab, tmp_path):
    run = make_run(tmp_path / "run", steps=2, sandbox_preload="", train_file="train.jsonl", eval_file="test.jsonl",
                   model=lab["tiny"], cold_start="none", max_model_len=256)
    (run / "eval.jsonl").write_text('{"step": 2, "tag": "after RL"}\n')
    (run / "checkpoints" / "step-000002" / "model.safetensors").unlink()
    with pytest.raises(SystemExit) as refusal:
        retool.main(["--resume", str(run)])
    assert refusal.value.code.startswith(f"error: --resume {run}: its latest checkpoint, {run}/checkpoints/"
                                         "step-000002, cannot be read back: it has no weights (model.safetensors)")


@pytest.mark.parametrize("damage, why", [
    (lambda c: (c / "model.safetensors").unlink(), "it has no weights (model.safetensors)"),
    (lambda c: os.truncate(c / "model.safetensors", 40), "its model.safetensors is cut short at 40 bytes"),
])
def test_eval_of_a_checkpoint_without_whole_weights_is_one_line_before_vllm(damage, why, lab, tmp_path):
    step = checkpoint(tmp_path, 2)
    damage(step)
    with pytest.raises(SystemExit) as refusal:
        evaluation.main(["--model", str(step), "--data", "test.jsonl", "--out", str(tmp_path / "eval")])
    assert refusal.value.code == f"error: --model '{step}' cannot be loaded: {why}"
    assert not (tmp_path / "eval").exists()


def test_eval_refuses_a_runs_template_it_does_not_know_and_notes_a_tool_run_told_of_no_tool(lab, tmp_path, capsys):
    run = make_run(tmp_path / "run", template="tir_base_0309")
    with pytest.raises(SystemExit) as refusal:
        evaluation.main(["--model", str(run / "checkpoints" / "step-000002"), "--data", "test.jsonl"])
    assert refusal.value.code == ("error: --template tir_base_0309 (the run's) is not one of torl, qwen-chat, cot, "
                                  "qwen-chat-cot, smollm2-chat: pass --template")
    with pytest.raises(SystemExit, match="missing.jsonl: no such file"):
        evaluation.main(["--model", lab["tiny"], "--template", "cot", "--data", "missing.jsonl"])
    assert ("note: --mode tir with the prompt 'cot', which never mentions the tool: the model is not told it may "
            "write code (a tool prompt: --template torl)\n") in capsys.readouterr().err


def test_eval_refuses_a_seed_vllm_would_refuse(capsys):
    with pytest.raises(SystemExit) as e:
        evaluation.main(["--model", "m", "--seed", "-1"])
    assert e.value.code == 2 and capsys.readouterr().err == "error: argument --seed: must be at least 0, got -1 (see --help)\n"


# --------------------------------------------------------------------------- disks (items 1 and 6)


@contextmanager
def small_files():
    """Files of this process may not grow past 64 KiB (RLIMIT_FSIZE): a real write fails, as on a full disk."""
    import resource

    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel ends the process
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, previous_handler)


def a_base(folder: Path) -> Path:
    """A cold-started base as cold_start.py leaves it, its weights 128 KiB of zeros."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 15], "data_offsets": [0, 1 << 17]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * (1 << 17))
    (folder / "cold_start.json").write_text("{}")
    return folder


def test_a_cached_base_that_cannot_be_copied_is_one_line_and_leaves_no_half_base(tmp_path):
    from problems_and_policy import copy_whole

    cached, base = a_base(tmp_path / "cache" / "key"), tmp_path / "run" / "base"
    base.parent.mkdir()
    with pytest.raises(SystemExit) as refusal, small_files():
        copy_whole(cached, base)
    assert re.fullmatch(rf"error: copying {cached} to {base} failed \(\[Errno 27\] File too large: '.*'; \d+ MiB free "
                        r"there\): raise the shell's file-size limit \(ulimit -f, now 64 KiB a file; ulimit -f "
                        r"unlimited\), then run the same command again", refusal.value.code), refusal.value.code
    assert sorted(p.name for p in base.parent.iterdir()) == []


def test_a_cache_that_cannot_keep_the_base_is_a_notice_and_the_run_goes_on(tmp_path, capsys):
    from problems_and_policy import keep_in_cache

    base, cached = a_base(tmp_path / "run" / "base"), tmp_path / "cache" / "key"
    with small_files():
        keep_in_cache(base, cached)
    out = capsys.readouterr().out
    assert out.startswith(f"note: the cold-start cache {cached.parent} keeps no copy of this base ([Errno 27] File too "
                          "large") and out.endswith("MiB free there); the run goes on\n")
    assert not cached.exists() and list(cached.parent.iterdir()) == [] and (base / "cold_start.json").exists()


def test_any_script_past_the_file_size_limit_or_on_a_full_disk_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """`ulimit -f`: a real write fails (EFBIG, not the kernel's SIGXFSZ, which run_script turns off); /dev/full is
    a disk that is always full (ENOSPC)."""
    import lab_cli

    monkeypatch.setattr(lab_cli, "quiet_console", lambda: None)  # the environment of this process stays as it is
    monkeypatch.setattr(lab_cli, "exit_now", lambda code: (_ for _ in ()).throw(SystemExit(code)))

    def write_big():
        (tmp_path / "big").write_bytes(b"\0" * (1 << 17))

    def write_full():
        with open("/dev/full", "wb") as f:
            f.write(b"x")
            f.flush()

    with pytest.raises(SystemExit) as e, small_files():
        lab_cli.run_script(write_big)
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: File too large: raise the shell's file-size limit (ulimit -f, now 64 KiB a file; ulimit -f unlimited), "
        "then run the same command again\n")
    with pytest.raises(SystemExit) as e:
        lab_cli.run_script(write_full)
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: No space left on device: free space, then run the same command again\n")


def made_by_this_process(run: Path) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / ".lock").write_text(str(os.getpid()))
    (run / "config.json").write_text(json.dumps({"steps": 1, "group_size": 2, "train_file": "t", "cold_start": "scratch"}))
    return run


def test_a_run_that_fails_before_its_first_step_keeps_only_a_whole_base_and_then_says_resume(tmp_path):
    from run_record import failure_line

    run = made_by_this_process(tmp_path / "half")
    a_base(run / "base")
    os.truncate(run / "base" / "model.safetensors", 100)  # a copy the disk cut short
    full = OSError(errno.ENOSPC, "No space left on device", str(run / "base" / "model.safetensors"))
    assert failure_line(full, run, new=True) == (f"error: No space left on device ({run}/base/model.safetensors): "
                                                 "free space, then run the same command again")
    assert not run.exists()  # its advice, the same command, starts clean
    run = made_by_this_process(tmp_path / "whole")
    a_base(run / "base")
    assert failure_line(SystemExit("error: a refusal"), run, new=True) == (
        f"error: a refusal; {run} keeps its cold-started base: then go on with --resume {run}")
    assert (run / "base" / "cold_start.json").exists()
    other = tmp_path / "another-runs"  # a folder this process did not make is never removed
    other.mkdir()
    (other / ".lock").write_text("1")
    assert failure_line(SystemExit("error: in use"), other, new=True) == "error: in use" and other.exists()


def test_a_resume_before_any_checkpoint_makes_a_base_cut_short_again(tmp_path, capsys):
    from run_record import drop_broken_base

    run = made_by_this_process(tmp_path / "run")
    a_base(run / "base")
    os.truncate(run / "base" / "model.safetensors", 100)
    drop_broken_base(run)
    assert not (run / "base").exists()
    assert capsys.readouterr().out == (f"note: {run}/base is not whole (its model.safetensors is cut short at 100 "
                                       "bytes); the cold start makes it again\n")


def test_a_full_disk_at_the_first_checkpoint_says_what_a_checkpoint_takes(tmp_path, monkeypatch):
    import collections

    import torch

    class FullDisk(torch.nn.Linear):
        def save_pretrained(self, folder):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: collections.namedtuple("Usage", "free")(5 << 20))
    with pytest.raises(SystemExit) as refusal:
        checkpoints.save_checkpoint(tmp_path, 1, FullDisk(1024, 1024), None, None, keep=1)
    assert refusal.value.code == (f"error: writing checkpoint {tmp_path}/checkpoints/step-000001 failed (the disk is "
                                  "full: 5 MiB free, a checkpoint takes about 12 MiB); no checkpoint was saved yet: "
                                  f"free space, then go on with --resume {tmp_path}")


# --------------------------------------------------------------------------- pipes and paths (item 7)


def test_a_closed_reader_of_the_output_stops_a_run_as_a_signal_would(monkeypatch):
    """`retool.py | head -5`: the next line finds the pipe closed; no BrokenPipeError, a stop (SIGPIPE) instead."""
    import lab_cli
    from stopping import STOPPER, StopRequested

    reader, writer = os.pipe()
    os.close(reader)
    stream = lab_cli._Closable(os.fdopen(writer, "w", buffering=1))
    monkeypatch.setitem(lab_cli._output, "gone", False)
    STOPPER.install()
    try:
        STOPPER.hold()  # mid-step: the stop waits until the step is recorded
        print("step 1", file=stream)  # the pipe is closed: written nowhere, and the stop asked for
        print("step 1 again", file=stream)
        with pytest.raises(StopRequested) as stop:
            STOPPER.release()
        assert stop.value.signum == signal.SIGPIPE
        STOPPER.install()  # `| tee` and Ctrl-C: the pipe closes, then the user's signal, which wins
        STOPPER.hold()
        STOPPER._output_closed()
        STOPPER._handle(signal.SIGINT, None)  # not "Ctrl-C again": the closed pipe was nobody's
        with pytest.raises(StopRequested) as stop:
            STOPPER.release()
        assert stop.value.signum == signal.SIGINT
    finally:
        STOPPER.uninstall()


@pytest.mark.vllm
def test_a_run_piped_into_head_stops_at_its_next_line_with_a_checkpoint_to_resume(tiny_model_path, tmp_path):
    """`retool.py ... | head -4`, for real: one stop line on stderr, exit 141 (128 + SIGPIPE), nothing lost."""
    from tiny_model import KV_CACHE_GIB

    train, test = make_toy_task(8, 2, seed=3)
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(test, tmp_path / "test.jsonl")
    run = tmp_path / "run"
    argv = [sys.executable, str(ROOT / "05-retool" / "retool.py"), "--run-dir", str(run), "--model", str(tiny_model_path),
            "--cold-start", "none", "--train-file", str(tmp_path / "train.jsonl"), "--eval-file", str(tmp_path / "test.jsonl"),
            "--steps", "4", "--problems-per-step", "2", "--group-size", "2", "--micro-batch-size", "2",
            "--max-response-tokens", "12", "--eval-max-response-tokens", "12", "--max-model-len", "256",
            "--cpu-kv-cache-gib", str(KV_CACHE_GIB), "--sandbox-preload", ""]
    with subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        head = [child.stdout.readline() for _ in range(4)]  # sandbox, settings, sampler, the evaluation before RL
        child.stdout.close()  # as head does once it has its lines
        err = child.stderr.read()
        child.wait(timeout=600)
    assert head[3].startswith("eval before RL") and child.returncode == 128 + signal.SIGPIPE, err[-3000:]
    assert err.splitlines()[-1] == (f"stopped by SIGPIPE after step 1: checkpoint {run}/checkpoints/step-000001; "
                                    f"go on with --resume {run}")
    assert "Traceback" not in err and checkpoints.resume_point(run)["step"] == 1


def test_a_stop_and_a_refusal_are_told_apart_by_name():
    from stopping import Stopped

    stop = Stopped(signal.SIGTERM)
    assert isinstance(stop, SystemExit) and stop.code == 128 + signal.SIGTERM
    assert not isinstance(SystemExit("error: a refusal"), Stopped)


def test_help_under_an_ascii_console_is_printed_not_a_unicode_error():
    done = subprocess.run([sys.executable, "05-retool/retool.py", "--help"], cwd=ROOT, capture_output=True,
                          env={**os.environ, "PYTHONIOENCODING": "ascii"}, timeout=120)
    assert done.returncode == 0 and b"rollout with a sandbox, ?1 reward" in done.stdout, done.stderr[-2000:]


def test_a_task_written_outside_the_labs_folder_says_where(tmp_path, monkeypatch, capsys):
    from problems_and_policy import load_data
    from retool import Config

    monkeypatch.chdir(tmp_path)
    load_data(Config(problems_per_step=8))
    assert capsys.readouterr().out == (f"toy task written: {tmp_path}/data/toy_train.jsonl (2000 problems) and "
                                       f"{tmp_path}/data/toy_test.jsonl (200 problems)\n")


# --------------------------------------------------------------------------- smaller (item 8)


def test_make_refuses_a_device_it_has_no_requirements_for_in_one_line():
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    done = subprocess.run(["make", "--no-print-directory", "-n", "test", "DEVICE=gpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "Makefile:13: *** DEVICE=gpu is not one this Makefile installs for: pass DEVICE=cpu or DEVICE=cuda (left out: "
        "cuda where nvidia-smi finds a GPU, else cpu).  Stop."]


# --------------------------------------------------------------------------- the fourth round (issue 67)


BENCH_MISTAKES = {  # the benches refuse with the run's own checks (lab_cli.at_least, configuration.model_problem)
    "no timed steps": ("train", ["--steps", "0", "--no-sync"], "error: argument --steps: must be at least 1, got 0 (see --help)"),
    "no sequences": ("train", ["--sequences", "0", "--no-sync"],
                     "error: argument --sequences: must be at least 1, got 0 (see --help)"),
    "a model that is not there": ("train", ["--model", "/nonexistent", "--no-sync"],
                                  "error: --model '/nonexistent' is not a folder here"),
    "a batch that is not whole groups": ("train", ["--group-size", "3", "--no-sync"],
                                         "error: argument --sequences: 16 is not whole groups of --group-size 3: pass "
                                         "--sequences 15 or 18 (see --help)"),
    "a rollout model that is not there": ("rollout", ["--model", "/nonexistent"],
                                          "error: --model '/nonexistent' is not a folder here"),
    "a dtype vLLM has no name for": ("rollout", ["--dtype", "float8"],
                                     "error: argument --dtype: invalid choice: 'float8' (choose from 'float32', "
                                     "'bfloat16', 'float16', 'auto') (see --help)"),
}


@pytest.mark.parametrize("case", list(BENCH_MISTAKES))
def test_each_mistake_of_a_bench_is_its_one_line_before_anything_loads(case, capsys):
    import bench_rollout
    import bench_train

    bench, argv, line = BENCH_MISTAKES[case]
    with pytest.raises(SystemExit) as refusal:
        (bench_train if bench == "train" else bench_rollout).parse_args(argv)
    said = refusal.value.code if isinstance(refusal.value.code, str) else capsys.readouterr().err.rstrip("\n")
    assert said == line


def test_the_bench_states_a_saving_only_where_skipping_saved_time():
    from bench_train import skip_saving

    assert skip_saving(0.5, 1.0, zero_rows=8) == "saves 50%"
    assert skip_saving(1.71, 1.0, zero_rows=8) == "no saving measured: the 71% difference is the machine's noise"
    assert skip_saving(0.9, 1.0, zero_rows=0) == "nothing to skip, so no saving"


def test_a_closed_stdout_is_one_line_on_stderr(monkeypatch, capsys):
    """`retool.py --dry-run >&-`: Python starts with sys.stdout None; every script's first call says so."""
    import lab_cli

    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(lab_cli.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit) as e:
        lab_cli.quiet_console()
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: stdout is closed (>&-): the lab writes its lines there; send it to a file instead (> out.log; or "
        "/dev/null)\n")


@pytest.mark.e2e
def test_a_script_with_its_stdout_closed_says_so_for_real():
    done = subprocess.run(["bash", "-c", f"'{sys.executable}' 05-retool/retool.py --dry-run >&-"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: stdout is closed (>&-)"), done.stderr[-2000:]
    assert len(done.stderr.splitlines()) == 1


def test_stdout_on_a_full_file_names_the_stream_and_where_it_goes(monkeypatch, capsys):
    import lab_cli

    monkeypatch.setattr(lab_cli, "quiet_console", lambda: None)
    monkeypatch.setattr(lab_cli, "exit_now", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(sys, "stdout", lab_cli._Closable(open("/dev/full", "w", buffering=1)))
    with pytest.raises(SystemExit) as e:
        lab_cli.run_script(lambda: print("a line"))
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: No space left on device writing stdout to /dev/full: send stdout to another file (> FILE) or free "
        "space there, then run the same command again\n")


def test_a_checkpoint_past_the_file_size_limit_advises_the_limit_not_space(tmp_path):
    import torch

    class TooLarge(torch.nn.Linear):
        def save_pretrained(self, folder):
            raise OSError(errno.EFBIG, "File too large")

    with pytest.raises(SystemExit) as refusal, small_files():
        checkpoints.save_checkpoint(tmp_path, 1, TooLarge(4, 4), None, None, keep=1)
    assert refusal.value.code == (f"error: writing checkpoint {tmp_path}/checkpoints/step-000001 failed (File too "
                                  "large); no checkpoint was saved yet: raise the shell's file-size limit (ulimit -f, "
                                  f"now 64 KiB a file; ulimit -f unlimited), then go on with --resume {tmp_path}")


@pytest.mark.parametrize("damage, why", [
    (lambda run: (run / "config.json").unlink(), "{run}/config.json is missing"),
    (lambda run: (run / "config.json").write_text('{"steps": 2'),
     "{run}/config.json cannot be read as JSON (Expecting ',' delimiter: line 1 column 12 (char 11))"),
])
def test_a_run_whose_config_json_is_gone_or_corrupt_names_the_file_on_resume_and_in_eval(damage, why, lab, tmp_path):
    run = make_run(tmp_path / "run")
    damage(run)
    why = why.format(run=run)
    with pytest.raises(SystemExit) as refusal:
        retool.main(["--resume", str(run)])
    assert refusal.value.code == (f"error: --resume {run}: {why}, and a resume takes the run's settings from it: put "
                                  "back a copy of the file, or start a new run from its latest checkpoint with --model "
                                  f"{run}/checkpoints/step-000002 --cold-start none")
    step = run / "checkpoints" / "step-000002"
    with pytest.raises(SystemExit) as refusal:
        evaluation.main(["--model", str(step), "--data", "test.jsonl", "--out", str(tmp_path / "eval")])
    assert refusal.value.code == (f"error: --model {step} is a checkpoint of a run whose {why}: eval.py takes the "
                                  "run's context, response budget and template from it; put back a copy of the file, or "
                                  "pass --max-model-len, --max-response-tokens, --template")
    assert not (tmp_path / "eval").exists()


def test_eval_given_one_file_twice_refuses_before_the_model(lab, tmp_path):
    with pytest.raises(SystemExit) as refusal:
        evaluation.main(["--model", lab["tiny"], "--data", "test.jsonl", "./test.jsonl", "--out", str(tmp_path / "e")])
    assert refusal.value.code == "error: --data names test.jsonl twice (./test.jsonl): pass each data set once"
    assert not (tmp_path / "e").exists()


def test_eval_says_when_its_template_is_not_the_runs_and_when_no_answer_was_readable(lab, tmp_path, capsys):
    import argparse

    from run_folders import take_run_settings

    run = make_run(tmp_path / "run", template="torl")
    args = argparse.Namespace(model=str(run / "checkpoints" / "step-000002"), mode="tir", template="qwen-chat",
                              max_model_len=None, max_response_tokens=None)
    take_run_settings(args)
    assert (f"note: --template qwen-chat, and the run {run} was trained with the template torl: a prompt its model "
            "never saw may score 0 (leave --template out to take the run's)\n") in capsys.readouterr().err
    nothing = {"template": "qwen-chat", "sets": {"toy": {"format_rate": 0.0}}}
    assert evaluation.no_answer_note(nothing, args) == (
        "note: not one response gave an answer in the form the scorer reads (format_rate 0), so every score is 0: was "
        "the model trained with the template qwen-chat? pass the one it was trained with (--template; one of "
        "torl, qwen-chat, cot, qwen-chat-cot, smollm2-chat)")
    assert evaluation.no_answer_note({**nothing, "sets": {"toy": {"format_rate": 0.1}}}, args) is None


def test_run_06_refuses_a_seed_its_runs_would_refuse_before_the_data_stage(tmp_path, monkeypatch):
    import experiment

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as refusal:
        experiment.main(["--seeds", "0", "-1", "--out", "exp"])
    assert refusal.value.code == ("error: --seeds -1: seed must be from 0 to 4294967235 (vLLM and numpy take 32-bit "
                                  "seeds; each rank and step adds to the run's), got -1")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no data, no experiment folder


def test_a_dry_run_outside_the_labs_folder_names_where_its_run_and_data_go(lab, tmp_path, capsys):
    with pytest.raises(SystemExit):
        retool.main([*(arg.format(**lab) for arg in TINY), "--dry-run", "--run-dir", "r"])
    out = capsys.readouterr().out
    assert f"  run folder: {tmp_path}/r (ok)\n" in out and f"  train_file {tmp_path}/train.jsonl: 40 problems\n" in out


def make(*argv: str) -> subprocess.CompletedProcess:
    import shutil

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    return subprocess.run(["make", "--no-print-directory", "-n", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.e2e
@pytest.mark.parametrize("argv, line", [
    (["run-05", "NPROC=0"], "NPROC=0 is not a number of processes: pass a whole number, 1 or more (one per GPU), e.g. "
                            "make run-05 NPROC=2"),
    (["run-05", "NPROC=abc"], "NPROC=abc is not a number of processes: pass a whole number, 1 or more (one per GPU), "
                              "e.g. make run-05 NPROC=2"),
    (["run-05", "NPROC="], "NPROC= is not a number of processes: pass a whole number, 1 or more (one per GPU), e.g. "
                           "make run-05 NPROC=2"),
    (["run-06", "PRESET=smollm2"], "PRESET=smollm2 is read only by make run-05, so make run-06 would ignore it: drop "
                                   "it, or run make run-05 PRESET=smollm2"),
    (["run-05", "SEEDS=3"], "SEEDS=3 is read only by make run-06, so make run-05 would ignore it: drop it, or run make "
                            "run-06 SEEDS=3"),
    (["test", "PRESET=smollm2"], "PRESET=smollm2 is read only by make run-05, so make test would ignore it: drop it, "
                                 "or run make run-05 PRESET=smollm2"),
])
def test_make_refuses_a_variable_its_target_would_ignore_or_misread(argv, line):
    done = make(*argv)
    assert done.returncode != 0 and done.stdout == ""
    assert re.fullmatch(r"Makefile:\d+: \*\*\* (.*)\.  Stop\.", done.stderr.strip()).group(1) == line, done.stderr


@pytest.mark.e2e
def test_make_passes_the_variables_its_target_reads():
    assert make("run-06", "SEEDS=3", "ARMS=all").stdout.strip().endswith("06-train/experiment.py --seeds 3 --arms all")
    assert "--nproc-per-node 2 05-retool/retool.py" in make("run-05", "NPROC=2").stdout


def test_make_base_after_ctrl_c_says_the_same_command_goes_on(tmp_path, monkeypatch, capsys):
    import make_base
    import problems_and_policy
    from stopping import Stopped

    def interrupted(cfg, out):
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(problems_and_policy, "cold_started_model", interrupted)
    monkeypatch.setattr(problems_and_policy, "load_data", lambda cfg: None)
    with pytest.raises(Stopped) as stop:
        make_base.main(["--preset", "cpu-demo", "--out", "b"])
    assert stop.value.code == 130 and capsys.readouterr().err == (
        "base-05: stopped by SIGINT (Ctrl-C); the same command (make base-05) goes on in b: finished cold starts are "
        "kept, the one cut short goes on from its last checkpoint\n")


def test_eval_with_no_room_for_the_prompt_says_what_to_pass(lab):
    with pytest.raises(SystemExit) as refusal:
        evaluation.main(["--model", lab["tiny"], "--data", "test.jsonl", "--max-model-len", "512"])
    assert refusal.value.code == ("error: --max-response-tokens 3072 leaves no room for the prompt in --max-model-len "
                                  "512: pass a smaller --max-response-tokens (e.g. 256) or a larger --max-model-len")


def test_a_librarys_write_past_the_file_size_limit_is_one_line_that_names_the_limit(tmp_path, monkeypatch, capsys):
    """torch and safetensors raise their own types (no errno) for a write `ulimit -f` cut short: the limit is named,
    not a full disk."""
    import lab_cli
    import torch
    from safetensors.torch import save_file

    monkeypatch.setattr(lab_cli, "quiet_console", lambda: None)
    monkeypatch.setattr(lab_cli, "exit_now", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    for write in (lambda: torch.save({"w": torch.zeros(1 << 16)}, tmp_path / "w.pt"),
                  lambda: save_file({"w": torch.zeros(1 << 16)}, tmp_path / "w.safetensors")):
        with pytest.raises(SystemExit) as e, small_files():
            lab_cli.run_script(write)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: a write failed past the file-size limit (") and err.endswith(
            "): raise the shell's file-size limit (ulimit -f, now 64 KiB a file; ulimit -f unlimited), then run the "
            "same command again\n") and len(err.splitlines()) == 1, err
