"""Decision tables of the operator policy, the target grammar and ACConfig."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

import prime_ac
from prime_ac import ACConfig, Target, make_policy
from prime_ac.actions import Action

SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
aten = torch.ops.aten
X = torch.zeros(2, 2)


def decide(policy, op, *args, **kwargs):
    return policy(None, op, *args, **kwargs)


@pytest.mark.parametrize(
    "op, expected",
    [
        (aten.mm.default, SAVE),
        (aten.addmm.default, SAVE),
        (aten.bmm.default, SAVE),
        (aten.convolution.default, SAVE),
        (aten._scaled_dot_product_flash_attention_for_cpu.default, SAVE),
        (aten._scaled_dot_product_efficient_attention.default, SAVE),
        (aten._grouped_mm.default, SAVE),
        (aten.topk.default, SAVE),  # mandatory
        (aten.mm.out, RECOMPUTE),  # mutating overload of a target: never cached
        (aten.add.Tensor, RECOMPUTE),
        (aten.silu.default, RECOMPUTE),
        (aten._fused_rms_norm.default, RECOMPUTE),
        (aten.view.default, RECOMPUTE),
        (aten.mul.Tensor, RECOMPUTE),
        (torch.ops.higher_order.flex_attention, SAVE),
    ],
)
def test_default_selective_decisions(op, expected):
    assert decide(make_policy("selective"), op) is expected


@pytest.mark.parametrize(
    "op, expected",
    [
        (aten.mm.default, RECOMPUTE),
        (aten._scaled_dot_product_flash_attention_for_cpu.default, RECOMPUTE),
        (aten.topk.default, SAVE),
        (torch.ops.higher_order.flex_attention, RECOMPUTE),
    ],
)
def test_full_mode_keeps_only_mandatory(op, expected):
    assert decide(make_policy("full", targets=["aten"]), op) is expected


@pytest.mark.parametrize(
    "targets, op, expected",
    [
        (["aten::mm"], aten.mm.default, SAVE),
        (["aten::mm"], aten.mm.dtype, SAVE),  # every overload
        (["aten::mm"], aten.addmm.default, RECOMPUTE),  # replaced the defaults
        (["aten::mm.default"], aten.mm.default, SAVE),
        (["aten::mm.default"], aten.mm.dtype, RECOMPUTE),  # that overload only
        (["aten"], aten.mul.Tensor, SAVE),  # namespace
        (["aten"], aten.add_.Tensor, RECOMPUTE),  # mutating: never cached by a target
        (["aten::add_"], aten.add_.Tensor, RECOMPUTE),
        ([], aten.mm.default, RECOMPUTE),
        ([], aten.topk.default, SAVE),  # the mandatory set survives an empty list
        (["aten::mm"], aten.topk.default, SAVE),
    ],
)
def test_custom_targets(targets, op, expected):
    assert decide(make_policy("selective", targets), op) is expected


def test_mandatory_namespaces_and_telemetry_in_every_mode():
    lib = torch.library.Library("deepep", "FRAGMENT")
    lib.define("stand_in_dispatch(Tensor x) -> Tensor")
    op = torch.ops.deepep.stand_in_dispatch.default
    for mode, targets in [("full", None), ("selective", None), ("selective", [])]:
        assert decide(make_policy(mode, targets), op) is SAVE
    assert make_policy("full").classify(op) is Action.MANDATORY


def test_device_to_host_copies_are_kept_and_host_copies_replayed():
    policy = make_policy("full")
    with FakeTensorMode():
        cuda = torch.empty(4, device="cuda")
        cpu = torch.empty(4)
    to_copy = aten._to_copy.default
    assert decide(policy, to_copy, cuda, device=torch.device("cpu")) is SAVE
    assert decide(policy, to_copy, cuda, device="cpu") is SAVE
    assert decide(policy, to_copy, cuda, dtype=torch.float16) is RECOMPUTE  # stays on device
    assert decide(policy, to_copy, cpu, device=torch.device("cpu")) is RECOMPUTE
    assert decide(policy, aten._local_scalar_dense.default, cuda) is SAVE
    assert decide(policy, aten._local_scalar_dense.default, cpu) is RECOMPUTE


def test_user_mandatory_adds_to_the_set():
    policy = make_policy("full", mandatory=["aten::mm.default"])
    assert decide(policy, aten.mm.default) is SAVE
    assert decide(policy, aten.bmm.default) is RECOMPUTE


def test_decisions_are_cached_per_overload():
    policy = make_policy("selective")
    decide(policy, aten.mm.default)
    decide(policy, aten.mm.default)
    assert list(policy._decisions) == [aten.mm.default]


def test_decision_is_a_lookup_once_per_overload_and_block(monkeypatch):
    # Deterministic stand-in for timing: after the first call of an overload, neither the
    # policy nor a block's contexts classify it again (the benchmark reports the time).
    from torch.utils.checkpoint import checkpoint

    policy = make_policy("selective")
    classified = []
    classify = policy.classify
    monkeypatch.setattr(policy, "classify", lambda op: classified.append(op) or classify(op))
    contexts = prime_ac.context_fn(policy=policy)
    lin = torch.nn.Linear(4, 4)
    for _ in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        checkpoint(lambda t: lin(t).relu().sum(), x, use_reentrant=False, context_fn=contexts)
        x.grad = None
    assert len(classified) == len(set(classified)) > 0
    decided = dict(policy._decisions)
    decide(policy, aten.mm.default)
    decide(policy, aten.mm.default)
    assert list(policy._decisions).count(aten.mm.default) == 1
    assert {k: v for k, v in policy._decisions.items() if k in decided} == decided


def test_bad_mode_and_targets_name_the_fix():
    with pytest.raises(ValueError, match=r"mode='fast'.*\['full', 'full_moe', .*'selective'\]"):
        make_policy("fast")
    with pytest.raises(ValueError, match=r"'aten:mm'.*'ns::op'"):
        make_policy("selective", ["aten:mm"])
    with pytest.raises(ValueError, match=r"write \['aten::mm'\]"):
        make_policy("selective", "aten::mm")


def test_unregistered_and_invisible_targets_are_logged_once_per_configuration(
    caplog, model_factory
):
    # names of a namespace no module registered are logged at debug level (an optional backend)
    caplog.set_level(logging.DEBUG, logger="prime_ac")
    targets = ["no_such_namespace_xyz", "no_such_namespace_xyz::op", "aten::layer_norm"]
    prime_ac.checkpoint_blocks(model_factory(), mode="selective", targets=targets)
    text = caplog.text
    assert "'no_such_namespace_xyz' names a namespace with no registered operator" in text
    assert "'no_such_namespace_xyz::op' names no registered operator" in text
    assert "'aten::layer_norm' is CompositeImplicitAutograd" in text
    caplog.clear()  # the same configuration again (a second model, a second call): said once
    prime_ac.checkpoint_blocks(model_factory(), mode="selective", targets=targets)
    assert "prime_ac target" not in caplog.text
    prime_ac.checkpoint_blocks(model_factory(), mode="selective", targets=targets[:1])
    assert "'no_such_namespace_xyz' names a namespace" in caplog.text  # another configuration
    with pytest.raises(ValueError, match="aten::layer_norm"):
        prime_ac.checkpoint_blocks(model_factory(), mode="selective", targets=targets, strict=True)
    # Registered, visible targets pass strict mode.
    prime_ac.checkpoint_blocks(
        model_factory(), mode="selective", targets=["aten::mm", "aten"], strict=True
    )


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("aten::mmm", r"'aten::mmm' names no registered operator \(did you mean aten::mm"),
        ("aten::mm.nope", r"'aten::mm.nope' names no registered overload \(known: default"),
        ("_c10d_functional::all_gather", r"'_c10d_functional::all_gather' names no registered"),
    ],
)
def test_a_name_in_torchs_own_namespaces_that_names_nothing_raises(target, message, model_factory):
    # aten is loaded with torch, so a name there that matches nothing is a typo: it can never
    # match, and training on would keep nothing while the log scrolls by (the README: "anything
    # else raises")
    model = model_factory()
    with pytest.raises(ValueError, match=message):
        prime_ac.checkpoint_blocks(model, mode="selective", targets=[target])
    assert prime_ac.wrapping.wrapped_blocks(model) == []  # refused before touching the model


def test_torchs_operators_of_other_releases_are_never_refused_as_typos(model_factory):
    # prime-rl's list names aten::_scaled_mm_v2 (torch 2.13's F.scaled_mm), which torch 2.9
    # lacks: the same list must load on every supported torch
    targets = ["aten::mm", *sorted(prime_ac.targets.RELEASE_DEPENDENT_OPERATORS)]
    model = model_factory()
    prime_ac.checkpoint_blocks(model, mode="selective", targets=targets)
    assert prime_ac.wrapping.wrapped_blocks(model)


def test_composite_names_trainers_use_are_translated_to_what_dispatches():
    policy = make_policy("selective", ["aten::linear", "aten::_scaled_dot_product_attention_math"])
    assert decide(policy, aten.addmm.default) is SAVE and decide(policy, aten.mm.default) is SAVE
    assert decide(policy, aten._scaled_dot_product_flash_attention_for_cpu.default) is SAVE
    assert "aten::linear" not in [str(t) for t in policy.targets]


@pytest.fixture
def model_factory():
    from ac_models import CountingModel

    return CountingModel


# --- the grammar ---------------------------------------------------------------------------------

identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)


@given(ns=identifiers, op=st.none() | identifiers, overload=st.none() | identifiers)
def test_valid_targets_round_trip(ns, op, overload):
    if op is None:
        overload = None
    if ns == "higher_order":
        overload = None
    text = ns + (f"::{op}" if op else "") + (f".{overload}" if overload else "")
    target = Target.parse(text)
    assert str(target) == text
    assert (target.namespace, target.op, target.overload) == (ns, op, overload)


@given(st.text(max_size=30))
def test_invalid_targets_raise_quoting_the_input(text):
    try:
        Target.parse(text)
    except ValueError as exc:
        assert repr(text) in str(exc)
    else:
        assert text == str(Target.parse(text))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "aten::",
        "::mm",
        "aten::mm.",
        "aten.mm",
        "aten::mm.default.x",
        "1aten",
        "aten::m m",
        "higher_order::flex_attention.default",
        "aten:::mm",
    ],
)
def test_invalid_target_examples(text):
    with pytest.raises(ValueError, match="invalid operator target"):
        Target.parse(text)


# --- ACConfig -----------------------------------------------------------------------------------


def test_config_from_toml_table():
    cfg = ACConfig.from_dict({"mode": "selective", "freq": 2, "targets": ["aten::mm"]})
    assert cfg == ACConfig("selective", 2, ("aten::mm",))
    assert ACConfig.from_dict({}) == ACConfig("full", 1, None)


@pytest.mark.parametrize(
    "table, message",
    [
        ({"mode": "selective", "target": ["aten::mm"]}, r"unknown .*\['target'\]"),
        ({"mode": "some"}, "mode='some'"),
        ({"freq": 0}, "freq=0"),
        ({"freq": True}, "freq=True"),
        ({"freq": "2"}, "freq='2'"),
        ({"targets": "aten::mm"}, "targets='aten::mm'"),
        ({"targets": ["aten::mm", "bad name"]}, "'bad name'"),
    ],
)
def test_config_errors_name_the_key(table, message):
    with pytest.raises(ValueError, match=message):
        ACConfig.from_dict(table)


def test_checkpoint_blocks_takes_a_config(model_factory):
    model = model_factory()
    names = prime_ac.checkpoint_blocks(model, config=ACConfig("full", 2))
    assert names == ["layers.0", "layers.2"]
    assert model.layers[0]._prime_ac.policy.mode == "full"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: make_policy("selective", targets=5), r"targets=5 is not a list of targets"),
        (lambda: ACConfig.from_dict(None), r"table must be a mapping.*got NoneType"),
        (lambda: ACConfig.from_dict([]), r"table must be a mapping.*got list"),
        (lambda: ACConfig.from_dict("mode=full"), r"got str 'mode=full'.*tomllib"),
        (lambda: prime_ac.audit(None, lambda m: 0), r"model must be a torch.nn.Module"),
        (lambda: prime_ac.audit("m", lambda m: 0), r"got str 'm'"),
    ],
)
def test_bad_arguments_raise_errors_naming_the_argument(call, message):
    with pytest.raises(TypeError, match=message):
        call()


def test_mandatory_none_adds_nothing():
    assert list(make_policy("full", mandatory=None).mandatory) == list(
        make_policy("full").mandatory
    )
