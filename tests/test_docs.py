"""Every ```python block of README.md and docs/*.md runs when pasted alone, on a CPU.

The convention the docs follow:

- Each block runs on its own, in a fresh Python process, in a temporary directory, with torch on
  one thread: a reader who pastes one block into a new interpreter gets what the page says.
- A block that builds on the one before it says so on the line right before its opening fence:
  ``<!-- continues the previous block -->``. It then runs after that block (and whatever that one
  continues) in the same process; the chain is checked as a whole.
- A block is not run if the line right before its fence is ``<!-- not run: REASON -->`` (examples
  that need CUDA, a kernel library or several processes); REASON must say which.
- Output shown in a block is checked: a line ending in ``# -> TEXT`` promises that the block
  prints TEXT as one line (in the order of such comments; ``...`` in TEXT stands for anything).
- "Runs" means: no exception and no warning on stderr, within the timeout (a block that hangs
  fails instead of stalling the suite). A failure names the file and the line of the fence.
- ``PRIME_OPS_DOCS_PYTHON=/path/to/python`` runs the blocks with that interpreter and without
  this checkout on its path: scripts/release_check.sh runs them against the installed wheel.

tests/test_docs_examples.py runs the shell examples.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>\S.*\S) -->$")
CONTINUES = "<!-- continues the previous block -->"
SHOWN = re.compile(r"#\s*->\s*(?P<text>\S.*?)\s*$")
REPOSITORY = "https://github.com/prime-ops/prime-ops/blob/main/"

# Runs in the child: exec each block of one chain in one namespace, printing each block's stdout
# as a JSON list on the last line; a failure prints where and exits 1.
RUNNER = """
import contextlib, io, json, sys, traceback
import torch
torch.set_num_threads(1)
namespace = {"__name__": "__main__"}
printed = []
for where, source in json.load(sys.stdin):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, where, "exec"), namespace)
    except BaseException:
        print(out.getvalue(), file=sys.stderr)
        print(f"block at {where} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
    printed.append(out.getvalue())
print(json.dumps(printed))
"""


@dataclass
class Block:
    where: str  # file:line of the opening fence
    source: str
    skipped: str | None = None  # the not-run reason
    continues: bool = False
    shown: list[str] = field(default_factory=list)  # lines the block promises to print


def python_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """Every ```python block of one file, in order, with its markers."""
    text = path.read_text()
    lines = text.splitlines()
    blocks = []
    for match in FENCE.finditer(text):
        language, body = match.groups()
        if language != "python":
            continue
        fence = text.count("\n", 0, match.start())  # 0-based line of the opening fence
        before = lines[fence - 1].strip() if fence else ""
        marker = NOT_RUN.match(before)
        blocks.append(
            Block(
                where=f"{path.relative_to(root)}:{fence + 1}",
                source=body,
                skipped=marker["reason"] if marker else None,
                continues=before == CONTINUES,
                shown=[m["text"] for line in body.splitlines() if (m := SHOWN.search(line))],
            )
        )
    return blocks


def chains(path: Path, root: Path = ROOT) -> list[list[Block]]:
    """The runnable chains of a file: a block alone, or a block with those it continues."""
    result: list[list[Block]] = []
    previous: list[Block] | None = None
    for block in python_blocks(path, root):
        if block.skipped:
            previous = None
            continue
        if block.continues:
            assert previous, f"{block.where}: {CONTINUES} but no runnable python block precedes"
            previous = [*previous, block]
            # The longer chain checks everything the shorter one did.
            if result and result[-1] == previous[:-1]:
                result[-1] = previous
            else:
                result.append(previous)
        else:
            previous = [block]
            result.append(previous)
    return result


CHAINS = [(path, chain) for path in DOCS for chain in chains(path)]


def test_markers_stand_right_before_a_python_block():
    for path in DOCS:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            stripped = line.strip()
            if not stripped.startswith("<!--") or not re.search("not run|continues", stripped):
                continue
            where = f"{path.relative_to(ROOT)}:{n + 1}"
            assert NOT_RUN.match(stripped) or stripped == CONTINUES, (
                f"{where}: write <!-- not run: REASON --> or {CONTINUES}"
            )
            following = lines[n + 1] if n + 1 < len(lines) else ""
            assert following.startswith("```python"), f"{where}: no ```python block follows"


def test_chains_start_where_blocks_stand_alone(tmp_path):
    """The chaining rule itself: a block without the marker never inherits names."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n"
        f"{CONTINUES}\n```python\nprint(x)  # -> 1\n```\n\n"
        "```python\ny = 2\n```\n"
    )
    found = chains(page, root=tmp_path)
    sources = [[block.source for block in chain] for chain in found]
    assert sources == [["x = 1\n", "print(x)  # -> 1\n"], ["y = 2\n"]]
    assert found[0][1].shown == ["1"]
    assert [block.where for block in found[0]] == ["page.md:1", "page.md:6"]


def test_the_readme_has_runnable_python_blocks():
    assert any(path.name == "README.md" for path, _ in CHAINS)


def _matches(shown: str, line: str) -> bool:
    pattern = ".*".join(re.escape(part.strip()) for part in shown.split("..."))
    return re.fullmatch(pattern, line.strip()) is not None


def check_shown(chain: list[Block], printed: list[str]) -> None:
    """Each ``# -> TEXT`` of a block is a line that block printed, in order."""
    for block, out in zip(chain, printed, strict=True):
        lines = iter(out.splitlines())
        for shown in block.shown:
            assert any(_matches(shown, line) for line in lines), (
                f"{block.where}: the page shows {shown!r}; the block printed:\n{out}"
            )


def test_shown_output_is_checked():
    block = Block(where="page.md:1", source="", shown=["[1, ...]", "done"])
    check_shown([block], ["[1, 2, 3]\ndone\n"])
    with pytest.raises(AssertionError, match="the page shows 'done'"):
        check_shown([block], ["done\n[1, 2]\n"])


@pytest.mark.slow
@pytest.mark.parametrize("path, chain", [pytest.param(p, c, id=c[-1].where) for p, c in CHAINS])
def test_python_blocks_run_as_pasted(path, chain, tmp_path):
    python = os.environ.get("PRIME_OPS_DOCS_PYTHON")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if python is None:
        python, env["PYTHONPATH"] = sys.executable, str(ROOT)
    else:
        env.pop("PYTHONPATH", None)
    # 300 s: over 10x what the slowest block takes on a quiet 2-core machine.
    done = subprocess.run(
        [python, "-c", RUNNER],
        input=json.dumps([(block.where, block.source) for block in chain]),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    noisy = [line for line in done.stderr.splitlines() if re.search(r"warn", line, re.I)]
    assert not noisy, f"{chain[-1].where} printed:\n" + "\n".join(noisy)
    check_shown(chain, json.loads(done.stdout.splitlines()[-1]))


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
