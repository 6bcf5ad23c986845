"""What a run leaves on disk so that it can go on: checkpoints, random state, and its metrics and eval records.

Key decisions: a checkpoint folder is complete or absent; records are flushed line by line and cut back on resume.
The story: docs/05-runs.md, "Checkpoints" and "Resume".
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import sys
from pathlib import Path

from lab_cli import write_fix
from stopping import STOPPER, Stopped, StopRequested


def save_checkpoint(run_dir: Path, step: int, model, optimizer, tokenizer, keep: int, rng: dict | None = None) -> Path:
    """Weights, tokenizer, optimizer and RNG state into a `.tmp` folder, flushed, then renamed: never half of one."""
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a "Writing model shards" bar per checkpoint would bury the step lines
    root = run_dir / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if hasattr(optimizer, "move_into"):  # FSDP2: every rank has written its shard (distributed.py)
            optimizer.move_into(tmp / "optimizer")
        else:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(rng if rng is not None else capture_rng(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step}))
        for path in sorted(tmp.rglob("*")):
            if path.is_file():
                _fsync(path)
        _fsync(tmp)
    except Exception as e:  # a full or failing disk (torch and safetensors raise their own types for it)
        shutil.rmtree(tmp, ignore_errors=True)  # the half-written folder goes; the last good checkpoint stays
        last = latest_checkpoint(run_dir)
        size = (sum(p.stat().st_size for p in Path(last["path"]).rglob("*") if p.is_file()) if last
                else checkpoint_bytes(model))
        free = shutil.disk_usage(root).free
        why = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
        if free < max(size, 2**27):  # torch says "unexpected pos": say what it means
            why = f"the disk is full: {free / 2**20:.0f} MiB free" + (
                f", a checkpoint takes {'' if last else 'about '}{size / 2**20:.0f} MiB" if size else "")
        kept = f"the last good checkpoint, {last['path']}, is kept" if last else "no checkpoint was saved yet"
        raise SystemExit(f"error: writing checkpoint {final} failed ({why}); {kept}: {write_fix(e)}, "
                         f"then go on with --resume {run_dir}") from None
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync(root)  # the rename itself
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_bytes(model) -> int:
    """About what a checkpoint of `model` takes on disk: its weights and AdamW's two moments, as they are held."""
    parameters = getattr(model, "parameters", lambda: [])()
    return 3 * sum(p.numel() * p.element_size() for p in parameters)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(run_dir: Path) -> dict | None:
    """{"path": folder, "step": N} of the newest complete checkpoint, or None."""
    complete = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if (p / "state.json").exists())
    return {"path": str(complete[-1]), **json.loads((complete[-1] / "state.json").read_text())} if complete else None


def resume_point(run_dir: Path) -> dict | None:
    """The newest complete checkpoint to resume from, or None; one line if it cannot be read back."""
    state = latest_checkpoint(run_dir)
    if state is None or not (why := checkpoint_damage(Path(state["path"]))):
        return state
    earlier = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if (p / "state.json").exists())[:-1]
    then = f"the one before, {earlier[-1]}" if earlier else "the start of RL (the cold-started base, or the model)"
    raise SystemExit(f"error: --resume {run_dir}: its latest checkpoint, {state['path']}, cannot be read back: {why}; "
                     f"remove it with rm -r {state['path']}, then resume again to go on from {then}")


def checkpoint_damage(folder: Path) -> str | None:
    """What is missing or cut short in a checkpoint folder, from the files' own structure, without loading; or None."""
    import zipfile

    if why := weights_damage(folder):
        return why
    for name in ("optimizer.pt", "rng.pt"):
        if not (folder / name).is_file():
            if name == "optimizer.pt" and (folder / "optimizer").is_dir():  # FSDP2's shards
                continue
            return f"it has no {name}"
        try:
            zipfile.ZipFile(folder / name).close()
        except (zipfile.BadZipFile, OSError):
            return f"its {name} is cut short at {(folder / name).stat().st_size:,} bytes"
    return None


