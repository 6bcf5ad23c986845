"""Chapter 06's experiment in one command: the preset is the pages' recipe, and make run-06 runs it end to end."""
import dataclasses
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

import cold_start
import experiment
import problems_and_policy
from chained_problems import make_chained_problems
from configuration import field_flag, make_config
from findings import PLOTS
from prepare_data import write_jsonl

ROOT = Path(__file__).resolve().parent.parent


def page_commands(page: str) -> dict[str, list[str]]:
    """The cold_start.py commands of a page's code blocks: {the --out folder's name: the command's flags}."""
    text = re.sub(r"\\\n\s*", "", (ROOT / page).read_text())
    commands = {}
    for line in text.splitlines():
        if "05-retool/cold_start.py" in line:
            argv = shlex.split(line.split("05-retool/cold_start.py", 1)[1])
            commands[Path(argv[argv.index("--out") + 1]).name] = argv
    return commands


def settings(argv: list[str]) -> dict:
    """cold_start.py's parsed flags, less where the model comes from and goes to."""
    return {k: v for k, v in vars(cold_start.parse_args(argv + ["--out", "x"])).items() if k not in ("out", "model")}


def test_the_chained_preset_is_the_recipe_of_the_pages_base():
    page = page_commands("docs/appendix/06-bases.md")
    recipe = [page["chained-base-c"], page["chained-base-f"], page["chained-base-h"]]
    assert page["chained-base-f"][page["chained-base-f"].index("--model") + 1] == "runs/chained-base-c"
    assert page["chained-base-h"][page["chained-base-h"].index("--model") + 1] == "runs/chained-base-f"
    preset = problems_and_policy.cold_start_argvs(make_config("cpu-chained", {}))
    assert [settings(argv) for argv in preset] == [settings(argv) for argv in recipe]
    assert experiment.chained_config([]) == make_config("cpu-chained", {})  # make_base.py builds the preset's base


def chained_data(folder: Path, train: int = 240, test: int = 40) -> None:
    rows = make_chained_problems(train, test, seed=0)
    write_jsonl(rows[0], folder / "data" / "chained_train.jsonl")
    write_jsonl(rows[1], folder / "data" / "chained_test.jsonl")


TOY = dict(cold_start_steps=6, cold_start_tool_only_steps=3, cold_start_batch_size=4, cold_start_schedules="4:2 4:1:drills",
           cold_start_cache=False)


def test_a_base_of_several_schedules_is_the_chain_of_separate_cold_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    chained_data(tmp_path)
    cfg = make_config("cpu-chained", TOY)
    problems_and_policy.cold_started_model(cfg, Path("run"))
    before = None
    for name, argv in zip("cfh", problems_and_policy.cold_start_argvs(cfg)):
        cold_start._DRAWN.clear()  # as a command of its own would: traces drawn anew
        cold_start.main(argv + ["--out", f"by-hand/{name}"] + (["--model", f"by-hand/{before}"] if before else []))
        before = name
    schedules = sorted(Path("run/base-schedules").iterdir()) + [Path("run/base")]
    for made, by_hand in zip(schedules, ["by-hand/c", "by-hand/f", "by-hand/h"]):
        assert (made / "model.safetensors").read_bytes() == (Path(by_hand) / "model.safetensors").read_bytes()
    assert json.loads(Path("run/base/cold_start.json").read_text())["drills_in_mix"]


def test_run_06_end_to_end_at_toy_sizes(tmp_path, monkeypatch, capsys):
    import moves_check

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(moves_check, "CHECK_PROBLEMS", 4)
    chained_data(tmp_path)
    base = problems_and_policy.cold_started_model(make_config("cpu-chained", TOY), Path("toy"))  # lacks the moves
    docs = {p: p.stat().st_mtime_ns for p in (ROOT / "docs").rglob("*")}
    flags = ["--steps", "2", "--problems-per-step", "2", "--group-size", "2", "--eval-problems", "4"]
    # A base without the moves: RL is refused, in one line, after its check on this machine.
    with pytest.raises(SystemExit, match=r"error: the base toy/base fails the moves check \(call "):
        experiment.main(["--base", base, "--arms", "baseline", "--", *flags])
    assert sorted(p.name for p in Path("runs/experiment-06").iterdir()) == ["experiment.json", "moves.json"]
    report = experiment.main(["--base", base, "--arms", "baseline", "--ignore-moves-check", "--", *flags])
    text = report.read_text()
    assert "| C = 4: held-out accuracy after RL | " in text and "the page" in text and all((report.parent / png).exists() for png in PLOTS)
    assert "| call | 0.000 | " in text  # the base's moves on this machine, beside the released base's
    run = Path("runs/experiment-06/baseline-s0")
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    stamp = (run / "metrics.jsonl").stat().st_mtime_ns
    capsys.readouterr()
    experiment.main(["--base", base, "--arms", "baseline", "--ignore-moves-check", "--", *flags])  # every stage kept
    assert "done already" in capsys.readouterr().out and (run / "metrics.jsonl").stat().st_mtime_ns == stamp
    with pytest.raises(SystemExit, match="holds an experiment of another recipe \\(steps 2, not 3\\)"):
        experiment.main(["--base", base, "--arms", "baseline", "--", *flags, "--steps", "3"])
    with pytest.raises(SystemExit, match="holds an experiment of another recipe \\(base '"):
        experiment.main(["--arms", "baseline", "--", *flags])  # the released base: another base, another folder
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "docs").rglob("*")} == docs  # nothing under docs/


