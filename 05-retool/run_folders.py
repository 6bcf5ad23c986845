"""What a folder named on the command line is, checked before anything is written: a run, an evaluation, or not ours.

Key decision: `--overwrite` removes only a folder the lab wrote, holding nothing but the names the lab writes there.
The story: docs/05-runs.md, "The run folder".
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

# The names a run writes into its folder (run_record.py, checkpoints.py, trackers.py, plots.py).
RUN_ENTRIES = {".lock", "config.json", "metrics.jsonl", "eval.jsonl", "checkpoints", "base", "base-schedules", "eval_samples",
               "last_step.jsonl", "last_step.html", "plots.png", "tensorboard", "wandb"}
RUN_MARKS = ("steps", "group_size", "train_file", "cold_start")  # fields every run's config.json records
EVAL_ENTRIES = {"summary.json", "samples.jsonl"}  # what eval.py writes into --out


def check_new_run_dir(run_dir: Path, overwrite: bool, remove: bool = True) -> None:
    """Refuse a new run into a folder that holds anything; with `overwrite` remove a run folder (if `remove`)."""
    keep = (f"error: run folder {run_dir} is not empty: pass --resume {run_dir} to go on with it, "
            "another --run-dir for a new run, or --overwrite to replace it")
    if to_replace(run_dir, overwrite, "--run-dir", "a run folder", is_run, RUN_ENTRIES, keep) and remove and \
            os.environ.get("RANK", "0") == "0":  # under torchrun the other ranks wait for rank 0 in setup
        hold_lock(run_dir).close()  # refuses a folder a live run holds
        shutil.rmtree(run_dir)


NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}  # what a file system without flock answers


def hold_lock(run_dir: Path):
    """An exclusive lock on RUN_DIR/.lock (the open file holds it; the kernel drops it when the process ends)."""
    lock = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise SystemExit(f"error: run folder {run_dir} is in use by another run (pid {holder}); "
                         "wait for it, or choose another --run-dir") from None
    except OSError as e:
        if e.errno not in NO_FLOCK:
            raise
        # Lustre mounted without its flock option, and some NFS set-ups: a start must not fail for a guard.
        print(f"warning: {run_dir} is on a file system without flock ({os.strerror(e.errno)}): "
              "nothing stops a second run from writing into it at the same time", file=sys.stderr)
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def check_resume_dir(run_dir: Path) -> None:
    """Refuse, in one line, a --resume of anything but a run folder, naming what it is and what to pass."""
    if is_run(run_dir):
        return
    if why := run_config_damage(run_dir):  # a run's records without its settings
        steps = sorted(run_dir.glob("checkpoints/step-*"))
        raise SystemExit(f"error: --resume {run_dir}: {why}, and a resume takes the run's settings from it: put back "
                         "a copy of the file, or " + (f"start a new run from its latest checkpoint with --model "
                                                      f"{steps[-1]} --cold-start none" if steps else "start the run again"))
    kind = what_is(run_dir)
    if kind.startswith("a checkpoint") and is_run(run_dir.parent.parent):
        hint = f"pass its run, --resume {run_dir.parent.parent} (or evaluate it with eval.py --model {run_dir})"
    elif kind.startswith(("a model", "a checkpoint")):
        hint = f"to start RL from it, pass --model {run_dir} --cold-start none (a new run)"
    elif kind.startswith("a folder of runs") and any(is_run(p) for p in run_dir.iterdir()):
        hint = f"pass one of them, e.g. --resume {next(p for p in sorted(run_dir.iterdir()) if is_run(p))}"
    else:
        hint = "pass a folder retool.py made (it holds the run's config.json)"
    raise SystemExit(f"error: --resume {run_dir} is {kind}, not a run folder: {hint}")


def check_eval_out(out: Path, overwrite: bool) -> None:
    """eval.py --out: a new or empty folder, or with `overwrite` an earlier evaluation (removed); else one line."""
    keep = (f"error: --out {out} holds an earlier evaluation ({out / 'summary.json'}): "
            "pass another --out, or --overwrite to replace it")
    if to_replace(out, overwrite, "--out", "an evaluation folder", is_evaluation, EVAL_ENTRIES, keep):
        shutil.rmtree(out)


def to_replace(folder: Path, overwrite: bool, flag: str, kind: str, is_kind, entries: set[str], keep: str) -> bool:
    """False if `folder` is new or empty; True if it is `kind`, holds only `entries` and `overwrite` asks (to be
    removed); else a one-line refusal (`keep` if not asked)."""
    from lab_cli import cannot_write, name_too_long

    if why := name_too_long(folder):  # else a traceback from the first look at it (File name too long)
        raise SystemExit(f"error: {flag} {str(folder)[:40]}...: {why}; choose a shorter {flag}")
    if why := cannot_write(folder):  # a read-only disk, /proc: refused in seconds, not after the work
        raise SystemExit(f"error: {flag} {folder}: cannot write there ({why}); choose a folder on a writable disk")
    if not folder.is_dir() or not any(folder.iterdir()):
        return False
    if not is_kind(folder):
        raise SystemExit(f"error: {flag} {folder} is {what_is(folder)}, not {kind}, and not empty: choose another "
                         f"{flag} (--overwrite only ever replaces {kind})")
    if not overwrite:
        raise SystemExit(keep)
    if foreign := sorted(p.name for p in folder.iterdir() if p.name not in entries):
        names = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise SystemExit(f"error: {flag} {folder} also holds {names}, which the lab did not write: --overwrite "
                         "leaves it as it is; move those out, or choose another " + flag)
    here, target = Path.cwd().resolve(), folder.resolve()
    if here == target or target in here.parents:
        raise SystemExit(f"error: {flag} {folder} holds the folder this command runs in: --overwrite leaves it as it is")
    return True


def read_object(path: Path) -> dict | None:
    """The JSON object in `path`, or None if there is none (missing, unreadable, not JSON, not an object)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def is_run(folder: Path) -> bool:
    config = read_object(folder / "config.json") if folder.is_dir() and not folder.is_symlink() else None
    return config is not None and all(name in config for name in RUN_MARKS)


