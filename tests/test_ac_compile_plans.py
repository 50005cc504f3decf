"""One plan, both modes (issue 44): a compiled block keeps, offloads and replays the calls its
eager plan does.

Random keep / offload / replay plans (seeded) over the built-in model's calls, applied to the
blocks and compiled one by one (``block.compile(backend="aot_eager")``, torchtitan's and
prime-rl's way): the decisions the compiled graph was tagged with equal the eager audit's, per
call; gradients are bitwise those of the same model compiled without AC; blocks of one class
with different plans each keep their own calls, blocks with equal plans share one graph; the
conformance suite's transformers Llama compiles with its plan alike. The offload graph is
checked on the meta device: a CPU build of torch cannot run autograd on fake
CUDA tensors, and torch's offload pass treats every device but the host alike.
"""

from __future__ import annotations

import dataclasses
import random
import re
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import prime_ac
import prime_ac.compiled
from prime_ac._compat import returns_alias, schema_is_mutable
from prime_ac.budget import BlockPlan, budget_context_fn
from prime_ac.compiled import compiled_offload_supported, compiled_plan, compiled_plan_context_fn
from prime_ac.models import build_model
from prime_ac.offload import Offloader
from prime_ac.policy import make_policy
from prime_ac.wrapping import checkpoint_state, wrap_block

pytestmark = pytest.mark.slow

MM = torch.ops.aten.mm.default
OFFLOAD = compiled_offload_supported()


def _tokens():
    return torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))


def _loss(model):
    return model.loss(_tokens())


def _random_plans(model, seed, same=()):
    """A random keep / offload / replay choice for every call of every block (views and
    in-place calls replay, mandatory calls are kept or offloaded); blocks in ``same`` get the
    first block's plan."""
    report = prime_ac.audit(model, _loss)
    rng = random.Random(seed)
    offloader = Offloader(None)
    plans = {}
    for name in report.blocks:
        if name in same and plans:
            plans[name] = dataclasses.replace(next(iter(plans.values())), block=name)
            continue
        kept, offloaded = [], []
        for call in report.calls[name]:
            if returns_alias(call.op) or schema_is_mutable(call.op):
                continue
            mandatory = call.decision == "mandatory"
            choice = rng.choice(("keep", "offload") if mandatory else ("keep", "offload", "replay"))
            if choice == "offload" and OFFLOAD:
                offloaded.append((call.op, call.index))
            elif choice != "replay" and call.decision != "mandatory":
                kept.append((call.op, call.index))
        plans[name] = BlockPlan(
            name, 0, tuple(kept), 0, 0, offloaded=tuple(offloaded), offloader=offloader
        )
    for name, plan in plans.items():
        block = model.get_submodule(name)
        state = checkpoint_state(block)
        context_fn = budget_context_fn(
            state.policy,
            frozenset(plan.kept),
            f"block {name!r}",
            frozenset(plan.offloaded),
            plan.offloader,
        )
        wrap_block(block, dataclasses.replace(state, plan=plan, context_fn=context_fn))
    return plans


def _eager_decisions(model):
    """{block: {(op, index): "kept" / "replayed"}} of an eager step (mandatory counts as kept)."""
    report = prime_ac.audit(model, _loss)
    return {
        name: {
            (c.op, c.index): "replayed" if c.decision == "replayed" else "kept"
            for c in report.calls[name]
        }
        for name in report.blocks
    }


def _compiled_step(model, fullgraph):
    for layer in model.layers:
        layer.compile(backend="aot_eager", fullgraph=fullgraph)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".* offloads results that are on the CPU")
        _loss(model).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize(("seed", "fullgraph"), [(0, True), (1, False)])
