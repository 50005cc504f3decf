"""prime_ac.audit and the memory-budget policy (targets="auto")."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
from pathlib import Path

import pytest
import torch
from ac_models import CountingModel, assert_bitwise_equal, grads
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import prime_ac
from prime_ac.__main__ import main as cli
from prime_ac.budget import choose_calls
from prime_ac.demo import compare_modes
from prime_ac.models import build_model


def _counting(settings_):
    torch.manual_seed(0)
    model = CountingModel()
    prime_ac.checkpoint_blocks(model, **settings_)
    x = torch.randn(5, 8)
    return model, (lambda m: m(x))


def _row(report, op, block="layers.0"):
    return next(r for r in report.ops if r.op == op and r.block == block)


def test_audit_selective_reports_kept_op_bytes_and_unmatched_targets():
    model, loss = _counting({"mode": "selective", "targets": ["prime_ac_test", "aten::bmm"]})
    report = prime_ac.audit(model, loss)
    assert report.blocks == [f"layers.{i}" for i in range(4)]
    row = _row(report, "prime_ac_test::scaled_tanh.default")
    assert (row.decision, row.calls, row.kept_bytes, row.replays) == ("kept", 1, 5 * 8 * 4, 0)
    mm = _row(report, "aten::addmm.default")
    assert mm.decision == "replayed" and mm.replays == 1 and mm.replayed_flops == 2 * 5 * 8 * 8
    assert report.unmatched_targets == ["aten::bmm"]
    assert report.block_kept_bytes() == {f"layers.{i}": 160 for i in range(4)}
    assert 0 < report.held_bytes < report.held_bytes_no_ac


def test_audit_full_mode_replays_the_op_in_every_block():
    model, loss = _counting({"mode": "full"})
    report = prime_ac.audit(model, loss)
    rows = [r for r in report.ops if r.op == "prime_ac_test::scaled_tanh.default"]
    assert [(r.decision, r.replays, r.kept_bytes) for r in rows] == [("replayed", 1, 0)] * 4
    assert report.unmatched_targets == []  # full mode has no targets


@pytest.mark.slow
def test_audit_replayed_flops_agree_with_the_backward_flop_difference():
    rows = {
        r.mode: r
        for r in compare_modes(
            "moe", modes=("none", "full"), batch=2, seq_len=16, n_layers=2, repeats=1
        )
    }
    model = build_model("moe", n_layers=2)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    prime_ac.checkpoint_blocks(model, mode="full")
    report = prime_ac.audit(model, lambda m: m.loss(tokens))
    assert report.replayed_flops == rows["full"].recomputed_flops
    assert report.held_bytes / report.held_bytes_no_ac == pytest.approx(rows["full"].held_ratio)
    mandatory = {r.op for r in report.ops if r.decision == "mandatory"}
    assert mandatory == {"aten::topk.default"}


def test_audit_leaves_gradients_and_serialises():
    model, loss = _counting({"mode": "selective"})
    loss(model).backward()
    before = grads(model)
    report = prime_ac.audit(model, loss)
    assert_bitwise_equal(grads(model), before)
    data = json.loads(report.to_json())
    assert data["mode"] == "selective" and data["ops"][0].keys() >= {"block", "op", "decision"}
    text = str(report)
    assert "prime_ac audit: mode=selective, 4 checkpointed blocks" in text
    assert "targets that matched nothing:" in text


def test_audit_needs_wrapped_blocks():
    with pytest.raises(ValueError, match="call prime_ac.checkpoint_blocks"):
        prime_ac.audit(CountingModel(), lambda m: m(torch.randn(2, 8)))


@pytest.mark.slow
def test_audit_cli_prints_json_only(capsys):
    # In-process; tests/test_demo.py checks the command line's errors.
    assert cli(["audit", "--model", "dense", "--mode", "full", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "full" and len(report["blocks"]) == 4


# --- the budget policy ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 100)), max_size=8),
    capacity=st.integers(0, 150),
)
def test_choose_calls_is_an_exact_knapsack(items, capacity):
    chosen = choose_calls(items, capacity)
    assert sum(items[i][0] for i in chosen) <= capacity
    best = max(
        sum(items[i][1] for i in subset)
        for r in range(len(items) + 1)
        for subset in itertools.combinations(range(len(items)), r)
        if sum(items[i][0] for i in subset) <= capacity
    )
    assert sum(items[i][1] for i in chosen) == best


@pytest.fixture(scope="module")
def dense_step():
    model = build_model("dense", n_layers=2)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    return model, (lambda m: m.loss(tokens))


@pytest.mark.slow
def test_budget_is_respected_and_more_budget_never_replays_more(dense_step):
    base, loss = dense_step
    reference = copy.deepcopy(base)
    loss(reference).backward()
    replayed = []
    for budget in [0.0, 0.1, 0.4, 1.0]:
        model = copy.deepcopy(base)
        prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=budget, profile=loss
        )
        report = prime_ac.audit(model, loss)
        assert report.mode == "auto"
        for block in model.layers:
            plan = block._prime_ac.plan
            assert report.block_kept_bytes()[plan.block] == plan.kept_bytes <= plan.budget_bytes
        replayed.append(report.replayed_flops)
        model.zero_grad()
        loss(model).backward()
        assert_bitwise_equal(grads(model), grads(reference))
    assert replayed == sorted(replayed, reverse=True)
    assert replayed[0] > replayed[-1] == 0  # everything worth keeping fits in the whole budget


def test_budget_in_bytes_is_the_steps_peak(dense_step):
    base, loss = dense_step
    peaks = {}
    for budget in (200_000, "200000B"):  # an int is bytes as a string with a unit is
        model = copy.deepcopy(base)
        prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=budget, profile=loss
        )
        plans = [block._prime_ac.plan for block in model.layers]
        peak = plans[0].peak
        assert peak is not None and all(p.peak is peak for p in plans)  # one plan for the step
        peaks[budget] = (peak.budget, peak.decisions, peak.measured)
    assert peaks[200_000][1] == peaks["200000B"][1]
    assert peaks[200_000][0] <= 200_000


def test_budget_in_bytes_per_block(dense_step):
    base, loss = dense_step
    model = copy.deepcopy(base)
    budget = {"layers.0": 20_000, "layers.1": 20_000}
    prime_ac.checkpoint_blocks(model, mode="selective", targets="auto", budget=budget, profile=loss)
    plans = [block._prime_ac.plan for block in model.layers]
    assert all(p.budget_bytes == 20_000 and 0 < p.kept_bytes <= 20_000 for p in plans)
    assert all(p.peak is None for p in plans)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "selective", "targets": "auto", "budget": 0.5}, "needs profile="),
        ({"mode": "full", "targets": "auto", "budget": 0.5, "profile": len}, 'mode="selective"'),
        ({"mode": "selective", "targets": "auto", "profile": len}, "needs budget="),
        ({"mode": "selective", "budget": 0.5}, 'applies only with targets="auto"'),
        ({"mode": "selective", "targets": "auto", "budget": 1.5, "profile": len}, r"\[0, 1\]"),
        ({"mode": "selective", "targets": "auto", "budget": -3, "profile": len}, "budget=-3"),
    ],
)
def test_budget_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        prime_ac.checkpoint_blocks(CountingModel(), **kwargs)


def test_config_accepts_auto_with_a_budget():
    cfg = prime_ac.ACConfig.from_dict({"mode": "selective", "targets": "auto", "budget": 0.25})
    assert (cfg.targets, cfg.budget) == ("auto", 0.25)


def test_budget_per_block_mapping(dense_step):
    base, loss = dense_step
    model = copy.deepcopy(base)
    budget = {"layers.0": 0, "layers.1": 40_000}
    prime_ac.checkpoint_blocks(model, mode="selective", targets="auto", budget=budget, profile=loss)
    first, second = (block._prime_ac.plan for block in model.layers)
    assert (first.budget_bytes, first.kept_bytes, first.kept) == (0, 0, ())
    assert second.budget_bytes == 40_000 and 0 < second.kept_bytes <= 40_000
    with pytest.raises(ValueError, match=r"no entry for checkpointed block\(s\) \['layers.1'\]"):
        prime_ac.checkpoint_blocks(
            copy.deepcopy(base),
            mode="selective",
            targets="auto",
            budget={"layers.0": 10},
            profile=loss,
        )
    with pytest.raises(ValueError, match=r"budget\['layers.0'\]=0.5"):
        prime_ac.ACConfig("selective", targets="auto", budget={"layers.0": 0.5})


def _tradeoff_benchmark():
    path = Path(__file__).parents[1] / "benchmarks" / "ac_tradeoff.py"
    spec = importlib.util.spec_from_file_location("ac_tradeoff", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tradeoff_benchmark_budget_policy_dominates_the_torchtitan_rule(kind):
    # The benchmark's own code, in-process, untimed, on one block and 16 tokens: the smallest
    # model where the budget policy still strictly dominates torchtitan's rule.
    bench = _tradeoff_benchmark()
    rows = bench.measure(kind, {"n_layers": 1}, (0.5, 1.0), seq_len=16, batch=1)
    by_policy = {r["policy"]: r for r in rows}
    pareto = bench.pareto_check(rows)
    assert pareto["dominated"] and pareto["strictly"], pareto
    none, full, anchor = by_policy["none"], by_policy["full"], by_policy["torchtitan"]
    assert full["kept_bytes"] < anchor["kept_bytes"] < none["kept_bytes"]
    assert 0 < anchor["replayed_flops"] < full["replayed_flops"]
    # the whole model's no-AC memory: not checkpointing fits, and replays nothing
    assert by_policy["budget 1"]["replayed_flops"] == 0
    assert by_policy["budget 1"]["kept_bytes"] <= none["kept_bytes"]


@pytest.mark.slow
def test_auto_plans_compile_and_audit_with_their_plan(dense_step):
    """Blocks compiled with fullgraph after planning run their plan (issue 44); the audit of the
    compiled model reads each block's eager forward and finds its graph tagged alike."""
    base, loss = dense_step
    model = copy.deepcopy(base)
    prime_ac.checkpoint_blocks(model, mode="selective", targets="auto", budget=0.3, profile=loss)
    eager = prime_ac.audit(model, loss)
    torch._dynamo.reset()
    for block in model.layers:
        block.compile(fullgraph=True, backend="aot_eager")
    loss(model).backward()
    report = prime_ac.audit(model, loss)
    assert set(report.compiled_blocks.values()) == {
        "compiled graph tagged as its eager forward, call for call"
    }
    assert report.held_bytes == eager.held_bytes
    torch._dynamo.reset()


