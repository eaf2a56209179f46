"""The troubleshooting page cannot drift: every entry of dptrain.troubleshooting is checked against the code.

An entry with a `case` runs that case of tests/test_bad_inputs.py (in-process, as there) and its
message must match the error line printed; every `source` fragment must be written in src/dptrain.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bad_inputs import CASES, Sandbox, age, run_dptrain, sandbox, snapshot  # noqa: F401 - sandbox: a fixture

from dptrain.troubleshooting import AREAS, PROBLEMS, Problem, render_markdown

SOURCE = "\n".join(path.read_text() for path in (Path(__file__).resolve().parents[1] / "src" / "dptrain").rglob("*.py")
                   if path.name != "troubleshooting.py")
CASE_BY_ID = {param.id: param.values[0] for param in CASES}


def test_every_entry_is_checked_by_a_case_or_by_fragments_of_the_code():
    for problem in PROBLEMS:
        assert problem.area in AREAS, problem.title
        assert problem.case or problem.source, f"'{problem.title}' is checked by nothing"
        assert not (problem.case and problem.symptom), problem.title
        assert problem.message.startswith("dptrain: ") or problem.symptom or problem.message.startswith("{") \
            or problem.message.startswith("rank "), problem.title
    titles = [problem.title for problem in PROBLEMS]
    assert len(titles) == len(set(titles))


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.source], ids=lambda p: p.title)
def test_the_fragments_of_an_entry_are_written_in_the_code(problem: Problem):
    missing = [fragment for fragment in problem.source if fragment not in SOURCE]
    assert not missing, f"'{problem.title}': src/dptrain no longer writes {missing}"
    if not problem.symptom:
        for fragment in problem.source:
            if fragment in problem.message:  # a fragment of the code around it (e.g. "stopping") may not be
                assert problem.pattern().fullmatch(problem.message)


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.case], ids=lambda p: p.case)
def test_the_message_of_an_entry_is_the_line_its_bad_input_prints(problem: Problem, sandbox: Sandbox, capsys):
    case = CASE_BY_ID[problem.case]
    argv = case.make(sandbox)
    age(sandbox.root)
    before = snapshot(sandbox.root)
    capsys.readouterr()

    code, stderr = run_dptrain(argv, case, sandbox.root, capsys)

    assert code == 2 and len(stderr.splitlines()) == 1, stderr
    assert problem.pattern().fullmatch(stderr.strip()), f"'{problem.title}' says\n  {problem.message}\nbut dptrain " \
                                                        f"prints\n  {stderr.strip()}"
    assert snapshot(sandbox.root) == before


def test_a_placeholder_matches_anything_even_nothing_and_the_rest_is_literal():
    problem = Problem("data", "t", "dptrain: error: --epochs must be at least 1 (got {value})", "c", "f", case="x")
    assert problem.pattern().fullmatch("dptrain: error: --epochs must be at least 1 (got -3)")
    assert not problem.pattern().fullmatch("dptrain: error: --epochs must be at least 2 (got -3)")
    assert Problem("run", "t", "{where}rank 0 left", "c", "f", source=("x",)).pattern().fullmatch("rank 0 left")


def test_the_page_has_every_area_and_every_entry_once():
    page = render_markdown()
    for heading in AREAS.values():
        assert page.count(f"\n## {heading}\n") + page.startswith(f"## {heading}\n") == 1
    for problem in PROBLEMS:
        assert page.count(f"### {problem.title}\n") == 1
    assert "{" not in page and "`dptrain: error: --data 'PATH' does not exist…`" in page
