"""The chained task against the real sandbox and chapter 04's reward, and the cold start's traces of it."""
import json
import random

from chained_problems import make_chained_problems, parse, scripted_calls, without_leading_zeros
from cold_start import FURTHER_CALL_RATE, chained_traces, is_chained_task
from tool_traces import TOOL_CLOSING, TOOL_OPENING
from reward import score_answer
from rollout import observation_text


def kind(row: dict) -> str:
    return row["source"].removeprefix("chained-heldout-").removeprefix("chained-")


def play(row, sandbox, decide) -> tuple[list[str], float]:
    """A scripted policy's calls through the sandbox, and the reward its boxed answer earns (-1 if it gave up)."""
    def run(code):
        result = sandbox.run(code)
        return result.stdout.strip() if result.ok else None

    calls, answer = scripted_calls(row["question"], run, decide)
    text = "The answer is \\boxed{%s}." % answer if answer is not None else "I give up."
    return calls, score_answer(text, row["answer"]).reward


def test_every_answer_is_scored_plus_one_and_the_multi_call_policy_earns_it_in_the_sandbox(sandbox):
    train, test = make_chained_problems(30, 30, seed=4)
    for row in train + test:
        assert score_answer("The answer is \\boxed{%s}." % row["answer"], row["answer"]).reward == 1.0
        calls, reward = play(row, sandbox, lambda move: True)
        assert reward == 1.0, (row, calls)
        assert len(calls) == {"1step": 1, "1step-padded": 2, "2step": 2, "2step-padded": 3}[kind(row)]


def test_the_single_call_policy_solves_only_the_one_step_unpadded_problems(sandbox):
    train, test = make_chained_problems(30, 30, seed=4)
    for row in train + test:
        calls, reward = play(row, sandbox, lambda move: False)
        assert len(calls) == 1
        assert reward == (1.0 if kind(row) == "1step" else -1.0), (row, calls)


def test_a_padded_first_call_fails_and_the_observation_says_why(sandbox):
    q = next(r["question"] for r in make_chained_problems(50, 0, seed=4)[0] if kind(r) == "2step-padded")
    reading, ((op, n), _) = parse(q)
    first = sandbox.run(f"print({reading} {op} {n})")
    assert not first.ok
    assert observation_text(first).startswith("\nSyntaxError: leading zeros in decimal integer literals are not permitted")
    fixed = sandbox.run(without_leading_zeros(f"print({reading} {op} {n})"))
    assert op == "+" and fixed.ok and int(fixed.stdout) == int(reading) + n


def test_cold_start_traces_show_each_move_at_the_low_rate_with_the_sandboxs_real_output():
    train, _ = make_chained_problems(300, 0, seed=0)
    assert is_chained_task(train) and not is_chained_task([{"question": "What is 12 * 34?"}])
    traces = chained_traces(train, tool_fraction=1.0, rng=random.Random(0), template="torl")
    fixes = chains = fix_points = chain_points = 0
    for row, trace in zip(train, traces):
        kinds = [k for k, _ in trace["segments"]]
        assert kinds == ["prompt"] + ["model", "observation"] * trace["calls"] + ["model"]
        codes = [text.removeprefix("```python\n").removesuffix("\n```\n```output")
                 for k, text in trace["segments"][1:-1:2]]
        reading, steps = parse(row["question"])
        assert codes[0] == f"print({reading} {steps[0][0]} {steps[0][1]})"  # the reading as written
        for code, (_, observation) in zip(codes, trace["segments"][2::2]):
            out = observation.strip("\n`")
            fix_points += out.startswith("SyntaxError")
            chain_points += out.isdigit() and code.endswith(f" {steps[0][1]})") and len(steps) == 2
        fixes += any(code == without_leading_zeros(codes[0]) != codes[0] for code in codes[1:])
        chains += len(codes) > 1 and codes[-1].endswith(f" {steps[-1][1]})") and len(steps) == 2
        boxed = trace["segments"][-1][1]
        assert boxed == f"The answer is \\boxed{{{row['answer']}}}." or trace["calls"] < len(steps) + (reading[0] == "0")
        needed = len(steps) + (reading[0] == "0")  # the drill: every move, so every call, and the right answer
        assert [k for k, _ in trace["drill"]] == ["prompt"] + ["move", "observation"] * needed + ["move"]
        assert trace["drill"][-1][1] == f"The answer is \\boxed{{{row['answer']}}}."
        assert trace["drill"][:2 * trace["calls"] + 1] == [("move" if k == "model" else k, t) for k, t in trace["segments"][:-1]]
    for made, possible in ((fixes, fix_points), (chains, chain_points)):
        assert possible > 40 and abs(made / possible - FURTHER_CALL_RATE) < 0.1, (made, possible)


