"""A run's configuration from the command line to the loop: one flag per Config field, one-line refusals.

Key decisions: every field of retool.Config is a flag of the same name (a
preset sets some, flags override); a configuration that would fail later, or
silently do the wrong thing, stops at start with one line, before any model
or engine loads. The story: docs/05-retool.md, "Checkpoints, resume, stop,
bad configuration".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path


def parse_with_field_flags(parser: argparse.ArgumentParser, config_class, argv, presets: dict | None = None
                           ) -> tuple[argparse.Namespace, dict]:
    """Add a flag per field of `config_class` to `parser`, parse `argv`: (args, the fields given on the line).

    Each flag's help is its field's comment and its default the chosen preset's value (`--preset` in argv).
    """
    chosen = argparse.ArgumentParser(add_help=False)
    chosen.add_argument("--preset", default="cpu-demo")
    preset = (presets or {}).get(chosen.parse_known_args(argv)[0].preset, {})
    meaning = field_comments(config_class)
    fields = parser.add_argument_group("configuration (every field; a preset sets some, these override)")
    for f in dataclasses.fields(config_class):
        flag = field_flag(f.name)
        default = preset.get(f.name, f.default)
        text = f"{meaning.get(f.name, '')} [default: {default!r}]".strip().replace("%", "%%")
        if f.type in ("bool", bool):
            fields.add_argument(flag, type=parse_bool, metavar="BOOL", default=argparse.SUPPRESS, help=text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            fields.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text)
    parser.error = lambda message: sys.exit(f"error: {message} (see --help)")  # one line, not a usage dump
    args = parser.parse_args(argv)
    names = {f.name for f in dataclasses.fields(config_class)}
    return args, {k: v for k, v in vars(args).items() if k in names}


def field_flag(name: str) -> str:
    """A Config field's command-line flag: seed_rollouts -> --seed-rollouts."""
    return "--" + name.replace("_", "-")


def settings_changed(cfg) -> str:
    """The fields that differ from Config's defaults, as flags: what this run chose (a preset or the command line)."""
    defaults = type(cfg)()
    changed = [f"{field_flag(f.name)} {json.dumps(getattr(cfg, f.name)).strip(chr(34))}"
               for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(defaults, f.name)]
    return f"; changed from the defaults: {' '.join(changed)}" if changed else "; every field at its default"


def field_comments(config_class) -> dict[str, str]:
    """{field: the comment on its line} of a dataclass, read from its source: one meaning, kept beside the field."""
    import inspect
    import io
    import tokenize

    comments, name = {}, None
    for token in tokenize.generate_tokens(io.StringIO(inspect.getsource(config_class)).readline):
        if token.type == tokenize.NAME and token.start[1] == 4 and name is None:
            name = token.string
        elif token.type == tokenize.COMMENT and name:
            comments[name] = token.string.lstrip("# ")
        elif token.type == tokenize.NEWLINE or token.type == tokenize.NL:
            name = None
    return comments


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"'{text}' is not a boolean")


def check_config(cfg, resuming: bool) -> None:
    """Refuse, with one line, a retool.Config that would fail later or silently do the wrong thing."""
    problems = config_problems(cfg, first_only=True)
    if problems:
        raise SystemExit(f"error: {problems[0]}")


