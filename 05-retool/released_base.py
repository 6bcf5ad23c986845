"""The lab's released bases: a tiny model cold-started by the lab's own recipe, shipped in the repository and checked
by its files' sha256 before any use.

As ToRL starts from a released model, each CPU task starts from one released file (why: docs/06-experiments.md).
`make base-05` and `make base-06` (06-train/make_base.py) are their recipe; each results file records its release.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import results

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Release:
    folder: Path  # where its files are shipped
    results: str  # docs/results/NAME.json: each file's sha256 and how the base was made
    target: str  # the make target that makes it again (06-train/make_base.py)
    train_file: str  # the task it was cold-started on: a run on this file starts from it with --cold-start released


RELEASES = {  # by the preset whose cold start made it (05-retool/presets.py)
    "cpu-demo": Release(results.ROOT / "05-retool" / "base", "05-base", "base-05", "toy_train.jsonl"),
    "cpu-chained": Release(results.ROOT / "06-train" / "base", "06-base", "base-06", "chained_train.jsonl"),
}


def release_for(train_file: str) -> Release | None:
    """The release cold-started on this task's training file (by its name), or None."""
    return next((r for r in RELEASES.values() if Path(train_file).name == r.train_file), None)


def released_base(release: Release) -> str:
    """The release's folder, once each of its files has the sha256 the release records; else one line naming it."""
    expected = results.load(release.results)["figures"]
    for name in FILES:
        if problem := file_problem(release.folder / name, expected[sha256_key(name)]):
            raise SystemExit(f"error: {problem}: not the released base (git checkout -- {shown(release.folder)} restores it)")
    return str(release.folder)


def file_problem(path: Path, want: str) -> str | None:
    """Why `path` is not the file whose sha256 is `want`; None if it is."""
    if not path.is_file():
        return f"{shown(path)} is missing (the release's sha256 {want})"
    got = sha256(path)
    return None if got == want else f"{shown(path)} has sha256 {got[:16]}... ({path.stat().st_size:,} bytes), not the release's {want}"


def shown(path: Path) -> Path:
    """The path as a line names it: from the lab's root where it lies inside it."""
    return path.relative_to(results.ROOT) if path.is_relative_to(results.ROOT) else path


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_key(name: str) -> str:
    """The results file's key of a file's hash: model.safetensors -> sha256_model_safetensors."""
    return "sha256_" + results.figure_key(name)
