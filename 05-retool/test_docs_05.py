"""docs/05 restates presets and defaults: each number here is read from the code, so the pages cannot drift."""
from __future__ import annotations

import pytest

from doc_pages import says
from presets import PRESETS
from configuration import Config, make_config


def short(x: float) -> str:
    """1e-4, 2e-5: how the pages write a learning rate."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def test_the_cpu_demo_page_states_the_demo_defaults():
    cfg = Config()
    says("appendix/05-retool-run-log.md",
         f"`--tool-only-steps {cfg.cold_start_tool_only_steps}` of {cfg.cold_start_steps}",
         f"The RL learning rate, {short(cfg.lr)}")
    says("05-retool.md",
         f"{cfg.cold_start_tool_fraction:.0%} of them open a code block",
         f"over {cfg.steps} RL steps",
         f"{cfg.problems_per_step} problems x {cfg.group_size} samples",
         f"every `eval_every` steps ({cfg.eval_every})", f"`num_minibatches` ({cfg.num_minibatches}) mini-batches")
    says("05-runs.md", f"Every `save_every` steps ({cfg.save_every} in the demo)")


def test_the_run_log_states_the_default_s_held_out_accuracy_as_its_results_files_hold_it():
    """The run log restates the chapter's table for the step count's choice: the same three seeds, from their files."""
    import results

    steps = Config().steps
    seeds = [results.load(name)["figures"][f"heldout_accuracy_step_{steps}"]
             for name in ("05-cpu-demo", "05-cpu-demo-s1", "05-cpu-demo-s2")]
    says("appendix/05-retool-run-log.md",
         f"- {steps} RL steps.",
         f"three seeds reached {seeds[0]}, {seeds[1]} and {seeds[2]} at step {steps} (seeds 0, 1 and 2",
         "from the results files `05-cpu-demo`, `05-cpu-demo-s1` and `05-cpu-demo-s2`")


def test_the_smollm2_recipe_table_is_the_preset():
    cfg = make_config("smollm2", {})
    says("05-smollm2.md",
         f"{cfg.cold_start_steps} steps x {cfg.cold_start_batch_size} traces of the word problems",
         f"{cfg.cold_start_tool_fraction:.0%} tool traces, the first {cfg.cold_start_tool_only_steps} steps on tool "
         f"traces alone, lr {short(cfg.cold_start_lr)}",
         f"the top {cfg.train_layers} of 30 layers",
         f"{cfg.steps} steps x {cfg.problems_per_step} problems x {cfg.group_size} samples, "
         f"{cfg.max_response_tokens} response tokens, lr {short(cfg.lr)}, temperature {cfg.temperature}, "
         f"tool budget {cfg.tool_budget}")


def test_the_torl_table_is_the_preset():
    cfg = make_config("torl-1.5b", {})
    says("05-torl.md",
         f"`max_prompt_tokens={cfg.max_prompt_tokens}`",
         f"| problems per step | `data.train_batch_size=128` | {cfg.problems_per_step} |",
         f"| samples per problem | `rollout.n=16` | {cfg.group_size} |",
         f"`num_minibatches={cfg.num_minibatches}`: one AdamW step",
         f"`micro_batch_size={cfg.micro_batch_size}` sequences on each GPU, 8 GPUs",
         f"`eps_low = eps_high = {cfg.eps_low}`",
         f"| `max_response_length=3072` | {cfg.max_response_tokens} |",
         f"`max_model_len={cfg.max_model_len}`",
         f"`tool_budget={cfg.tool_budget}`",
         f"`eval_every={cfg.eval_every}` on the same file, `eval_temperature={cfg.eval_temperature:g}`, "
         f"`eval_k={cfg.eval_k}`",
         f"`save_every={cfg.save_every}`; the last {cfg.keep_checkpoints} kept",
         f"`steps={cfg.steps}` (300 x 224)",
         f"vLLM at {cfg.gpu_memory_utilization} of each GPU",
         f"lr {short(cfg.lr)}, betas (0.9, 0.999)")
    assert cfg.cold_start == "none"  # the table's model row: RL from the base model, as ToRL
    says("05-torl.md", f"`scorer={cfg.scorer}`, the same rule", f"`sandbox_timeout={cfg.sandbox_timeout:g}`")


def test_the_sandbox_comparison_is_the_sandbox_s_config():
    from configuration import sandbox_config
    from sandbox import SandboxConfig

    cfg = sandbox_config(Config())  # the sandbox a run starts: the sandbox's own defaults
    assert cfg == SandboxConfig()
    says("05-torl.md", f"`memory_mb` {cfg.memory_mb} MB per call", f"with the same {cfg.timeout:g} s limit",
         f"already imported `{cfg.preload[0]}`, `{cfg.preload[1]}` and `{cfg.preload[2]}`")


def test_the_7b_paragraph_is_the_preset():
    cfg = PRESETS["torl-7b"]
    says("05-torl.md", f"micro-batches of {cfg['micro_batch_size']} and vLLM at "
                       f"`gpu_memory_utilization={cfg['gpu_memory_utilization']}`")


def test_the_dry_run_on_the_page_is_the_code_s_check():
    """docs/05-torl.md shows the dry run as a check: its planned GPUs and the refusal of a 7B trainer on one GPU.

    The plans' figures live on docs/06-scaling.md (06-train/test_docs_06.py holds them to memory_plan).
    """
    from dry_run import memory_plan, model_shape
    from retool import parse_args

    args, _ = parse_args(["--preset", "torl-1.5b", "--dry-run"])
    cfg = make_config("torl-7b", {})
    refusal = memory_plan(cfg, model_shape(cfg.model), gpus=1, gpu_gb=args.plan_gpu_gb).problems
    says("05-torl.md",
         f"`--plan-gpus` GPUs of `--plan-gpu-gb` GB ({args.plan_gpus} and {args.plan_gpu_gb:g})",
         f"dry run of preset torl-1.5b: {args.plan_gpus} x {args.plan_gpu_gb:.0f} GB GPU(s) planned",
         f"--preset torl-7b --dry-run --plan-gpus 1 ... refused: {refusal[0]}")
    assert len(refusal) == 1


def test_the_tool_s_share_is_measured_on_the_demo_s_final_checkpoint():
    steps = Config().steps
    says("05-torl.md", f"`runs/cpu-demo/checkpoints/step-{steps:06d}`", f"| after {steps} RL steps |")


def test_the_unknown_preset_refusal_lists_every_preset():
    says("05-runs.md", f"error: unknown preset 'gpt-5' (choose from {', '.join(PRESETS)})")


def test_the_step_on_the_page_is_train_step_s_own_code():
    """The page's main line of a step is retool.py's, line for line: a change to the step shows on the page."""
    import re
    from pathlib import Path

    from doc_pages import DOCS

    block = re.search(r"## One step.*?```python\n(.*?)```", (DOCS / "05-retool.md").read_text(), re.S).group(1)
    assert "grpo_step(" in block and block in (Path(__file__).parent / "retool.py").read_text()


def test_the_help_states_the_demos_times_the_pages_measured(capsys):
    import results
    import retool

    with pytest.raises(SystemExit):
        retool.parse_args(["--help"])
    said = " ".join(capsys.readouterr().out.split())
    demo, smollm2 = results.load("05-cpu-demo")["figures"], results.load("05-smollm2")["figures"]
    assert f"cpu-demo preset takes about {demo['wall_s']} s from its released base" in said
    assert f"smollm2 about {smollm2['wall_min']} min" in said