def config_problems(cfg, world: int | None = None, first_only: bool = False) -> list[str]:
    """Everything wrong with a retool.Config that can be seen without a model, one line each.

    `world`: the ranks to plan for (default: torchrun's WORLD_SIZE, else 1). With
    `first_only`, the checks that import torch (two seconds) are skipped once a
    cheaper one has found a problem, so that most refusals take well under one.
    """
    from problems_and_policy import COLD_STARTS
    from reward import SCORERS
    from rollout import OBSERVATION_STYLES, SCHEDULES, TEMPLATES
    from trackers import missing_package

    problems = []
    for name in ("train_file", "eval_file"):
        path = getattr(cfg, name)
        if not Path(path).exists() and "toy_" not in path and "word_" not in path:
            flag = "--" + name.replace("_", "-")
            hint = ("put ToRL's data/torl_data/ folder under data/, or pass " + flag if "torl_data" in path else
                    "join SimpleTIR's datasets/ files there (docs/05-torl.md), or pass " + flag if "simpletir" in path
                    else "run `make run-01` to prepare data")
            problems.append(f"{name} '{path}' does not exist ({hint})")
        elif Path(path).exists():
            problems += [data_problem(name, path)] if data_problem(name, path) else []
    if cfg.cold_start not in COLD_STARTS:
        problems.append(f"cold_start must be {_one_of(COLD_STARTS)}, got '{cfg.cold_start}'")
    elif cfg.cold_start == "scratch" and cfg.model:
        problems.append(f"cold_start 'scratch' trains a tiny model from scratch, yet model '{cfg.model}' is given: "
                        "pass --cold-start none to start RL from it, or finetune to tune it on tool traces first")
    elif cfg.cold_start != "scratch" and not cfg.model:
        problems.append(f"cold_start '{cfg.cold_start}' needs a model (--model), or use scratch for a tiny one")
    elif cfg.cold_start != "none" and cfg.cold_start_steps < 1:
        problems.append(f"cold_start_steps must be at least 1 with cold_start '{cfg.cold_start}', got {cfg.cold_start_steps}")
    if cfg.model:
        problems += [model_problem(cfg.model)] if model_problem(cfg.model) else []
    if cfg.max_response_tokens >= cfg.max_model_len:
        problems.append(f"max_response_tokens ({cfg.max_response_tokens}) leaves no room for the prompt in max_model_len ({cfg.max_model_len})")
    if cfg.max_prompt_tokens and cfg.max_prompt_tokens + cfg.max_response_tokens > cfg.max_model_len:
        problems.append(f"max_prompt_tokens ({cfg.max_prompt_tokens}) + max_response_tokens ({cfg.max_response_tokens}) "
                        f"do not fit in max_model_len ({cfg.max_model_len})")
    if cfg.eval_max_response_tokens >= cfg.max_model_len:
        problems.append(f"eval_max_response_tokens ({cfg.eval_max_response_tokens}) does not fit in max_model_len ({cfg.max_model_len})")
    if cfg.scorer not in SCORERS:
        problems.append(f"scorer must be {_one_of(SCORERS)}, got '{cfg.scorer}'")
    if cfg.template not in TEMPLATES:
        problems.append(f"template '{cfg.template}' is not one of {', '.join(TEMPLATES)}")
    if cfg.observation_style not in OBSERVATION_STYLES:
        problems.append(f"observation_style must be {_one_of(OBSERVATION_STYLES)}, got '{cfg.observation_style}'")
    if cfg.dtype not in DTYPES:
        problems.append(f"dtype must be {_one_of(DTYPES)}, got '{cfg.dtype}'")
    try:
        sandbox_config(cfg)
    except ValueError as e:
        problems.append(f"sandbox_{e}")
    if not cfg.temperature > 0:
        problems.append(f"temperature {cfg.temperature}: training samples must be drawn (above 0); the trainer divides by it")
    if not cfg.eval_temperature >= 0:
        problems.append(f"eval_temperature must be 0 (greedy) or more, got {cfg.eval_temperature}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        problems.append(f"gpu_memory_utilization is a share of the device: above 0 and at most 1, got {cfg.gpu_memory_utilization}")
    if not cfg.cpu_kv_cache_gib > 0:
        problems.append(f"cpu_kv_cache_gib is the KV cache's size on a CPU: above 0, got {cfg.cpu_kv_cache_gib}")
    if not (0 < cfg.eps_low < 1 and cfg.eps_high > 0):
        problems.append(f"the clip band needs 0 < eps_low < 1 and eps_high > 0, got {cfg.eps_low} and {cfg.eps_high}")
    if cfg.trainer_threads < -1 or cfg.train_layers < 0:
        problems.append(f"trainer_threads must be -1 (every core) or more and train_layers 0 (all) or more, "
                        f"got {cfg.trainer_threads} and {cfg.train_layers}")
    if cfg.group_size < 2:
        problems.append(f"group_size {cfg.group_size}: a group of one has no one to be compared with")
    for name in ("steps", "problems_per_step", "num_minibatches", "micro_batch_size", "save_every", "keep_checkpoints",
                 "eval_k", "max_response_tokens", "eval_max_response_tokens", "max_model_len"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name} must be at least 1, got {getattr(cfg, name)}")
    for name in ("eval_problems", "eval_every", "max_prompt_tokens"):
        if getattr(cfg, name) < 0:
            problems.append(f"{name} must be 0 or more, got {getattr(cfg, name)}")
    if cfg.eval_temperature == 0 and cfg.eval_k > 1:
        problems.append(f"eval_k {cfg.eval_k} with greedy evaluation (eval_temperature 0) gives {cfg.eval_k} identical samples")
    if cfg.problems_per_step * cfg.group_size < cfg.num_minibatches:
        problems.append(f"{cfg.problems_per_step * cfg.group_size} trajectories cannot fill {cfg.num_minibatches} mini-batches")
    world = world or int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's ranks
    if world > 1 and cfg.problems_per_step % (cfg.num_minibatches * world):
        problems.append(f"problems_per_step ({cfg.problems_per_step}) must split evenly into num_minibatches"
                        f" ({cfg.num_minibatches}) x {world} ranks")
    if cfg.aggregation == "token-sum" and cfg.scale_advantages:
        problems.append("aggregation token-sum is Dr. GRPO's objective, which drops the std scaling: set --scale-advantages false")
    if cfg.tis_cap and not cfg.tis_cap >= 1:
        problems.append(f"tis_cap {cfg.tis_cap}: a cap below 1 shrinks every token, use 0 (off) or at least 1 (2 is common)")
    if cfg.tool_budget < 0:
        problems.append(f"tool_budget must be 0 or more, got {cfg.tool_budget}")
    elif cfg.tool_budget == 0 and cfg.template not in TEXT_TEMPLATES:
        problems.append(f"tool_budget 0 with template '{cfg.template}', which asks for programs: no code block would "
                        f"ever run; pass --tool-budget 1 or more, or a text-only template ({_one_of(TEXT_TEMPLATES)})")
    if cfg.rollout_schedule not in SCHEDULES:
        problems.append(f"rollout_schedule must be {_one_of(SCHEDULES)}, got '{cfg.rollout_schedule}'")
    if cfg.dynamic_sampling and cfg.dynamic_sampling_rounds < 1:
        problems.append(f"dynamic_sampling_rounds must be at least 1, got {cfg.dynamic_sampling_rounds}")
    if not 0 < cfg.lr < 1:
        problems.append(f"lr {cfg.lr} is not a learning rate")
    try:
        missing = missing_package(cfg.log)  # also refuses an unknown name
    except ValueError as e:
        problems.append(str(e))
    else:
        if missing:
            problems.append(missing)
    if not (first_only and problems):
        from distributed import STRATEGIES
        from grpo import AGGREGATIONS, OBJECTIVES
        from objectives import objective_problems

        if cfg.strategy not in STRATEGIES:
            problems.append(f"strategy must be {_one_of(STRATEGIES)}, got '{cfg.strategy}'")
        if cfg.aggregation not in AGGREGATIONS:
            problems.append(f"aggregation must be {_one_of(AGGREGATIONS)}, got '{cfg.aggregation}'")
        problems += objective_problems(cfg, tuple(OBJECTIVES))
    if cfg.cold_start in ("scratch", "finetune") and not problems and Path(cfg.train_file).exists():
        problems += [p for p in [cold_start_problem(cfg)] if p]
    if cfg.model and not problems:
        limit = position_limit(cfg.model)
        if limit is not None and cfg.max_model_len > limit:
            problems.append(f"max_model_len {cfg.max_model_len} is above the position limit of {cfg.model}, "
                            f"{limit} tokens (max_position_embeddings)")
    return problems


def sandbox_config(cfg):
    """Chapter 02's SandboxConfig from a run's Config (SandboxConfig's own checks run as it is made)."""
    from distributed import cores_per_rank
    from lab_cli import comma_list
    from sandbox import SandboxConfig

    return SandboxConfig(backend=cfg.sandbox_backend, timeout=cfg.sandbox_timeout, isolation=cfg.sandbox_isolation,
                         urls=comma_list(cfg.sandbox_urls), preload=comma_list(cfg.sandbox_preload),
                         concurrency=cores_per_rank())  # the ranks of a node share its cores


DTYPES = ("float32", "bfloat16", "float16", "auto")  # the sampler's: vLLM's names
TEXT_TEMPLATES = ("cot", "qwen-chat-cot")  # 03-rollout's templates that never mention a tool


def model_problem(model: str) -> str | None:
    """What is wrong with `model` as a local folder or a hub id, read from disk only; None if nothing."""
    from smollm2 import HUB_ID

    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "checkpoints").is_dir() and not (path / "model.safetensors").exists():
            steps = sorted(path.glob("checkpoints/step-*"))
            example = steps[-1] if steps else path / "checkpoints" / "step-NNNNNN"
            return f"model {model} is a run folder, not a model: use one of its checkpoints, e.g. {example}"
        if not (path / "config.json").is_file():
            return f"model '{model}' is a folder without config.json"
        if "model_type" not in json.loads((path / "config.json").read_text() or "{}"):
            return f"model '{model}' is not a model folder (its config.json names no model_type)"
        return None
    if model.startswith(("/", ".", "~")) or Path(model.split("/")[0]).is_dir():
        return f"model '{model}' is not a folder here"
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return f"model '{model}' is neither a folder nor a hub id (org/name)"
    if model == HUB_ID:  # SmolLM2 has a package to fall back on (smollm2.py)
        return None
    from huggingface_hub import try_to_load_from_cache

    from prepare_data import hub_unreachable

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return None
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    why = "HF_HUB_OFFLINE is set" if offline else (hub_unreachable() or "").split(";")[0]  # its advice is for data sets
    return (f"model '{model}' is a hub id that is not in the local cache, and {why}: download it where the hub "
            "answers, or pass a local model folder" if why else None)


def cold_start_problem(cfg) -> str | None:
    """Why the cold start cannot use the training file (cold_start.py draws its traces without the sandbox)."""
    from cold_start import traces_problem

    return traces_problem(cfg.train_file, cfg.cold_start_tool_fraction, cfg.template, cfg.seed,
                          cfg.cold_start_batch_size, cfg.cold_start_tool_only_steps)


def data_problem(name: str, path: str) -> str | None:
    """What 01-data's loader says is wrong with a data file, in one line; None if it reads."""
    from prepare_data import DataError, load_problems

    try:
        load_problems(path)
    except DataError as e:
        return f"{name}: {e}"
    return None


def _one_of(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1]


def position_limit(model: str) -> int | None:
    """The longest context `model` was built for (max_position_embeddings), or None when unknown.

    Read from the model's folder or the local hub cache only, never the network.
    With RoPE scaling the usable window is longer and vLLM judges it itself.
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    except Exception:  # not downloaded yet: vLLM checks after the download
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return None
    return getattr(config, "max_position_embeddings", None)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
