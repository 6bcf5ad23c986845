"""01-data: every source lands in one schema; what cannot be verified is dropped and counted."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prepare_data import DataError, load_problems, main, make_toy_task, read_problems, write_jsonl

SCHEMA = {"id", "question", "answer", "source"}


def write_lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_local_jsonl_is_normalised_to_the_schema(tmp_path):
    f = write_lines(tmp_path / "mine.jsonl", [{"problem": " What is 2+2? ", "answer": 4, "extra": 1}])
    rows, dropped = load_problems(str(f))
    assert dropped == {}
    assert len(rows) == 1 and set(rows[0]) == SCHEMA
    assert rows[0]["question"] == "What is 2+2?" and rows[0]["answer"] == "4" and rows[0]["source"] == "mine"
    assert rows[0]["id"].startswith("mine-")


def test_torl_release_schema_parquet_reads_user_message_and_ground_truth(tmp_path):
    rows = [
        {
            "data_source": "aime24",
            "prompt": [
                {"role": "system", "content": "Please reason step by step."},
                {"role": "user", "content": "Find x if x+1=3."},
            ],
            "reward_model": {"ground_truth": "2", "style": "rule"},
        }
    ] * 4  # ToRL's test file repeats each AIME problem four times
    path = tmp_path / "torl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    kept, dropped = load_problems(str(path))
    assert kept == [{"id": kept[0]["id"], "question": "Find x if x+1=3.", "answer": "2", "source": "aime24"}]
    assert dropped == {"duplicate question": 3}


def test_unverifiable_rows_are_dropped_and_counted_by_reason(tmp_path):
    f = write_lines(
        tmp_path / "mixed.jsonl",
        [
            {"question": "What is 1+1?", "answer": "2"},
            {"question": "what  is 1+1?", "answer": "2"},  # same question up to case and spaces
            {"question": "What is 3+3?", "answer": ""},
            {"question": "Prove that there are infinitely many primes.", "answer": "infinitely many"},
            {"question": "Find (a) the sum and (b) the product of the roots.", "answer": "3"},
            {"question": "Solve x^2=4.", "answer": "2; -2"},
            {"question": "In the figure (A) is joined to (B). Find AB.", "answer": "5"},
        ],
    )
    rows, dropped = load_problems(str(f))
    assert [r["answer"] for r in rows] == ["2", "5"]
    assert dropped == {"duplicate question": 1, "empty answer": 1, "proof": 1, "multi-part": 2}


def test_training_rows_whose_question_is_in_an_evaluation_set_are_left_out(tmp_path, capsys):
    ev = write_lines(tmp_path / "ev.jsonl", [{"question": "What is 2+2?", "answer": "4"}])
    tr = write_lines(tmp_path / "tr.jsonl", [{"question": "what is  2+2?", "answer": "4"},
                                              {"question": "What is 3+3?", "answer": "6"}])
    out = tmp_path / "out"
    assert main(["--train", str(tr), "--eval", str(ev), "--no-toy", "--out", str(out)]) == 0
    assert [r["question"] for r in read_problems(out / "train.jsonl")] == ["What is 3+3?"]
    assert [r["question"] for r in read_problems(out / "ev.jsonl")] == ["What is 2+2?"]  # the evaluation set keeps it
    assert "dropped 1 (in an evaluation set)" in capsys.readouterr().out


def test_limit_counts_rows_kept_after_every_filter_the_evaluation_overlap_included(tmp_path):
    ev = write_lines(tmp_path / "ev.jsonl", [{"question": "What is 2+2?", "answer": "4"}])
    tr = write_lines(tmp_path / "tr.jsonl", [{"question": f"What is {a}+{a}?", "answer": str(2 * a)} for a in (2, 3, 4)])
    out = tmp_path / "out"
    assert main(["--train", str(tr), "--eval", str(ev), "--no-toy", "--limit", "2", "--out", str(out)]) == 0
    assert [r["question"] for r in read_problems(out / "train.jsonl")] == ["What is 3+3?", "What is 4+4?"]


def test_toy_task_is_deterministic_correct_and_splits_do_not_overlap():
    train, test = make_toy_task(50, 20, seed=7)
    assert (train, test) == make_toy_task(50, 20, seed=7)
    assert train != make_toy_task(50, 20, seed=8)[0]
    assert {r["question"] for r in train}.isdisjoint(r["question"] for r in test)
    for row in train + test:
        assert set(row) == SCHEMA
        a, b = (int(x) for x in row["question"].removeprefix("What is ").removesuffix("?").split(" * "))
        assert 100 <= a <= 999 and 100 <= b <= 999 and int(row["answer"]) == a * b
        assert len(row["answer"]) == 6  # one answer length for every problem


def test_written_files_read_back_unchanged(tmp_path):
    train, _ = make_toy_task(10, 0)
    write_jsonl(train, tmp_path / "toy.jsonl")
    assert read_problems(tmp_path / "toy.jsonl") == train


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        load_problems(str(tmp_path / "nope.jsonl"))


def test_unknown_dataset_name_is_refused_without_touching_the_hub():
    with pytest.raises(DataError, match="unknown data set 'aime2099'"):
        load_problems("aime2099")


def test_missing_answer_column_names_file_row_and_columns(tmp_path):
    f = write_lines(tmp_path / "q.jsonl", [{"question": "What is 1+1?", "solution": "2"}])
    with pytest.raises(DataError, match=r"q.jsonl row 0: no answer column .*found question, solution"):
        load_problems(str(f))


def test_missing_question_column_is_reported(tmp_path):
    f = write_lines(tmp_path / "a.jsonl", [{"text": "hi", "answer": "2"}])
    with pytest.raises(DataError, match=r"a.jsonl row 0: no question column"):
        load_problems(str(f))


def test_invalid_json_line_names_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"question": "q", "answer": "1"}\n{"question": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_problems(str(f))


def test_unreadable_row_names_the_row(tmp_path):
    f = write_lines(tmp_path / "r.jsonl", [{"question": "q", "answer": "1"}, {"question": 5, "answer": "1"}])
    with pytest.raises(DataError, match=r"r.jsonl row 1: column 'question' holds no question text"):
        load_problems(str(f))


def test_cli_bad_input_is_one_line_and_leaves_no_file(tmp_path, capsys):
    bad = write_lines(tmp_path / "bad.jsonl", [{"question": "q", "answer": "1"}, {"nothing": 1}])
    out = tmp_path / "out"
    code = main(["--train", str(bad), "--no-eval", "--no-toy", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "bad.jsonl row 1" in err
    assert not out.exists() or list(out.iterdir()) == []


def test_an_unwritable_out_folder_is_one_line_before_any_data_is_made(capsys):
    code = main(["--out", "/proc/lab-data"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --out /proc/lab-data: cannot write there (/proc: ") and err.count("\n") == 1


def test_failed_write_leaves_previous_file_intact(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_jsonl([{"id": "1", "question": "q", "answer": "1", "source": "s"}], path)
    before = path.read_text()
    with pytest.raises(TypeError):
        write_jsonl([{"id": "2", "question": object()}], path)  # not JSON-serialisable mid-write
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


def test_cli_writes_toy_task(tmp_path, capsys):
    code = main(["--no-train", "--no-eval", "--out", str(tmp_path), "--toy-train", "30", "--toy-test", "5"])
    assert code == 0
    assert len(read_problems(tmp_path / "toy_train.jsonl")) == 30
    assert len(read_problems(tmp_path / "toy_test.jsonl")) == 5
    assert "toy: 30 train and 5 test problems" in capsys.readouterr().out


def test_an_unreachable_hub_is_found_once_not_per_data_set(tmp_path, monkeypatch, capsys):
    import datasets

    import prepare_data

    probes = []
    monkeypatch.setattr(prepare_data, "_hub_probe", {})
    monkeypatch.setattr(prepare_data, "_probe_hub", lambda: probes.append(1) or "no answer (test)")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("tried the hub after finding it unreachable"))
    assert prepare_data.main(["--out", str(tmp_path)]) == 0  # the default run: toy task, train set, two eval sets
    err = capsys.readouterr().err.splitlines()
    assert probes == [1]
    assert len(err) == 3 and all(l.startswith("skipped: ") and l.endswith("no answer (test)") for l in err)
    assert (tmp_path / "toy_train.jsonl").exists()


def test_a_named_train_file_does_not_make_the_default_eval_sets_fail_offline(tmp_path, monkeypatch, capsys):
    import prepare_data

    monkeypatch.setattr(prepare_data, "_hub_probe", {})
    monkeypatch.setattr(prepare_data, "_probe_hub", lambda: "no answer (test)")
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"question": "What is 2 + 3?", "answer": "5"}\n')
    assert prepare_data.main(["--out", str(tmp_path / "data"), "--no-toy", "--train", str(mine)]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().err.splitlines()] == ["skipped", "skipped"]
    assert len(read_problems(tmp_path / "data" / "train.jsonl")) == 1
    assert prepare_data.main(["--out", str(tmp_path / "data"), "--no-toy", "--no-train", "--eval", "aime24"]) == 1


def test_offline_mode_never_tries_the_network(monkeypatch):
    from huggingface_hub import utils

    import prepare_data

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(utils, "get_session", lambda: pytest.fail("probed the network in offline mode"))
    assert prepare_data._probe_hub() is None


@pytest.mark.parametrize("argv, says", [
    (["--toy-digits", "1"], "argument --toy-digits: must be at least 2, got 1"),
    (["--toy-digits", "0"], "argument --toy-digits: must be at least 2, got 0"),
    (["--toy-train", "-5"], "argument --toy-train: must be at least 0, got -5"),
    (["--toy-test", "x"], "argument --toy-test: not an integer: 'x'"),
    (["--limit", "0"], "argument --limit: must be at least 1, got 0"),
    (["--toy-digits", "2", "--toy-train", "9000", "--no-train", "--no-eval"],
     "toy task: 2-digit factors give fewer than 9200 distinct problems"),
])
def test_each_command_line_mistake_is_one_line_with_status_2_and_writes_nothing(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        code = main(argv + ["--out", str(tmp_path / "out")])
        raise SystemExit(code)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_the_page_states_the_sources_columns_and_toy_defaults_of_the_code():
    """docs/01-data.md restates the named sources, the recognised columns and the toy task's sizes: read from the code."""
    from doc_pages import says
    from prepare_data import ANSWER_COLUMNS, DEFAULT_TRAIN, NAMED_SOURCES, QUESTION_COLUMNS, parse_args

    for name, spec in NAMED_SOURCES.items():
        says("01-data.md", f"| `{name}`" + (" (default train)" if name == DEFAULT_TRAIN else "") + f" | `{spec['path']}` | {spec['split']}")
    says("01-data.md", "recognised for the question: " + ", ".join(f"`{c}`" for c in QUESTION_COLUMNS),
         "for the answer: " + ", ".join(f"`{c}`" for c in ANSWER_COLUMNS),
         f"(looked for {', '.join(ANSWER_COLUMNS)};", f"one of {', '.join(NAMED_SOURCES)}")
    args = parse_args([])
    says("01-data.md", f"{args.toy_train} and {args.toy_test} problems by default (`--toy-train`",
         f"Products of two {args.toy_digits}-digit numbers (`--toy-digits`, at least 2), always {2 * args.toy_digits} digits")
