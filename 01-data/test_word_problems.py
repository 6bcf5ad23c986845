"""The word-problem task: right answers, phrasings split between train and test, code recoverable from the text."""
import re

import pytest

from word_problems import TEST_TEMPLATES, TRAIN_TEMPLATES, make_word_problems, solution_code


def test_answers_are_what_the_recovered_code_prints():
    train, test = make_word_problems(300, 100, seed=3)
    for row in train + test:
        code = solution_code(row["question"])
        assert re.fullmatch(r"print\(\d+ [-+*] \d+\)", code)
        assert str(eval(code.removeprefix("print(").removesuffix(")"))) == row["answer"]
        assert int(row["answer"]) > 0
        numbers = [int(n) for n in re.findall(r"\d+", row["question"])]
        assert len(numbers) == 2 and all(100 <= n <= 9999 for n in numbers)


def test_held_out_phrasings_never_appear_in_training_and_every_phrasing_is_used():
    train, test = make_word_problems(500, 200, seed=0)
    def phrasing(q):
        return re.sub(r"\d+", "#", q)
    train_phrasings = {phrasing(r["question"]) for r in train}
    test_phrasings = {phrasing(r["question"]) for r in test}
    assert not train_phrasings & test_phrasings
    assert len(train_phrasings) == len(TRAIN_TEMPLATES) and len(test_phrasings) == len(TEST_TEMPLATES)
    assert {op for _, op in TEST_TEMPLATES} == {op for _, op in TRAIN_TEMPLATES} == {"*", "+", "-"}
    assert {r["source"] for r in test} == {"word-heldout"}


def test_same_seed_same_problems_and_no_duplicates():
    a, b = make_word_problems(200, 50, seed=7), make_word_problems(200, 50, seed=7)
    assert a == b
    ids = [r["id"] for r in a[0] + a[1]]
    assert len(ids) == len(set(ids))
    assert a != make_word_problems(200, 50, seed=8)


def test_text_the_task_did_not_write_is_refused():
    with pytest.raises(ValueError, match="not a question this task writes"):
        solution_code("What is 12 * 34?")
