"""Compiled checkpoint regions follow their own configuration (issue 30, items 2 and 3).

Two models of one block class checkpointed with different settings and compiled in one process
each get their own graph: what a compiled model saves for backward (counted through torch's
saved-tensor hooks) equals what the same configuration holds eagerly (prime_ac's measurement),
in both orders, whether they differ in mode, targets or scoped targets (a budget plan raises
under compile). And every public way to build a ``context_fn`` works when it is built inside a
compiled function, with and without ``fullgraph``.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import prime_ac
from prime_ac.budget import budget_context_fn
from prime_ac.contexts import block_context_fn, checkpoint_contexts
from prime_ac.measure import track_step
from prime_ac.modes import Rules

pytestmark = pytest.mark.slow


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return torch.mm(x, self.w)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return torch.mm(self.inner(x).sin(), self.w).cos()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


CONFIGS = {
    "selective-mm": {"mode": "selective", "targets": ["aten::mm"]},
    "selective-sin": {"mode": "selective", "targets": ["aten::sin"]},
    "full": {"mode": "full"},
    "scoped": {"mode": "selective", "targets": ["inner/aten::mm"]},  # the first mm only
}


def _inputs():
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _saved_bytes(parameters, step):
    """Bytes of the storages the forward saves for backward, ``parameters`` excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in parameters}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step(_inputs())
    out.sum().backward()
    return sum(saved.values())


def _checkpointed(name):
    model = Model()
    prime_ac.checkpoint_blocks(model, blocks=lambda n, m: isinstance(m, Block), **CONFIGS[name])
    eager, _ = track_step(model, lambda m: m(_inputs()).sum())
    return model, eager


ORDERS = [
    ("selective-mm", "full"),
    ("full", "selective-mm"),
    ("selective-sin", "selective-mm"),
    ("scoped", "selective-mm"),
]


def _compile_blocks(model):
    for layer in model.layers:
        layer.compile(backend="aot_eager")
    return model


@pytest.mark.parametrize("order", ORDERS, ids="-then-".join)
def test_each_configuration_compiles_its_own_graph(order):
    """Blocks compiled one by one (torchtitan's way) save what they hold eagerly."""
    torch._dynamo.reset()
    eager_bytes, compiled_bytes = [], []
    for name in order:
        model, eager = _checkpointed(name)
        eager_bytes.append(eager)
        compiled_bytes.append(_saved_bytes(model.parameters(), _compile_blocks(model)))
    assert eager_bytes[0] != eager_bytes[1]  # the two configurations differ measurably
    assert compiled_bytes == eager_bytes


@pytest.mark.parametrize("order", ORDERS[:2], ids="-then-".join)
def test_whole_compiled_models_follow_their_configuration(order):
    """A whole model compiled after another configuration's saves what it saves compiled
    alone (one graph lets the partitioner recompute a block's output from its kept matmul)."""
    alone = {}
    for name in order:
        torch._dynamo.reset()
        model, _ = _checkpointed(name)
        alone[name] = _saved_bytes(model.parameters(), torch.compile(model, backend="aot_eager"))
    torch._dynamo.reset()
    after = {}
    for name in order:
        model, _ = _checkpointed(name)
        after[name] = _saved_bytes(model.parameters(), torch.compile(model, backend="aot_eager"))
    assert alone[order[0]] != alone[order[1]]
    assert after == alone


def _block(x, w):
    return torch.mm(torch.mm(x, w).sin(), w).cos()


def _keep_mm(ctx, op, *args, **kwargs):
    """torch's SAC policy keeping every mm: the reference, written without prime_ac."""
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


_POLICY = prime_ac.make_policy("selective", ["aten::mm"])
BUILDERS = {
    "context_fn(mode, targets)": lambda: prime_ac.context_fn("selective", ["aten::mm"]),
    "context_fn(policy=OperatorPolicy)": lambda: prime_ac.context_fn(policy=_POLICY),
    "context_fn(policy=callable)": lambda: prime_ac.context_fn(policy=_keep_mm),
    "block_context_fn": lambda: block_context_fn(_POLICY, "block"),
    "checkpoint_contexts": lambda: checkpoint_contexts(Rules(_POLICY), "region"),
}


