"""prime_ac's module structure: layers without cycles, no private name across a module boundary,
and adapters (prime_ac/integrations) that use the public API and import their framework lazily.

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
    {"_compat", "models", "tables", "planner", "remat", "report_html"},
    {"targets", "actions", "store", "ranks", "compiled"},
    {"scopes", "diagnostics"},
    {"policy", "offload"},  # offload labels its buffers' allocations (diagnostics)
    {"pipeline_offload"},
    {"config"},
    {"modes", "layer_modes"},
    {"watch", "keep"},
    {"contexts"},
    {"region", "discovery", "measure", "offload_targets"},  # offload_targets: contexts' recipes
    {"wrapping"},
    {"audit"},
    {"budget"},
    {"checkpoint"},
    {"__init__"},
    {"demo"},
    {"__main__"},
]

FRAMEWORKS = {"torchtitan", "transformers", "peft", "trl", "diffusers", "fastvideo", "datasets"}


def _imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """``(imported prime_ac module, names taken from it, inside a function)`` for every import
    in the module at ``path``."""
    tree = ast.parse(path.read_text())
    in_functions = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    }
    found = []
    for node in ast.walk(tree):
        lazy = id(node) in in_functions
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prime_ac"):
            if node.module == "prime_ac":  # from prime_ac import audit / _compat
                for alias in node.names:
                    found.append((alias.name, [], lazy))
            else:
                found.append((node.module.split(".")[1], [a.name for a in node.names], lazy))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("prime_ac."):
                    found.append((alias.name.split(".")[1], [], lazy))
    return found


MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def test_every_module_has_a_layer():
    assert set(MODULES) == set().union(*LAYERS)


@pytest.mark.parametrize("module", MODULES)
def test_modules_import_only_lower_layers_and_public_names(module):
    rank = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    for imported, names, _ in _imports(PACKAGE / f"{module}.py"):
        if imported not in rank:  # a name re-exported by prime_ac/__init__.py
            imported = "__init__"
        assert rank[imported] < rank[module], f"{module} imports {imported} (same or higher layer)"
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{module} imports private names {private} from prime_ac.{imported}"


def test_import_prime_ac_loads_no_demo_or_models():
    code = "import sys, prime_ac; print(sorted(m for m in sys.modules if m.startswith('prime_ac')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "prime_ac.demo" not in out.stdout and "prime_ac.models" not in out.stdout


INTEGRATIONS = sorted(p.stem for p in (PACKAGE / "integrations").glob("*.py"))


@pytest.mark.parametrize("module", INTEGRATIONS)
def test_integrations_use_the_public_api_and_import_frameworks_lazily(module):
    path = PACKAGE / "integrations" / f"{module}.py"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prime_ac"):
            names = [alias.name for alias in node.names]
            # names prime_ac exports, _compat's (every private torch name in one place), or
            # tables' (where an adapter registers its table reader and marks the targets it supplies)
            assert node.module in ("prime_ac", "prime_ac._compat", "prime_ac.tables"), (
                f"integrations.{module} imports from {node.module}: use prime_ac's public API"
            )
            private = [n for n in names if n.startswith("_")]
            assert not private, f"integrations.{module} imports private names {private}"
    top_level = {
        alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not top_level & FRAMEWORKS, f"integrations.{module} imports {top_level & FRAMEWORKS}"


def test_import_prime_ac_and_its_integrations_loads_no_framework():
    code = (
        "import sys, prime_ac, prime_ac.integrations.torchtitan, prime_ac.integrations.hf, "
        "prime_ac.integrations.fastvideo; print(sorted({m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert not FRAMEWORKS & set(eval(out.stdout)), out.stdout
