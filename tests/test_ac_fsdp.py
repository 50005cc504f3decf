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
import gc

import pytest
import torch
from torch import nn

import prime_ac
from prime_ac.models import build_model
from prime_ac.wrapping import checkpoint_state, wrapped_blocks
from tests.dist_utils import run_distributed


def _state(model: nn.Module):
    return [(n, type(m), m.__dict__.get("_prime_ac")) for n, m in model.named_modules()]


def _figures(report):
    return report.held_bytes, report.held_bytes_no_ac, report.replayed_flops, report.forward_flops


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)


class DecoderLayer(nn.Module):
    """HF layout: attention and an MoE with an ``experts`` ModuleList inside the layer."""

    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(8), nn.LayerNorm(8)
        self.q_proj, self.o_proj, self.gate = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.experts = nn.ModuleList(Expert() for _ in range(3))

    def forward(self, x):
        h = self.input_layernorm(x)
        q = self.q_proj(h)
        attn = torch.softmax(q @ h.transpose(-1, -2), dim=-1) @ h
        x = x + self.o_proj(attn)
        h = self.post_attention_layernorm(x)
        weights, chosen = torch.topk(torch.softmax(self.gate(h), dim=-1), 2, dim=-1)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            w = (weights * (chosen == i)).sum(-1, keepdim=True)
            out = out + w * expert.down(torch.relu(expert.up(h)))
        return x + out


class HFStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(32, 8)
        self.model.layers = nn.ModuleList(DecoderLayer() for _ in range(2))
        self.lm_head = nn.Linear(8, 32)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x)

    def loss(self, ids):
        return nn.functional.cross_entropy(self(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def _layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers if isinstance(model, HFStyle) else model.layers


def _fully_shard(model: nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in _layers(model):
        fully_shard(layer)
    fully_shard(model)


def _fail(model):
    raise RuntimeError("profile failed")


def _body(rank: int, world_size: int) -> None:
    gc.freeze()  # the audit collects garbage per step; torch's long-lived objects need no visit
    for build, vocab in ((lambda: build_model("moe", n_layers=2), 256), (HFStyle, 32)):
        torch.manual_seed(0)
        _check_both_orders(
            build(), torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
        )


def _check_both_orders(base: nn.Module, tokens: torch.Tensor) -> None:
    def loss(m):
        return m.loss(tokens)

    single = copy.deepcopy(base)
    names = prime_ac.checkpoint_blocks(single, mode="selective")
    expected = _figures(prime_ac.audit(single, loss))
    assert 0 < expected[0] < expected[1]
    prime_ac.checkpoint_blocks(single, mode="full")
    expected_full = _figures(prime_ac.audit(single, loss))
    assert expected_full[0] < expected[0] and expected_full[2] > 0  # replays FLOPs

    for order in ("ac-then-fsdp", "fsdp-then-ac"):
        model = copy.deepcopy(base)
        if order == "ac-then-fsdp":
            prime_ac.checkpoint_blocks(model, mode="selective")
            _fully_shard(model)
        else:
            _fully_shard(model)
            prime_ac.checkpoint_blocks(model, mode="selective")
        layers = _layers(model)
        classes = [type(layer) for layer in layers]
        assert _figures(prime_ac.audit(model, loss)) == expected, order

        before = _state(model)
        with pytest.raises(RuntimeError, match="profile failed"):
            prime_ac.checkpoint_blocks(
                model, mode="selective", targets="auto", budget=0.5, profile=_fail
            )
        assert _state(model) == before, order

        prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=0.5, profile=loss
        )
        assert [type(layer) for layer in layers] == classes, order
        assert all(checkpoint_state(layer).plan is not None for layer in layers)
        assert prime_ac.audit(model, loss).mode == "auto"

        # fewer blocks after fully_shard: the other block keeps its class and runs plainly
        assert prime_ac.checkpoint_blocks(model, mode="full", freq=2) == names[:1]
        assert [n for n, _ in wrapped_blocks(model)] == names[:1]
        assert checkpoint_state(layers[0]).policy.mode == "full"
        loss(model).backward()  # trains
        # and back to every block, by state alone
        assert prime_ac.checkpoint_blocks(model, mode="full") == names
        assert [type(layer) for layer in layers] == classes, order
        assert _figures(prime_ac.audit(model, loss)) == expected_full, order


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