def test_audit_of_a_budget_plan_splits_an_operator_by_decision(dense_step):
    base, loss = dense_step
    model = copy.deepcopy(base)
    prime_ac.checkpoint_blocks(model, mode="selective", targets="auto", budget=0.5, profile=loss)
    report = prime_ac.audit(model, loss)
    mm = [r for r in report.ops if r.op == "aten::mm.default" and r.block == "layers.0"]
    assert {r.decision for r in mm} == {"kept", "replayed"}
    kept = next(r for r in mm if r.decision == "kept")
    assert kept.replays == 0 and kept.kept_bytes > 0
    assert "block " in str(report) and "layers.1" in str(report)


@pytest.mark.parametrize(
    "loss_fn, message",
    [
        (None, r"loss_fn=None is not callable"),
        (lambda m: m.loss_terms(), r"one-element tensor.*shape \(2,\)"),
        (lambda m: m.loss_terms().sum().detach(), r"requires_grad=False"),
    ],
)
def test_audit_names_a_bad_loss_fn(loss_fn, message):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(2))

        def loss_terms(self):
            x = torch.ones(2, 4)
            for layer in self.layers:
                x = layer(x)
            return x.sum(dim=1)

    model = Model()
    prime_ac.checkpoint_blocks(model, mode="full")
    with pytest.raises(TypeError, match=message):
        prime_ac.audit(model, loss_fn)


