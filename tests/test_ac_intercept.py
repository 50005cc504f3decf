"""Eager regions intercept through a dispatch key: only operators that need a decision reach Python.

What the key changes is cost, never results: these tests check which calls reach prime_ac's
kernels, that the choice between key and dispatch modes follows what is active, and that the
results (bitwise gradients, copy on write, replay errors) are those of the mode path.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import prime_ac
from prime_ac import _compat, contexts, intercept
from prime_ac.models import build_model


class Block(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x)).exp().clamp(max=4.0)
        rows = torch.tensor(range(h.shape[0]))
        h = torch.zeros_like(h).index_add(0, rows, h.clone())  # composites writing internally
        return x + self.down(h)


class InPlaceRouter(nn.Module):
    """Top-k weights renormalised in place, then scaled by Python numbers (wrapped scalars)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.gate = nn.Linear(dim, 4)
        self.scale = torch.tensor(0.5)  # a 0-dim float32 tensor written with a Python float

    def forward(self, x):
        weights, _ = torch.topk(self.gate(x).softmax(-1), 2)
        weights /= weights.sum(-1, keepdim=True)
        weights.mul_(2.0)
        return x * weights.sum(-1, keepdim=True) * self.scale.clone().mul_(3.0)


def _contexts(mode: str = "full"):
    return contexts.context_fn(mode)()


def _grads(model, x):
    model(x).square().sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_regions_use_the_key_unless_a_mode_is_active_or_the_policy_is_a_callable():
    keep, replay = _contexts()
    assert isinstance(keep, contexts.KeepRegion) and isinstance(replay, contexts.ReplayRegion)
    with FlopCounterMode(display=False):
        keep, _ = _contexts()
    assert isinstance(keep, contexts.KeepMode)

    def policy(ctx, op, *args, **kwargs):
        return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    keep, _ = contexts.context_fn(policy=policy)()
    assert isinstance(keep, contexts.KeepMode)


def test_only_decisions_per_call_reach_python(monkeypatch):
    seen = []
    handle = contexts.KeepRegion.handle

    def spy(self, func, args, kwargs):
        seen.append(func)
        return handle(self, func, args, kwargs)

    monkeypatch.setattr(contexts.KeepRegion, "handle", spy)
    model, x = Block(), torch.randn(4, 8, requires_grad=True)
    keep, _ = _contexts("selective")
    with keep:
        model(x)
    # addmm is a target, kept every call: kept in C++. gelu, exp, clamp and add never reach
    # Python, and neither do the writes of zeros_like, index_add and clone (zero_, copy_,
    # index_add_), which hit no storage holding a kept result.
    assert seen == []
    assert keep.cache.stored == 2 and keep.cache.kept_ops() == {torch.ops.aten.addmm.default}
    # A budget plan decides per call: those calls reach Python, and only those.
    rules = contexts.Rules(
        prime_ac.make_policy("full"), plan={torch.ops.aten.addmm.default: frozenset({1})}
    )
    keep, _ = contexts.checkpoint_contexts(rules, "planned")()
    with keep:
        model(x)
    assert seen == [torch.ops.aten.addmm.default] * 2
    assert list(keep.cache.entries[torch.ops.aten.addmm.default]) == [1]


def test_operators_without_a_gate_run_as_without_the_key():
    """The key falls through for an operator nobody decides about, also where a composite kernel
    would fill its slot: a structured operator runs its own kernel, not empty + its out= variant
    (the dispatcher calls the profiler records are the same inside a region and outside)."""
    x = torch.randn(8)

    def calls():
        with torch.profiler.profile() as profile:
            torch.neg(x), torch.mul(x, x), x.t()
        return [event.name for event in profile.events()]

    outside = calls()
    keep, _ = _contexts("selective")
    with keep:
        inside = calls()
    assert inside == outside and "aten::empty" not in inside


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("block", [Block, InPlaceRouter])
def test_key_and_mode_paths_give_the_same_bitwise_gradients(mode, block):
    torch.manual_seed(0)
    plain, x = nn.Sequential(block(), block()), torch.randn(6, 8)
    reference = _grads(plain, x)
    wrapped = copy.deepcopy(plain)
    prime_ac.checkpoint_blocks(wrapped, mode=mode)
    assert _grads(wrapped, x).keys() == reference.keys()
    for name, grad in _grads(copy.deepcopy(wrapped), x).items():
        assert torch.equal(grad, reference[name]), name
    with FlopCounterMode(display=False):  # the mode path
        moded = _grads(copy.deepcopy(wrapped), x)
    for name, grad in moded.items():
        assert torch.equal(grad, reference[name]), name


