"""docs/development.md's Layout names every module, script and test folder, and nothing that is
gone: the map a newcomer reads stays the tree they cloned."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def layout() -> str:
    text = (ROOT / "docs" / "development.md").read_text()
    section = text.split("## Layout", 1)[1]
    return re.search(r"^```\n(.*?)^```", section, re.M | re.S).group(1)


def _files() -> list[Path]:
    folders = ["prime_ac", "prime_ac/integrations", "prime_ops", "prime_ops/attn"]
    files = [p for folder in folders for p in (ROOT / folder).glob("*.py")]
    files += [p for p in (ROOT / "scripts").glob("*.sh")]
    return [p for p in files if p.name != "__init__.py" or p.parent.name == "prime_ac"]


def test_the_layout_names_every_module_script_and_test_folder():
    names = set(re.findall(r"[\w.]+", layout()))
    missing = [str(p.relative_to(ROOT)) for p in _files() if p.name not in names]
    folders = [p for p in (ROOT / "tests").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    folders += [p for p in (ROOT / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))]
    missing += [f"tests/{p.name}/" for p in set(folders) if f"{p.name}/" not in layout()]
    assert not missing, f"docs/development.md's Layout does not name {sorted(missing)}"


def test_every_file_the_layout_names_exists():
    block = layout()
    named = set(re.findall(r"\b[\w]+\.(?:py|sh)\b", block))
    folders = ["prime_ac", "prime_ops", "scripts", "tests", "benchmarks", "csrc"]
    present = {p.name for f in folders for p in (ROOT / f).rglob("*") if p.suffix in (".py", ".sh")}
    assert not named - present, f"the Layout names files that do not exist: {named - present}"
