"""Every ```python block of README.md and docs/*.md runs as pasted, on a CPU.

The convention the docs follow:

- A block is run unless the line right before its opening fence is
  ``<!-- not run: REASON -->`` (for examples that need CUDA, a kernel library or several
  processes); REASON must say which.
- A file's blocks run in order in one namespace, in one fresh Python process per file (so a
  block may use what an earlier block of the same file defined, as a reader pasting them one
  after another would), in a temporary directory, with torch on one thread.
- "Runs" means: no exception and no warning on stderr, within the timeout (a block that hangs
  fails its file instead of stalling the suite). The failure names the file and the line of the
  block's opening fence.

tests/test_docs_examples.py runs the shell examples.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>\S.*\S) -->$")
REPOSITORY = "https://github.com/prime-ops/prime-ops/blob/main/"

# Files whose blocks do not run yet, as found when this test was written (undefined names, CUDA
# or several processes unmarked); strict: once a file runs, its entry must go.
PENDING: dict[str, str] = {}

# Runs in the child: exec each block in one namespace; a failure prints where and exits 1.
RUNNER = """
import json, sys, traceback
import torch
torch.set_num_threads(1)
namespace = {"__name__": "__main__"}
for where, source in json.load(sys.stdin):
    try:
        exec(compile(source, where, "exec"), namespace)
    except BaseException:
        print(f"block at {where} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def python_blocks(path: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(run, skipped): ``(file:line, source)`` of each python block, and ``(file:line, reason)``
    of each block marked ``not run``."""
    text = path.read_text()
    lines = text.splitlines()
    run, skipped = [], []
    for match in FENCE.finditer(text):
        language, body = match.groups()
        if language != "python":
            continue
        fence = text.count("\n", 0, match.start())  # 0-based line of the opening fence
        where = f"{path.relative_to(ROOT)}:{fence + 1}"
        marker = NOT_RUN.match(lines[fence - 1].strip()) if fence else None
        if marker:
            skipped.append((where, marker["reason"]))
        else:
            run.append((where, body))
    return run, skipped


def test_not_run_markers_stand_right_before_a_python_block_and_give_a_reason():
    for path in DOCS:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if "not run" in line and line.lstrip().startswith("<!--"):
                where = f"{path.relative_to(ROOT)}:{n + 1}"
                assert NOT_RUN.match(line.strip()), f"{where}: write <!-- not run: REASON -->"
                following = lines[n + 1] if n + 1 < len(lines) else ""
                assert following.startswith("```python"), f"{where}: no ```python block follows"


def test_the_readme_has_runnable_python_blocks():
    run, _ = python_blocks(ROOT / "README.md")
    assert run


def _doc_param(path: Path):
    name = str(path.relative_to(ROOT))
    marks = [pytest.mark.xfail(reason=PENDING[name], strict=True)] if name in PENDING else []
    return pytest.param(path, id=name, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("path", [_doc_param(path) for path in DOCS])
def test_python_blocks_run_as_pasted(path, tmp_path):
    blocks, _ = python_blocks(path)
    if not blocks:
        pytest.skip(f"{path.name} has no python block to run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # 300 s: over 10x what the slowest file takes on a quiet 2-core machine.
    done = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(blocks),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    noisy = [line for line in done.stderr.splitlines() if re.search(r"warn", line, re.I)]
    assert not noisy, f"{path.name} printed:\n" + "\n".join(noisy)


def test_readme_links_name_files_of_the_repository():
    """The README is also the package's page on the index, where relative links lead nowhere:
    it links to the repository, and every such link names a file this checkout has."""
    text = (ROOT / "README.md").read_text()
    inline = re.findall(r"\]\((?!https?://|#)([^)]+)\)", text)
    defined = re.findall(r"^\[[^\]]+\]:\s*(?!https?://|#)(\S+)", text, re.M)
    relative = inline + defined
    assert not relative, f"relative links in README.md: {relative}; use {REPOSITORY}PATH"
    for target in re.findall(re.escape(REPOSITORY) + r"([^)#\s]+)", text):
        assert (ROOT / target).exists(), f"README.md links to {REPOSITORY}{target}: no such file"
