"""Chapter 06's experiment in one command: from the released base, its moves check, RL at C = 1 and 4, a report.

    make run-06                                  # one seed: C = 1 and 4, 60 steps each (about 6 min)
    make run-06 ARMS=budget                      # C = 2 as well: the page's three budgets
    make run-06 SEEDS="5 6 7" ARMS=all           # every arm of ablation.py, three seeds
    make run-06 ARGS="--base runs/base-06/base"  # from a base `make base-06` made instead of the released one
    .venv/bin/python 06-train/experiment.py --seeds 0 --arms budget -- --steps 30   # retool.py's flags after --

Four stages (docs/06-experiments.md), each kept once done, so that Ctrl-C and the same command go on where it
stopped: the data, the base and its moves check, the RL runs (ablation.py's run_arm), OUT/report.md. A folder of
another recipe or base is refused, never overwritten; nothing is written under docs/ unless --results NAME asks.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from ablation import ARMS, load_runs, results_key, run_arm
from ablation import report as arms_report
from configuration import Config, check_config, make_config, number_problems, parse_with_field_flags
from lab_cli import run_script, script_parser
from presets import PRESETS
from released_base import RELEASES, released_base, sha256

BUDGET_ARMS = ["calls-1", "calls-2", "baseline"]  # C = 1, 2, 4 (findings.BUDGETS)
# The default: the budget's two ends, which show its cap and hold the baseline's findings; C = 2 is one word away
DEFAULT_ARMS = ["calls-1", "baseline"]
PRESET = "cpu-chained"
RELEASE = RELEASES[PRESET]  # 06-train/base
PAGE_RESULTS = "06-experiments-released"  # the page's runs, which the report sets beside these
# Time-left estimates, two idle cores (make bench-06): moves check, RL step (C = 1 and 4's mean), a run's fixed part.
SECONDS = {"moves_check": 5.0, "rl_step": 2.5, "rl_run_fixed": 20.0}


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    cfg = chained_config(args.flags)  # refused here, in one line, before any model loads
    for seed in args.seeds:  # each run's seed as its retool.py checks it, before the data stage (a minute and more)
        if problems := number_problems(dataclasses.replace(cfg, seed=seed), world=1):
            raise SystemExit(f"error: --seeds {seed}: {problems[0]}")
    base = args.base or released_base(RELEASE)  # the released base's files checked against their sha256
    out = Path(args.out)
    # the recipe (`recipe`), not seeds or arms, which only add runs
    claim(out, {"preset": PRESET, "config": dataclasses.asdict(cfg), "flags": args.flags, "base": base_hash(base)})
    runs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    clock = Clock(cfg, len(runs))
    try:
        report = run_stages(cfg, args, base, out, runs, clock)
    except KeyboardInterrupt:  # Ctrl-C reaches the run's retool.py too, which stops at once
        from stopping import Stopped

        print(f"run-06: stopped by SIGINT (Ctrl-C); the same command goes on in {out}: finished stages are kept, "
              "a run cut short goes on from its last checkpoint", file=sys.stderr)
        raise Stopped(2) from None  # exit 130, as every script of the lab stopped by Ctrl-C
    print(f"run-06: done in {clock.finish(out)}; the report: {report}")
    return report


def run_stages(cfg, args, base: str, out: Path, runs: list, clock) -> Path:
    """The four stages; each one done is kept in OUT, so a second call goes on from the first it has not."""
    from problems_and_policy import load_data

    clock.stage("data", f"{cfg.train_file} and {cfg.eval_file}")
    load_data(cfg)
    clock.stage("base", f"the moves check of {base} on this machine")
    moves_checked(base, moves_here(base, out, cfg), args.ignore_moves_check)
    for number, (arm, seed) in enumerate(runs, 1):
        clock.stage("runs", f"run {number} of {len(runs)}: {arm}, seed {seed}, {cfg.steps} steps", run=number)
        try:
            run_arm(base, out / f"{arm}-s{seed}", arm, seed, cfg.steps, PRESET, args.flags)
        except subprocess.CalledProcessError as e:
            if e.returncode in (130, -2):  # the run saw the Ctrl-C first
                raise KeyboardInterrupt from None
            raise SystemExit(f"error: the run {out / f'{arm}-s{seed}'} stopped (exit {e.returncode}); its last "
                             "lines are above. The same command goes on from there") from None
    clock.stage("report", str(out / "report.md"))
    return write_report(out, args.results)


def chained_config(flags: list[str]):
    """The cpu-chained preset with retool.py's `flags` over it, checked as retool.py checks a run's."""
    parser = argparse.ArgumentParser(prog="experiment.py ... --")
    parser.add_argument("--preset", choices=[PRESET], default=PRESET)
    _, overrides = parse_with_field_flags(parser, Config, ["--preset", PRESET, *flags], PRESETS)
    cfg = make_config(PRESET, overrides)
    check_config(cfg)
    return cfg


def claim(out: Path, wanted: dict) -> None:
    """Make OUT this recipe's folder, or find it so; refuse a folder of another recipe, or not an experiment's."""
    record = out / "experiment.json"
    if record.exists():
        made, wanting = recipe(json.loads(record.read_text())), recipe(wanted)
        fields = wanted.get("config", {})  # a changed setting is named by its field, before the flags that set it
        changed = sorted((k for k in set(made) | set(wanting) if made.get(k) != wanting.get(k)),
                         key=lambda k: (k not in fields, k))
        if changed:
            name = changed[0]
            raise SystemExit(f"error: {out} holds an experiment of another recipe ({name} {made.get(name)!r}, "
                             f"not {wanting.get(name)!r}): pass another --out, or remove that folder")
        print(f"going on in {out}: the stages it finished are kept")
        return
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: {out} is not empty and not an experiment's folder (no experiment.json): "
                         "pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    record.with_suffix(".tmp").write_text(json.dumps(wanted, indent=1))
    record.with_suffix(".tmp").replace(record)


def recipe(record: dict) -> dict:
    """What makes a folder's runs what they are, flat: the Config's fields by name, then the rest of the record
    (flags, the base's hash, kernels), but the commit that first wrote it."""
    return {**record.get("config", {}), **{k: v for k, v in record.items() if k not in ("config", "commit")}}


def base_hash(base: str) -> str:
    """The sha256 of the base's weights: a folder's runs are of one base."""
    weights = Path(base) / "model.safetensors"
    if not weights.is_file():
        raise SystemExit(f"error: --base {base}: no model.safetensors there (a base of `make base-06` is "
                         "runs/base-06/base)")
    return sha256(weights)


def moves_here(base: str, out: Path, cfg) -> dict:
    """The base's moves check on this machine (moves_check.check_base), kept in OUT/moves.json once made."""
    kept = out / "moves.json"
    if not kept.exists():
        from moves_check import check_base

        moves = check_base(base, cfg.template, cfg.seed, said_by="run-06")
        kept.with_suffix(".tmp").write_text(json.dumps(moves))
        kept.with_suffix(".tmp").replace(kept)
    return json.loads(kept.read_text())


def moves_checked(base: str, moves: dict, ignore: bool) -> None:
    """RL from a base that fails the moves check is refused in one line (--ignore-moves-check runs it anyway)."""
    from moves_check import MOVES, MOVES_NEEDED

    said = ", ".join(f"{m} {moves.get(m, 0):.2f}" for m in MOVES)
    if moves.get("passed"):
        print(f"run-06: the base has every move ({said}; each at least {MOVES_NEEDED})")
    elif ignore:
        print(f"run-06: the base lacks a move ({said}); RL goes on (--ignore-moves-check)")
    else:
        raise SystemExit(f"error: the base {base} fails the moves check ({said}; each must reach {MOVES_NEEDED}): "
                         "RL would have little to amplify (docs/06-experiments.md); --ignore-moves-check runs it anyway")


class Clock:
    """One line per stage with the time left: estimated from SECONDS, then paced by the runs timed so far."""

    def __init__(self, cfg, runs: int):
        self.left = {"data": 1.0, "base": SECONDS["moves_check"],
                     "runs": runs * (SECONDS["rl_run_fixed"] + cfg.steps * SECONDS["rl_step"]), "report": 5.0}
        self.runs, self.seconds, self.current, self.since = runs, {}, None, time.time()

    def stage(self, name: str, what: str, run: int = 0) -> None:
        self._count()
        if self.current and self.current != name:
            self.left[self.current] = 0.0
        self.current = name
        if run > 1:  # the runs timed so far set the pace of the rest
            self.left["runs"] = self.seconds["runs"] / (run - 1) * (self.runs - run + 1)
        print(f"run-06: {list(self.left).index(name) + 1}/{len(self.left)} {name}: {what}; about "
              f"{minutes(sum(self.left.values()))} left", flush=True)

    def finish(self, out: Path) -> str:
        """Writes OUT/timings.json, each stage's seconds in this call (a stage kept from before took none); the total."""
        self._count()
        (out / "timings.json").write_text(json.dumps({k: round(v, 1) for k, v in self.seconds.items()}))
        return minutes(sum(self.seconds.values()))

    def _count(self) -> None:
        now = time.time()
        if self.current:
            self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self.since
        self.since = now


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def write_report(out: Path, results_name: str | None) -> Path:
    """OUT/report.md: each finding of these runs beside the page's seeds, the base's moves, the plots (in OUT)."""
    import findings
    import results

    runs = findings.load_runs(out)
    mine, page = findings.summarise(runs, out), results.load(PAGE_RESULTS)["figures"]
    findings.plot_all(runs, out)
    seeds = " / ".join(str(s) for s in sorted({s for _, s in runs}))
    lines = ["# Chapter 06's experiment: these runs beside the page's", "",
             f"Runs of `{out}`, seeds {seeds} (their mean); the page's: docs/06-experiments.md, each of its seeds. A "
             f"share agrees with the page when it lies within the page's seeds widened by {AGREES} on each side.", "",
             "| figure | these runs | the page's seeds | agrees |", "| --- | --- | --- | --- |"]
    for arm, budget in findings.BUDGETS.items():
        for name, label in (("held_out", "held-out accuracy after RL"), ("gain", "gain over the base")):
            lines += compared(mine, page, arm, name, f"C = {budget}: {label}")
    for name in findings.SELF_CORRECTION + findings.CODE_USE:
        for when, words in (("first5", "first 5 steps"), ("last10", "last 10 steps")):
            lines += compared(mine, page, "baseline", f"{name}_{when}", f"C = 4: {name}, {words}",
                              share=name != "response_length")
    lines += ["", *moves_table(out), "", *(f"![{png}]({png})" for png in findings.PLOTS)]
    if {arm for arm, _ in load_runs(out, ARMS)} - set(findings.BUDGETS):  # docs/06-beyond-torl.md's options too
        lines += ["", "## Every arm", "", arms_report(out, out)]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    if results_name:  # the pages' own files: only when asked
        results.save(results_name, " ".join(["06-train/experiment.py", *sys.argv[1:]]), mine)
        findings.plot_all(runs, results.ROOT / "docs" / "img")
    return report


AGREES = 0.1  # two standard errors of one held-out figure (one sample on each of 100 problems: about 0.05)


def compared(mine: dict, page: dict, arm: str, name: str, label: str, share: bool = True) -> list[str]:
    """A report row: this folder's mean of a figure, the range of the page's seeds, and whether it lies within
    that range widened by AGREES (a share only); no row where this folder has no such run."""
    import re

    key = results_key(arm)
    if f"{key}_mean_{name}" not in mine:
        return []
    value, seeds = mine[f"{key}_mean_{name}"], [v for k, v in page.items() if re.fullmatch(rf"{key}_s\d+_{name}", k)]
    low, high = min(seeds), max(seeds)
    agrees = ("yes" if low - AGREES <= value <= high + AGREES else "no") if share else ""
    return [f"| {label} | {value:.2f} | {low:.2f} to {high:.2f} | {agrees} |"]


def moves_table(out: Path) -> list[str]:
    """The base's moves check on this machine (OUT/moves.json) beside the released base's on the machine that made it."""
    import results
    from moves_check import DECISIONS, MOVES

    here, release = json.loads((out / "moves.json").read_text()), results.load(RELEASE.results)["figures"]
    return ["| the base's moves check | on this machine | the released base, where it was made |", "| --- | --- | --- |",
            *(f"| {name} | {here[name]:.3f} | {release[f'moves_{name}']:.3f} |" for name in MOVES + DECISIONS)]


def parse_args(argv):
    p = script_parser(__doc__)
    p.add_argument("--out", default="runs/experiment-06", help="the experiment's folder (default runs/experiment-06)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="RL seeds (default 0; the page's: 5 6 7)")
    p.add_argument("--arms", nargs="+", default=DEFAULT_ARMS,
                   help="arm names (default calls-1 baseline: C = 1 and 4), budget (C = 1, 2, 4: calls-1 calls-2 "
                        "baseline) or all (every arm of ablation.py)")
    p.add_argument("--base", help="the base model's folder (default: the released base, 06-train/base)")
    p.add_argument("--ignore-moves-check", action="store_true", help="run RL even from a base that fails the moves check")
    p.add_argument("--results", metavar="NAME", help="also write the figures to docs/results/NAME.json and the plots "
                                                     "to docs/img (the pages' own: only to remake them)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="after --: retool.py's flags over the cpu-chained preset")
    args = p.parse_args(argv)
    args.flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    named = {"budget": BUDGET_ARMS, "all": list(ARMS)}
    args.arms = list(dict.fromkeys(a for name in args.arms for a in named.get(name, [name])))
    if unknown := [a for a in args.arms if a not in ARMS]:
        p.error(f"--arms: no arm '{unknown[0]}' (budget, all, or one of {', '.join(ARMS)})")
    if "baseline" not in args.arms:
        p.error("--arms: the report compares with the baseline (C = 4); keep it in")
    return args


if __name__ == "__main__":
    run_script(main)  # Ctrl-C: "stopped by SIGINT (Ctrl-C)", exit 130; the same command goes on where it stopped
