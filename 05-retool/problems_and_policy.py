"""What a run starts from: its problems and its first policy.

Key decisions: the generated tasks are written on first use, so the demos run without a data step; ToRL's long
prompts are dropped at load, not cut; the first policy follows one explicit setting, Config.cold_start.
The story: docs/05-retool.md.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def load_data(cfg, dp=None) -> tuple[list[dict], list[dict]]:
    """Training and evaluation problems in 01-data's schema; a generated task is written first if missing (rank 0)."""
    if dp is not None:
        with dp.main_first():
            return load_data(cfg)
    from lab_cli import shown
    from prepare_data import DataError, load_problems, write_jsonl

    for name in tasks_to_write(cfg):  # what `make run-01` or the task's own script writes
        files = list(zip(make_task(name), task_files(name)))
        for rows, path in files:
            write_jsonl(rows, path)
        print(f"{name} task written: " + " and ".join(f"{shown(path)} ({len(rows)} problems)" for rows, path in files))
    loaded = []
    for path in (cfg.train_file, cfg.eval_file):
        try:
            rows, dropped = load_problems(path)
        except DataError as e:  # 01-data's loader names the file and the row
            raise SystemExit(f"error: {e}") from None
        if dropped:  # e.g. ToRL's test file holds each AIME problem four times
            print(f"{path}: kept {len(rows)} problems; dropped " + ", ".join(f"{n} ({why})" for why, n in dropped.items()))
        loaded.append(rows)
    if problem := too_few_problems(cfg, len(loaded[0])):
        raise SystemExit(f"error: {problem}")
    return loaded[0], loaded[1]


def too_few_problems(cfg, count: int) -> str | None:
    """Why `count` training problems cannot fill a step of cfg.problems_per_step distinct problems; None if they can."""
    if count >= cfg.problems_per_step:
        return None
    return (f"problems_per_step {cfg.problems_per_step} is more than the {count} problem{'s' * (count != 1)} of train_file "
            f"{cfg.train_file}: a step would hold one problem twice; pass --problems-per-step {count} or less, "
            "or a larger --train-file")


GENERATED_TASKS = ("toy", "word", "chained")  # data/NAME_train.jsonl and data/NAME_test.jsonl, made on first use


def task_files(name: str) -> list[Path]:
    return [Path(f"data/{name}_{part}.jsonl") for part in ("train", "test")]


def tasks_to_write(cfg) -> list[str]:
    """The generated tasks the run names whose two files are both missing (one alone may be the user's: kept)."""
    named = {cfg.train_file, cfg.eval_file}
    return [name for name in GENERATED_TASKS
            if named & {str(p) for p in task_files(name)} and not any(p.exists() for p in task_files(name))]


def make_task(name: str) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of a generated task, as `make run-01` or the task's own script writes them."""
    from chained_problems import SIZES, make_chained_problems
    from prepare_data import make_toy_task
    from word_problems import make_word_problems

    return {"toy": lambda: make_toy_task(2000, 200, seed=0), "word": lambda: make_word_problems(2000, 200, seed=0),
            "chained": lambda: make_chained_problems(*SIZES, seed=0)}[name]()


def fit_prompts(train: list[dict], evaluation: list[dict], model_path: str, cfg) -> list[dict]:
    """The training problems, those over cfg.max_prompt_tokens dropped (if set); a prompt that leaves no room for the
    response budget would fail at its first step: refused here, naming the flag that drops such prompts."""
    if cfg.max_prompt_tokens:
        train = drop_long_prompts(train, model_path, cfg)
    evaluation = evaluation[: cfg.eval_problems] if cfg.eval_problems else evaluation
    for name, problems, budget in (("train_file", train, cfg.max_response_tokens),
                                   ("eval_file", evaluation, cfg.eval_max_response_tokens)):
        room = cfg.max_model_len - budget
        if over := [length for length in prompt_lengths(problems, model_path, cfg.template) if length > room]:
            raise SystemExit(f"error: {name} {getattr(cfg, name)}: {len(over)} of {len(problems)} prompts are longer "
                             f"than the {room} tokens max_model_len {cfg.max_model_len} leaves beside a response of "
                             f"{budget} (the longest: {max(over)}): pass --max-prompt-tokens {room} to drop them at "
                             "load, or a larger --max-model-len")
    return train


def prompt_lengths(problems: list[dict], model_path: str, template: str) -> list[int]:
    """Each problem's rendered prompt, in tokens of the model at `model_path`."""
    from transformers import AutoTokenizer

    from rollout import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [render_prompt(p["question"], template) for p in problems]
    return [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]] if prompts else []


