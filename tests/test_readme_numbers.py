"""tests/check_readme_numbers.py: the linked numbers of the README, the docs pages and the projects' READMEs
equal their JSON artefacts and their relative links lead somewhere (the real pages, in CI); on a small
fixture README every kind of mismatch is reported with its line."""

import json
import pathlib

import pytest

import check_readme_numbers as checker

ROOT = pathlib.Path(__file__).parent.parent
RESULTS = {"runs": [{"kind": "16 fixed", "batch_size": 1, "ratio": 7.9657, "tok_s": 17.747},
                    {"kind": "16 fixed", "batch_size": 8, "ratio": 4.5616, "tok_s": 4365.2}],
           "solve_rate": 0.035, "parameters": 25_250_000_000, "name": "tiny", "flag": True}
README = """\
# Fixture
| run | batch | tok/s | ratio |
|---|---|---|---|
| 16 fixed | 1 | [18](results/r.json#/runs/0/tok_s) | [**8.0x**](results/r.json#/runs/batch_size=1/ratio) |
| 16 fixed | 8 | [4,365](results/r.json#/runs/kind=16%20fixed,batch_size=8/tok_s) | [4.56x](results/r.json#/runs/1/ratio) |
| unconverted | 16 | 166 | 5.3x |

Solved [3.5%](results/r.json#/solve_rate*100) with [25.25B](results/r.json#/parameters*1e-9) parameters.
"""


@pytest.fixture
def fixture(tmp_path):
  (tmp_path / "results").mkdir()
  (tmp_path / "results" / "r.json").write_text(json.dumps(RESULTS))
  readme = tmp_path / "README.md"
  readme.write_text(README)
  return readme


PAGES = checker.pages(ROOT)


def test_the_checked_pages_are_the_readme_the_docs_and_the_projects_readmes():
  names = {str(page.relative_to(ROOT)) for page in PAGES}
  assert {"README.md", "docs/performance.md", "docs/sampling.md", "projects/sudoku/README.md"} <= names
  assert names == {"README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
                   *(f"projects/{p.parent.name}/README.md" for p in (ROOT / "projects").glob("*/README.md"))}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_numbers_of_every_page_match_their_json_and_its_links_lead_somewhere(page):
  wrong = [str(item) for item in checker.check(page) if item.error] + checker.broken_links(page)
  assert not wrong, "\n".join(wrong)


def test_a_docs_page_links_its_json_from_one_folder_down_and_its_links_are_checked(fixture):
  docs = fixture.parent / "docs"
  docs.mkdir()
  page = docs / "page.md"
  page.write_text("# Page\n## A section: here\n[18](../results/r.json#/runs/0/tok_s) [back](../README.md#fixture) "
                  "[self](#a-section-here) [web](https://example.com/x)\n[18](results/r.json#/runs/0/tok_s)\n")
  assert [(i.line, i.error is None) for i in checker.check(page)] == [(3, True), (4, False)]
  assert "No such file" in checker.check(page)[1].error  # results/ seen from docs/ is docs/results/
  assert checker.broken_links(page) == ["line 4: results/r.json#/runs/0/tok_s (no such file)"]
  page.write_text("[a](missing.md) [b](../README.md#no-such-heading) [c](#fixture)\n")
  assert checker.broken_links(page) == ["line 1: missing.md (no such file)",
                                        "line 1: ../README.md#no-such-heading (no such heading in README.md)",
                                        "line 1: #fixture (no such heading in page.md)"]
  assert checker.main([str(page)]) == 1


def test_matching_numbers_pass_with_rounding_selectors_and_factors(fixture):
  items = checker.check(fixture)
  assert [(i.line, i.written, i.error) for i in items] == [
      (4, 18, None), (4, 8.0, None), (5, 4365, None), (5, 4.56, None), (8, 3.5, None), (8, 25.25, None)]
  assert items[-1].value == pytest.approx(25.25)
  assert checker.main([str(fixture)]) == 0
  assert checker.unbacked(fixture) == [(6, "| unconverted | 16 | 166 | 5.3x |")]


@pytest.mark.parametrize("old,new,message", [
    ("[18]", "[19]", "the README says '19' but the JSON holds 17.747"),
    ("[**8.0x**]", "[**8.1x**]", "the README says '**8.1x**' but the JSON holds 7.9657"),
    ("[3.5%]", "[3.6%]", "the README says '3.6%'"),
    ("[4.56x]", "[4.57x]", "holds 4.5616"),  # rounding is to the decimals written: 4.5616 is 4.56
    ("solve_rate*100", "solve_rate", "the README says '3.5%' but the JSON holds 0.035"),
    ("#/runs/0/tok_s", "#/runs/2/tok_s", "no element '2' in a list of 2"),
    ("batch_size=1/ratio", "batch_size=4/ratio", "0 elements have 'batch_size=4'"),
    ("/runs/1/ratio", "/runs/1/ratios", "no key 'ratios'"),
    ("/solve_rate*100", "/name", "the value there is 'tiny', not a number"),
    ("/solve_rate*100", "/flag", "the value there is True, not a number"),
    ("(results/r.json#/runs/0/tok_s)", "(results/missing.json#/runs/0/tok_s)", "No such file"),
    ("(results/r.json#/runs/0/tok_s)", "(other/r.json#/runs/0/tok_s)", "not under results/"),
    ("[18]", "[about]", "holds no number"),
    ("#/runs/0/tok_s", "#runs/0/tok_s", "does not start with '/'"),
])
def test_each_kind_of_mismatch_is_reported_with_its_line(fixture, old, new, message):
  fixture.write_text(README.replace(old, new, 1))
  wrong = [item for item in checker.check(fixture) if item.error]
  assert len(wrong) == 1 and message in wrong[0].error, [str(w) for w in wrong]
  assert wrong[0].line == next(i for i, line in enumerate(README.splitlines(), 1) if old in line)
  assert checker.main([str(fixture)]) == 1


def test_rounding_is_half_a_unit_of_the_last_digit():
  assert checker.matches(8.0, 1, 7.95) and checker.matches(8.0, 1, 8.05) and not checker.matches(8.0, 1, 8.06)
  assert checker.matches(18, 0, 17.5) and not checker.matches(18, 0, 17.4)
  assert not checker.matches(1.0, 1, float("nan"))
  assert checker.written_number("**1,234.5 tok/s**") == (1234.5, 1)
