"""prime_ac against torch's own selective checkpointing on random programs of operators.

Each program is a short chain of operators on a [4, 8] activation: matmuls (``mm``, ``addmm``),
elementwise ops, views, a multi-output op (``max.dim``), the mandatory ``topk``, and in-place
writes, with a random set of them as targets. It runs under torch's
``create_selective_checkpoint_contexts`` with the same policy object and under
``prime_ac.context_fn``, optionally with a dispatch mode active around backward. Then:

- gradients are bitwise those of the program without checkpointing;
- the operators kept are the same as torch's;
- the operator calls that reach a mode active around backward (the replayed calls plus the
  backward's own) are as many as torch's.

torch raises when a kept result is written in place later in the forward (directly or through a
view of it); prime_ac copies it first, so such programs compare against no AC only. Kept views
and writes through them (``view_write``, ``t_write``, ``narrow_write`` with ``view``, ``t``,
``slice`` or ``select`` among the targets) must train as without AC: views replay, so in the
recompute they share their base's storage. The policy is also given as a plain torch-style
callable that keeps the targets by name, views included; its gradients are compared with no AC
(torch's SAC keeps such views apart from their base and can train differently).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import prime_ac

STEPS = (
    "mm",
    "addmm",
    "tanh",
    "sin",
    "view",
    "transpose",
    "max",
    "topk",
    "add_",
    "mul_",
    "clone",
    "view_write",
    "t_write",
    "narrow_write",
)
TARGETS = {
    "clone": "aten::clone",
    "t": "aten::t",
    "slice": "aten::slice.Tensor",
    "select": "aten::select.int",
    "mm": "aten::mm",
    "addmm": "aten::addmm",
    "tanh": "aten::tanh",
    "sin": "aten::sin",
    "view": "aten::view",
    "transpose": "aten::transpose",
    "max": "aten::max.dim",
}


class Program(nn.Module):
    def __init__(self, steps: list[str], seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.steps = steps
        self.w = nn.Parameter(torch.randn(8, 8, generator=generator) / 3)
        self.b = nn.Parameter(torch.randn(8, generator=generator) / 3)

    def forward(self, x):
        h = x
        for step in self.steps:
            if step == "mm":
                h = torch.mm(h, self.w)
            elif step == "addmm":
                h = nn.functional.linear(h, self.w, self.b)
            elif step == "tanh":
                h = h.tanh()
            elif step == "sin":
                h = h.sin()
            elif step == "view":
                h = h.view(8, 4).view(4, 8)
            elif step == "transpose":
                h = h.t().contiguous().t()
            elif step == "max":
                values, _ = h.max(dim=1, keepdim=True)
                h = h * values
            elif step == "topk":
                values, _ = torch.topk(h, 2, dim=1)
                h = h + values.sum(dim=1, keepdim=True)
            elif step == "add_":
                h.add_(0.5)
            elif step == "mul_":
                h.mul_(1.5)
            elif step == "clone":
                h = h.clone()
            elif step == "view_write":  # a write through views of the activation
                h.view(32)[:4].mul_(2.0)
            elif step == "t_write":
                h.t()[0].add_(1.0)
            elif step == "narrow_write":
                h.narrow(1, 4, 4).mul_(0.5)
        return h


class CountCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _run(model, x, context_fn, around_backward):
    model = copy.deepcopy(model)
    x = x.clone().requires_grad_()
    if context_fn is None:
        out = model(x)
    else:
        out = checkpoint(model, x, use_reentrant=False, context_fn=context_fn)
    loss = out.square().sum()
    counter = CountCalls()
    if around_backward:
        with counter:
            loss.backward()
    else:
        loss.backward()
    return {"x": x.grad, "w": model.w.grad, "b": model.b.grad}, counter.calls


def _assert_same(grads, expected):
    for name, grad in expected.items():
        assert (grad is None and grads[name] is None) or torch.equal(grads[name], grad), name


def _keeping_by_name(names: set[str]):
    """A torch SAC policy callable keeping the operators named (``aten::max.dim``) and the
    mandatory topk, written without prime_ac."""

    def policy(ctx, op, *args, **kwargs):
        name = op.name()  # "aten::mm", "aten::max.dim"
        if name == "aten::topk" or name in names:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _recording(make):
    made = []

    def context_fn():
        made.append(make())
        return made[-1]

    return context_fn, made


# torch's SAC storage as the comparison reads it: per operator, call index -> kept result or a
# recompute marker (torch 2.13+). Earlier releases keep a list that the recompute empties, and
# their recompute dispatches calls of its own around the kept results: there, programs are
# compared with no AC only.
_RECOMPUTE = getattr(torch.utils.checkpoint, "_RECOMPUTE", None)


def _torch_kept(caching_mode) -> set:
    """Operators with a kept result in torch's SAC storage."""
    return {
        key[0] if isinstance(key, tuple) else key
        for key, entries in caching_mode.storage.items()
        if any(entry is not _RECOMPUTE for entry in entries.values())
    }


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    steps=st.lists(st.sampled_from(STEPS), min_size=1, max_size=8),
    keep=st.sets(st.sampled_from(sorted(TARGETS.values()))),
    around_backward=st.booleans(),
    seed=st.integers(0, 3),
    as_callable=st.booleans(),
)
# issue 30: a kept result written through a kept view of it (views and their base must stay one
# storage in the recompute)
@example(["mm", "view_write", "sin"], {"aten::mm", "aten::view"}, False, 0, False)
@example(["sin", "clone", "view_write", "tanh"], {"aten::clone", "aten::view"}, False, 0, False)
@example(["mm", "narrow_write", "mm"], {"aten::mm", "aten::slice.Tensor"}, False, 3, False)
@example(["mm", "t_write", "sin"], {"aten::mm", "aten::t"}, True, 1, False)
@example(["mm", "view_write", "tanh"], {"aten::view"}, False, 2, True)
def test_random_programs_match_torch_selective_checkpointing(
    steps, keep, around_backward, seed, as_callable
):
    model = Program(steps, seed)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    try:
        reference, _ = _run(model, x, None, False)
    except RuntimeError:  # autograd refuses this program: a tensor its backward reads was written
        assume(False)
    if as_callable:
        ours, _ = _run(model, x, prime_ac.context_fn(policy=_keeping_by_name(keep)), False)
        _assert_same(ours, reference)
        return
    policy = prime_ac.make_policy("selective", targets=sorted(keep))
    ours_fn, ours_made = _recording(prime_ac.context_fn(policy=policy))
    ours, ours_calls = _run(model, x, ours_fn, around_backward)
    _assert_same(ours, reference)
    if _RECOMPUTE is None:
        return

    torch_fn, torch_made = _recording(lambda: create_selective_checkpoint_contexts(policy))
    try:
        theirs, theirs_calls = _run(model, x, torch_fn, around_backward)
    except RuntimeError as error:
        assert "has been mutated" in str(error)  # a kept result written in place: prime_ac copies
        assert ours_made[0][0].store.copies > 0
        return
    ((keep_mode, _),) = ours_made
    ((caching_mode, _),) = torch_made
    assert keep_mode.store.kept_ops() == _torch_kept(caching_mode)
    assert ours_calls == theirs_calls
    _assert_same(ours, theirs)


