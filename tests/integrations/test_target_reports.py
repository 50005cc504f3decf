"""What the first step reports about targets, as an adapter's user sees it.

An adapter's own list (a trainer's save list, its translations, each device's kernels:
``prime_ac.tables.supplied``) is never reported as matching nothing, so ``strict=True`` works
with it; a target the user named still is, and the advice names only operators that could stand
for it (its family: a matmul for a matmul, never ``aten::add`` for ``aten::addmm``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import prime_ac
from prime_ac.tables import supplied


class Unbiased(nn.Module):
    """Linears without bias dispatch aten::mm; the residual adds dispatch aten::add."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)) + 1.0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Unbiased(), Unbiased())


def _first_step(model: nn.Module, caplog) -> str:
    caplog.clear()
    model(torch.randn(4, 16, requires_grad=True)).sum().backward()
    return caplog.text


# what a trainer's list holds that a CPU model never calls: other devices' kernels, collectives
# without a process group, MoE and compiled-region operators
DEVICE_VARIANTS = [
    "aten::_flash_attention_forward.default",
    "aten::_scaled_dot_product_cudnn_attention.default",
    "_c10d_functional::all_to_all_single.default",
    "aten::_grouped_mm.default",
    "aten::addmm.default",
    "higher_order::flex_attention",
    "higher_order::inductor_compiled_code",
]


def test_an_adapters_targets_are_not_reported_and_strict_works(caplog):
    caplog.set_level(logging.WARNING, logger="prime_ac")
    model = _model()
    targets = supplied([*DEVICE_VARIANTS, "aten::mm.default"])
    prime_ac.checkpoint_blocks(model, mode="selective", targets=targets, strict=True)
    assert "matched no operator call" not in _first_step(model, caplog)


def test_a_user_named_target_beside_them_is_still_reported(caplog):
    caplog.set_level(logging.WARNING, logger="prime_ac")
    model = _model()
    targets = (*supplied(DEVICE_VARIANTS), "aten::cholesky")
    prime_ac.checkpoint_blocks(model, mode="selective", targets=targets)
    text = _first_step(model, caplog)
    assert "'aten::cholesky'" in text
    assert not any(t in text for t in DEVICE_VARIANTS)
    model = _model()
    prime_ac.checkpoint_blocks(model, mode="selective", targets=targets, strict=True)
    with pytest.raises(ValueError, match="aten::cholesky"):
        _first_step(model, caplog)


def test_the_advice_names_only_the_targets_family(caplog):
    """addmm unmatched where the blocks called mm and add: mm could stand for it, add never
    (nor add_, which writes its input and is never kept)."""
    caplog.set_level(logging.WARNING, logger="prime_ac")
    model = _model()
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::addmm"])
    text = _first_step(model, caplog)
    assert "'aten::addmm' (the blocks called aten::mm: name that instead" in text
    assert "aten::add," not in text and "aten::add_" not in text and "aten::add:" not in text


def test_a_target_of_no_family_gets_close_names_of_no_family(caplog):
    caplog.set_level(logging.WARNING, logger="prime_ac")
    model = _model()
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::relu6"])
    text = _first_step(model, caplog)
    assert "'aten::relu6' (the blocks called aten::relu: name that instead" in text
