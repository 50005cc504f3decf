"""prime_ac on FSDP2-sharded models: audit, targets="auto" and re-configuration, both orders.

On 2 gloo ranks, a model is wrapped then sharded (``fully_shard`` per block, then the root: the
documented order) or sharded then wrapped. Nothing may be unwrapped: the audit measures its no-AC
baseline with checkpointing switched off in place, and never asks a sharded parameter (a DTensor)
for its storage. Every rank runs the same batch, so its figures must equal those of the same
model in one process without FSDP. A re-configuration that fails (a profile that raises) leaves
every block's class, mode and plan as they were; one that succeeds changes only block state.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import prime_ac
from prime_ac.blocks import checkpoint_state, wrapped_blocks
from prime_ac.models import build_model
from tests.dist_utils import run_distributed


def _state(model: nn.Module):
    return [(n, type(m), m.__dict__.get("_prime_ac")) for n, m in model.named_modules()]


def _figures(report):
    return report.held_bytes, report.held_bytes_no_ac, report.replayed_flops, report.forward_flops


def _fully_shard(model: nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)


def _fail(model):
    raise RuntimeError("profile failed")


def _body(rank: int, world_size: int) -> None:
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))

    def loss(m):
        return m.loss(tokens)

    torch.manual_seed(0)
    base = build_model("moe", n_layers=2)
    single = copy.deepcopy(base)
    prime_ac.checkpoint_blocks(single, mode="selective")
    expected = _figures(prime_ac.audit(single, loss))

    for order in ("ac-then-fsdp", "fsdp-then-ac"):
        model = copy.deepcopy(base)
        if order == "ac-then-fsdp":
            prime_ac.checkpoint_blocks(model, mode="selective")
            _fully_shard(model)
        else:
            _fully_shard(model)
            prime_ac.checkpoint_blocks(model, mode="selective")
        classes = [type(layer) for layer in model.layers]
        assert _figures(prime_ac.audit(model, loss)) == expected, (order, rank)

        before = _state(model)
        with pytest.raises(RuntimeError, match="profile failed"):
            prime_ac.checkpoint_blocks(
                model, mode="selective", targets="auto", budget=0.5, profile=_fail
            )
        assert _state(model) == before, order

        prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=0.5, profile=loss
        )
        assert [type(layer) for layer in model.layers] == classes, order
        assert all(checkpoint_state(layer).plan is not None for layer in model.layers)
        assert prime_ac.audit(model, loss).mode == "auto"

        # fewer blocks after fully_shard: the other block keeps its class and runs plainly
        assert prime_ac.checkpoint_blocks(model, mode="full", freq=2) == ["layers.0"]
        assert [n for n, _ in wrapped_blocks(model)] == ["layers.0"]
        assert checkpoint_state(model.layers[0]).policy.mode == "full"
        model(tokens[:, :-1]).sum().backward()  # trains


@pytest.mark.slow
def test_audit_auto_and_reconfiguration_on_fsdp2_in_both_orders():
    run_distributed(_body, 2, timeout=300)


def test_a_failed_reconfiguration_after_a_class_swap_changes_nothing():
    """The single-process version: a foreign class swap, as fully_shard does."""
    from ac_models import CountingModel

    model, x = CountingModel(), torch.randn(3, 8)
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::mm"])
    for layer in model.layers:
        layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    classes = [type(layer) for layer in model.layers]
    before = _state(model)
    with pytest.raises(RuntimeError, match="profile failed"):
        prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=0.5, profile=_fail
        )
    assert _state(model) == before
    assert prime_ac.checkpoint_blocks(model, mode="full", freq=3) == ["layers.0", "layers.3"]
    assert [type(layer) for layer in model.layers] == classes
    report = prime_ac.audit(model, lambda m: m(x))
    assert report.blocks == ["layers.0", "layers.3"]
    assert 0 < report.held_bytes < report.held_bytes_no_ac