def drop_long_prompts(problems: list[dict], model_path: str, cfg) -> list[dict]:
    """The problems whose prompt has at most `cfg.max_prompt_tokens` tokens, as ToRL's loader: none cut."""
    lengths = prompt_lengths(problems, model_path, cfg.template)
    kept = [p for p, length in zip(problems, lengths) if length <= cfg.max_prompt_tokens]
    print(f"{cfg.train_file}: kept {len(kept)} of {len(problems)} problems; dropped {len(problems) - len(kept)} "
          f"whose prompt is over {cfg.max_prompt_tokens} tokens")
    if not kept:
        raise SystemExit(f"error: {cfg.train_file}: every prompt is over max_prompt_tokens ({cfg.max_prompt_tokens})")
    return kept


def trainer_threads(cfg) -> int:
    return (os.cpu_count() or 1) if cfg.trainer_threads < 0 else cfg.trainer_threads


def trainer_policy(cfg, model_path: str, dp):
    """The trainer's float32 policy, only its top cfg.train_layers trained if set; under torchrun DDP's or FSDP2's."""
    policy = dp.load_policy(model_path)
    if cfg.train_layers:
        from cold_start import freeze_all_but_top

        print(f"training the top {cfg.train_layers} layers: {freeze_all_but_top(policy, cfg.train_layers):,} weights")
    return dp.wrap(policy)


COLD_STARTS = ("released", "scratch", "finetune", "none")


def needs_cold_start(cfg) -> bool:
    return cfg.cold_start in ("scratch", "finetune")


def first_policy(cfg, run_dir: Path, dp) -> str:
    """The folder RL starts from: the task's released base, cold-started in the run folder (by rank 0), or as given."""
    from released_base import release_for, released_base

    if cfg.cold_start == "released":
        return released_base(release_for(cfg.train_file))
    with dp.main_first():
        return cold_started_model(cfg, run_dir) if needs_cold_start(cfg) else local_model(cfg.model)


def local_model(model: str) -> str:
    """SmolLM2's hub id becomes a local folder (hub, else the package's GGUF converted); anything else is as given."""
    from smollm2 import HUB_ID, ModelUnavailable, smollm2_path

    if model != HUB_ID:
        return model
    try:
        return smollm2_path()
    except ModelUnavailable as e:
        raise SystemExit(f"error: {e}")


def cold_started_model(cfg, run_dir: Path) -> str:
    """RUN_DIR/base: cold_start.py once per schedule (earlier ones in RUN_DIR/base-schedules/N), each from the last
    one's weights; one done is kept, one made before from the same inputs (cold_start_cache) copied."""
    import cold_start
    from lab_cli import caches_kept
    from smollm2 import default_cache_dir

    argvs, base = cold_start_argvs(cfg), run_dir / "base"
    keep = cfg.cold_start_cache and caches_kept()  # not where the cache folder cannot be written (lab_cli.py)
    key, source = "", None
    for number, argv in enumerate(argvs, 1):
        out = base if number == len(argvs) else run_dir / "base-schedules" / str(number)
        if number == 1 and cfg.cold_start == "finetune":  # a pretrained model: find it (hub, else the package's GGUF)
            from rollout import render_prompt
            from smollm2 import check_template

            source = local_model(cfg.model)
            if "<|im_start|>" in render_prompt("", cfg.template):  # ChatML: the model's own template must agree
                check_template(source, cfg.template)
            argv = argv + ["--model", source]
        key = cold_start_key(argv, cfg.train_file, source if number == 1 else None, before=key)
        argv = argv + ["--out", str(out)] + (["--model", str(previous)] if number > 1 else [])
        previous = out
        if (out / "cold_start.json").exists():
            continue
        cached = default_cache_dir() / "cold-start" / key if keep else None  # the lab's cache folder, never in git
        if cached is not None and (cached / "cold_start.json").exists():
            copy_whole(cached, out)
            print(f"cold start: the base made before from the same inputs, {cached} (--cold-start-cache false trains anew)")
            continue
        if len(argvs) > 1:
            print(f"cold start: schedule {number} of {len(argvs)} ({argv[argv.index('--steps') + 1]} steps) into {out}")
        cold_start.main(argv)
        if cached is not None:
            keep_in_cache(out, cached)
    return str(base)


def copy_whole(source: Path, to: Path) -> None:
    """Copy the folder `source` to `to`, whole or not at all; a disk that fills on the way is one line."""
    if why := copied(source, to):
        from lab_cli import file_size_fix

        fix = file_size_fix() if "[Errno 27]" in why else "free space"  # EFBIG: past `ulimit -f`, not a full disk
        raise SystemExit(f"error: copying {source} to {to} failed ({why}): {fix}, then run the same command again")


