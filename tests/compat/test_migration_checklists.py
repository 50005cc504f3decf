"""docs/migration.md's checklists for prime-rl and FastVideo: every step names the tests in
tests/compat that make its calls, and every test it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MIGRATION = (HERE.parents[1] / "docs" / "migration.md").read_text()


def _checklist(title: str) -> list[str]:
    """The numbered steps of the section ``### <title>``, one string each."""
    section = MIGRATION.split(f"### {title}\n", 1)[1].split("\n#", 1)[0]
    steps = re.split(r"\n(?=\d+\. )", "\n" + section)
    return [" ".join(step.split()) for step in steps if re.match(r"\d+\. ", step)]


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    return {n.name for n in functions if n.name.startswith("test_")}


@pytest.mark.parametrize(
    ("title", "default_file", "steps"),
    [
        ("prime-rl: the maintainer's checklist", None, 9),
        ("FastVideo: the maintainer's checklist", "test_fastvideo.py", 7),
    ],
)
def test_each_step_names_tests_that_exist(title, default_file, steps):
    checklist = _checklist(title)
    assert len(checklist) == steps
    for step in checklist:
        files = re.findall(r"(test_[a-z0-9_]+\.py)", step)
        names = [n for n in re.findall(r"\b(test_[a-z0-9_]+)\b(?!\.py)", step)]
        assert files or names, f"step names no test: {step}"
        for file in files:
            assert (HERE / file).exists(), f"{file} (in: {step})"
        pool = set().union(*(_tests_in(HERE / f) for f in (files or [default_file])))
        for name in names:
            if f"{name}.py" in files:
                continue
            assert name in pool, f"{name} not in {files or [default_file]} (in: {step})"