COMPILED_PROGRAMS = [
    ["addmm", "tanh", "mm", "max", "sin"],
    ["mm", "view", "topk", "addmm", "transpose", "tanh"],
    ["addmm", "add_", "mm", "sin"],
]


@pytest.mark.slow
@pytest.mark.parametrize("steps", COMPILED_PROGRAMS, ids=lambda s: "-".join(s))
def test_compiled_programs_match_torch_selective_checkpointing(steps):
    """The same programs under torch.compile: prime_ac's context_fn hands torch's own contexts
    the policy, so compiled gradients equal torch's compiled SAC with that policy."""
    model, x = Program(steps, 0), torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    policy = prime_ac.make_policy("selective", targets=["aten::mm", "aten::max.dim"])

    def compiled(context_fn):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        xi = x.clone().requires_grad_()

        @torch.compile(backend="aot_eager", fullgraph=True)
        def step(xi):
            out = checkpoint(m, xi, use_reentrant=False, context_fn=context_fn)
            return out.square().sum()

        step(xi).backward()
        return {"x": xi.grad, "w": m.w.grad, "b": m.b.grad}

    ours = compiled(prime_ac.context_fn(policy=policy))
    theirs = compiled(lambda: create_selective_checkpoint_contexts(policy))
    reference, _ = _run(model, x, None, False)
    _assert_same(ours, theirs)
    for name, grad in reference.items():
        torch.testing.assert_close(ours[name], grad)