def run_config_damage(folder: Path) -> str | None:
    """What is wrong with the config.json of a folder that holds a run's records; None without records or damage."""
    if not folder.is_dir() or not any((folder / name).exists() for name in ("checkpoints", "metrics.jsonl", ".lock")):
        return None
    config = folder / "config.json"
    if not config.exists():
        return f"{config} is missing"
    try:
        value = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        return f"{config} cannot be read as JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    missing = [name for name in RUN_MARKS if not isinstance(value, dict) or name not in value]
    return f"{config} lacks {', '.join(missing)}" if missing else None


def is_evaluation(folder: Path) -> bool:
    summary = read_object(folder / "summary.json") if folder.is_dir() and not folder.is_symlink() else None
    return summary is not None and "sets" in summary


def what_is(folder: Path) -> str:
    """A few words on what `folder` is, for a refusal: "a checkpoint (a model folder)", "a git clone (it has .git)"..."""
    if folder.is_symlink():
        return f"a symbolic link (to {os.readlink(folder)})"
    if not folder.exists():
        return "a path that does not exist"
    if not folder.is_dir():
        return "a file"
    if is_run(folder):
        return "a run folder"
    if is_evaluation(folder):
        return "an evaluation folder"
    config = read_object(folder / "config.json") or {}
    if "model_type" in config:
        return "a checkpoint (a model folder)" if (folder / "state.json").exists() else "a model folder"
    if (folder / ".git").exists():
        return "a git clone (it has .git)"
    if why := run_config_damage(folder):
        return f"a run whose {why}"
    if held := [p.name for p in sorted(folder.iterdir()) if is_run(p) or is_evaluation(p)]:
        return f"a folder of runs ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''})"
    return "a folder the lab did not make"