def test_in_place_write_on_a_kept_result_is_copied_first():
    model, x = InPlaceRouter(), torch.randn(6, 8)
    keep, replay = _contexts("full")
    with keep:
        model(x)
    assert keep.cache.copies == 1  # the topk values, before `/=`; not the fresh tensors after
    assert replay.cache is keep.cache


def test_a_mode_around_backward_sees_only_what_the_recompute_runs():
    """The shield hands kept results back above FlopCounterMode, which then counts no matmul."""
    model, x = Block(), torch.randn(4, 8)
    flops = {}
    for mode in ("none", "full", "selective"):
        if mode == "none":
            out = model(x)
        else:
            out = checkpoint(model, x, use_reentrant=False, context_fn=contexts.context_fn(mode))
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        flops[mode] = counter.get_total_flops()
    assert flops["selective"] == flops["none"]  # selective keeps both addmm: none is recounted
    assert flops["full"] >= flops["none"] + 2 * 4 * 8 * 16  # full recounts at least the first


def test_a_region_on_one_thread_leaves_other_threads_alone():
    keep, _ = _contexts("selective")
    included = []
    with keep:
        thread = threading.Thread(target=lambda: included.append(_compat.intercept_key_included()))
        thread.start()
        thread.join()
        assert _compat.intercept_key_included()
    assert included == [False]
    assert not _compat.intercept_key_included()


def test_an_operator_registered_after_the_policy_gets_its_kernel(monkeypatch):
    gc.collect()  # earlier tests' forwards that never ran backward hold off listing until freed
    monkeypatch.setattr(intercept, "RELIST_SECONDS", 0.0)
    lib = torch.library.Library("prime_ac_test_late", "DEF")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CompositeExplicitAutograd")
    rules = contexts.Rules(prime_ac.make_policy("selective", targets=["prime_ac_test_late"]))
    assert rules.intercepts()
    keep, _ = contexts.checkpoint_contexts(rules, "late")()
    with keep:
        torch.ops.prime_ac_test_late.double(torch.ones(2))
    assert keep.cache.stored == 1


def test_the_key_taken_by_another_library_means_dispatch_modes(monkeypatch):
    monkeypatch.setattr(intercept, "_native", [None])
    keep, replay = _contexts("selective")
    assert isinstance(keep, contexts.KeepMode) and isinstance(replay, contexts.ReplayMode)


def test_a_failed_build_warns_once_and_means_dispatch_modes(monkeypatch):
    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(intercept, "_native", [])
    monkeypatch.setattr(intercept, "_load_native", no_compiler)
    monkeypatch.setattr(_compat, "intercept_key_taken", lambda: False)
    with pytest.warns(RuntimeWarning, match="pip install ninja"):
        keep, _ = _contexts("selective")
    assert isinstance(keep, contexts.KeepMode)
    with warnings.catch_warnings():  # decided once per process: no second warning, same path
        warnings.simplefilter("error")
        keep, _ = _contexts("selective")
    assert isinstance(keep, contexts.KeepMode)


def test_prime_ac_intercept_0_means_dispatch_modes(monkeypatch):
    monkeypatch.setattr(intercept, "_native", [])
    monkeypatch.setenv("PRIME_AC_INTERCEPT", "0")
    keep, _ = _contexts("selective")
    assert isinstance(keep, contexts.KeepMode)


class CallsLateOp(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(dim, dim) / dim**0.5) for _ in range(3))

    def forward(self, x):
        h = torch.mm(x, self.w[0]).tanh()
        h = torch.ops.prime_ac_test_between.project(h, self.w[1]).tanh()  # an mm inside
        return torch.mm(h, self.w[2]).tanh()  # its backward reads the kept mm result


def test_operators_listed_between_forward_and_recompute_change_nothing(monkeypatch):
    """A target listed after a forward would get a gate: its recompute would run it as one call,
    see fewer mm calls than the forward kept (its inner mm) and hand the wrong kept results
    back. No listing while a recompute is pending."""
    gc.collect()  # earlier tests' forwards that never ran backward hold off listing until freed
    model, x = CallsLateOp(), torch.randn(8, 8)
    monkeypatch.setattr(intercept, "RELIST_SECONDS", 0.0)
    targets = ["aten::mm", "prime_ac_test_between::project"]
    contexts.context_fn("selective", targets)()  # everything registered so far is listed

    @torch.library.custom_op("prime_ac_test_between::project", mutates_args=())
    def project(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(h, w)

    project.register_autograd(
        lambda ctx, g: (g @ ctx.w.T, ctx.h.T @ g),
        setup_context=lambda ctx, inputs, output: (
            ctx.__setattr__("h", inputs[0]) or ctx.__setattr__("w", inputs[1])
        ),
    )
    expected = _grads(copy.deepcopy(model), x)

    monkeypatch.setattr(intercept, "RELIST_SECONDS", 1e9)
    context_fn = contexts.context_fn("selective", targets)
    out = checkpoint(model, x, use_reentrant=False, context_fn=context_fn)
    loss = out.square().sum()  # the inner mm is seen and kept: the op is not listed yet
    monkeypatch.setattr(intercept, "RELIST_SECONDS", 0.0)
    contexts.context_fn("selective", targets)()  # would list it now, between forward and recompute
    assert "prime_ac_test_between::project" not in intercept._names
    loss.backward()
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, expected[name]), name
    contexts.context_fn("selective", targets)()  # no recompute pending: listed now
    assert "prime_ac_test_between::project" in intercept._names
    assert torch.ops.prime_ac_test_between.project.default in intercept.gated()


