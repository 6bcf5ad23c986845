"""05-retool: --overwrite, --resume and eval.py --out touch only what the lab made; everything else is left byte for byte."""
import dataclasses
import json
from pathlib import Path

import pytest

import eval as evaluation
import retool
from retool import Config
from run_folders import check_eval_out, check_new_run_dir, recipe_changes, resume_config, stopped_before_training


def snapshot(folder: Path) -> dict:
    """Every path under `folder` with its bytes (folders as None): equal snapshots mean nothing was touched."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def make_run(folder: Path, **fields) -> Path:
    """A run folder as retool.py leaves it: config.json of a Config, records, a checkpoint that is a model folder."""
    (folder / "checkpoints" / "step-000002").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**dataclasses.asdict(Config()), **fields}))
    (folder / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (folder / "checkpoints" / "step-000002" / "config.json").write_text('{"model_type": "qwen2"}')
    (folder / "checkpoints" / "step-000002" / "state.json").write_text('{"step": 2}')
    (folder / "checkpoints" / "step-000002" / "model.safetensors").write_bytes(SAFETENSORS)
    return folder


HEADER = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
SAFETENSORS = len(HEADER).to_bytes(8, "little") + HEADER + b"\0" * 4  # one float32 weight, the format's smallest file


def make_evaluation(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text('{"model": "m", "sets": {"toy": {"avg@1": 0.5}}}')
    (folder / "samples.jsonl").write_text('{"problem_id": "1"}\n' * 200)
    return folder


def git_clone(folder: Path) -> Path:
    (folder / ".git" / "objects").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / "README.md").write_text("a project\n")
    return folder


def runs_folder(folder: Path) -> Path:
    make_run(folder / "cpu-demo-1")
    make_evaluation(folder / "eval-1")
    return folder


def run_with_notes(folder: Path) -> Path:
    make_run(folder)
    (folder / "notes.txt").write_text("what I saw at step 2\n")
    return folder


def user_folder(folder: Path) -> Path:
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    return folder


@pytest.mark.parametrize("make, says", [
    (git_clone, "is a git clone (it has .git), not a run folder"),
    (runs_folder, "is a folder of runs (cpu-demo-1, eval-1), not a run folder"),
    (run_with_notes, "also holds notes.txt, which the lab did not write"),
    (user_folder, "is a folder the lab did not make, not a run folder"),
    (lambda f: make_evaluation(f), "is an evaluation folder, not a run folder"),
    (lambda f: make_run(f.parent / "run") / "checkpoints" / "step-000002", "is a checkpoint (a model folder)"),
])
def test_overwrite_refuses_every_folder_but_a_run_and_leaves_it_byte_for_byte(make, says, tmp_path):
    folder = make(tmp_path / "target")
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        retool.main(["--run-dir", str(folder), "--overwrite", "--steps", "1"])
    assert says in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("error: ")
    assert snapshot(tmp_path) == before


def test_overwrite_of_the_folder_the_command_runs_in_is_refused(tmp_path, monkeypatch):
    make_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path / "run")
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit, match="holds the folder this command runs in"):
        check_new_run_dir(Path("."), overwrite=True)
    assert snapshot(tmp_path) == before


def test_overwrite_removes_a_run_folder_and_nothing_beside_it(tmp_path):
    make_run(tmp_path / "run")
    (tmp_path / "notes.txt").write_text("beside it\n")
    check_new_run_dir(tmp_path / "run", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("make, says", [
    (lambda f: make_run(f.parent / "run") / "checkpoints" / "step-000002",
     "is a checkpoint (a model folder), not a run folder: pass its run, --resume {tmp}/run"),
    (lambda f: (f.mkdir(), (f / "config.json").write_text('{"model_type": "llama"}'), f)[-1],
     "is a model folder, not a run folder: to start RL from it, pass --model {tmp}/target --cold-start none"),
    (runs_folder, "is a folder of runs (cpu-demo-1, eval-1), not a run folder: pass one of them, "
                  "e.g. --resume {tmp}/target/cpu-demo-1"),
    (git_clone, "is a git clone (it has .git), not a run folder"),
    (lambda f: f, "is a path that does not exist, not a run folder"),
])
def test_resume_takes_only_a_run_folder_and_names_what_was_given(make, says, tmp_path):
    folder = make(tmp_path / "target")
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        retool.main(["--resume", str(folder)])
    assert says.format(tmp=tmp_path) in str(e.value) and "\n" not in str(e.value)
    assert snapshot(tmp_path) == before


def test_eval_out_never_replaces_an_earlier_evaluation_unless_asked(tmp_path):
    out = make_evaluation(tmp_path / "eval")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as e:
        evaluation.main(["--model", str(model), "--data", "x.jsonl", "--out", str(out)])
    assert "holds an earlier evaluation" in str(e.value) and "--overwrite" in str(e.value)
    assert snapshot(tmp_path) == before
    (out / "notes.txt").write_text("mine\n")
    before = snapshot(tmp_path / "eval")
    with pytest.raises(SystemExit, match="also holds notes.txt, which the lab did not write"):
        check_eval_out(out, overwrite=True)
    with pytest.raises(SystemExit, match="is a run folder, not an evaluation folder"):
        check_eval_out(make_run(tmp_path / "run"), overwrite=True)
    assert snapshot(tmp_path / "eval") == before and (tmp_path / "run" / "config.json").exists()
    (out / "notes.txt").unlink()
    check_eval_out(out, overwrite=True)  # asked, and only the lab's files: replaced
    assert not out.exists()


def test_a_folder_that_cannot_be_written_is_refused_before_anything_runs(tmp_path):
    for argv in (["--run-dir", "/proc/lab-run"], ["--run-dir", str(tmp_path / "file" / "run")]):
        (tmp_path / "file").write_text("")
        with pytest.raises(SystemExit) as e:
            retool.main(argv + ["--steps", "1"])
        assert "cannot write there" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit, match="--out /proc/eval: cannot write there \\(/proc: "):
        check_eval_out(Path("/proc/eval"), overwrite=False)


def test_resume_refuses_flags_it_would_ignore_and_recipe_changes_unless_asked(tmp_path):
    run = make_run(tmp_path / "run", lr=2e-5, group_size=8)
    before = snapshot(tmp_path)
    for argv in (["--preset", "smollm2"], ["--run-dir", "elsewhere"], ["--overwrite"]):
        with pytest.raises(SystemExit, match=f"so {argv[0]} would be ignored"):
            retool.main(["--resume", str(run), *argv])
    with pytest.raises(SystemExit, match="with --lr 1e-05: the run was trained with lr 2e-05; pass --change-recipe"):
        retool.main(["--resume", str(run), "--lr", "1e-5"])
    assert snapshot(tmp_path) == before
    cfg = resume_config(Config, run, {"steps": 40, "eval_every": 5}, [], change_recipe=False)  # when, not what
    assert cfg.steps == 40 and cfg.lr == 2e-5
    cfg = resume_config(Config, run, {"lr": 1e-5, "group_size": 4}, [], change_recipe=True)
    assert cfg.lr == 1e-5 and cfg.group_size == 4
    assert recipe_changes(run, cfg, step=2) == [{"step": 2, "group_size": [8, 4], "lr": [2e-5, 1e-5]}]


def test_a_stop_before_the_run_folder_exists_does_not_advise_resuming_it(tmp_path):
    assert "nothing to resume" in stopped_before_training("SIGINT", tmp_path / "c1")
    assert f"--resume {tmp_path / 'run'}" in stopped_before_training("SIGINT", make_run(tmp_path / "run"))


def test_a_model_missing_from_the_cache_is_not_told_to_set_hf_hub_offline(monkeypatch):
    import prepare_data
    from configuration import model_problem

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setitem(prepare_data._hub_probe, "unreachable_because",
                        "https://hub does not answer (ConnectError); "
                        "set HF_HUB_OFFLINE=1 to use data sets already in the local cache")
    problem = model_problem("nobody-here/no-such-model")
    assert "does not answer (ConnectError)" in problem and "pass a local model folder" in problem
    assert "HF_HUB_OFFLINE" not in problem


def test_eval_of_a_runs_checkpoint_takes_the_runs_context_and_budget(tmp_path, capsys):
    """The command eval.py's docstring suggests, on the demo's checkpoint: its 512-token context, not ToRL's 3072."""
    run = make_run(tmp_path / "run", max_model_len=512, eval_max_response_tokens=96)
    with pytest.raises(SystemExit, match="missing.jsonl: no such file"):  # every check of the model passed
        evaluation.main(["--model", str(run / "checkpoints" / "step-000002"), "--data", str(tmp_path / "missing.jsonl"),
                         "--out", str(tmp_path / "eval")])
    assert (f"settings of the run {run}: --max-model-len 512 --max-response-tokens 96 --template torl"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit, match="--max-response-tokens 600 leaves no room for the prompt in --max-model-len 512"):
        evaluation.main(["--model", str(run / "checkpoints" / "step-000002"), "--max-response-tokens", "600"])