@pytest.mark.e2e
def test_an_arm_cut_short_goes_on_from_its_last_checkpoint_and_redoes_no_step(tmp_path, monkeypatch):
    """run-06 after Ctrl-C: the arm in progress resumes from its checkpoint (every SAVE_EVERY steps, and the one a
    stop saves), so the steps before it are not run again."""
    import subprocess

    import ablation

    monkeypatch.chdir(tmp_path)
    chained_data(tmp_path)
    monkeypatch.setattr(ablation, "SAVE_EVERY", 2)
    flags = ["--problems-per-step", "2", "--group-size", "2", "--eval-problems", "4"]
    run = Path("runs/baseline-s0")
    monkeypatch.setenv("RETOOL_TEST_SIGNAL", "KILL@4")  # killed as step 4 begins: the checkpoint of step 2 is the last
    with pytest.raises(subprocess.CalledProcessError):
        ablation.run_arm(experiment.RELEASE.folder, run, "baseline", 0, 5, "cpu-chained", flags)
    monkeypatch.delenv("RETOOL_TEST_SIGNAL")
    first = (run / "metrics.jsonl").read_text().splitlines()
    assert len(first) == 3 and [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"]
    ablation.run_arm(experiment.RELEASE.folder, run, "baseline", 0, 5, "cpu-chained", flags)
    after = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in after] == [1, 2, 3, 4, 5]
    assert after[:2] == first[:2]  # steps 1 and 2 kept as they were, not run again
    assert ablation.finished(run)


def test_ctrl_c_during_a_run_stops_with_one_line_saying_the_same_command_goes_on(tmp_path, monkeypatch, capsys):
    import subprocess

    monkeypatch.chdir(tmp_path)
    chained_data(tmp_path)
    monkeypatch.setattr(experiment, "moves_here", lambda base, out, cfg: {"passed": True})

    def run_sees_ctrl_c(*args, **kwargs):  # retool.py got the SIGINT too, and stopped with 130
        raise subprocess.CalledProcessError(130, "retool.py")

    monkeypatch.setattr(experiment, "run_arm", run_sees_ctrl_c)
    with pytest.raises(SystemExit) as stopped:
        experiment.main(["--arms", "baseline"])
    assert stopped.value.code == 130
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "stopped by SIGINT (Ctrl-C); the same command goes on in runs/experiment-06" in err
    assert "a run cut short goes on from its last checkpoint" in err
    assert (Path("runs/experiment-06") / "experiment.json").exists()  # the folder is kept, claimed for this recipe


def test_run_06_starts_from_the_released_base_and_refuses_it_changed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "released"
    shutil.copytree(experiment.RELEASE.folder, copy)
    monkeypatch.setattr(experiment, "RELEASE", dataclasses.replace(experiment.RELEASE, folder=copy))
    (copy / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"released/tokenizer.json has sha256 .*, not the release's [0-9a-f]{64}"):
        experiment.main(["--arms", "baseline"])
    assert not Path("runs").exists()  # refused before anything is written


def test_bad_arms_and_flags_are_refused_in_one_line_before_any_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        experiment.main(["--arms", "calls-3"])
    assert "error: --arms: no arm 'calls-3'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="cold_start_schedules: '600:700' is not"):
        experiment.main(["--", "--cold-start-schedules", "600:700"])
    assert not Path("runs").exists()


def ablation_save_every() -> int:
    import ablation

    return ablation.SAVE_EVERY


def test_the_pages_say_what_run_06_does_and_how_long_it_takes():
    from doc_pages import says

    import results

    cfg, words = make_config("cpu-chained", {}), {3: "three"}
    says("06-experiments.md", f"preset's\n{words[1 + len(cfg.cold_start_schedules.split())]} cold starts with the kernels held",
         f"one RL run of {cfg.steps} steps per arm and seed", f"{', '.join(map(str, [1, 2]))} and 4",
         "runs four stages", f"checkpoint (one every {ablation_save_every()} steps)")
    bench = results.load("06-bench-experiment")["figures"]
    assert bench["runs"] == len(experiment.DEFAULT_ARMS)
    assert f"one seed, about {round(bench['total_min'])} min on two cores" in (ROOT / "README.md").read_text()
