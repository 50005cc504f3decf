"""``offload=[...]`` (prime_ac.offload_targets): the operators a user names go to host memory.

On CPU the host copy is a separate tensor; gradients stay bitwise those of no AC, and the
ledger and the storage ledger (prime_ac.measure) count the bytes moved off the device.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ac_models import BlockStack, assert_bitwise_equal, grads
from torch import nn

import prime_ac
from prime_ac.actions import Action
from prime_ac.measure import measure_peak
from prime_ac.offload_targets import offload_policies
from prime_ac.wrapping import checkpoint_state

DIM, HEADS = 16, 2
SDPA = "aten::_scaled_dot_product_flash_attention_for_cpu"


class Block(nn.Module):
    """Attention, views, an in-place write, dropout and a mandatory top-k in one block."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.up = nn.Linear(DIM, 2 * DIM)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).transpose(1, 3).unbind(2)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.out(att.transpose(1, 2).reshape(b, s, DIM))
        g = self.up(h)
        g.mul_(0.5)  # in place on a result the mode keeps
        g, _ = torch.native_dropout(nn.functional.gelu(g), 0.1, self.training)  # random
        top = g.topk(2, dim=-1).values.sum(-1, keepdim=True)  # mandatory: never replayed
        return h + g[..., :DIM] * top


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(3)  # the same dropout masks in every run
    return model(x)


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    model, x = BlockStack(Block), torch.randn(2, 12, DIM)
    reference = copy.deepcopy(model)
    _step(reference, x).backward()
    return model, x, grads(reference)


_KEPT = ["aten::topk", "aten::native_dropout", "aten::gelu"]
# (mode, targets, offload, the targets keeping on the device what offload moves to the host;
# None: the mode's own, for results the mode keeps anyway)
OFFLOADS = [
    # the mode's own targets offloaded, and an operator the mode would replay (attention)
    ("selective", ["aten::addmm"], ["aten::addmm", SDPA], None),
    # a mandatory operator, a random one (dropout) and a replayed one, never replayed now:
    # less than keeping them on the device (not less than full mode, which replays two of them)
    ("full", None, _KEPT, _KEPT),
    # a whole namespace: views and in-place writes in it stay as the mode says. It keeps more
    # than the mode did (everything else); on the host it holds less than kept on the device
    ("selective", ["aten::addmm"], ["aten"], ["aten"]),
]


def _offloader(model: nn.Module):
    return checkpoint_state(model.layers[0]).policy.offloader


@pytest.mark.parametrize(("mode", "targets", "offload", "on_device"), OFFLOADS)
def test_named_offload_gradients_bitwise_and_fewer_device_bytes(
    base, mode, targets, offload, on_device
):
    model, x, expected = base
    model = copy.deepcopy(model)
    if on_device is None:
        prime_ac.checkpoint_blocks(model, mode=mode, targets=targets, skip_worse=False)
    else:
        prime_ac.checkpoint_blocks(model, mode="selective", targets=on_device, skip_worse=False)
    without = measure_peak(model, lambda m: _step(m, x))
    model.zero_grad(set_to_none=True)

    prime_ac.checkpoint_blocks(model, mode=mode, targets=targets, offload=offload, skip_worse=False)
    offloader = _offloader(model)
    assert all(checkpoint_state(b).policy.offloader is offloader for b in model.layers)
    seen = []
    with_offload = measure_peak(
        model, lambda m: _step(m, x), lambda: seen.append(offloader.ledger.host) or seen[-1]
    )
    assert_bitwise_equal(grads(model), expected)
    ledger = offloader.ledger
    assert ledger.offloaded > 0 and ledger.peak_host > 0 and max(seen) == ledger.peak_host
    assert ledger.host == 0  # every result came back for its block's recompute
    assert ledger.device == 0 and ledger.overflowed == 0  # CPU: no copy in flight, no cap
    assert with_offload < without

    first = ledger.offloaded
    model.zero_grad(set_to_none=True)
    _step(model, x).backward()  # a second step offloads the same results again
    assert_bitwise_equal(grads(model), expected)
    assert ledger.offloaded == 2 * first and ledger.host == 0


def test_replayed_operator_named_in_offload_is_kept_on_the_host(base):
    """An operator full mode replays is kept once named in offload: its calls are offloaded,
    and they are the only ones (views and in-place results are not)."""
    model, x, expected = base
    model = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(model, mode="full", offload=[SDPA])
    _step(model, x).backward()
    assert_bitwise_equal(grads(model), expected)
    # one attention call per block, its output tuple's tensors
    assert _offloader(model).ledger.offloaded == len(model.layers)


def test_views_and_in_place_results_are_never_offloaded():
    base = prime_ac.make_policy("selective", ["aten::mm"])
    named = offload_policies({"selective": base}, ["aten"])["selective"]
    aten = torch.ops.aten
    assert named.offloads(aten.mm.default) and named.offloads(aten.gelu.default)
    for op in (aten.view.default, aten.transpose.int, aten.mul_.Tensor, aten.mm.out):
        assert not named.offloads(op), op
    # views and writes replay as the mode says; a replayed plain op is kept for offload
    assert named.classify(aten.view.default) is base.classify(aten.view.default)
    assert named.classify(aten.mul_.Tensor) is base.classify(aten.mul_.Tensor)
    assert base.classify(aten.gelu.default) is Action.REPLAY
    assert named.classify(aten.gelu.default) is Action.KEEP


@pytest.mark.parametrize(
    ("offload", "error", "match"),
    [
        ("aten::mm", ValueError, r"offload=.*must be a list"),
        (["aten::mmm"], ValueError, r"aten::mmm.*did you mean aten::mm"),
        (["attention/aten::mm"], ValueError, r"offload=.*scoped"),
        ([3], (TypeError, ValueError), r"3"),
    ],
)
def test_bad_offload_names_raise(base, offload, error, match):
    model = copy.deepcopy(base[0])
    with pytest.raises(error, match=match):
        prime_ac.checkpoint_blocks(model, mode="full", offload=offload)
    assert not any(checkpoint_state(b) for b in model.layers)  # nothing applied


def test_config_carries_offload(base):
    model, x, expected = base
    config = prime_ac.ACConfig.from_dict({"mode": "full", "offload": ["aten::topk"]})
    assert config.offload == ("aten::topk",)
    model = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(model, config=config)
    _step(model, x).backward()
    assert_bitwise_equal(grads(model), expected)
    assert _offloader(model).ledger.offloaded == len(model.layers)  # one top-k per block
    with pytest.raises(ValueError, match=r"pass offload= either as arguments or in config="):
        prime_ac.checkpoint_blocks(model, config=config, offload=["aten::topk"])
    with pytest.raises(ValueError, match=r"offload=5 must be a list"):
        prime_ac.ACConfig(offload=5)
    with pytest.raises(ValueError, match=r'offload=.*targets="auto"'):
        prime_ac.ACConfig(mode="selective", targets="auto", budget="1GiB", offload=["aten::mm"])
    with pytest.raises(ValueError, match=r"unknown activation-checkpointing key.*'ofload'"):
        prime_ac.ACConfig.from_dict({"mode": "full", "ofload": ["aten::mm"]})
