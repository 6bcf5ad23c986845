"""What a run leaves on disk so that it can go on: checkpoints, random state, and its metrics and eval records.

Key decisions: a checkpoint folder is complete or absent (written under a
`.tmp` name, every file flushed, then renamed); metrics.jsonl and eval.jsonl
are appended and flushed line by line, and a resume cuts the lines of steps
after its checkpoint; a stop saves the last finished step before exiting.
The story: docs/05-retool.md, "Checkpoints, resume, stop, bad configuration".
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

from stopping import STOPPER, StopRequested


def save_checkpoint(run_dir: Path, step: int, model, optimizer, tokenizer, keep: int, rng: dict | None = None) -> Path:
    """Hugging Face weights + tokenizer + optimizer + RNG state, written to a temporary folder then renamed.

    A checkpoint folder either is complete or does not exist: a kill mid-write
    leaves only a `.tmp` folder, which the next save or resume ignores. Every
    file is flushed to disk before the rename, so a power cut right after it
    cannot leave a complete-looking folder of empty files. `rng` is the random
    state to record (default: the current one).
    """
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a "Writing model shards" bar per checkpoint would bury the step lines
    root = run_dir / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
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
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync(root)  # the rename itself
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(run_dir: Path) -> dict | None:
    """{"path": folder, "step": N} of the newest complete checkpoint, or None."""
    complete = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if (p / "state.json").exists())
    if not complete:
        return None
    path = complete[-1]
    return {"path": str(path), **json.loads((path / "state.json").read_text())}


def load_optimizer(state: dict, optimizer) -> None:
    """The checkpoint's optimizer state, mapped onto the CPU first; `load_state_dict` moves it to the weights' device.

    Read straight to where it was saved from, a GPU would briefly hold a second
    copy of AdamW's moments (twice the model in float32) beside the live ones.
    Memory-mapped, the file is read only where a tensor is used: ranks that
    take rank 0's state instead (FSDP2) read nothing, and ranks on one node
    share one copy in the page cache (torl-7b's file is 61 GB).
    """
    import torch

    shards = Path(state["path"]) / "optimizer"
    if shards.is_dir():  # FSDP2: each rank reads its own shard
        optimizer.load_shards(shards)
        return
    path = Path(state["path"]) / "optimizer.pt"
    optimizer.load_state_dict(torch.load(path, map_location="cpu", mmap=True))


def capture_rng() -> dict:
    import torch

    import numpy as np

    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict) -> None:
    import torch

    import numpy as np

    random.setstate(rng["python"])
    if "numpy" in rng:  # checkpoints written before numpy's state was kept have none
        np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def stop_with_checkpoint(stop: StopRequested, run_dir: Path, step: int, rng: dict, model, optimizer, tokenizer,
                         keep: int, dp):
    """Save `step`, the last finished one, unless it is saved already; then exit with 128 + the signal.

    `rng` is the random state right after that step. Data parallel: rank 0 saves
    its replica alone, with no collective, since the other ranks may be anywhere;
    FSDP2 shards cannot be gathered then, so such a run resumes from its last save.
    """
    final = run_dir / "checkpoints" / f"step-{step:06d}"
    if step > 0 and not (final / "state.json").exists() and dp.is_main and dp.strategy != "fsdp":
        STOPPER.hold()  # a further signal while saving waits (a third one stops at once)
        save_checkpoint(run_dir, step, dp.unwrap(model), optimizer, tokenizer, keep, rng=rng)
    saved = f"checkpoint {final}" if step > 0 else "no checkpoint (no step finished)"
    print(f"stopped by {signal.Signals(stop.signum).name} after step {step}: {saved}; "
          f"go on with --resume {run_dir}", file=sys.stderr)
    raise SystemExit(128 + stop.signum) from None


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` from metrics.jsonl or eval.jsonl, atomically."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    _fsync(tmp)
    os.replace(tmp, path)


def has_eval_row(run_dir: Path, step: int, tag: str | None = None) -> bool:
    """Whether eval.jsonl has a row for `step` (with `tag`, if given)."""
    path = run_dir / "eval.jsonl"
    if not path.exists():
        return False
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return any(r["step"] == step and (tag is None or r.get("tag") == tag) for r in rows)


def append_jsonl(path: Path, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(json_safe(row)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def json_safe(value):
    """`value` with NaN and infinities as null: JSON has no NaN (an empty set's ratio is undefined, not a number)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
