"""The chained task: deterministic, held-out frames and numbers apart, every kind present, two-step answers out of one call's reach.

Its scripted policies run in the real sandbox and are scored by chapter 04's reward in 05-retool/test_chained_task.py.
"""
import re
from collections import Counter

import pytest

from chained_problems import (TEST_FRAMES, TRAIN_FRAMES, make_chained_problems, parse, scripted_calls, single_programs,
                              step_call, without_leading_zeros)

KINDS = ("1step", "1step-padded", "2step", "2step-padded")


def kind(row: dict) -> str:
    return row["source"].removeprefix("chained-heldout-").removeprefix("chained-")


def test_same_seed_same_problems_another_seed_others_and_no_duplicates():
    a, b = make_chained_problems(300, 60, seed=5), make_chained_problems(300, 60, seed=5)
    assert a == b
    assert a != make_chained_problems(300, 60, seed=6)
    ids = [r["id"] for r in a[0] + a[1]]
    assert len(ids) == len(set(ids))


def test_held_out_problems_share_neither_frame_nor_numbers_with_training():
    train, test = make_chained_problems(2000, 200, seed=0)

    def frame(q):
        ask, rest = q.split("? ", 1)
        return ask, rest.split(". ")[0].rsplit(" ", 1)[0]  # the question, the opening without the reading

    def numbers(q):
        reading, steps = parse(q)
        return int(reading), tuple(steps)

    assert not {frame(r["question"]) for r in train} & {frame(r["question"]) for r in test}
    assert len({frame(r["question"]) for r in train}) == len(TRAIN_FRAMES)
    assert len({frame(r["question"]) for r in test}) == len(TEST_FRAMES)
    assert not {numbers(r["question"]) for r in train} & {numbers(r["question"]) for r in test}
    assert {kind(r) for r in test} == {kind(r) for r in train} == set(KINDS)
    assert all(r["source"].startswith("chained-heldout-") for r in test)


def test_the_held_out_problems_do_not_depend_on_how_many_training_problems_are_drawn():
    assert make_chained_problems(50, 30, seed=1)[1] == make_chained_problems(500, 30, seed=1)[1]
    assert make_chained_problems(50, 30, seed=1)[1] != make_chained_problems(50, 30, seed=2)[1]


def test_every_kind_is_common_enough_to_show_in_an_evaluation_of_100():
    train, test = make_chained_problems(2000, 200, seed=0)
    for rows in (train, test[:100]):
        counts = Counter(kind(r) for r in rows)
        assert set(counts) == set(KINDS) and min(counts.values()) >= len(rows) // 10, counts


def test_answers_are_the_steps_applied_in_order_and_the_text_says_its_kind():
    train, test = make_chained_problems(400, 100, seed=2)
    for row in train + test:
        reading, steps = parse(row["question"])
        value = int(reading)
        for op, n in steps:
            value = {"*": value * n, "+": value + n, "-": value - n}[op]
        assert str(value) == row["answer"] and 0 < value < 10**8
        assert all(op == "+" and 100 <= n <= 999 for op, n in steps)  # fixed widths: see the module's docstring
        assert 1000 <= int(reading) + steps[0][1] <= 9999
        assert len(reading) == 4 and row["source"].endswith(f"{len(steps)}step" + ("-padded" if reading[0] == "0" else ""))


def test_no_single_program_of_the_taught_shape_reaches_a_two_step_answer():
    train, test = make_chained_problems(1000, 200, seed=1)
    two_step = [r for r in train + test if len(parse(r["question"])[1]) == 2]
    assert len(two_step) > 400
    for row in two_step:
        assert int(row["answer"]) not in single_programs(row["question"])


def test_the_moves_first_call_as_written_fix_drops_zeros_next_step_uses_the_printed_value():
    q = "What number do you get? A counter shows 0482. Add 637, then add 905."
    assert parse(q) == ("0482", [("+", 637), ("+", 905)])
    assert step_call(q, 0, "0482") == "print(0482 + 637)"
    assert without_leading_zeros("print(0482 + 637)") == "print(482 + 637)"
    assert without_leading_zeros("print(1005 + 100)") == "print(1005 + 100)"
    assert step_call(q, 1, "1119") == "print(1119 + 905)"

    printed = {"print(482 + 637)": "1119", "print(1119 + 905)": "2024"}  # what Python prints; None: it raised
    assert scripted_calls(q, printed.get, lambda move: True) == (
        ["print(0482 + 637)", "print(482 + 637)", "print(1119 + 905)"], "2024")
    assert scripted_calls(q, printed.get, lambda move: False) == (["print(0482 + 637)"], None)
    assert scripted_calls(q, printed.get, lambda move: move == "fix") == (["print(0482 + 637)", "print(482 + 637)"], "1119")
    assert scripted_calls(q, printed.get, lambda move: True, budget=2) == (["print(0482 + 637)", "print(482 + 637)"], None)


def test_text_the_task_did_not_write_is_refused():
    for text in ("What is 12 * 34?", "What number do you get? A counter shows 482. Add 5 to it.",
                 "What number do you get? A counter shows 0482. Divide it by 2.",
                 "A counter shows 0482. Add 137. What number do you get?"):
        with pytest.raises(ValueError, match="not a question this task writes"):
            parse(text)
    assert re.fullmatch(r"print\(\d+ [*+-] \d+\)", step_call(make_chained_problems(1, 0)[0][0]["question"], 0, "1234"))