def test_random_plans_compile_to_the_eager_decisions(seed, fullgraph):
    """Three blocks of one class, the first and last with one random plan and the middle with
    another: each compiled block is tagged with its own plan's decisions, call for call as the
    eager audit records them, in two graphs; gradients are bitwise the no-AC compiled ones."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build_model(n_layers=3, seed=seed)
    prime_ac.checkpoint_blocks(model, mode="full")
    plans = _random_plans(model, seed, same=("layers.0", "layers.2"))
    assert plans["layers.0"].kept != plans["layers.1"].kept  # the plans differ
    eager = _eager_decisions(model)
    grads = _compiled_step(model, fullgraph)

    for name, plan in plans.items():
        traced = checkpoint_state(model.get_submodule(name)).compiled.traced
        compiled = {(op, i): d for op, i, d in traced if op in {o for o, _ in eager[name]}}
        assert {k: "replayed" if d == "replayed" else "kept" for k, d in compiled.items()} == {
            k: d for k, d in eager[name].items() if k in compiled
        }, name
        assert {k for k, d in compiled.items() if d == "offloaded"} == set(plan.offloaded)
        assert {k for k, d in compiled.items() if d == "kept"} >= set(plan.kept)
    assert counters["stats"]["unique_graphs"] == 2  # equal plans share one
    report = prime_ac.audit(model, _loss)  # blocks compiled: read from their eager forwards
    assert report.compiled_blocks == dict.fromkeys(
        plans, "compiled graph tagged as its eager forward, call for call"
    )
    assert _eager_decisions(model) == eager

    torch._dynamo.reset()
    plain = build_model(n_layers=3, seed=seed)
    expected = _compiled_step(plain, fullgraph)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 16) / 4)
        self.w2 = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        h = torch.mm(x, self.w1).relu()
        return torch.mm(h, self.w2).sin() + h.view(x.shape).cos()


def _saved_bytes(model, step):
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in parameters:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step(x)
    out.sum().backward()
    return sum(saved.values())


def _planned_blocks(plans):
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in plans))
    prime_ac.checkpoint_blocks(model, mode="full", blocks=lambda n, m: isinstance(m, Block))
    for (name, block), kept in zip(model.named_children(), plans, strict=True):
        state = checkpoint_state(block)
        plan = BlockPlan(f"{name}", 0, tuple(kept), 0, 0)
        context_fn = budget_context_fn(state.policy, frozenset(kept), f"block {name!r}")
        wrap_block(block, dataclasses.replace(state, plan=plan, context_fn=context_fn))
    return model


def test_a_compiled_plan_saves_what_the_eager_plan_holds():
    """Saved bytes (torch's saved-tensor hooks) of the compiled step equal the eager step's and
    the audit's of the compiled model, for two blocks of one class keeping different calls."""
    from prime_ac.measure import track_step

    torch._dynamo.reset()
    model = _planned_blocks([[(MM, 0)], [(MM, 1)]])
    eager, _ = track_step(model, lambda m: m(torch.randn(8, 16)).sum())
    for block in model:
        block.compile(backend="aot_eager", fullgraph=True)
    compiled = _saved_bytes(model, model)
    assert compiled == eager
    # the input made inside the step, as _saved_bytes makes it, so both count it
    assert prime_ac.audit(model, lambda m: m(torch.randn(8, 16)).sum()).held_bytes == compiled


def test_many_distinct_plans_warn_at_the_recompile_limit(monkeypatch):
    """dynamo compiles at most recompile_limit graphs per code object (every wrapped block's
    forward is one) and runs the rest eagerly: prime_ac says so when that many distinct plans
    were compiled."""
    torch._dynamo.reset()
    monkeypatch.setattr(prime_ac.compiled, "_traced", weakref.WeakSet())  # earlier tests' plans
    model = _planned_blocks([[(MM, 0)], [(MM, 1)], []])
    for block in model:
        block.compile(backend="aot_eager")
    with torch._dynamo.config.patch(recompile_limit=2):
        with pytest.warns(UserWarning, match=r"2 distinct block plans compiled, which is"):
            model(torch.randn(8, 16)).sum().backward()


def _block(x, w1, w2):
    h = torch.mm(x, w1).relu()
    v = h.view(-1)
    return torch.mm(h, w2).sin().sum() + v.sum()


def _partitioned(plan, device):
    """The forward and backward graphs torch's partitioner makes of ``_block`` under ``plan``."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = {}

    class Partitioned(Exception):
        pass

    def partition(joint, inputs, **kwargs):
        graphs["fw"], graphs["bw"] = min_cut_rematerialization_partition(joint, inputs, **kwargs)
        raise Partitioned  # the graphs are all this test reads; nothing runs on the device

    backend = aot_autograd(fw_compiler=lambda g, _: g, partition_fn=partition)

    @torch.compile(backend=backend, fullgraph=True)
    def step(x, w1, w2):
        context_fn = compiled_plan_context_fn(plan)
        return checkpoint(_block, x, w1, w2, use_reentrant=False, context_fn=context_fn)

    torch._dynamo.reset()
    args = [torch.empty(8, 16, device=device, requires_grad=True)]
    args += [torch.empty(16, 16, device=device, requires_grad=True) for _ in range(2)]
    try:
        step(*args)
    except Exception as e:  # dynamo wraps what the backend raised
        if "Partitioned" not in str(e):
            raise
    return graphs["fw"].graph, graphs["bw"].graph


def _targets(graph, name):
    return [n for n in graph.nodes if n.op == "call_function" and name in str(n.target)]


@pytest.mark.skipif(not OFFLOAD, reason="compile-side offload needs torch 2.13+")
def test_the_offload_graph_moves_the_planned_calls_only():
    """Planned offloads of the first mm, a view and a parameter's transpose: the mm leaves after
    its last forward use and comes back (prefetched) before its first backward use; the view and
    the transpose are never offloaded (they share a storage dropping would not free). The
    kept mm stays saved on the device."""
    view, t = torch.ops.aten.view.default, torch.ops.aten.t.default
    plan = compiled_plan(
        make_policy("full"), kept=[(MM, 1)], offloaded=[(MM, 0), (view, 0), (t, 0)], owner="t"
    )
    forward, backward = _partitioned(plan, "meta")
    offloads = _targets(forward, "ao.offload")
    assert [n.args[0].target for n in offloads] == [MM]
    mm = offloads[0].args[0]
    order = list(forward.nodes)
    uses = [u for u in mm.users if u.op != "output" and "ao." not in str(u.target)]
    last_use = max(order.index(u) for u in uses)
    assert order.index(offloads[0]) > last_use  # after its last forward use
    reloads = _targets(backward, "ao.reload")
    waits = [n for n in _targets(backward, "ao.wait_tensor") if n.args[0] in reloads]
    assert len(reloads) == len(waits) == 1
    body = list(backward.nodes)
    first_use = min(body.index(u) for u in waits[0].users)
    assert body.index(reloads[0]) < body.index(waits[0]) < first_use
    saved = {n.name for n in forward.find_nodes(op="output")[0].args[0]}
    assert "mm_1" in saved  # the kept mm, on the device
    assert plan.traced[0] == (MM, 0, "offloaded")


@pytest.mark.skipif(not OFFLOAD, reason="compile-side offload needs torch 2.13+")
def test_offload_of_host_values_in_a_compiled_block_warns_and_keeps():
    """On the CPU there is no host to move to: the planned offload is saved in place, as
    keeping it would, with a warning."""
    plan = compiled_plan(make_policy("full"), offloaded=[(MM, 0)], owner="cpu")
    with pytest.warns(UserWarning, match="cpu offloads results that are on the CPU"):
        forward, _ = _partitioned(plan, "cpu")
    assert not _targets(forward, "ao.offload")
    assert "mm" in {n.name for n in forward.find_nodes(op="output")[0].args[0]}


@pytest.mark.skipif(OFFLOAD, reason="this torch has compile-side offload")
def test_offload_without_compile_side_offload_raises_at_the_first_compiled_call():
    """torch 2.9-2.12: a compiled block that would offload raises, naming the torch version and
    what to do, never a silent keep."""
    plan = compiled_plan(make_policy("full"), offloaded=[(MM, 0)], owner="old")
    version = re.escape(torch.__version__)
    with pytest.raises(Exception, match=rf"torch {version} has no compile-side offload"):
        _partitioned(plan, "cpu")


def test_the_audit_says_where_a_compiled_graph_saved_differently():
    """A compiled block whose traced tags disagree with its eager forward is named, with the
    calls; one not traced yet says so; one without a plan is read through its policy."""
    from prime_ac.audit import CallRecord
    from prime_ac.compiled import compiled_readings

    plan = compiled_plan(make_policy("full"), kept=[(MM, 0)], owner="x")
    calls = {"a": [CallRecord(MM, 0, "replayed", 4, 1), CallRecord(MM, 1, "replayed", 4, 1)]}
    states = {"a": type("S", (), {"compiled": plan})(), "b": type("S", (), {"compiled": None})()}
    assert "not traced yet" in compiled_readings(["a"], states, calls)["a"]
    plan.traced = ((MM, 0, "kept"), (MM, 1, "replayed"))
    readings = compiled_readings(["a", "b"], states, calls)
    assert readings["a"].startswith("compiled graph saved differently from its eager forward at 1")
    assert "aten.mm.default#0 compiled saves" in readings["a"]
    assert readings["b"].startswith("eager forward with the policy that tags its compiled graph")


def test_a_peak_budget_plans_and_calibrates_blocks_compiled_before():
    """checkpoint_blocks(targets="auto", budget=<peak>) on blocks compiled with fullgraph
    first: the profile and the calibration step run (on the CPU, whose storage ledger is a
    dispatch mode, through the blocks' eager forwards), and the compiled blocks then run the
    plan: their graphs tagged as the audit's eager forwards."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    for block in model:
        block.compile(backend="aot_eager", fullgraph=True)

    def loss(m):
        return m(torch.randn(8, 16, generator=torch.Generator().manual_seed(1))).sum()

    prime_ac.checkpoint_blocks(
        model,
        mode="selective",
        targets="auto",
        budget=1 << 20,
        profile=loss,
        blocks=lambda n, m: isinstance(m, Block),
    )
    plan = checkpoint_state(model[0]).plan
    assert plan.peak.measured is not None and plan.kept
    loss(model).backward()
    assert all(checkpoint_state(b).compiled.traced for b in model)  # traced with the plan
    report = prime_ac.audit(model, loss)
    assert set(report.compiled_blocks.values()) == {
        "compiled graph tagged as its eager forward, call for call"
    }


def test_blocks_compiled_before_their_first_step_warn_that_the_watch_misses_them():
    """The first step's report, skip_worse and the drop of unread kept results are eager-only:
    blocks compiled before that step say so once, naming them."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    prime_ac.checkpoint_blocks(
        model, mode="selective", targets=["aten::mm"], blocks=lambda n, m: isinstance(m, Block)
    )
    for block in model:
        block.compile(backend="aot_eager", fullgraph=True)
    with pytest.warns(UserWarning, match=r"compiled before their first step \(0, 1\)"):
        model(torch.randn(8, 16)).sum().backward()


@pytest.mark.skipif(not OFFLOAD, reason="compile-side offload needs torch 2.13+")
def test_named_offload_in_compiled_blocks_is_tagged_not_silently_kept():
    """offload=["aten::mm"] on compiled blocks: the mm results are tagged for offload (on the
    CPU: kept in place, said once), gradients bitwise those of the eager offload."""
    torch._dynamo.reset()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block())
        prime_ac.checkpoint_blocks(
            model, mode="full", offload=["aten::mm"], blocks=lambda n, m: isinstance(m, Block)
        )
        models.append(model)
    for block in models[0]:
        block.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="offloads results that are on the CPU"):
        models[0](x).sum().backward()
    models[1](x).sum().backward()
    assert all(
        torch.equal(a.grad, b.grad)
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True)
    )


def test_a_transformers_llama_compiles_with_its_plan(monkeypatch):
    """The conformance suite's Llama (transformers' decoder layers, compiled with fullgraph
    after planning): every layer's graph tagged as its eager forward, call for call, the audit's
    bytes those of the eager model, gradients bitwise those of the layers compiled without AC."""
    pytest.importorskip("transformers")
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "conformance"))
    from real_models import CASES

    case = next(c for c in CASES if c.name == "llama")
    batch = case.batch()

    def loss(m):
        return case.loss(m, batch)

    torch._dynamo.reset()
    grads = []
    for checkpointed in (True, False):
        model = case.build()
        if checkpointed:
            kwargs = dict(mode="selective", targets="auto", budget=0.5, profile=loss)
            prime_ac.checkpoint_blocks(model, **kwargs)
            eager = prime_ac.audit(model, loss).held_bytes
        for name in case.blocks:
            model.get_submodule(name).compile(backend="aot_eager", fullgraph=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*compiled before their first step")
            loss(model).backward()
        grads.append([p.grad for p in model.parameters()])
        if checkpointed:
            report = prime_ac.audit(model, loss)
            assert set(report.compiled_blocks.values()) == {
                "compiled graph tagged as its eager forward, call for call"
            }
            assert report.held_bytes == eager
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_the_partitioned_graph_saves_the_eager_plans_kept_results():
    """Read from the partitioned forward graph itself: the activations it saves for backward
    (its outputs past the block's result that are no graph input) are the eager plan's kept
    calls, operator and bytes alike."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    forwards = []
    backend = aot_autograd(
        fw_compiler=lambda g, _: forwards.append(g) or g,
        bw_compiler=lambda g, _: g,
        partition_fn=min_cut_rematerialization_partition,
    )
    torch._dynamo.reset()
    model = build_model(n_layers=2, seed=0)
    prime_ac.checkpoint_blocks(model, mode="selective", targets="auto", budget=0.5, profile=_loss)
    kept = sorted(
        (str(c.op), c.bytes)
        for c in prime_ac.audit(model, _loss).calls["layers.0"]
        if c.decision != "replayed"
    )
    assert kept  # the plan keeps something
    model.layers[0].compile(backend=backend, fullgraph=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*compiled before their first step")
        _loss(model).backward()
    outputs = forwards[0].graph.find_nodes(op="output")[0].args[0][1:]
    saved = sorted(
        (str(n.target), n.meta["val"].numel() * n.meta["val"].element_size())
        for n in outputs
        if n.op == "call_function" and "recompute" in n.meta  # inside the region
    )
    assert saved == kept