def weights_damage(folder: Path) -> str | None:
    """Why a model folder's weights cannot load: none there, or a safetensors file shorter than its header says."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None if any(folder.glob("pytorch_model*.bin")) else "it has no weights (model.safetensors)"
    for path in files:
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(length)) if 0 < length <= size - 8 else None
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            whole = size >= 8 + length + end
        except (ValueError, TypeError, KeyError, AttributeError, OSError):
            whole = False
        if not whole:
            return f"its {path.name} is cut short at {size:,} bytes"
    return None


def load_optimizer(state: dict, optimizer) -> None:
    """The checkpoint's optimizer state, memory-mapped onto the CPU (`load_state_dict` moves it): the GPU never holds
    AdamW's moments twice, and ranks on one node share the page cache."""
    import torch

    shards = Path(state["path"]) / "optimizer"
    if shards.is_dir():  # FSDP2: each rank reads its own shard
        optimizer.load_shards(shards)
    else:
        optimizer.load_state_dict(torch.load(shards.with_suffix(".pt"), map_location="cpu", mmap=True))


def capture_rng() -> dict:
    import numpy as np
    import torch

    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict) -> None:
    import numpy as np
    import torch

    random.setstate(rng["python"])
    if "numpy" in rng:  # checkpoints written before numpy's state was kept have none
        np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def stop_with_checkpoint(stop: StopRequested, run_dir: Path, step: int, rng: dict, model, optimizer, tokenizer,
                         keep: int, dp):
    """Save `step`, the last finished one, unless saved; exit with 128 + the signal. Rank 0 saves alone, with no
    collective (the others may be anywhere): FSDP2 shards cannot be gathered, so such a run resumes from its last."""
    final = run_dir / "checkpoints" / f"step-{step:06d}"
    if step > 0 and not (final / "state.json").exists() and dp.is_main and dp.strategy != "fsdp":
        STOPPER.hold()  # a further signal while saving waits (a third one stops at once)
        save_checkpoint(run_dir, step, dp.unwrap(model), optimizer, tokenizer, keep, rng=rng)
    saved = f"checkpoint {final}" if step > 0 else "no checkpoint (no step finished)"
    print(f"stopped by {signal.Signals(stop.signum).name} after step {step}: {saved}; "
          f"go on with --resume {run_dir}", file=sys.stderr)
    raise Stopped(stop.signum) from None


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` from metrics.jsonl or eval.jsonl, atomically."""
    if not path.exists():
        return
    rows = [row for row in read_rows(path, say_repair=True) if row["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _fsync(tmp)
    os.replace(tmp, path)


def has_eval_row(run_dir: Path, step: int, tag: str | None = None) -> bool:
    """Whether eval.jsonl has a row for `step` (with `tag`, if given)."""
    path = run_dir / "eval.jsonl"
    return path.exists() and any(r["step"] == step and (tag is None or r.get("tag") == tag) for r in read_rows(path))


def read_rows(path: Path, say_repair: bool = False) -> list[dict]:
    """The rows of metrics.jsonl or eval.jsonl; a torn last line left out (said if `say_repair`), a bad one refused."""
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            row = "torn"
        if row is None:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            if number == len(lines) and row == "torn":
                if say_repair:
                    print(f"note: {path}, line {number}: half-written when the run stopped; left out")
                continue
            raise SystemExit(f"error: {path}, line {number}: not a row of the run's record (JSON with a step); "
                             "repair or remove that line, then --resume again")
        rows.append(row)
    return rows


def append_jsonl(path: Path, row: dict) -> None:
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(json_safe(row)) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full disk: one line; the torn line it may leave is dropped on resume
        raise SystemExit(f"error: writing {path} failed ({e.strerror or e}): {write_fix(e)}, then go on with "
                         f"--resume {path.parent}") from None


def json_safe(value):
    """`value` with NaN and infinities as null: JSON has no NaN (an empty set's ratio is undefined, not a number)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
