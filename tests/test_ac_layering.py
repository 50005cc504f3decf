"""prime_ac's module structure: layers without cycles, no private name across a module boundary.

Read from the sources (ast), so it checks every import, including those inside functions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "prime_ac"

# Each module may import only modules of a lower layer (the entry points sit on top).
LAYERS = [
    {"_compat", "models"},
    {"targets", "actions", "store"},
    {"scopes"},
    {"policy", "config"},
    {"modes"},
    {"contexts"},
    {"blocks", "measure"},
    {"audit"},
    {"budget"},
    {"checkpoint"},
    {"__init__"},
    {"demo"},
    {"__main__"},
]


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """``(imported prime_ac module, names taken from it)`` for every import in ``module``."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prime_ac"):
            if node.module == "prime_ac":  # from prime_ac import audit / _compat
                for alias in node.names:
                    found.append((alias.name, []))
            else:
                found.append((node.module.split(".")[1], [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("prime_ac."):
                    found.append((alias.name.split(".")[1], []))
    return found


MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def test_every_module_has_a_layer():
    assert set(MODULES) == set().union(*LAYERS)


@pytest.mark.parametrize("module", MODULES)
def test_modules_import_only_lower_layers_and_public_names(module):
    rank = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    for imported, names in _imports(module):
        if imported not in rank:  # a name re-exported by prime_ac/__init__.py
            imported = "__init__"
        assert rank[imported] < rank[module], f"{module} imports {imported} (same or higher layer)"
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{module} imports private names {private} from prime_ac.{imported}"


def test_import_prime_ac_loads_no_demo_or_models():
    code = "import sys, prime_ac; print(sorted(m for m in sys.modules if m.startswith('prime_ac')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "prime_ac.demo" not in out.stdout and "prime_ac.models" not in out.stdout