# What a resumed run may change freely: when and how it evaluates, saves, logs and runs, not what it learns.
FREE_ON_RESUME = {"steps", "eval_every", "eval_problems", "eval_k", "eval_temperature", "eval_max_response_tokens",
                  "eval_text", "save_every", "keep_checkpoints", "log", "sandbox_backend", "sandbox_urls",
                  "sandbox_timeout", "sandbox_isolation", "sandbox_preload", "trainer_threads", "gpu_memory_utilization",
                  "cpu_kv_cache_gib", "enforce_eager", "micro_batch_size", "gradient_checkpointing",
                  "skip_zero_advantage", "rollout_schedule", "strategy"}


def resume_config(config_class, run_dir: Path, overrides: dict, argv: list[str] | None, change_recipe: bool):
    """The Config of the run in `run_dir` with `overrides`, refusing what a resume would ignore or silently change."""
    from configuration import field_flag

    check_resume_dir(run_dir)
    given = [a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)]
    if clash := [flag for flag in ("--preset", "--run-dir", "--overwrite") if flag in given]:
        raise SystemExit(f"error: --resume {run_dir} takes its folder and settings from the run, so {clash[0]} "
                         "would be ignored: drop it, or start a new run without --resume")
    recorded = read_object(run_dir / "config.json")
    changed = [name for name, value in overrides.items()
               if name not in FREE_ON_RESUME and name in recorded and recorded[name] != value]
    if changed and not change_recipe:
        name = changed[0]
        raise SystemExit(f"error: --resume {run_dir} with {field_flag(name)} {overrides[name]}: the run was trained "
                         f"with {name} {recorded[name]}; pass --change-recipe to change it mid-run (recorded in "
                         "config.json), or start a new run")
    names = {f.name for f in dataclasses.fields(config_class)}  # config.json also records facts of the run
    return config_class(**{k: v for k, v in {**recorded, **overrides}.items() if k in names})


def recipe_changes(run_dir: Path, cfg, step: int) -> list[dict]:
    """config.json's record of recipe changes made on resume, with the one at `step` (if any) added."""
    recorded = read_object(run_dir / "config.json") or {}
    changes = list(recorded.get("recipe_changes", []))
    now = {f.name: [recorded[f.name], getattr(cfg, f.name)] for f in dataclasses.fields(cfg)
           if f.name not in FREE_ON_RESUME and f.name in recorded and recorded[f.name] != getattr(cfg, f.name)}
    return changes + ([{"step": step, **now}] if now else [])


def stopped_before_training(stop, run_dir: Path) -> str:
    """The line for a stop before the first step: resume advice only where there is a run to resume."""
    if is_run(run_dir):
        return f"stopped by {stop} before training began; go on with --resume {run_dir}"
    return f"stopped by {stop} before the run folder was made: nothing to resume; start it again"


def take_run_settings(args) -> None:
    """eval.py on a run's checkpoint: its run's context, response budget and template unless given (eval.py's are
    ToRL's, far above a tiny model's context)."""
    model = Path(args.model)
    run = read_object(model.parent.parent / "config.json") if is_run(model.parent.parent) else None
    needed = [f"--{name.replace('_', '-')}" for name in ("max_model_len", "max_response_tokens", "template")
              if getattr(args, name) is None]
    if model.parent.name == "checkpoints" and needed and (why := run_config_damage(model.parent.parent)):
        raise SystemExit(f"error: --model {model} is a checkpoint of a run whose {why}: eval.py takes the run's "
                         f"context, response budget and template from it; put back a copy of the file, or pass "
                         f"{', '.join(needed)}")
    if run and args.mode == "tir" and args.template is not None and run.get("template", args.template) != args.template:
        print(f"note: --template {args.template}, and the run {model.parent.parent} was trained with the template "
              f"{run['template']}: a prompt its model never saw may score 0 (leave --template out to take the run's)",
              file=sys.stderr)
    taken = {}
    for name, field in (("max_model_len", "max_model_len"), ("max_response_tokens", "eval_max_response_tokens"),
                        ("template", "template")):
        if getattr(args, name) is None and run and field in run and (name != "template" or args.mode == "tir"):
            setattr(args, name, run[field])
            taken[name] = run[field]
    if taken:
        print(f"settings of the run {model.parent.parent}: " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                         for k, v in taken.items()), file=sys.stderr)
    args.max_response_tokens = args.max_response_tokens or 3072
