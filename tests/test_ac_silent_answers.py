"""No silent answer and no unclear error on prime_ac's surface (issue 45): each case here
answered wrongly without a word, or raised an error that did not say what to fix."""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import math
import pickle
import warnings

import pytest
import torch
from ac_models import assert_bitwise_equal, grads
from torch import nn

import prime_ac
from prime_ac import planner
from prime_ac.__main__ import main
from prime_ac.budget import budget_context_fn
from prime_ac.offload import Offloader, SavedInputOffload
from prime_ac.planner import BlockProfile, Call, parse_bytes
from prime_ac.wrapping import checkpoint_state, wrap_block

DIM = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        h = nn.functional.dropout(self.up(x).tanh(), 0.25, self.training)
        return x + self.down(h).sigmoid()


class Model(nn.Module):
    def __init__(self, blocks: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(5)  # the same dropout masks in every run
    return model(x)


def _model_and_batch() -> tuple[Model, torch.Tensor]:
    torch.manual_seed(0)
    return Model(), torch.randn(4, 8, DIM)


def _auto(model: nn.Module, x: torch.Tensor, budget) -> None:
    prime_ac.checkpoint_blocks(
        model, mode="selective", targets="auto", budget=budget, profile=lambda m: _step(m, x)
    )


# --- budget strings: one meaning everywhere -------------------------------------------------


@pytest.mark.parametrize("text", ["0.3", "0.5", "4096", " 7 "])
def test_a_budget_string_without_a_unit_is_refused_naming_both_forms(text):
    model, x = _model_and_batch()
    for refuse in (
        parse_bytes,
        lambda text: prime_ac.ACConfig("selective", targets="auto", budget=text),
        lambda text: _auto(model, x, text),
    ):
        with pytest.raises(ValueError, match=r"budget=.* no unit") as raised:
            refuse(text)
        assert "float fraction" in str(raised.value) and "with a unit" in str(raised.value)
    assert checkpoint_state(model.layers[0]) is None  # refused before anything changed


def test_the_command_line_reads_a_bare_number_one_way(capsys):
    # audit: a fraction (a peak needs a unit); plan takes a peak only: a bare number is refused
    with pytest.raises(SystemExit):
        main(["plan", "--budget", "0.3"])
    assert "--budget='0.3'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--budget", "4096"])
    assert "'4096B'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["audit", "--targets", "auto", "--budget", "4096"])
    assert "nor a peak with a unit" in capsys.readouterr().err


def test_unit_names_are_case_insensitive():
    assert parse_bytes("64KIB") == parse_bytes("64kib") == parse_bytes("64KiB") == 64 * 2**10
    assert parse_bytes("2gb") == parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("512b") == 512
    for bad in ("64 kibs", "KiB", "-1KiB", "nanGiB", "infB", True, -3, 1.5):
        with pytest.raises(ValueError, match="host_cap="):
            parse_bytes(bad, "host_cap")


# --- planning keeps what the model holds ----------------------------------------------------


@pytest.mark.parametrize("budget", ["40KiB", 0.5])
def test_planning_keeps_accumulated_gradients_bitwise(budget):
    model, x = _model_and_batch()
    _step(model, x).backward()  # a micro-batch already accumulated
    before = grads(model)
    grad_objects = [p.grad for p in model.parameters()]
    _auto(model, x, budget)
    assert all(p.grad is g for p, g in zip(model.parameters(), grad_objects, strict=True))
    assert_bitwise_equal(grads(model), before)


# --- host copies of blocks whose backward never runs ---------------------------------------


def _named_offload_model():
    model, x = _model_and_batch()
    prime_ac.checkpoint_blocks(model, mode="full", offload=["aten::addmm"], skip_worse=False)
    return model, x, checkpoint_state(model.layers[0]).policy.offloader


def test_a_dropped_forward_releases_its_host_copies():
    model, x, offloader = _named_offload_model()
    for _ in range(3):
        _step(model, x)  # the loss is dropped: no backward ever runs
        assert offloader.ledger.host == 0
    assert offloader.ledger.offloaded > 0  # the forwards did offload


def test_a_forward_that_raises_releases_its_host_copies():
    model, x, offloader = _named_offload_model()

    def fail(module, args, out):
        raise RuntimeError("boom")

    hook = model.layers[2].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        _step(model, x)
    gc.collect()  # the traceback's frames hold the blocks' graphs until collected
    hook.remove()
    assert offloader.ledger.offloaded > 0 and offloader.ledger.host == 0


