"""prime_ops' ``quantizer="torchao"`` gate against the installed torchao's own.

torchao 0.16 to 0.18 decide at import (``torchao/prototype/mx_formats/kernels.py``,
``_triton_kernels_available``) whether ``triton_to_mxfp8_dim0`` is the Triton cast or a stand-in
that raises ``AssertionError("needs triton")`` (0.16 and 0.17: "needs torch version 2.8+ and
triton"; 0.16's stand-in takes no ``scaling_mode``, so prime_ops' call meets a TypeError). Each
case evaluates a release's gate expression (:data:`GATES`; the installed one's is compared with
its source) with torch.cuda reporting one device and Triton present, as on any GPU machine with
the extra installed, and checks that ``prime_ops.mxfp8`` refuses exactly where that torchao has
no cast.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import types

import pytest
import torch

from prime_ops.mxfp8 import _torchao_cast_missing

torchao = pytest.importorskip("torchao")
torchao_utils = pytest.importorskip("torchao.utils")  # the gates' helpers

TORCHAO_VERSIONS = ("0.16", "0.17", "0.18")
"""torchao releases whose gate this was checked against (the mxfp8 extra's floor is 0.16)."""
KERNELS = "torchao.prototype.mx_formats.kernels"
GATES = {
    (0, 16): "torch_version_at_least('2.7.0') and has_triton() and torch.cuda.is_available() "
    "and is_sm_at_least_100() and is_cuda_version_at_least(12, 8)",
    (0, 17): "torch_version_at_least('2.7.0') and has_triton() and torch.cuda.is_available() "
    "and (is_sm_at_least_100() and is_cuda_version_at_least(12, 8)) or (is_ROCM() and is_MI350())",
    (0, 18): "has_triton() and torch.cuda.is_available() "
    "and (is_sm_at_least_100() and is_cuda_version_at_least(12, 8)) or (is_ROCM() and is_MI350())",
}
"""Each release's ``_triton_kernels_available`` (read from its wheel's
``torchao/prototype/mx_formats/kernels.py``; the ``if`` above ``triton_to_mxfp8_dim0``). The
installed release's entry is compared with its source; the others are evaluated in the installed
torchao's namespace, whose helpers (``is_sm_at_least_100``, ``is_MI350``, ...) they share."""

pytestmark = pytest.mark.skipif(
    not torchao.__version__.startswith(TORCHAO_VERSIONS),
    reason=f"torchao {torchao.__version__}: the gate was checked for {TORCHAO_VERSIONS}",
)


def _gate_expression(kernels) -> ast.expr:
    """The expression torchao defines the cast under: the ``if`` that holds the Triton
    ``triton_to_mxfp8_dim0`` (its ``else`` holds the stand-in)."""
    tree = ast.parse(inspect.getsource(kernels))
    for node in tree.body:
        if isinstance(node, ast.If) and any(
            isinstance(d, ast.FunctionDef) and d.name == "triton_to_mxfp8_dim0" for d in node.body
        ):
            assert any(
                isinstance(d, ast.FunctionDef) and d.name == "triton_to_mxfp8_dim0"
                for d in node.orelse
            ), "torchao's else branch no longer defines the stand-in"
            test = node.test
            if isinstance(test, ast.Name):  # a flag assigned earlier: evaluate its value
                (assign,) = [
                    n
                    for n in tree.body
                    if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == test.id for t in n.targets)
                ]
                test = assign.value
            return test
    raise AssertionError(f"{KERNELS} no longer defines triton_to_mxfp8_dim0 under an if")


def test_the_recorded_gate_is_the_installed_one():
    kernels = importlib.import_module(KERNELS)
    installed = tuple(int(p) for p in torchao.__version__.split(".")[:2])
    recorded = ast.parse(GATES[installed], mode="eval").body
    assert ast.dump(recorded) == ast.dump(_gate_expression(kernels))


def _torchao_defines_cast(monkeypatch, gate, capability, cuda, hip, gcn) -> bool:
    """A torchao gate evaluated, in the installed module's namespace, with torch.cuda reporting
    the simulated device (re-importing the module would register its ops twice)."""
    kernels = importlib.import_module(KERNELS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    props = types.SimpleNamespace(gcnArchName=gcn)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    namespace = {**vars(torchao_utils), **vars(kernels), "has_triton": lambda: True}
    code = compile(ast.Expression(gate), kernels.__file__, "eval")
    return bool(eval(code, namespace))  # noqa: S307 -- torchao's own expression


def test_the_stand_in_raises_needs_triton():
    """On this CPU-only machine torchao left the stand-in: what a call before SM100 meets."""
    kernels = importlib.import_module(KERNELS)
    assert not kernels._triton_kernels_available
    with pytest.raises(AssertionError, match="needs triton"):
        kernels.triton_to_mxfp8_dim0(torch.empty(2, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "capability, cuda, hip, gcn",
    [
        ((8, 0), "12.8", None, ""),  # A100
        ((9, 0), "12.8", None, ""),  # H100 / H200
        ((9, 0), "13.0", None, ""),
        ((10, 0), "12.8", None, ""),  # B200
        ((10, 0), "12.6", None, ""),
        ((10, 3), "13.0", None, ""),  # B300
        ((12, 0), "12.8", None, ""),  # RTX 50xx
        ((9, 4), None, "6.4", "gfx942:sramecc+:xnack-"),  # MI300X
        ((9, 5), None, "6.4", "gfx950:sramecc+:xnack-"),  # MI350X
    ],
)
@pytest.mark.parametrize("version", sorted(GATES), ids=lambda v: f"{v[0]}.{v[1]}")
def test_prime_ops_refuses_where_torchao_has_no_cast(
    monkeypatch, version, capability, cuda, hip, gcn
):
    gate = ast.parse(GATES[version], mode="eval").body
    defined = _torchao_defines_cast(monkeypatch, gate, capability, cuda, hip, gcn)
    monkeypatch.setattr("prime_ops.mxfp8._installed_torchao", lambda: version)
    missing = _torchao_cast_missing(torch.device("cuda", 0))
    assert (missing is None) == defined, (version, capability, cuda, hip, missing)