def test_a_drill_trains_every_token_of_a_move_but_the_first_the_decision(tiny_model_path):
    from transformers import AutoTokenizer

    from cold_start import tokenize_trace

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    segments = [("prompt", "Q: 1 + 2?\n"), ("model", "```python\nprint(1 + 2)\n```\n```output"), ("observation", "\n3\n```\n"),
                ("model", "The answer is \\boxed{3}.")]
    ids, mask = tokenize_trace({"segments": segments}, tokenizer)
    drill_ids, drill_mask = tokenize_trace({"segments": [("move" if k == "model" else k, t) for k, t in segments]}, tokenizer)
    assert drill_ids == ids
    starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]  # where each model segment begins
    assert len(starts) == 2 and all(drill_mask[i] == 0 for i in starts)
    assert [m for i, m in enumerate(mask) if i not in starts] == [m for i, m in enumerate(drill_mask) if i not in starts]


def test_the_experiments_page_states_the_task_the_cold_start_and_the_preset():
    from collections import Counter

    from chained_problems import PADDED_SHARE, SIZES, TEST_FRAMES, TRAIN_FRAMES, TWO_STEP_SHARE
    from doc_pages import says
    from moves_check import CHECK_PROBLEMS, MOVES_NEEDED
    from problems_and_policy import further_schedules
    from retool import Config, make_config

    cfg, demo, words = make_config("cpu-chained", {}), Config(), {2: "two", 3: "three", 4: "four", 0.5: "half", 1 / 3: "a third"}
    schedules, rounds = further_schedules(cfg.cold_start_schedules), {2: "twice"}
    assert schedules[-1][2] and cfg.cold_start_schedules.split()[0] == f"{cfg.cold_start_steps}:{cfg.cold_start_tool_only_steps}"
    held_out = Counter(kind(r) for r in make_chained_problems(0, SIZES[1], seed=0)[1][:cfg.eval_problems])
    says("06-experiments.md",
         f"two steps ({words[TWO_STEP_SHARE]} the problems) and a reading below 1000 ({words[PADDED_SHARE]})",
         f"({words[len(TEST_FRAMES)]} frames against {words[len(TRAIN_FRAMES)]} in training)",
         *(f"| {name} | {detail} | {held_out[k]} |" for k, name, detail in (
             ("1step", "one step", "1"), ("1step-padded", "one step, padded reading", "2: the error, then the same call"
                                          " without the zero"),
             ("2step", "two steps", "2: the second reads the first's printed result"),
             ("2step-padded", "two steps, padded reading", "3"))),
         f"{cfg.cold_start_tool_fraction:.0%} of its traces call the tool",
         f"`FURTHER_CALL_RATE` = {FURTHER_CALL_RATE}", f"`MOVES_NEEDED` = {MOVES_NEEDED}",
         f"multi-call policy on {CHECK_PROBLEMS} fresh problems in the held-out frames",
         f"Of the {SIZES[0]:,} training problems", f"the model is a tiny one whose {words[cfg.cold_start_kv_heads]} heads each have",
         f"A cold start trains {cfg.cold_start_steps} steps, the first {cfg.cold_start_tool_only_steps} on the drills "
         f"alone (the demo's {demo.cold_start_steps} and {demo.cold_start_tool_only_steps}",
         f"The base\n  takes {words[1 + len(schedules)]}: that schedule (run {rounds[cfg.cold_start_rounds]} when",
         f"one whose mixed phase, {schedules[-1][0] - schedules[-1][1]} steps,\n  keeps the drills",
         f"({cfg.problems_per_step} problems × {cfg.group_size} samples, lr {cfg.lr:.0e}".replace("e-05", "e-5"),
         f"a tool budget of {cfg.tool_budget} (the hardest kind needs 3), {cfg.max_response_tokens} response tokens",
         f"and {cfg.steps} steps: 30 were planned, and doubled",
         f"each of the first {cfg.eval_problems} held-out problems")