def test_a_build_killed_midway_does_not_block_later_processes(tmp_path, monkeypatch):
    """cpp_extension waits for its build baton forever; one left by a killed build is removed."""
    from torch.utils import cpp_extension

    builds = []

    def build(**kwargs):  # stands in for the compiler: records what a real build would see
        builds.append((kwargs["build_directory"], (out / "lock").exists()))

    monkeypatch.setenv("PRIME_AC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", build)
    out = intercept.cache_dir()
    out.mkdir(parents=True)
    (out / "lock").touch()
    intercept._load_native()  # a fresh baton: another process is building, so wait for it
    stale = time.time() - intercept._STALE_BUILD_SECONDS - 60
    os.utime(out / "lock", (stale, stale))
    intercept._load_native()
    assert builds == [(str(out), True), (str(out), False)]


def test_eager_benchmark_reports_every_variant_and_the_blocks_operator_calls():
    """The benchmark's own code, in-process on the smallest model: its rows carry every variant,
    and its operator count is what a dispatch mode sees in the blocks' forward (no timing is
    asserted)."""
    path = Path(__file__).parents[1] / "benchmarks" / "eager_overhead.py"
    spec = importlib.util.spec_from_file_location("eager_overhead", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.measure("moe", 16, steps=1, warmup=0)
    assert row["steps"] == 16  # x16 below dim 256
    assert set(row["vs_plain"]) == set(bench.VARIANTS) and row["vs_plain"]["plain"] == 1.0
    assert set(row["us_per_op"]) == {"torch_sac", "full", "selective"}
    model = build_model("moe", dim=16, hidden_dim=16)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 17))
    assert row["ops"] == bench._block_forward_ops(model, tokens) > 0


@torch.library.custom_op("prime_ac_test_store::pieces", mutates_args=())
def _pieces(x: torch.Tensor) -> list[torch.Tensor]:
    return [x * 2, x.sin()]


_pieces.register_fake(lambda x: [torch.empty_like(x), torch.empty_like(x)])
_pieces.register_autograd(
    lambda ctx, grads: grads[0] * 2 + grads[1] * ctx.x.cos(),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
)


class Pieces(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        doubled, sine = _pieces(self.proj(x))
        return (doubled * sine).tanh()  # tanh's backward reads its output: the kept pieces count


def test_a_kept_operator_returning_a_list_is_kept_and_handed_back_natively():
    torch.manual_seed(0)
    model, x = Pieces(), torch.randn(4, 8, requires_grad=True)
    reference = _grads(copy.deepcopy(model), x)
    context_fn = contexts.context_fn("selective", ["prime_ac_test_store::pieces"])
    made = []

    def recording():
        made.append(context_fn())
        return made[-1]

    wrapped = copy.deepcopy(model)
    out = checkpoint(wrapped, x, use_reentrant=False, context_fn=recording)
    ((keep, replay),) = made
    assert isinstance(keep, contexts.KeepRegion) and keep.cache.entries == {}  # none in Python
    assert keep.cache.kept_ops() == {torch.ops.prime_ac_test_store.pieces.default}
    out.square().sum().backward()
    assert keep.cache.stored == keep.cache.hits == 1
    for name, param in wrapped.named_parameters():
        assert torch.equal(param.grad, reference[name]), name


def test_a_natively_kept_result_written_after_the_forward_raises_in_backward():
    model, x = Pieces(), torch.randn(4, 8)
    context_fn = contexts.context_fn("selective", ["prime_ac_test_store::pieces"])
    kept = []

    def forward(x):
        doubled, sine = _pieces(model.proj(x))
        kept.append(sine)
        return (doubled * sine).tanh()

    out = checkpoint(forward, x, use_reentrant=False, context_fn=context_fn)
    with torch.no_grad():
        kept[0].add_(1.0)  # after the region: no gate sees it, the version counter does
    with pytest.raises(prime_ac.KeptOutputMutatedError, match=r"prime_ac_test_store\.pieces"):
        out.sum().backward()