def keep_in_cache(base: Path, cached: Path) -> None:
    """Keep a copy of the cold-started `base` for later runs; the cache is optional: where it cannot, a notice."""
    if why := copied(base, cached):
        print(f"note: the cold-start cache {cached.parent} keeps no copy of this base ({why}); the run goes on")


def copied(source: Path, to: Path) -> str | None:
    """Copy `source` under a temporary name, then rename it `to`; None, or why not (what was copied is removed)."""
    tmp = to.with_name(f".{to.name}.tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        shutil.rmtree(to, ignore_errors=True)
        os.replace(tmp, to)
    except OSError as e:  # copytree gathers its files' errors into one shutil.Error: (source, copy, why) each
        shutil.rmtree(tmp, ignore_errors=True)
        why = e.args[0][0][2] if isinstance(e, shutil.Error) and e.args and e.args[0] else (e.strerror or str(e))
        return f"{why}; {shutil.disk_usage(next(p for p in to.parents if p.exists())).free / 2**20:.0f} MiB free there"
    return None


def cold_start_argvs(cfg) -> list[list[str]]:
    """cold_start.py's flags for each schedule of the base, without --out (and later ones' --model): the Config's
    cold_start_* settings, then each of cold_start_schedules, as a separate command would run it."""
    first = {"--train-file": cfg.train_file, "--steps": cfg.cold_start_steps,
             "--tool-fraction": cfg.cold_start_tool_fraction, "--template": cfg.template, "--seed": cfg.seed,
             "--tool-only-steps": cfg.cold_start_tool_only_steps, "--lr": cfg.cold_start_lr,
             "--batch-size": cfg.cold_start_batch_size}
    for flag, value in (("--kv-heads", cfg.cold_start_kv_heads), ("--rounds", cfg.cold_start_rounds)):
        if value != 1:  # only where set: the demo's argv, and so its cached base, stay as they were
            first[flag] = value
    if cfg.cold_start == "finetune":
        first.update({"--train-layers": cfg.train_layers, "--warmup-steps": 10, "--threads": trainer_threads(cfg) or 1})
    elif cfg.trainer_threads:  # a tiny model's threads only where set: 06-train/make_base.py holds them to one count
        first["--threads"] = trainer_threads(cfg)
    flags = [first]
    for steps, tool_only_steps, drills in further_schedules(cfg.cold_start_schedules):
        later = {k: v for k, v in first.items() if k not in ("--kv-heads", "--rounds")}  # the model exists by now
        flags.append({**later, "--steps": steps, "--tool-only-steps": tool_only_steps,
                      **({"--drills-in-mix": None} if drills else {})})
    return [[part for flag, value in f.items() for part in (flag, *([] if value is None else [str(value)]))]
            for f in flags]


def further_schedules(text: str) -> list[tuple[int, int, bool]]:
    """Config.cold_start_schedules, "600:450 600:150:drills", as [(steps, tool-only steps, drills in the mix)]."""
    schedules = []
    for item in text.split():
        parts = item.split(":")
        try:
            steps, tool_only = int(parts[0]), int(parts[1])
        except (IndexError, ValueError):
            raise ValueError(f"'{item}' is not STEPS:TOOL_ONLY_STEPS[:drills], e.g. 600:150:drills") from None
        if len(parts) > 3 or parts[2:] not in ([], ["drills"]) or not 0 <= tool_only <= steps or steps < 1:
            raise ValueError(f"'{item}' is not STEPS:TOOL_ONLY_STEPS[:drills] with 0 <= TOOL_ONLY_STEPS <= STEPS")
        schedules.append((steps, tool_only, len(parts) == 3))
    return schedules


def cold_start_key(argv: list[str], train_file: str, source: str | None, before: str) -> str:
    """A digest of everything that determines a cold-started base (a change to any of it is a new base): the
    settings, the problems, the code, a tuned model's files and the key of the schedule `before` this one ("")."""
    import hashlib

    import torch
    import transformers

    here, root = Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    digest.update(repr((argv, torch.__version__, transformers.__version__)).encode())
    for path in (Path(train_file), here / "cold_start.py", here / "tool_traces.py", root / "tiny_model.py", root / "01-data" / "chained_problems.py",
                 root / "03-rollout" / "prompt_templates.py", root / "03-rollout" / "rollout.py"):
        digest.update(path.read_bytes())
    if source:
        digest.update(repr(sorted((p.name, p.stat().st_size) for p in Path(source).iterdir())).encode())
    digest.update(before.encode())  # b"" for the first schedule: no change to the digest
    return digest.hexdigest()[:16]
