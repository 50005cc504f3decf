"""Every shell example in README.md and docs/*.md that runs on a CPU runs clean, as written.

A fenced ``bash``/``sh``/``shell``/``console`` block is run when each of its commands starts with
``python`` and needs nothing but this package. Skipped: blocks with ``pip``, ``git``, build steps
or a CUDA library's import; the test suite itself, the demo and the benchmarks (minutes each;
CI runs the suite through scripts/test.sh, tests/test_demo.py and tests/test_ac_audit.py run the
demo's and the trade-off benchmark's code in-process). "Clean" means exit code 0 and no warning
on stderr.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELL = {"bash", "sh", "shell", "console"}
SKIP = re.compile(
    r"deep_ep|deep_gemm|flash_attn|quack|cuda|-m pytest|prime_ac demo|benchmarks/", re.I
)


def _commands(body: str, first_line: int) -> list[tuple[int, str]]:
    """(line number, command) for each command line of a block; comments and prompts dropped."""
    lines = [
        (first_line + i, line.strip().removeprefix("$ "))
        for i, line in enumerate(body.splitlines())
    ]
    return [(n, line) for n, line in lines if line and not line.startswith("#")]


def shell_examples() -> list[tuple[str, str]]:
    """(``file:line``, command) for each command of each CPU-runnable shell block."""
    examples = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            language, body = match.groups()
            commands = _commands(body, text.count("\n", 0, match.start()) + 2)
            runnable = commands and all(
                c.startswith("python ") and not SKIP.search(c) for _, c in commands
            )
            if language in SHELL and runnable:
                examples += [(f"{path.relative_to(ROOT)}:{n}", c) for n, c in commands]
    return examples


EXAMPLES = shell_examples()


def test_the_docs_have_runnable_examples():
    assert any(where.startswith("docs/") for where, _ in EXAMPLES), EXAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("where, command", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_shell_example_runs_clean(where, command):
    argv = shlex.split(command.split(" #")[0])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # 600 s: over 10x what the slowest example takes on a quiet 2-core machine.
    done = subprocess.run(
        [sys.executable, *argv[1:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{where}: {command}\n{done.stderr[-3000:]}"
    noisy = [
        line for line in done.stderr.splitlines() if re.search(r"warn|matches nothing", line, re.I)
    ]
    assert not noisy, f"{where}: {command} printed:\n" + "\n".join(noisy)