def test_a_plan_whose_block_is_frozen_keeps_offloading_with_a_bounded_buffer():
    model, x = _model_and_batch()
    prime_ac.checkpoint_blocks(model, mode="full")
    report = prime_ac.audit(model, lambda m: _step(m, x))
    per_step = 0
    offloader = Offloader(0)
    for name in report.blocks:
        calls = [c for c in report.calls[name] if "addmm" in str(c.op)]
        per_step += sum(c.bytes for c in calls)
        state = checkpoint_state(model.get_submodule(name))
        fn = budget_context_fn(
            state.policy, frozenset(), name, frozenset((c.op, c.index) for c in calls), offloader
        )
        wrap_block(model.get_submodule(name), dataclasses.replace(state, context_fn=fn))
    offloader.capacity = per_step  # room for one step's results, no more
    expected = grads(_trained(copy.deepcopy(model), x))
    for p in model.parameters():
        p.requires_grad_(False)  # frozen after planning: no block runs a backward
    for _ in range(3):
        _step(model, x)
        assert offloader.ledger.host == 0
    for p in model.parameters():
        p.requires_grad_(True)
    offloaded = offloader.ledger.offloaded
    _trained(model, x)
    assert offloader.ledger.overflowed == 0  # the frozen steps left the buffer empty
    assert offloader.ledger.offloaded > offloaded and offloader.ledger.host == 0
    assert_bitwise_equal(grads(model), expected)


def _trained(model: nn.Module, x: torch.Tensor) -> nn.Module:
    model.zero_grad(set_to_none=True)
    _step(model, x).backward()
    return model


# --- copies and pickles ---------------------------------------------------------------------


def test_a_deep_copy_offloads_through_its_own_offloader():
    model, x, offloader = _named_offload_model()
    copied = copy.deepcopy(model)
    (own,) = {id(checkpoint_state(layer).policy.offloader) for layer in copied.layers}
    assert own != id(offloader)
    _trained(copied, x)
    assert offloader.ledger.offloaded == 0  # the original's offloader saw nothing
    assert checkpoint_state(copied.layers[0]).policy.offloader.ledger.offloaded > 0


def _round_trips():
    def torch_round_trip(model):
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    return [lambda m: pickle.loads(pickle.dumps(m)), torch_round_trip, copy.deepcopy]


@pytest.mark.parametrize("how", ["offload", "fraction", "peak"])
def test_planned_and_offloading_models_pickle_and_train_alike(how):
    model, x = _model_and_batch()
    if how == "offload":
        prime_ac.checkpoint_blocks(model, mode="full", offload=["aten::addmm"], skip_worse=False)
    else:
        _auto(model, x, 0.5 if how == "fraction" else "60KiB")
    expected = grads(_trained(model, x))
    for round_trip in _round_trips():
        copied = round_trip(model)
        plans = [checkpoint_state(layer).plan for layer in copied.layers]
        originals = [checkpoint_state(layer).plan for layer in model.layers]
        assert [p and p.kept for p in plans] == [p and p.kept for p in originals]
        assert_bitwise_equal(grads(_trained(copied, x)), expected)
        if how == "offload":
            policy = checkpoint_state(copied.layers[0]).policy
            assert policy.offloader.ledger.offloaded > 0
            assert policy.offloader is not checkpoint_state(model.layers[0]).policy.offloader


# --- a plan profiled in one mode and trained in the other ------------------------------------


@pytest.mark.parametrize("budget", [0.5, "60KiB"])
def test_a_plan_profiled_in_eval_warns_when_trained_in_train_mode(budget):
    model, x = _model_and_batch()
    model.eval()
    _auto(model, x, budget)
    model.train()
    with pytest.warns(UserWarning, match=r"eval\(\).*train\(\).*model\.train\(\)"):
        _trained(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            _step(model, x)  # a pass without gradients holds nothing for backward
        model.eval()
        _step(model, x)  # the mode it was planned in: nothing to say


# --- the audit shows offloaded calls as offloaded -------------------------------------------


def test_the_audit_lists_offloaded_calls_with_their_host_bytes():
    model, x, offloader = _named_offload_model()
    report = prime_ac.audit(model, lambda m: _step(m, x))
    addmm = [r for r in report.ops if r.op == "aten::addmm.default"]
    assert addmm and {r.decision for r in addmm} == {"offloaded"}
    assert all(r.kept_bytes == 0 for r in addmm)
    calls = [c for c in report.calls["layers.0"] if "addmm" in str(c.op)]
    assert {c.decision for c in calls} == {"offloaded"}
    assert sum(r.offloaded_bytes for r in addmm) == sum(c.bytes for c in calls) * 3 > 0
    assert "offloaded" in str(report) and "held on the host" in str(report)


# --- every public value validated, naming the argument --------------------------------------


@pytest.mark.parametrize("value", ["0", "nan", "inf", "-5", "-inf"])
def test_plan_refuses_a_bandwidth_that_is_not_a_positive_rate(value, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--budget", "6MiB", "--bandwidth", value])
    assert "--bandwidth" in capsys.readouterr().err


def _profile(**call) -> list[BlockProfile]:
    fields = {"op": "aten::mm", "index": 0, "bytes": 2**10, "seconds": 1e-4, **call}
    return [BlockProfile("layers.0", (Call(**fields),))]


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"budget": -1}, "budget"),
        ({"budget": 1.5}, "budget"),
        ({"budget": "1MiB"}, "budget"),
        ({"budget": 2**20, "bandwidth": 0}, "bandwidth"),
        ({"budget": 2**20, "bandwidth": math.nan}, "bandwidth"),
        ({"budget": 2**20, "bandwidth": -1.0}, "bandwidth"),
        ({"budget": 2**20, "bandwidth": "fast"}, "bandwidth"),
        ({"budget": 2**20, "host_cap": -1}, "host_cap"),
        ({"budget": 2**20, "host_cap": math.inf}, "host_cap"),
        ({"budget": 2**20, "bandwidth_error": math.nan}, "bandwidth_error"),
    ],
)
def test_planner_plan_names_each_bad_argument(kwargs, argument):
    with pytest.raises((TypeError, ValueError), match=rf"\b{argument}="):
        planner.plan(_profile(), **kwargs)