class _Recomputing(torch.autograd.Function):
    """Runs the layers without gradients and recomputes their bodies itself in backward, from
    the saved input (the structure of Reformer's reversible layers)."""

    @staticmethod
    def forward(ctx, x, layers):
        ctx.save_for_backward(x)
        ctx.layers = layers
        for layer in layers:
            x = layer(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            y = x
            for layer in ctx.layers:
                y = layer.body(y)
            y.backward(grad)
        return x.grad, None


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    def forward(self, x):
        return self.body(x)


class _SelfRecomputing(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))

    def forward(self, x):
        return _Recomputing.apply(x, self.layers)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_blocks_whose_checkpointing_saves_nothing_are_reported(mode):
    torch.manual_seed(0)
    plain, x = _SelfRecomputing(), torch.randn(4, 16, requires_grad=True)
    plain(x).square().sum().backward()
    model = copy.deepcopy(plain)
    model.zero_grad(set_to_none=True)
    prime_ac.checkpoint_blocks(model, mode=mode)
    report = prime_ac.audit(model, lambda m: m(x).square().sum())
    assert report.blocks_saving_nothing == ["layers.0", "layers.1"]
    assert report.held_bytes == report.held_bytes_no_ac
    assert "blocks whose checkpointing saves nothing (they run" in str(report)
    model(x).square().sum().backward()
    assert_bitwise_equal(grads(model), grads(plain))

    blocks = build_model("dense", n_layers=2)  # blocks that checkpoint: nothing reported
    prime_ac.checkpoint_blocks(blocks, mode=mode)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    assert prime_ac.audit(blocks, lambda m: m.loss(tokens)).blocks_saving_nothing == []


def test_audit_counts_the_bytes_an_out_gemm_wrote_in_its_row():
    # an out= GEMM returns nothing and is kept with what it wrote (Action.KEEP_WRITTEN): its row
    # reports those bytes, and the rows add up to the blocks' kept bytes
    lib = torch.library.Library("prime_ac_test_audit_out", "DEF")
    lib.define("gemm_out(Tensor a, Tensor b, Tensor(a!) out) -> ()")

    def gemm_out(a, b, out):
        torch.mm(a, b, out=out)

    lib.impl("gemm_out", gemm_out, "CompositeExplicitAutograd")

    class OutGemm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            out = a.new_empty(a.shape[0], b.shape[1])
            torch.ops.prime_ac_test_audit_out.gemm_out(a, b, out)
            return out

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad @ b.T, a.T @ grad

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return OutGemm.apply(x, self.w).tanh()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    try:
        model = Model()
        prime_ac.checkpoint_blocks(
            model, mode="selective", targets=["prime_ac_test_audit_out::gemm_out"], blocks="layers"
        )
        x = torch.randn(4, 8)
        report = prime_ac.audit(model, lambda m: m(x).square().sum())
        rows = [r for r in report.ops if r.op == "prime_ac_test_audit_out::gemm_out.default"]
        assert [r.decision for r in rows] == ["kept", "kept"]
        assert [r.kept_bytes for r in rows] == [4 * 8 * 4, 4 * 8 * 4]
        per_block = {
            b: sum(r.kept_bytes for r in report.ops if r.block == b) for b in report.blocks
        }
        assert per_block == report.block_held_bytes
    finally:
        lib._destroy()