def test_a_cold_start_on_the_chained_task_trains_on_its_chained_traces(tmp_path, monkeypatch):
    import cold_start
    import moves_check
    from prepare_data import write_jsonl

    monkeypatch.setattr(moves_check, "CHECK_PROBLEMS", 8)  # the check's contract, on fewer problems
    write_jsonl(make_chained_problems(40, 0, seed=3)[0], tmp_path / "chained.jsonl")
    built = []
    real = cold_start.chained_traces
    monkeypatch.setattr(cold_start, "chained_traces", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    out = cold_start.main(["--train-file", str(tmp_path / "chained.jsonl"), "--steps", "2", "--tool-only-steps", "1",
                           "--batch-size", "4", "--hidden-size", "64", "--num-layers", "1", "--vocab-size", "128",
                           "--max-len", "128", "--warmup-steps", "1", "--tool-fraction", "0.5", "--out", str(tmp_path / "base"),
                           "--rounds", "2"])
    assert (out / "config.json").exists() and len(built) == 1 and len(built[0]) == 40
    assert any(t["tool"] for t in built[0]) and any(not t["tool"] for t in built[0])
    moves = json.loads((out / "cold_start.json").read_text())["moves"]  # checked before any RL, and kept with the base
    assert set(moves) == {"call", "box", "fix", "chain", "next", "last", "passed"} and moves["passed"] is False  # two steps learn nothing
    assert json.loads((out / "cold_start.json").read_text())["rounds"] == 2  # so the schedule ran again, then gave up


def test_the_moves_check_scores_exactly_the_tokens_of_each_move(tiny_model_path):
    from transformers import AutoTokenizer

    from moves_check import move_spans

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = make_chained_problems(0, 24, seed=5)[1]
    for row, (ids, spans, decisions) in zip(rows, move_spans(rows, tokenizer, "torl")):
        reading, steps = parse(row["question"])
        expected = ["call"] + ["fix"] * reading.startswith("0") + ["chain"] * (len(steps) - 1) + ["box"]
        assert [move for move, _, _ in spans] == expected, row
        # a decision after each result: "next" opens the chain's call, "last" the box
        assert [d for d, _ in decisions] == ["next"] * (len(steps) - 1) + ["last"], row
        decided = [s for s in spans if s[0] in ("chain", "box")]
        for (decision, at), (_, _, end) in zip(decisions, decided):
            opening = TOOL_OPENING if decision == "next" else TOOL_CLOSING
            assert tokenizer.decode(ids[at:end]).startswith(opening.split("{")[0]), row
        texts = [tokenizer.decode(ids[start:end]) for _, start, end in spans]
        assert texts[0] == f"print({reading} {steps[0][0]} {steps[0][1]})" and texts[-1] == row["answer"]
        if reading.startswith("0"):
            assert texts[1] == without_leading_zeros(texts[0])


def test_self_correction_counts_each_error_observation_once_by_what_followed_it():
    from run_record import outcome_metrics, self_correction
    from trajectory import ToolCall, Trajectory

    def call(ok):
        return ToolCall(code="print(1)", ok=ok, timed_out=False, returncode=0 if ok else 1, latency=0.0,
                        observation="", start=0, end=0)

    def trajectory(*oks):
        return Trajectory(problem_id="p", group_index=0, reference="1", prompt_ids=[1], token_ids=[2], logprobs=[0.0],
                          loss_mask=[1], text="", tool_calls=[call(ok) for ok in oks], reward=-1.0)

    # errors: (fixed, right), (fixed, wrong), (followed by another error, wrong) and that error (last call, wrong)
    trajectories = [trajectory(False, True), trajectory(False, True, True), trajectory(False, False), trajectory(True)]
    correct = [True, False, False, True]
    m = self_correction(trajectories, correct)
    assert (m["errors"], m["error_then_call_ok"], m["error_then_correct"]) == (4.0, 0.5, 0.25)
    assert self_correction([trajectory(True)], [True])["errors"] == 0.0  # no error observation: nothing to say

    class Result:
        def __init__(self, right):
            self.correct, self.valid_format = right, True
    assert outcome_metrics(trajectories, [Result(r) for r in correct])["error_then_call_ok"] == 0.5


def test_a_run_on_the_chained_preset_writes_the_chained_task_when_its_files_are_missing(tmp_path, monkeypatch):
    from chained_problems import SIZES
    from problems_and_policy import load_data
    from retool import make_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "toy_test.jsonl").write_text("")  # another task's file is left alone
    train, held_out = load_data(make_config("cpu-chained", {}))
    assert (len(train), len(held_out)) == SIZES and is_chained_task(train) and is_chained_task(held_out)
    assert held_out == make_chained_problems(0, SIZES[1], seed=0)[1]
    assert (tmp_path / "data" / "toy_test.jsonl").read_text() == "" and not (tmp_path / "data" / "toy_train.jsonl").exists()