def _compiled_step(make_context_fn, fullgraph):
    w = nn.Parameter(torch.randn(16, 16, generator=torch.Generator().manual_seed(2)) / 4)

    @torch.compile(backend="aot_eager", fullgraph=fullgraph)
    def step(x):
        return checkpoint(_block, x, w, use_reentrant=False, context_fn=make_context_fn())

    return w, step


def _run(make_context_fn, fullgraph):
    torch._dynamo.reset()
    w, step = _compiled_step(make_context_fn, fullgraph)
    x = _inputs()
    nbytes = _saved_bytes([w], lambda _: step(x))
    return nbytes, x.grad, w.grad


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks", "fullgraph"])
@pytest.mark.parametrize("builder", BUILDERS, ids=str)
def test_context_fn_built_inside_a_compiled_function(builder, fullgraph):
    """Each builder, called inside the compiled function, saves what torch's own SAC contexts
    with the same decision save, and gives its gradients."""
    ours = _run(BUILDERS[builder], fullgraph)
    theirs = _run(lambda: functools.partial(create_selective_checkpoint_contexts, _keep_mm), True)
    assert ours[0] == theirs[0]
    assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[2], theirs[2])


_FULL = prime_ac.make_policy("full")  # built outside: torch 2.9's dynamo cannot trace make_policy


def _planned():
    return budget_context_fn(_FULL, frozenset({(torch.ops.aten.mm.default, 0)}), "block 'b'")


@pytest.mark.parametrize("inside", [False, True], ids=["built-outside", "built-inside"])
def test_a_budget_plan_under_compile_raises(inside):
    """A plan counts the calls of an eager forward; a compiled region would ignore it."""
    planned = _planned()
    torch._dynamo.reset()
    _, step = _compiled_step(_planned if inside else lambda: planned, True)
    with pytest.raises(Exception, match="keeps the calls of a budget plan"):
        step(_inputs())


# Results the backward reads: a kept block output (cos) is held eagerly, and a compiled graph
# saves only what its backward reads, so cos is left out of the comparison.
_OPS = ("aten::mm", "aten::sin", "inner/aten::mm")


@settings(max_examples=5, deadline=None, derandomize=True)
@given(
    first=st.sets(st.sampled_from(_OPS), max_size=2),
    second=st.sets(st.sampled_from(_OPS), max_size=2),
    full_first=st.booleans(),
)
def test_random_configuration_pairs_compile_their_own_graphs(first, second, full_first):
    """Two random configurations (target sets, or full mode first) of one block class compiled
    one after the other each save what they hold eagerly."""
    torch._dynamo.reset()
    configs = [
        {"mode": "full"} if full_first else {"mode": "selective", "targets": sorted(first)},
        {"mode": "selective", "targets": sorted(second)},
    ]
    for config in configs:
        model = Model()
        prime_ac.checkpoint_blocks(model, blocks=lambda n, m: isinstance(m, Block), **config)
        eager, _ = track_step(model, lambda m: m(_inputs()).sum())
        assert _saved_bytes(model.parameters(), _compile_blocks(model)) == eager, config


def test_a_copied_model_compiles_one_graph_for_its_blocks():
    """A deep copy's blocks share one copied policy (not one each), so compiled one by one they
    share one graph, as the original's do; the copy trains as the original."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Model()
    model.layers.append(Block())
    prime_ac.checkpoint_blocks(
        model, blocks=lambda n, m: isinstance(m, Block), mode="selective", targets=["aten::mm"]
    )
    twin = copy.deepcopy(model)
    policies = {id(layer._prime_ac.policy) for layer in twin.layers}
    assert len(policies) == 1 and id(model.layers[0]._prime_ac.policy) not in policies
    grads = []
    for m in (model, twin):
        _compile_blocks(m)(_inputs()).sum().backward()
        grads.append([p.grad for p in m.parameters()])
    assert counters["stats"]["unique_graphs"] == 2  # one per policy, not one per block
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
