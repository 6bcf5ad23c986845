"""Every measured figure a page quotes agrees with its one results file (results.py says how a page quotes)."""
from __future__ import annotations

import pytest

import results


def test_every_page_quotes_its_results_files_as_they_are():
    texts = {str(page.relative_to(results.ROOT)): page.read_text(encoding="utf-8") for page in results.pages()}
    found = results.problems(texts)
    assert not found, "\n".join(found) + "\n(after a new measurement: `python results.py` rewrites the pages)"


def test_every_results_file_names_its_command_and_holds_small_figures():
    for name in results.names():
        result = results.load(name)
        assert set(result) == {"command", "figures"} and result["command"].strip(), f"results {name}"
        results.check(name, result["figures"])  # refuses what a results file may not hold


@pytest.fixture
def one_file(tmp_path, monkeypatch):
    """A results folder of its own holding demo.json, and a page quoting it in a block and inline."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    results.save("demo", "make run-demo", {"accuracy": 0.94, "wall_s": 264, "note": "seed 0"})
    page = ("Before.\n<!-- results demo -->\n" + results.block("demo", []) + "<!-- /results -->\n"
            "After RL <!-- r demo.accuracy -->0.94, in <!-- r demo.wall_s -->264 s.\n")
    return {"docs/a.md": page}


def test_a_page_that_agrees_with_its_file_passes(one_file):
    assert results.problems(one_file) == []
    assert "| `accuracy` | 0.94 |" in one_file["docs/a.md"] and "`make run-demo`" in one_file["docs/a.md"]


def test_a_changed_figure_in_prose_fails_and_the_rewrite_restores_it(one_file):
    page = one_file["docs/a.md"].replace("-->0.94,", "-->0.91,")
    (found,) = results.problems({"docs/a.md": page})
    assert "differs from its results file" in found and "0.91" in found
    assert results.render(page) == one_file["docs/a.md"]


def test_a_quote_ends_before_a_percent_sign_or_a_closing_full_stop(one_file):
    page = "<!-- r demo.accuracy -->0.5% and <!-- r demo.wall_s -->1.\n"
    assert results.render(page) == "<!-- r demo.accuracy -->0.94% and <!-- r demo.wall_s -->264.\n"


def test_a_changed_figure_in_a_block_fails(one_file):
    page = one_file["docs/a.md"].replace("| 0.94 |", "| 0.95 |")
    assert any("differs from its results file" in p for p in results.problems({"docs/a.md": page}))


def test_a_new_measurement_fails_until_the_page_is_rewritten(one_file):
    results.save("demo", "make run-demo", {"accuracy": 0.96, "wall_s": 270, "note": "seed 0"})
    assert len(results.problems(one_file)) >= 2
    page = results.render(one_file["docs/a.md"])
    assert "-->0.96, in <!-- r demo.wall_s -->270 s." in page and results.problems({"docs/a.md": page}) == []


def test_a_marker_in_backticks_is_an_example_not_a_quote(one_file):
    example = "Quote inline as `<!-- r NAME.key -->0.94`, in blocks as `<!-- results NAME -->`.\n"
    assert results.problems({**one_file, "README.md": example}) == []


def test_one_results_file_quoted_on_two_pages_fails(one_file):
    """The rule README.md states: one results file, one page (a file may hold several runs, each quoted with it)."""
    found = results.problems({**one_file, "docs/b.md": "Also <!-- r demo.wall_s -->264.\n"})
    assert found == ["results demo is quoted on 2 pages, not one: docs/a.md, docs/b.md"]


def test_the_readme_states_the_rule_the_check_enforces():
    readme = " ".join((results.ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "fails while a page and its file differ, or when one results file is quoted on two pages or on none" in readme


def test_a_quote_of_a_missing_file_or_figure_fails(one_file):
    for quote in ("<!-- r nosuch.accuracy -->1", "<!-- r demo.nosuch -->1", "<!-- results demo nosuch -->\n<!-- /results -->"):
        (found,) = results.problems({"docs/a.md": one_file["docs/a.md"] + quote + "\n"})
        assert found.startswith("docs/a.md: ") and "nosuch" in found


def test_a_figure_of_several_words_is_quoted_in_a_block_only(one_file):
    (found,) = results.problems({"docs/a.md": one_file["docs/a.md"] + "<!-- r demo.note -->seed 0\n"})
    assert found == "docs/a.md: results demo.note is 'seed 0', not one word: quote it in a block"


def test_a_results_file_no_page_quotes_fails(one_file):
    assert results.problems({"docs/a.md": "No figures.\n"}) == ["results demo is quoted by no page"]


def test_a_block_must_show_the_command_that_measured_it(one_file):
    page = one_file["docs/a.md"].replace("Measured by `make run-demo`", "Measured")
    assert "docs/a.md: the block of results demo does not show its command" in results.problems({"docs/a.md": page})


def test_a_results_file_holds_numbers_and_short_strings_only(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    for name, figures in (("a/b", {}), ("ok", {"x.y": 1}), ("ok", {"x": [1]}), ("ok", {"x": True}), ("ok", {"x": "y" * 41})):
        with pytest.raises(ValueError):
            results.save(name, "cmd", figures)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_the_rewrite_changes_no_page_while_one_quotes_what_is_not_there(one_file, tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    good, bad = tmp_path / "docs" / "good.md", tmp_path / "docs" / "bad.md"
    good.write_text(one_file["docs/a.md"].replace("-->0.94,", "-->0.5,"))
    bad.write_text("<!-- r demo.nosuch -->1\n")
    monkeypatch.setattr(results, "pages", lambda: [good, bad])
    monkeypatch.setattr(results, "ROOT", tmp_path)
    assert results.main([]) == 1 and "-->0.5," in good.read_text()
    bad.write_text("")
    assert results.main([]) == 0 and good.read_text() == one_file["docs/a.md"]


def test_an_appendix_page_is_checked_and_links_the_results_folder_from_where_it_is(one_file, tmp_path, monkeypatch):
    monkeypatch.setattr(results, "ROOT", tmp_path)
    appendix = tmp_path / "docs" / "appendix"
    appendix.mkdir(parents=True)
    (tmp_path / "README.md").write_text("No figures.\n")
    stale = one_file["docs/a.md"].replace("-->0.94,", "-->0.91,")
    (appendix / "02-a.md").write_text(stale)
    assert appendix / "02-a.md" in results.pages()
    texts = {str(page.relative_to(tmp_path)): page.read_text() for page in results.pages()}
    found = results.problems(texts)
    assert any(p.startswith("docs/appendix/02-a.md:") and "0.91" in p for p in found), found
    assert results.main([]) == 0
    fixed = (appendix / "02-a.md").read_text()
    assert "-->0.94, in" in fixed and "([results/demo.json](../results/demo.json))" in fixed
    assert results.problems({"docs/appendix/02-a.md": fixed}) == []


TABLE = ("<!-- results-table demo.wall demo.x; {}_s accuracy -->\n"
         "| figure | wall | x |\n| --- | --- | --- |\n| seconds | 264 | 1 |\n| accuracy | 0.94 | 0.94 |\n")


def test_a_table_without_markers_is_checked_cell_by_cell_and_rewritten(one_file):
    results.save("demo", "make run-demo", {"accuracy": 0.94, "wall_s": 264, "note": "seed 0", "x_s": 1})
    assert results.problems({"docs/a.md": TABLE}) == []  # the table alone quotes demo: it counts as its page
    stale = TABLE.replace("| seconds | 264 |", "| seconds | 263 |")
    (found,) = results.problems({"docs/a.md": stale})
    assert "docs/a.md:4: differs from its results file" in found and "263" in found
    assert results.render(stale) == TABLE


def test_a_table_with_a_key_too_few_or_a_row_without_a_label_fails_in_one_line(one_file):
    (found,) = results.problems({"docs/a.md": TABLE.replace(" accuracy -->", " -->")})
    assert found == "docs/a.md: results-table demo.wall demo.x: 1 keys for 2 rows"
    (found,) = results.problems({"docs/a.md": TABLE.replace("| seconds | 264 | 1 |", "| 264 | 1 |")})
    assert found == "docs/a.md: results-table demo.wall demo.x: row 1 has 2 cells, no label"
