"""The released bases: shipped whole, refused when changed, and its recipe one command that holds the kernels."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import make_base
import moves_check
import problems_and_policy
import released_base
import results
from chained_problems import make_chained_problems
from configuration import make_config
from prepare_data import write_jsonl

ROOT = Path(__file__).resolve().parent.parent
TOY = dict(cold_start_steps=6, cold_start_tool_only_steps=3, cold_start_batch_size=4, cold_start_schedules="4:2 4:1:drills")


CHAINED = released_base.RELEASES["cpu-chained"]


@pytest.mark.parametrize("preset", list(released_base.RELEASES))
def test_each_released_base_is_its_files_as_released_and_small(preset):
    release = released_base.RELEASES[preset]
    assert released_base.released_base(release) == str(release.folder)
    figures = results.load(release.results)["figures"]
    assert sorted(p.name for p in release.folder.iterdir()) == sorted(released_base.FILES)
    assert sum((release.folder / name).stat().st_size for name in released_base.FILES) <= 10 * 2**20
    if preset == "cpu-chained":  # the chained task's base passes the moves check
        assert all(figures[f"moves_{move}"] >= moves_check.MOVES_NEEDED for move in moves_check.MOVES)
    assert len(figures["commit"]) == 40 and figures["uncommitted_edits"] in ("yes", "no")
    assert figures["threads"] == make_base.THREADS
    assert {figures["aten_cpu_capability"], figures["mkl_cbwr"]} == set(make_base.KERNELS.values())
    assert make_config(preset, {}).cold_start == "released"  # the preset starts from it
    assert released_base.release_for(make_config(preset, {}).train_file) == release


@pytest.mark.parametrize("damage, says", [
    (lambda path: path.write_bytes(path.read_bytes()[:-1000]), "has sha256 "),  # truncated
    (lambda path: path.write_bytes(path.read_bytes()[:-1] + b"\x00"), "has sha256 "),  # one byte changed
    (lambda path: path.unlink(), "is missing"),
])
def test_a_changed_truncated_or_missing_file_is_refused_in_one_line_naming_it_and_its_hash(tmp_path, monkeypatch, damage, says):
    copy = tmp_path / "base"
    shutil.copytree(CHAINED.folder, copy)
    release = dataclasses.replace(CHAINED, folder=copy)
    assert released_base.released_base(release) == str(copy)
    damage(copy / "model.safetensors")
    want = results.load(CHAINED.results)["figures"]["sha256_model_safetensors"]
    with pytest.raises(SystemExit) as refused:
        released_base.released_base(release)
    assert str(copy / "model.safetensors") in refused.value.code and says in refused.value.code
    assert want in refused.value.code and "\n" not in refused.value.code


def toy_data(folder: Path) -> None:
    rows = make_chained_problems(240, 40, seed=0)
    write_jsonl(rows[0], folder / "data" / "chained_train.jsonl")
    write_jsonl(rows[1], folder / "data" / "chained_test.jsonl")


def test_the_recipe_is_the_presets_cold_starts_at_one_thread_resumed_and_refused_as_another(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    toy_data(tmp_path)
    monkeypatch.setattr(make_base, "chained_config", lambda flags: make_config("cpu-chained", TOY))
    monkeypatch.setattr(moves_check, "CHECK_PROBLEMS", 4)
    monkeypatch.setattr(make_base, "commit", lambda: "a" * 40)  # a committed tree, whatever the checkout's state
    base = make_base.main(["--out", "runs/b"])  # --preset cpu-chained, the default
    argvs = [json.loads((folder / "cold_start.json").read_text())
             for folder in (Path("runs/b/base-schedules/1"), Path("runs/b/base-schedules/2"), base)]
    assert [a["threads"] for a in argvs] == [make_base.THREADS] * 3 and argvs[-1]["drills_in_mix"]
    said = capsys.readouterr().out
    assert "another base than the released one" in said and "this base fails the moves check" in said
    stamp = (base / "model.safetensors").stat().st_mtime_ns
    make_base.main(["--out", "runs/b"])  # again: every schedule kept
    assert (base / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(SystemExit, match="fails the moves check: not released"):
        make_base.main(["--out", "runs/b", "--release"])  # a base without the moves is never released
    monkeypatch.setattr(make_base, "chained_config", lambda flags: make_config("cpu-chained", {**TOY, "seed": 1}))
    with pytest.raises(SystemExit, match=r"runs/b holds an experiment of another recipe \(seed 0, not 1\)"):
        make_base.main(["--out", "runs/b"])


def test_a_release_from_a_tree_with_uncommitted_edits_is_refused_before_the_recipe_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(make_base, "commit", lambda: "a" * 40 + "-dirty")
    monkeypatch.setattr(make_base, "chained_config", lambda flags: pytest.fail("the recipe started"))
    with pytest.raises(SystemExit, match="^error: the tree has uncommitted edits, and a release records the commit"):
        make_base.main(["--out", "runs/b", "--release"])
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_release_writes_the_files_whole_and_the_hashes_that_then_check_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = Path("made")
    shutil.copytree(CHAINED.folder, source)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "experiment.json").write_text(json.dumps({"commit": "a" * 40, "kernels": make_base.KERNELS}))
    release = dataclasses.replace(CHAINED, folder=tmp_path / "released")
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    moves = {**{name: 0.9 for name in moves_check.MOVES + moves_check.DECISIONS}, "passed": True}
    make_base.release(source, moves, tmp_path / "out", ["--preset", "cpu-chained", "--release"], release)
    assert released_base.released_base(release) == str(tmp_path / "released")
    figures = results.load(CHAINED.results)
    assert figures["command"] == "make base-06 ARGS=--release" and figures["figures"]["commit"] == "a" * 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made", "out", "released", "results"]  # no temporary left
    (tmp_path / "out" / "experiment.json").write_text(json.dumps({"commit": "a" * 40 + "-dirty", "kernels": {}}))
    with pytest.raises(SystemExit, match="built from uncommitted changes"):
        make_base.release(source, moves, tmp_path / "out", ["--release"], release)


ONE_SCHEDULE = {**TOY, "cold_start_schedules": "", "cold_start_rounds": 1}  # the kernels' part of the recipe, quicker


def recipe_weights(tmp_path: Path, name: str, held: bool, **env) -> bytes:
    """The toy recipe's base, made in a process of its own whose environment adds `env` (another machine's kernels):
    by make_base.py, which holds the kernels (held), or by the cold start alone, which takes the machine's."""
    make = (f"import make_base; make_base.hold_kernels(); from configuration import make_config; import moves_check; "
            f"moves_check.CHECK_PROBLEMS = 4; make_base.chained_config = lambda flags: make_config('cpu-chained', {ONE_SCHEDULE!r}); "
            f"make_base.main(['--out', '{name}'])")
    argv = problems_and_policy.cold_start_argvs(make_config("cpu-chained", {**ONE_SCHEDULE, "trainer_threads": make_base.THREADS}))[0]
    alone = f"import cold_start; cold_start.main({[*argv, '--out', f'{name}/base']!r})"
    subprocess.run([sys.executable, "-c", make if held else alone], env={**os.environ, **env}, cwd=tmp_path, check=True,
                   capture_output=True)
    return (tmp_path / name / "base" / "model.safetensors").read_bytes()


def test_the_recipe_holds_the_kernels_whatever_instruction_sets_the_machine_would_pick(tmp_path):
    toy_data(tmp_path)
    another = dict(ATEN_CPU_CAPABILITY="avx2", MKL_CBWR="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2")
    held = recipe_weights(tmp_path, "here", held=True)
    assert recipe_weights(tmp_path, "another", held=True, **another) == held
    assert recipe_weights(tmp_path, "another-alone", held=False, **another) != held  # the kernels a machine picks