def test_drills_in_mix_keep_the_drills_in_the_mixed_phase_pool_and_only_then(tmp_path, monkeypatch):
    import cold_start
    import moves_check
    from prepare_data import write_jsonl

    monkeypatch.setattr(moves_check, "CHECK_PROBLEMS", 2)
    write_jsonl(make_chained_problems(30, 0, seed=4)[0], tmp_path / "chained.jsonl")
    pools = {}

    def train(model, examples, tool_examples, pad_id, args):
        pools[args.drills_in_mix] = (examples, tool_examples)
        return [0.0]

    monkeypatch.setattr(cold_start, "train", train)
    for flag in ([], ["--drills-in-mix"]):
        cold_start.main(["--train-file", str(tmp_path / "chained.jsonl"), "--steps", "2", "--tool-only-steps", "1",
                         "--hidden-size", "64", "--num-layers", "1", "--vocab-size", "128", "--max-len", "128",
                         "--tool-fraction", "0.5", "--out", str(tmp_path / f"base{len(flag)}"), *flag])
    (mixed, drills), (mixed_with, drills_with) = pools[False], pools[True]
    assert len(mixed) == 30 and drills and drills == drills_with
    assert mixed_with == mixed + drills  # every trace as before, and each drill once more


def test_the_chained_presets_own_data_passes_the_cold_starts_check_and_a_foreign_row_is_named(tmp_path, monkeypatch):
    """`retool.py --preset cpu-chained` on a fresh clone: the check before any model drew toy-task traces for it."""
    from configuration import config_problems
    from prepare_data import write_jsonl
    from retool import make_config

    monkeypatch.chdir(tmp_path)
    train, held_out = make_chained_problems(200, 20, seed=0)
    (tmp_path / "data").mkdir()
    write_jsonl(held_out, tmp_path / "data" / "chained_test.jsonl")
    write_jsonl(train, tmp_path / "data" / "chained_train.jsonl")
    assert config_problems(make_config("cpu-chained", {})) == []
    train[9] = {"question": "What is 3 * 4?", "answer": "12"}
    write_jsonl(train, tmp_path / "data" / "chained_train.jsonl")
    problems = config_problems(make_config("cpu-chained", {"cold_start": "scratch", "cold_start_tool_fraction": 1.0}))
    assert len(problems) == 1 and "row 10: the cold start cannot write a trace for it (not a question" in problems[0]
