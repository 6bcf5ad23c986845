"""Copies of the run's records for the tools people watch runs with: TensorBoard and W&B.

    .venv/bin/python 05-retool/retool.py --log tensorboard          # event files in RUN_DIR/tensorboard
    .venv/bin/python 05-retool/retool.py --log wandb                # a W&B run (offline without a network)
    .venv/bin/python 05-retool/retool.py --log tensorboard,wandb

metrics.jsonl and eval.jsonl stay the record; a tracker gets each row under the same keys (docs/05-runs.md, "Logs").
"""
from __future__ import annotations

import math
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

LOGGERS = ("tensorboard", "wandb")
INSTALL = "the {} package: .venv/bin/pip install -r requirements/logging.txt"  # either tracker's


def parse_log(text: str) -> list[str]:
    """"tensorboard,wandb" -> ["tensorboard", "wandb"]; raises ValueError (one line) on an unknown name."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if unknown := [name for name in names if name not in LOGGERS]:
        raise ValueError(f"log '{unknown[0]}' is not one of {', '.join(LOGGERS)}")
    return names


def missing_package(log: str) -> str | None:
    """A one-line error if a tracker named in `log` cannot be imported, else None; checked before any model loads."""
    import importlib.util

    for name in parse_log(log):
        if importlib.util.find_spec(name) is None:  # torch.utils.tensorboard needs the tensorboard package
            return f"--log {name} needs {INSTALL.format(name)}"
    return None


def open_trackers(log: str, run_dir: Path, config: dict, start_step: int = 0) -> "Trackers":
    """The trackers named in `log`; from `start_step` TensorBoard drops redone steps' events, W&B resumes its id."""
    if missing := missing_package(log):  # the start's check (config_problems), for any other caller
        raise SystemExit(f"error: {missing}")
    writers = []  # (write(scalars, step), close) per tracker
    for name in parse_log(log):
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            board = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1)

            def write(scalars: dict, step: int, board=board) -> None:
                for key, value in scalars.items():
                    board.add_scalar(key, value, step)
                board.flush()

            writers.append((write, board.close))
        else:
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_reachable(wandb) else "offline")
            run = wandb.init(project=os.environ.get("WANDB_PROJECT", "tool-rl-lab"), name=run_dir.name,
                             id=_run_id(run_dir), resume="allow", dir=str(run_dir), config=config, mode=mode)
            print(f"wandb: {mode} run {run.id} in {run_dir / 'wandb'}")
            writers.append((lambda scalars, step, run=run: run.log(scalars, step=step), run.finish))
    return Trackers(writers)


class Trackers:
    def __init__(self, writers: list) -> None:
        self.writers = writers

    def log(self, row: dict) -> None:
        """A metrics.jsonl row: its numbers under their own keys, at its step."""
        self._write(scalars_of(row), row["step"])

    def log_eval(self, row: dict) -> None:
        """An eval.jsonl row: every number of every set as eval/<set>/<metric>, at its step."""
        self._write({f"eval/{name}/{key}": value for name, summary in row["sets"].items()
                     for key, value in scalars_of(summary).items()}, row["step"])

    def _write(self, scalars: dict, step) -> None:
        for write, _ in self.writers:
            write(scalars, int(step))

    def close(self) -> None:
        for _, close in self.writers:
            close()


def scalars_of(row: dict) -> dict[str, float]:
    """The finite numbers of a row (not its step, lists or text), as floats."""
    return {key: float(value) for key, value in row.items() if key != "step" and not isinstance(value, bool)
            and isinstance(value, (int, float)) and math.isfinite(value)}


def _run_id(run_dir: Path) -> str:
    """One W&B id per run folder, so a resume continues the same run."""
    import hashlib

    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', run_dir.name)[:40]}-{digest}"


def _wandb_reachable(wandb, timeout: float = 3.0) -> bool:
    """Whether W&B's server answers a TCP connection within `timeout` s (no key, no network: offline)."""
    try:
        url = urlparse(wandb.Settings().base_url)
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout):
            return True
    except Exception:
        return False
