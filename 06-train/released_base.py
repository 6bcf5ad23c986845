"""Chapter 06's released base: the chained task's cold-started tiny model, shipped in 06-train/base/ and checked by
its files' sha256 before any use.

ToRL starts RL from a released model, and every reproduction starts from that same file; a tiny model's cold start
belongs to the machine that trains it, so chapter 06 starts from one file too (docs/06-experiments.md says why).
`make base-06` (make_base.py) is its recipe; docs/results/06-base.json records the release: each file's sha256, the
moves check, the commit and the machine that made it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import results

FOLDER = Path(__file__).resolve().parent / "base"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
RESULTS = "06-base"


def released_base() -> str:
    """FOLDER, once each of its files has the sha256 the release records; a changed, truncated or missing file is
    refused in one line that names it and the hash it should have."""
    expected = results.load(RESULTS)["figures"]
    for name in FILES:
        problem = file_problem(FOLDER / name, expected[sha256_key(name)])
        if problem:
            raise SystemExit(f"error: {problem}: not the released base (git checkout -- 06-train/base restores it)")
    return str(FOLDER)


def file_problem(path: Path, want: str) -> str | None:
    """Why `path` is not the file whose sha256 is `want`; None if it is."""
    shown = path.relative_to(results.ROOT) if path.is_relative_to(results.ROOT) else path
    if not path.is_file():
        return f"{shown} is missing (the release's sha256 {want})"
    got = sha256(path)
    return None if got == want else f"{shown} has sha256 {got[:16]}... ({path.stat().st_size:,} bytes), not the release's {want}"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_key(name: str) -> str:
    """The results file's key of a file's hash: model.safetensors -> sha256_model_safetensors."""
    return "sha256_" + results.figure_key(name)
