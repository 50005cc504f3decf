"""Kept results and their aliases stay one storage in the recompute (issue 30, item 1).

A block that writes through a view of a kept result must train as it does without AC. Views
(``view``, ``t``, ``slice``, ...) are never kept: kept apart from their base, a write through one
in the recompute would miss the recomputed base. Kept results that share a storage (``mm`` and the
``_unsafe_view`` of its result) are copied on write as views of one copy.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import prime_ac
from prime_ac._compat import storage_id
from prime_ac.actions import Action

aten = torch.ops.aten


def _grads(fn, x, w, context_fn):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    if context_fn is None:
        out = fn(x, w)
    else:
        out = checkpoint(fn, x, w, use_reentrant=False, context_fn=context_fn)
    out.square().sum().backward()
    return x.grad, w.grad


def _write_through_view(h, a):
    y = torch.mm(h, a)
    y.view(32)[:4].mul_(2.0)
    return y.sin()


def _write_through_transpose(h, a):
    y = torch.mm(h, a)
    y.t()[0].add_(1.0)
    return y.cos()


def _write_through_clone_view(h, a):
    y = torch.mm(h, a).clone()
    y.view(32)[4:8].mul_(3.0)
    return y * a.sum()


def _write_through_narrow(h, a):
    y = torch.mm(h, a)
    y.narrow(1, 4, 4).mul_(0.5)
    return y.tanh()


PROGRAMS = [
    _write_through_view,
    _write_through_transpose,
    _write_through_clone_view,
    _write_through_narrow,
]
TARGET_LISTS = [
    ["aten::mm", "aten::view"],
    ["aten::clone", "aten::view"],
    ["aten::mm", "aten::t"],
    ["aten::view"],
    ["aten::mm", "aten::slice.Tensor", "aten::select.int"],
]


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=generator), torch.randn(8, 8, generator=generator) / 3


@pytest.mark.parametrize("targets", TARGET_LISTS, ids="+".join)
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_writes_through_kept_views_train_bitwise(fn, targets):
    x, w = _inputs()
    reference = _grads(fn, x, w, None)
    ours = _grads(fn, x, w, prime_ac.context_fn("selective", targets))
    for got, expected in zip(ours, reference, strict=True):
        assert torch.equal(got, expected)


def test_torch_refuses_what_prime_ac_trains_bitwise():
    """torch's SAC raises where a kept result is written through a view; prime_ac copies it."""
    x, w = _inputs()
    policy = prime_ac.make_policy("selective", ["aten::mm", "aten::view"])
    with pytest.raises(RuntimeError, match="has been mutated"):
        _grads(_write_through_view, x, w, lambda: create_selective_checkpoint_contexts(policy))
    reference = _grads(_write_through_view, x, w, None)
    ours = _grads(_write_through_view, x, w, prime_ac.context_fn(policy=policy))
    for got, expected in zip(ours, reference, strict=True):
        assert torch.equal(got, expected)


def test_views_replay_even_when_targeted():
    policy = prime_ac.make_policy("selective", ["aten::view", "aten::t", "aten::mm"])
    assert policy.classify(aten.view.default) is Action.REPLAY
    assert policy.classify(aten.t.default) is Action.REPLAY
    assert policy.classify(aten.mm.default) is Action.KEEP
    ctx = None
    assert policy(ctx, aten.view.default) is CheckpointPolicy.PREFER_RECOMPUTE


def test_a_policy_callable_that_keeps_every_op_trains_bitwise():
    """A torch-style callable saying MUST_SAVE for every call (views included): prime_ac does not
    keep the views, so the write reaches the recomputed base; gradients are those of no AC."""
    asked = []

    def keep_everything(ctx, op, *args, **kwargs):
        asked.append(op)
        return CheckpointPolicy.MUST_SAVE

    x, w = _inputs()
    reference = _grads(_write_through_view, x, w, None)
    ours = _grads(_write_through_view, x, w, prime_ac.context_fn(policy=keep_everything))
    for got, expected in zip(ours, reference, strict=True):
        assert torch.equal(got, expected)
    assert aten.mm.default in asked and aten.view.default not in asked


def test_kept_results_sharing_a_storage_are_copied_as_one():
    """``matmul`` of a 3-d input calls mm and _unsafe_view (which aliases mm's result); both
    kept, a write through the result copies their one storage once, and the copies share it."""
    made = []
    inner = prime_ac.context_fn("selective", ["aten::mm", "aten::_unsafe_view"])

    def recording():
        made.append(inner())
        return made[-1]

    def fn(h, a):
        y = torch.matmul(h, a)
        y.view(-1)[:4].mul_(2.0)
        return y.sin()

    generator = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 4, 8, generator=generator), torch.randn(8, 8, generator=generator)
    reference = _grads(fn, x, w, None)
    forward_done = []

    def kept_storages(h, a):
        out = fn(h, a)
        store = made[0][0].store
        kept = [e.tensors[0] for entries in store.entries.values() for e in entries.values()]
        forward_done.append({storage_id(t) for t in kept})
        return out

    ours = _grads(kept_storages, x, w, recording)
    for got, expected in zip(ours, reference, strict=True):
        assert torch.equal(got, expected)
    store = made[0][0].store
    assert store.copies == 1
    assert store.copied_bytes == 2 * 4 * 8 * 4  # the [8, 8] float32 result, once
    assert len(forward_done[0]) == 1  # mm's and _unsafe_view's kept copies: one storage
