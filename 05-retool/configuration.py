"""A run's configuration, from the command line to the loop: `Config`, one flag per field, one-line refusals.

Key decisions: every field of `Config` is a flag of the same name (a preset sets some; flags override); a setting
that would fail later, or silently do the wrong thing, stops at start with one line, before any model or engine loads.
The story: docs/05-runs.md, "Bad configuration".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from presets import PRESETS


@dataclass
class Config:
    # --- the recipe: what ToRL sets (the torl-* presets take its script's values) ---
    model: str = ""  # hub id or local folder; "" with cold_start "released" or "scratch": the lab's tiny model
    train_file: str = "data/toy_train.jsonl"  # 01-data's schema; the toy task is made if missing
    eval_file: str = "data/toy_test.jsonl"  # held-out problems, same schema (or ToRL's test set)
    template: str = "torl"  # prompt template (03-rollout's table)
    max_prompt_tokens: int = 0  # training prompts longer than this (rendered, in tokens) are dropped at load; 0 = keep all
    steps: int = 20  # RL steps
    problems_per_step: int = 8  # problems sampled per step, each a group
    group_size: int = 8  # samples per problem: GRPO's group
    max_response_tokens: int = 96  # model + observation tokens per response (ToRL: 3072)
    max_model_len: int = 512  # the sampler's context: prompt + response must fit
    tool_budget: int = 1  # code executions per response (ToRL: 1)
    temperature: float = 1.0  # the trainer divides logits by the same value
    exec_error_penalty: float = 0.0  # ToRL's optional -0.5 for failed code; off, as in its script
    scorer: str = "lab"  # the reward's rule: the lab's, or ToRL's own (04-reward/torl_scorer.py), in training and eval
    lr: float = 2e-5  # the tiny model (2e-4 learned in 3 steps, then collapsed and recovered twice); a 1.5B model wants 1e-6
    eps_low: float = 0.2  # the clip band's lower side: ratio at least 1 - eps_low where the advantage is negative
    eps_high: float = 0.28  # its upper side, 1 + eps_high where the advantage is positive (DAPO's clip-higher)
    scale_advantages: bool = False  # divide by the group's std (original GRPO; ToRL's verl does)
    num_minibatches: int = 2  # optimizer steps per RL step (ToRL: 1)
    micro_batch_size: int = 16  # sequences per forward/backward pass: memory and speed, not the update (GRPOConfig's 8 is torl-1.5b's)
    eval_every: int = 10  # steps; 0 = only before and after training
    eval_problems: int = 100  # held-out problems per evaluation; 0 = all
    eval_k: int = 1  # samples per problem
    eval_temperature: float = 1.0  # sampled, so the demo's tool-use rate shows in it; ToRL evaluates greedily (0)
    eval_max_response_tokens: int = 96  # the response budget in evaluations
    save_every: int = 1  # steps between checkpoints
    # --- the starting policy: one explicit rule (problems_and_policy.py) ---
    cold_start: str = "released"  # released: the task's released base (model ""); scratch: train a tiny model first (model ""); finetune: tune `model` on tool traces; none
    cold_start_steps: int = 300  # supervised steps on tool traces before RL
    cold_start_tool_fraction: float = 0.3  # share of traces that call the tool (the rest box a guess)
    cold_start_tool_only_steps: int = 200  # the first steps on tool traces alone
    cold_start_lr: float = 2e-3  # the cold start's learning rate
    cold_start_batch_size: int = 32  # traces per cold-start step
    cold_start_kv_heads: int = 1  # scratch: key-value heads of the tiny model (1: its heads share one)
    cold_start_rounds: int = 1  # chained task: schedules run until the base passes the moves check, at most
    cold_start_schedules: str = ""  # further cold starts, each from the last one's weights: STEPS:TOOL_ONLY_STEPS[:drills] ...
    cold_start_cache: bool = True  # reuse a base cold-started before from the same inputs (~/.cache/tool-rl-lab)
    # ===== Below: how the lab runs the recipe, and options beyond it. A first read can stop here. =====
    # --- the same method, run another way (rollout and update mechanics) ---
    seed: int = 0  # the data order, the sampler and the trainer's random state
    observation_style: str = "torl"  # ToRL's rule; on the toy task "short" would show the same text
    rollout_schedule: str = "overlap"  # rollout's default; "rounds": one generate call per turn of the batch (docs/03)
    seed_rollouts: bool = False  # per-request seeds: reproducible rollouts, but vLLM's slow sampling path on a GPU
    aggregation: str = "token-mean"  # how token losses add up: token-mean, sequence-mean or token-sum (docs/06)
    skip_zero_advantage: bool = True  # no forward/backward for rows without gradient: the same update, faster
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more time
    train_layers: int = 0  # train only the top N decoder layers (0 = all)
    # --- the sandbox (02-sandbox) ---
    sandbox_backend: str = "local"  # where model code runs: local (fork server), docker, or sandboxfusion (02-sandbox)
    sandbox_urls: str = ""  # sandboxfusion: run_code URLs, comma-separated (the token from $SANDBOX_TOKEN)
    sandbox_timeout: float = 10.0  # seconds a tool call may run (ToRL: 10)
    sandbox_isolation: str = "namespaces"  # local backend: namespaces (contained) or plain (weaker; docs/02)
    sandbox_preload: str = "math,numpy,sympy"  # modules the warm interpreter imports once, comma-separated; "" for none
    sandbox_concurrency: int = 0  # tool calls a rank runs at once; 0 = its share of the node's cores (cores_per_rank)
    # --- the engines: vLLM and the trainer on this machine's devices ---
    strategy: str = "ddp"  # under torchrun: a full trainer replica per GPU (ddp) or 1/N of it (fsdp)
    trainer_threads: int = 0  # CPU torch threads for training (-1 = every core; 0 = torch's default, which vLLM's CPU engine keeps)
    dtype: str = "float32"  # the sampler's dtype (the trainer always keeps float32 weights)
    gpu_memory_utilization: float = 0.3  # vLLM's share of the GPU for weights and KV cache
    cpu_kv_cache_gib: float = 2.0  # on a CPU: host memory for vLLM's KV cache (a GPU's comes from the share above)
    enforce_eager: bool = True  # vLLM without compilation (torch.compile, CUDA graphs): starts in seconds, decodes slower
    # --- what the run records ---
    eval_text: bool = False  # also evaluate without the tool, before and after RL
    keep_checkpoints: int = 2  # the newest checkpoints kept in the run folder
    log: str = ""  # also log to tensorboard, wandb or "tensorboard,wandb" (metrics.jsonl is always written)
    # --- options from the field since ToRL (batch_filters.py, docs/06-beyond-torl.md); off in the torl-* presets ---
    tis_cap: float = 0.0  # truncated importance sampling, min(pi_old / pi_sampler, cap) per token; 0 = off
    dynamic_sampling: bool = False  # DAPO: sample more problems until every group of the step is informative
    dynamic_sampling_rounds: int = 4  # the most extra rollout rounds a step may take for that
    mask_truncated: bool = False  # DAPO's overlong filtering: budget-truncated trajectories get no gradient
    filter_void_turns: bool = False  # SimpleTIR: a turn with neither complete code nor an answer keeps its trajectory out
    # --- the objectives after DAPO (06-train/objectives.py, docs/06-beyond-torl.md) ---
    objective: str = "ppo-clip"  # ppo-clip, gspo (one ratio per sequence: its eps ~1000x narrower, the paper's 3e-4 / 4e-4) or cispo
    force_gspo_clip: bool = False  # let gspo run with a PPO-sized clip band (above 0.01), refused otherwise
    tis_mode: str = "truncate"  # with tis_cap: truncate, or weight 0 outside [1/cap, cap] per token-mask or sequence-mask


def make_config(preset: str, overrides: dict) -> Config:
    if preset not in PRESETS:
        raise SystemExit(f"error: unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    paths = {name: os.path.expanduser(overrides[name]) for name in ("model", "train_file", "eval_file")
             if name in overrides}  # "--model=~/x" reaches the script unexpanded
    return Config(**{**PRESETS[preset], **overrides, **paths})


def parse_with_field_flags(parser: argparse.ArgumentParser, config_class, argv, presets: dict | None = None
                           ) -> tuple[argparse.Namespace, dict]:
    """A flag per field of `config_class` (help: its comment), parsed: (args, the fields given on the line)."""
    chosen = argparse.ArgumentParser(add_help=False)
    chosen.add_argument("--preset", default="cpu-demo")
    preset = (presets or {}).get(chosen.parse_known_args(argv)[0].preset, {})
    meaning = field_comments(config_class)
    fields = parser.add_argument_group("configuration (every field; a preset sets some, these override)")
    for f in dataclasses.fields(config_class):
        text = f"{meaning.get(f.name, '')} [default: {preset.get(f.name, f.default)!r}]".strip().replace("%", "%%")
        kind = {"bool": parse_bool, "int": int, "float": float}.get(str(f.type), str)
        fields.add_argument(field_flag(f.name), type=kind, metavar="BOOL" if kind is parse_bool else None,
                            default=argparse.SUPPRESS, help=text)
    parser.error = lambda message: sys.exit(f"error: {message} (see --help)")  # one line, not a usage dump
    args = parser.parse_args(argv)
    names = {f.name for f in dataclasses.fields(config_class)}
    return args, {k: v for k, v in vars(args).items() if k in names}


def field_flag(name: str) -> str:
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
        elif token.type in (tokenize.NEWLINE, tokenize.NL):
            name = None
    return comments


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return text.lower() in ("1", "true", "yes", "on")
    raise argparse.ArgumentTypeError(f"'{text}' is not a boolean")


def check_config(cfg) -> None:
    """Refuse, with one line, a Config that would fail later or silently do the wrong thing."""
    if problems := config_problems(cfg, first_only=True):
        raise SystemExit(f"error: {problems[0]}")


def config_problems(cfg, world: int | None = None, first_only: bool = False) -> list[str]:
    """Everything wrong with a Config that can be seen without a model, one line each, for `world` ranks (default:
    torchrun's). `first_only` skips the checks that import torch (two seconds) once a cheaper one has refused."""
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    problems = (data_problems(cfg) + policy_problems(cfg) + choice_problems(cfg) + number_problems(cfg, world)
                + combination_problems(cfg, world))
    if not (first_only and problems):
        problems += engine_problems(cfg)
    if not problems:  # the slower checks, which need the rest to be right
        problems += model_problems(cfg)
    return problems


def data_problems(cfg) -> list[str]:
    """The data files: each exists (or is a task the run writes on first use) and loads, with enough problems."""
    from prepare_data import DataError, load_problems
    from problems_and_policy import task_files, tasks_to_write, too_few_problems

    problems, written = [], {str(p) for name in tasks_to_write(cfg) for p in task_files(name)}  # made at load
    for name in ("train_file", "eval_file"):
        path, flag = getattr(cfg, name), field_flag(name)
        if not Path(path).exists() and not Path(path).is_symlink() and path not in written:
            hint = ("put ToRL's data/torl_data/ folder under data/, or pass " + flag if "torl_data" in path else
                    "join SimpleTIR's datasets/ files there (docs/05-torl.md), or pass " + flag if "simpletir" in path
                    else "run `make run-01` to prepare data, or pass " + flag)
            problems.append(f"{name} '{path}' does not exist ({hint})")
        elif Path(path).exists() or Path(path).is_symlink():
            try:
                rows, _ = load_problems(path)
            except DataError as e:  # 01-data's loader says what is wrong, in one line
                problems.append(f"{name}: {e}")
                continue
            if name == "train_file":
                problems += [p for p in [too_few_problems(cfg, len(rows))] if p]
    return problems


def policy_problems(cfg) -> list[str]:
    """The starting policy: one cold start rule, its schedules, and a model that exists."""
    from problems_and_policy import COLD_STARTS, further_schedules

    problems = []
    if cfg.cold_start not in COLD_STARTS:
        problems.append(f"cold_start must be {_one_of(COLD_STARTS)}, got '{cfg.cold_start}'")
    elif cfg.cold_start in ("released", "scratch") and cfg.model:
        problems.append(f"cold_start '{cfg.cold_start}' starts from the lab's tiny model, yet model '{cfg.model}' is "
                        "given: pass --cold-start none to start RL from it, or finetune to tune it on tool traces first")
    elif cfg.cold_start == "released":
        problems += [p for p in [released_problem(cfg.train_file)] if p]
    elif cfg.cold_start != "scratch" and not cfg.model:
        problems.append(f"cold_start '{cfg.cold_start}' needs a model (--model), or use scratch for a tiny one")
    elif cfg.cold_start != "none" and cfg.cold_start_steps < 1:
        problems.append(f"cold_start_steps must be at least 1 with cold_start '{cfg.cold_start}', got {cfg.cold_start_steps}")
    try:
        further_schedules(cfg.cold_start_schedules)
    except ValueError as e:
        problems.append(f"cold_start_schedules: {e}")
    if cfg.model:
        problems += [p for p in [model_problem(cfg.model)] if p]
    return problems


def combination_problems(cfg, world: int) -> list[str]:
    """Settings each fine alone but not together: the token budgets against the sampler's context, a step's batch
    against its mini-batches and the ranks, greedy evaluation against its samples, a recipe that is not the method it
    seems to be."""
    problems = []
    if cfg.max_response_tokens >= cfg.max_model_len:
        problems.append(f"max_response_tokens ({cfg.max_response_tokens}) leaves no room for the prompt in max_model_len ({cfg.max_model_len})")
    if cfg.max_prompt_tokens and cfg.max_prompt_tokens + cfg.max_response_tokens > cfg.max_model_len:
        problems.append(f"max_prompt_tokens ({cfg.max_prompt_tokens}) + max_response_tokens ({cfg.max_response_tokens}) "
                        f"do not fit in max_model_len ({cfg.max_model_len})")
    if cfg.eval_max_response_tokens >= cfg.max_model_len:
        problems.append(f"eval_max_response_tokens ({cfg.eval_max_response_tokens}) does not fit in max_model_len ({cfg.max_model_len})")
    if cfg.eval_temperature == 0 and cfg.eval_k > 1:
        problems.append(f"eval_k {cfg.eval_k} with greedy evaluation (eval_temperature 0) gives {cfg.eval_k} identical samples")
    if cfg.problems_per_step * cfg.group_size < cfg.num_minibatches:
        problems.append(f"{cfg.problems_per_step * cfg.group_size} trajectories cannot fill {cfg.num_minibatches} mini-batches")
    if world > 1 and cfg.problems_per_step % (cfg.num_minibatches * world):
        problems.append(f"problems_per_step ({cfg.problems_per_step}) must split evenly into num_minibatches"
                        f" ({cfg.num_minibatches}) x {world} ranks")
    if cfg.aggregation == "token-sum" and cfg.scale_advantages:
        problems.append("aggregation token-sum is Dr. GRPO's objective, which drops the std scaling: set --scale-advantages false")
    if cfg.tis_cap and not cfg.tis_cap >= 1:
        problems.append(f"tis_cap {cfg.tis_cap}: a cap below 1 shrinks every token, use 0 (off) or at least 1 (2 is common)")
    if cfg.tool_budget == 0 and cfg.template not in TEXT_TEMPLATES:
        problems.append(f"tool_budget 0 with template '{cfg.template}', which asks for programs: no code block would "
                        f"ever run; pass --tool-budget 1 or more, or a text-only template ({_one_of(TEXT_TEMPLATES)})")
    return problems


def choice_problems(cfg) -> list[str]:
    """Settings that name one of a few choices, the trackers' packages included; the sandbox's own checks."""
    from reward import SCORERS
    from rollout import OBSERVATION_STYLES, SCHEDULES, TEMPLATES
    from trackers import missing_package

    problems = []
    for name, choices in (("scorer", SCORERS), ("observation_style", OBSERVATION_STYLES), ("dtype", DTYPES),
                          ("rollout_schedule", SCHEDULES)):
        if getattr(cfg, name) not in choices:
            problems.append(f"{name} must be {_one_of(choices)}, got '{getattr(cfg, name)}'")
    if cfg.template not in TEMPLATES:
        problems.append(f"template '{cfg.template}' is not one of {', '.join(TEMPLATES)}")
    if cfg.sandbox_concurrency < 0:  # 0 is a choice here (a rank's share of the cores), not SandboxConfig's error
        problems.append(f"sandbox_concurrency must be 0 (a rank's share of the cores) or more, got {cfg.sandbox_concurrency}")
    try:
        sandbox_config(cfg)
    except ValueError as e:
        problems.append(f"sandbox_{e}")
    try:
        problems += [missing for missing in [missing_package(cfg.log)] if missing]  # also refuses an unknown name
    except ValueError as e:
        problems.append(str(e))
    return problems


SEED_LIMIT = 2**32 - 1  # vLLM seeds numpy's generator, which takes 32 bits


def number_problems(cfg, world: int) -> list[str]:
    """Numbers out of their range: temperatures, shares, the clip band, counts, the seed, the learning rate."""
    problems = []
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
    elif cfg.trainer_threads > (cores := len(os.sched_getaffinity(0))):
        problems.append(f"trainer_threads {cfg.trainer_threads} is more than the {cores} cores this process may use: "
                        f"more threads than cores only wait on each other; pass --trainer-threads {cores} or less "
                        "(-1: every core)")
    if cfg.group_size < 2:
        problems.append(f"group_size {cfg.group_size}: a group of one has no one to be compared with")
    for name in ("steps", "problems_per_step", "num_minibatches", "micro_batch_size", "save_every", "keep_checkpoints",
                 "eval_k", "max_response_tokens", "eval_max_response_tokens", "max_model_len"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name} must be at least 1, got {getattr(cfg, name)}")
    for name in ("eval_problems", "eval_every", "max_prompt_tokens", "tool_budget"):
        if getattr(cfg, name) < 0:
            problems.append(f"{name} must be 0 or more, got {getattr(cfg, name)}")
    seed_max = SEED_LIMIT - 1_000_003 * (world - 1) - max(cfg.steps, 0)  # each rank's engine and each step add to it
    if seed_max < 0:  # the steps alone leave no seed: they, not the seed, are what to change
        problems.append(f"steps {cfg.steps} is more than a run can take: each step adds one to the 32-bit seed "
                        f"(vLLM and numpy take 32 bits); pass --steps {seed_max + max(cfg.steps, 0) - max(cfg.seed, 0)} or less")
    elif not 0 <= cfg.seed <= seed_max:
        problems.append(f"seed must be from 0 to {seed_max} (vLLM and numpy take 32-bit seeds; each rank and step "
                        f"adds to the run's), got {cfg.seed}")
    if cfg.dynamic_sampling and cfg.dynamic_sampling_rounds < 1:
        problems.append(f"dynamic_sampling_rounds must be at least 1, got {cfg.dynamic_sampling_rounds}")
    if not 0 < cfg.lr < 1:
        problems.append(f"lr {cfg.lr} is not a learning rate")
    return problems


def engine_problems(cfg) -> list[str]:
    """What needs torch to check (two seconds to import): the strategy, the objective, the CPU's KV cache."""
    from distributed import STRATEGIES
    from grpo import OBJECTIVES
    from objectives import objective_problems

    problems = []
    if cfg.strategy not in STRATEGIES:
        problems.append(f"strategy must be {_one_of(STRATEGIES)}, got '{cfg.strategy}'")
    problems += objective_problems(cfg, tuple(OBJECTIVES))  # the aggregation's too
    if not cuda_available():
        problems += [p for p in [kv_cache_problem(cfg.cpu_kv_cache_gib)] if p]
    return problems


def kv_cache_problem(gib: float) -> str | None:
    """Why vLLM's CPU engine could not reserve `gib` GiB of KV cache (or VLLM_CPU_KVCACHE_SPACE) now; None if it can."""
    setting = "--cpu-kv-cache-gib"
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        setting, gib = "VLLM_CPU_KVCACHE_SPACE", float(os.environ["VLLM_CPU_KVCACHE_SPACE"])
    try:  # Linux's MemAvailable: what a new allocation can take
        with open("/proc/meminfo") as f:
            available = int(dict(line.split(":", 1) for line in f)["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):  # not known here
        return None
    return None if gib <= available else (
        f"{setting} {gib:g}: vLLM's KV cache on the CPU would take {gib:g} GiB, and this machine has "
        f"{available:.1f} GiB available now; pass a smaller {setting} (the demo takes 2)")


def released_problem(train_file: str) -> str | None:
    """Why no released base fits this training file (released_base.py's RELEASES), or None."""
    from released_base import RELEASES, release_for, shown

    if release_for(train_file) is None:
        tasks = ", ".join(f"{r.train_file} ({shown(r.folder)})" for r in RELEASES.values())
        return (f"cold_start 'released' has no released base for {train_file}: the lab releases one for {tasks}; "
                "pass --cold-start scratch to cold-start a tiny model on it")
    return None


def model_problems(cfg) -> list[str]:
    """The cold start's traces of the training file, and the context against the model's positions."""
    problems = []
    if cfg.cold_start in ("scratch", "finetune") and Path(cfg.train_file).exists():
        from cold_start import traces_problem  # the cold start's own draw of its traces, without the sandbox

        problems += [p for p in [traces_problem(cfg.train_file, cfg.cold_start_tool_fraction, cfg.template, cfg.seed,
                                                cfg.cold_start_batch_size, cfg.cold_start_tool_only_steps)] if p]
    model, limit = cfg.model or "the tiny model the cold start builds", None
    if cfg.model:
        limit = position_limit(cfg.model)
    elif cfg.cold_start == "released" and not released_problem(cfg.train_file):
        from released_base import release_for, shown

        folder = release_for(cfg.train_file).folder
        model, limit = f"the released base {shown(folder)}", position_limit(str(folder))
    else:  # the tiny model cold_start.py builds: 4 x its default --max-len positions (build_base_policy)
        from cold_start import parse_args

        limit = parse_args([]).max_len * 4
    if not problems and limit is not None and cfg.max_model_len > limit:
        problems.append(f"max_model_len {cfg.max_model_len} is above the position limit of {model}, "
                        f"{limit} tokens (max_position_embeddings): pass --max-model-len {limit} or less")
    return problems


def sandbox_config(cfg):
    """Chapter 02's SandboxConfig from a run's Config (SandboxConfig's own checks run as it is made)."""
    from distributed import cores_per_rank
    from lab_cli import comma_list
    from sandbox import SandboxConfig

    return SandboxConfig(backend=cfg.sandbox_backend, timeout=cfg.sandbox_timeout, isolation=cfg.sandbox_isolation,
                         urls=comma_list(cfg.sandbox_urls), preload=comma_list(cfg.sandbox_preload),
                         # 0 (or less, refused above in config_problems' words): the ranks of a node share its cores
                         concurrency=cfg.sandbox_concurrency if cfg.sandbox_concurrency > 0 else cores_per_rank())


def check_preload(sandbox, cfg) -> None:
    """One call: the warm interpreter imported every module of cfg.sandbox_preload, else one line (the sandbox
    skips a missing one, and each call would then import it, or fail)."""
    from lab_cli import comma_list

    modules = [] if cfg.sandbox_backend == "sandboxfusion" else list(comma_list(cfg.sandbox_preload))  # it preloads none
    if missing := sandbox.run(f"import sys\nprint(*[m for m in {modules!r} if m not in sys.modules])").stdout.split():
        sandbox.close()
        raise SystemExit(f"error: sandbox_preload: {', '.join(missing)} cannot be imported by the sandbox's Python "
                         f"({sandbox.config.python if cfg.sandbox_backend == 'local' else 'in its image'}): install "
                         "it there, or leave it out of --sandbox-preload")


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
        from checkpoints import weights_damage

        if why := weights_damage(path):
            return f"model '{model}' cannot be loaded: {why}"
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


def _one_of(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1]


def position_limit(model: str) -> int | None:
    """`model`'s max_position_embeddings, read from disk; None when unknown or with RoPE scaling (vLLM judges it)."""
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
