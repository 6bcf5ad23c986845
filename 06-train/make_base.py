"""The recipe of a released base in one command: a preset's cold starts with the kernels held, then the release.

    make base-05                       # the demo's base (cpu-demo's cold start) into runs/base-05, about 7 min
    make base-06                       # cpu-chained's base and its moves check into runs/base-06, about 1 h 45 min
    make base-06 ARGS="--release"      # ... and release it: 06-train/base/ and docs/results/06-base.json

The kernels are held to one path (torch's default CPU kernels, MKL's compatible path, one thread), so that the recipe
gives the same weights on every x86-64 machine with the lab's versions (docs/06-experiments.md). After Ctrl-C the same
command goes on; a folder of another recipe is refused; a tree with uncommitted edits is not released.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import results
from configuration import make_config
from experiment import chained_config, claim
from lab_cli import run_script, script_parser
from released_base import FILES, RELEASES, sha256, sha256_key

KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
THREADS = 1  # a parallel sum splits its work by thread (two threads gave other weights than one): one, everywhere


def hold_kernels() -> None:
    """Set KERNELS over whatever the machine's environment says. torch and MKL read them once, as they load: so
    before either does, or refused."""
    if "torch" in sys.modules and any(os.environ.get(k) != v for k, v in KERNELS.items()):
        raise RuntimeError("hold_kernels() must run before torch is imported")
    os.environ.update(KERNELS)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    release_to = RELEASES[args.preset]
    if args.release and commit().endswith("-dirty"):  # before hours of cold starts, not after
        raise SystemExit("error: the tree has uncommitted edits, and a release records the commit that made it: "
                         "commit them, then run the same command again")
    preset = chained_config([]) if args.preset == "cpu-chained" else make_config(args.preset, {})
    cfg = dataclasses.replace(preset, cold_start="scratch", model="", cold_start_cache=False, trainer_threads=THREADS)
    kernels = {name: os.environ.get(name, "") for name in KERNELS}  # as set for this process (tests leave them)
    out = Path(args.out or f"runs/{release_to.target}")
    claim(out, {"config": dataclasses.asdict(cfg), "kernels": kernels, "commit": commit()})
    from moves_check import DECISIONS, MOVES
    from problems_and_policy import cold_started_model, load_data

    load_data(cfg)
    name = release_to.target
    print(f"{name}: the recipe's {1 + len(cfg.cold_start_schedules.split())} cold start(s) into {out / 'base'}, "
          f"kernels held to one path ({' '.join(f'{k}={v}' for k, v in kernels.items())}, {THREADS} thread{'s' * (THREADS > 1)})", flush=True)
    try:
        base = Path(cold_started_model(cfg, out))
    except KeyboardInterrupt:  # the schedules done are kept, and the one cut short has its last checkpoint
        from stopping import Stopped

        print(f"{name}: stopped by SIGINT (Ctrl-C); the same command (make {name}) goes on in {out}: "
              "finished cold starts are kept, the one cut short goes on from its last checkpoint", file=sys.stderr)
        raise Stopped(2) from None  # exit 130, as every script of the lab stopped by Ctrl-C
    moves = json.loads((base / "cold_start.json").read_text()).get("moves", {})  # the chained task's check only
    made = results.RESULTS / f"{release_to.results}.json"
    released = results.load(release_to.results)["figures"] if made.exists() else {}
    mine, theirs = sha256(base / "model.safetensors"), released.get(sha256_key("model.safetensors"), "none yet")
    print(f"{name}: {base}/model.safetensors, sha256 {mine}: "
          + ("the released base, bit for bit" if mine == theirs else f"another base than the released one ({theirs})"))
    for move in MOVES + DECISIONS if moves else ():
        print(f"{name}:   {move:6} this base {moves[move]:.3f}" + (f"   the released base {released[f'moves_{move}']:.3f}"
                                                                   if released else ""))
    if moves:
        print(f"{name}: this base {'passes' if moves['passed'] else 'fails'} the moves check")
    if args.release:
        release(base, moves, out, argv if argv is not None else sys.argv[1:], release_to)
    return base


def release(base: Path, moves: dict, out: Path, argv: list[str], release_to) -> None:
    """Copy the base's files to the release's folder (whole or not at all) and write its results file."""
    made = json.loads((out / "experiment.json").read_text())
    if moves and not moves["passed"]:
        raise SystemExit(f"error: {base} fails the moves check: not released")
    if made["commit"].endswith("-dirty"):
        raise SystemExit(f"error: {out} was built from uncommitted changes ({made['commit']}): commit, then build again")
    from moves_check import DECISIONS, MOVES

    folder = release_to.folder
    tmp, old = folder.with_name(".base.tmp"), folder.with_name(".base.old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name in FILES:
        shutil.copyfile(base / name, tmp / name)
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    import torch
    import transformers

    figures = {**{sha256_key(name): sha256(folder / name) for name in FILES},
               **{f"moves_{name}": moves[name] for name in (MOVES + DECISIONS if moves else ())},
               "size_mb": round(sum((folder / name).stat().st_size for name in FILES) / 2**20, 1),
               "commit": made["commit"].removesuffix("-dirty"),
               "uncommitted_edits": "yes" if made["commit"].endswith("-dirty") else "no",
               "threads": THREADS, **{k.lower(): v for k, v in made["kernels"].items()},
               "machine_kernels": native_kernels(), "cpu": cpu_name()[:40], "torch": torch.__version__,
               "transformers": transformers.__version__, "python": platform.python_version()}
    name = release_to.target  # the make target, which names the preset itself
    shown = [a for i, a in enumerate(argv) if a != "--preset" and (i == 0 or argv[i - 1] != "--preset")]
    results.save(release_to.results, results.make_command(name, shown), figures)
    print(f"{name}: released into {folder} ({figures['size_mb']} MiB) and {results.RESULTS / release_to.results}.json")


def commit() -> str:
    """The commit whose code runs, "-dirty" added if tracked files differ from it ("unknown" outside a git checkout)."""
    def git(*words):
        return subprocess.run(["git", *words], cwd=results.ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def native_kernels() -> str:
    """The kernels torch picks on this machine when nothing holds them (AVX2, AVX512, ...)."""
    env = {k: v for k, v in os.environ.items() if k not in KERNELS}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def parse_args(argv):
    p = script_parser(__doc__)
    p.add_argument("--preset", choices=list(RELEASES), default="cpu-chained",
                   help="whose base: cpu-demo (make base-05) or cpu-chained (make base-06, the default)")
    p.add_argument("--out", help="the recipe's folder (default runs/base-05 or runs/base-06)")
    p.add_argument("--release", action="store_true", help="copy the base to the release's folder (05-retool/base or "
                   "06-train/base) and write its docs/results file (only to release a new base)")
    return p.parse_args(argv)


if __name__ == "__main__":
    hold_kernels()  # nothing above imported torch
    run_script(main)
