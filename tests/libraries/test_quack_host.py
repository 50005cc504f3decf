"""prime_ops' QuACK GEMMs through the real quack-kernels host code, for SM90 and SM100, and the
op lists against what the installed quack-kernels registers.

prime_ops' CUDA kernels for ``quack::prime_linear`` / ``prime_grouped_linear`` and their
backwards run under ``FakeTensorMode`` with CUDA fake tensors; QuACK's ``gemm`` (untuned: its
autotuner synchronises the device) runs its host asserts, builds its plan and compiles the kernel
for the architecture asked for (``QUACK_ARCH``, ``CUTE_DSL_ARCH``), and stops where it asks the
CUDA driver for the SM count (``_build_gemm_plan`` -> ``get_max_active_clusters``). A tensor of
QuACK's output shape stands in for the launch after that (tests/libraries/cases.py), so each of
prime_ops' GEMM calls is checked, the backward's second one included.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

from libraries import cases

QUACK = cases.require("quack-kernels", cases.QUACK_VERSIONS)

STEPS = [
    pytest.param(arch, name, step, id=f"quack-{QUACK}-{arch}-{name}-{step}")
    for arch in cases.QUACK_ARCH_ENV
    for name in cases.QUACK_CASES
    for step in ("forward", "backward")
]


@pytest.fixture(scope="module")
def quack_runs():
    return cases.Runs("quack", cases.QUACK_ARCH_ENV)


def _expected_calls(case: cases.GemmCase, step: str) -> list[dict]:
    """The GEMMs prime_ops asks QuACK for (``out = A @ B``, ``B`` as ``(K, N)``): shapes and
    strides of A and B, and the keyword tensors."""
    m, k, n = case.m, case.k, case.n
    if not case.counts:
        if step == "forward":
            bias = {"bias": [[n], [1], "bfloat16"]} if case.bias else {}
            return [dict(args=[[[m, k], [k, 1]], [[k, n], [1, k]]], kwargs=bias)]
        # grad_x = grad @ weight; grad_w = grad.T @ x
        return [
            dict(args=[[[m, n], [n, 1]], [[n, k], [k, 1]]], kwargs={}),
            dict(args=[[[n, m], [1, n]], [[m, k], [k, 1]]], kwargs={}),
        ]
    e, offsets = len(case.counts), {"cu_seqlens_m": [[len(case.counts) + 1], [1], "int32"]}
    if step == "forward":
        return [dict(args=[[[m, k], [k, 1]], [[e, k, n], [n * k, 1, k]]], kwargs=offsets)]
    return [
        dict(args=[[[m, n], [n, 1]], [[e, n, k], [n * k, k, 1]]], kwargs=offsets),
        dict(
            args=[[[n, m], [1, n]], [[m, k], [k, 1]]],
            kwargs={"cu_seqlens_k": offsets["cu_seqlens_m"]},
        ),
    ]


@pytest.mark.parametrize(("arch", "name", "step"), STEPS)
def test_prime_ops_gemm_passes_quack_host_checks(quack_runs, arch, name, step, record_property):
    """Each GEMM prime_ops makes reaches QuACK's driver query with every host assert passed
    and its kernel compiled; prime_ops' kernel returns what its fake says."""
    case = cases.QUACK_CASES[name]
    row = quack_runs.row(arch, case=name, step=step)
    calls = [dict(args=[a[:2] for a in c["args"]], kwargs=c["kwargs"]) for c in row["calls"]]
    assert calls == _expected_calls(case, step)
    for call in row["calls"]:
        assert all(a[2] == "bfloat16" for a in call["args"])
        stopped = call["stopped"]
        assert stopped is not None, "QuACK launched a kernel on fake tensors"
        assert stopped["quack_frames"][-2:] == ["_build_gemm_plan", "get_max_active_clusters"], (
            f"QuACK stopped before its driver query: {stopped}"
        )
    got, fake = row["outputs"]
    assert got == fake
    record_property("seconds", row["s"])


def _import_all_quack_modules() -> list[str]:
    """Import every module of the installed quack package; the names of those that need what
    is not installed (jax) or were removed (quack.trace)."""
    import quack

    skipped = []
    for info in pkgutil.walk_packages(quack.__path__, "quack."):
        try:
            importlib.import_module(info.name)
        except ImportError:
            skipped.append(info.name)
    return skipped


def test_op_lists_match_installed_quack():
    """Every op the installed quack-kernels registers is in QUACK_OP_NAMES; the GEMMs among them
    are kept by prime_ac (prime_ac.targets.QUACK_GEMMS), and docs/backends.md gives the reason
    for each of the others."""
    from prime_ac.targets import QUACK_GEMMS
    from prime_ops import quack as prime_quack
    from prime_ops._compat import registered_op_names

    skipped = _import_all_quack_modules()
    assert set(skipped) <= {"quack.jax_utils", "quack.softmax_jax", "quack.trace"}, skipped
    ours = {f"quack::{n}" for n in prime_quack.OP_NAMES}
    registered = {n for n in registered_op_names() if n.startswith("quack::")} - ours
    listed = {f"quack::{n}" for n in prime_quack.QUACK_OP_NAMES}
    assert registered == listed, (
        f"registered, not listed: {sorted(registered - listed)}; "
        f"listed, not registered: {sorted(listed - registered)}"
    )
    kept = set(QUACK_GEMMS)
    assert kept <= registered
    assert {n for n in registered if n.startswith("quack::gemm")} == kept
    section = Path(__file__).parents[2].joinpath("docs", "backends.md").read_text()
    section = section.split("### QuACK's other ops", 1)[1].split("\n#", 1)[0]
    documented = {f"quack::{n}" for n in re.findall(r"^\| `([a-z_0-9]+)` \|", section, flags=re.M)}
    assert documented == registered - kept, (
        f"not documented: {sorted(registered - kept - documented)}; "
        f"documented, not registered or kept: {sorted(documented - (registered - kept))}"
    )