def test_planner_plan_takes_block_profiles_only():
    with pytest.raises(TypeError, match=r"blocks="):
        planner.plan([("layers.0", ())], 2**20)


@pytest.mark.parametrize(
    "call, argument",
    [
        ({"bytes": -1}, "bytes"),
        ({"bytes": 1.5}, "bytes"),
        ({"bytes": True}, "bytes"),
        ({"seconds": -1.0}, "seconds"),
        ({"seconds": math.nan}, "seconds"),
        ({"seconds": math.inf}, "seconds"),
        ({"seconds": "1ms"}, "seconds"),
        ({"index": -1}, "index"),
        ({"op": 3}, "op"),
        ({"kind": "kept"}, "kind"),
    ],
)
def test_planner_call_names_each_bad_value(call, argument):
    with pytest.raises((TypeError, ValueError), match=rf"\b{argument}="):
        _profile(**call)


@pytest.mark.parametrize(
    "profile, argument",
    [
        ({"name": 0}, "name"),
        ({"calls": [("aten::mm", 0)]}, "calls"),
        ({"input_bytes": -1}, "input_bytes"),
        ({"input_bytes": math.nan}, "input_bytes"),
        ({"saved_bytes": -2}, "saved_bytes"),
    ],
)
def test_planner_block_profile_names_each_bad_value(profile, argument):
    fields = {"name": "layers.0", "calls": (), **profile}
    with pytest.raises((TypeError, ValueError), match=rf"\b{argument}="):
        BlockProfile(**fields)


def test_a_zero_bandwidth_is_refused_not_divided_by():
    with pytest.raises(ValueError, match=r"bandwidth=0"):
        planner.plan(_profile(), 0, bandwidth=0)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"max_inflight": 0}, "max_inflight"),
        ({"min_bytes": -1}, "min_bytes"),
        ({"min_bytes": math.nan}, "min_bytes"),
        ({"min_bytes": "1KiB"}, "min_bytes"),
        ({"pin_memory": "yes"}, "pin_memory"),
    ],
)
def test_saved_input_offload_names_each_bad_value(kwargs, argument):
    with pytest.raises((TypeError, ValueError), match=rf"\b{argument}="):
        SavedInputOffload(**kwargs)


def test_saved_input_offload_exited_without_entering_says_so():
    with pytest.raises(RuntimeError, match=r"without being entered.*with offload"):
        SavedInputOffload().__exit__(None, None, None)


@pytest.mark.parametrize("value", [True, 5, "yes", ["pin_memory"]])
def test_an_ac_offloading_value_that_is_not_a_table_says_so(value):
    with pytest.raises(ValueError, match=r"ac_offloading=.*table"):
        prime_ac.ACConfig.from_dict({"mode": "full", "ac_offloading": value})
    with pytest.raises(ValueError, match=r"ac_offloading=.*table"):
        prime_ac.ACConfig(ac_offloading=value)


def test_an_ac_offloading_mapping_is_read_as_the_table():
    config = prime_ac.ACConfig(ac_offloading={"pin_memory": False})
    assert config.input_offload().pin_memory is False
    assert config == prime_ac.ACConfig.from_dict({"ac_offloading": {"pin_memory": False}})


# --- context_fn and make_policy refuse what checkpoint_blocks refuses ------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: prime_ac.context_fn("selective", ["aten::sinn"]),
        lambda: prime_ac.make_policy("selective", ["aten::sinn"]),
        lambda: prime_ac.make_policy("full", mandatory=["aten::sinn"]),
        lambda: prime_ac.checkpoint_blocks(Model(), mode="selective", targets=["aten::sinn"]),
    ],
)
def test_a_typo_in_a_torch_namespace_is_refused_everywhere(build):
    with pytest.raises(ValueError, match=r"'aten::sinn'.*did you mean aten::sin\b"):
        build()
