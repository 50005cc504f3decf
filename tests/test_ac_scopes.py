"""Scoped targets, forced replay and tags (prime_ac.scopes): which calls are kept, what it costs."""

from __future__ import annotations

import copy
import gc
import logging
import pickle

import pytest
import torch
from ac_models import assert_bitwise_equal, grads
from torch import nn

import prime_ac
from prime_ac.budget import BlockPlan
from prime_ac.config import ACConfig
from prime_ac.models import build_model
from prime_ac.scopes import ScopedTarget, parse_target
from prime_ac.wrapping import checkpoint_state
from tests.dist_utils import run_distributed


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap():
    """The audit collects garbage per step; torch's long-lived objects need no visit."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _loss(model):
    return model.loss(TOKENS)


def _step(model):
    model.zero_grad(set_to_none=True)
    _loss(model).backward()
    return grads(model)


def _dense(targets=None, kind="dense"):
    model = build_model(kind, n_layers=2, dim=32, hidden_dim=64)
    if targets is not None:
        prime_ac.checkpoint_blocks(model, mode="selective", targets=targets)
    return model


def _kept(report, op="aten::mm.default", block="layers.0"):
    """The submodule paths where ``op`` was kept in ``block``."""
    return sorted(
        c.scope for c in report.calls[block] if c.target().endswith(op) and c.decision != "replayed"
    )


def test_scoped_attention_keeps_between_no_and_every_matmul_with_bitwise_grads():
    reference = _step(_dense())
    reports = {}
    for name, targets in {
        "none": [],
        "attention": ["attention/aten::mm"],
        "all": ["aten::mm"],
    }.items():
        model = _dense(targets)
        reports[name] = prime_ac.audit(model, _loss)
        assert_bitwise_equal(_step(model), reference)
    assert reports["none"].held_bytes < reports["attention"].held_bytes < reports["all"].held_bytes
    assert _kept(reports["attention"]) == [
        "attention.wk",
        "attention.wo",
        "attention.wq",
        "attention.wv",
    ]
    assert _kept(reports["all"]) == sorted(
        ["attention.wk", "attention.wo", "attention.wq", "attention.wv"]
        + ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    )
    # fewer kept bytes, more replayed work
    assert reports["attention"].replayed_flops > reports["all"].replayed_flops


def test_forced_replay_beats_every_keep_and_mandatory_beats_forced_replay():
    reference = _step(_dense(kind="moe"))
    model = _dense(
        [
            "aten::mm",
            "feed_forward.router/aten::mm",
            "!feed_forward/aten::mm",
            "!feed_forward/aten::topk",
        ],
        kind="moe",
    )
    report = prime_ac.audit(model, _loss)
    assert _kept(report) == ["attention.wk", "attention.wo", "attention.wq", "attention.wv"]
    # top-k is mandatory: the recompute must route the same way whatever the targets say
    assert {
        c.decision for c in report.calls["layers.0"] if c.target().endswith("aten::topk.default")
    } == {"mandatory"}
    assert_bitwise_equal(_step(model), reference)

    unscoped = prime_ac.audit(_dense(["aten::mm"], kind="moe"), _loss)
    assert report.held_bytes < unscoped.held_bytes


def test_scope_segments_match_consecutively_anywhere_in_the_path():
    path = ("feed_forward", "experts", "3", "w1")
    within = {
        "w1": True,
        "experts.*.w1": True,
        "feed_forward": True,
        "feed_forward.experts": True,
        "*.3": True,
        "experts.w1": False,  # not consecutive
        "w2": False,
        "feed_forward.*.*.*.*": False,
    }
    for scope, expected in within.items():
        assert ScopedTarget.parse(f"{scope}/aten::mm").within(path) is expected, scope


class _Tagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, x):
        h = prime_ac.tag(torch.sin(self.inner(x)), "hidden")
        return x + self.mlp(h)


class _TaggedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Tagged() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().sum()


def _tagged(targets):
    torch.manual_seed(0)
    model = _TaggedModel()
    if targets is not None:
        prime_ac.checkpoint_blocks(model, mode="selective", targets=targets)
    return model


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _tag_decisions(model):
    report = prime_ac.audit(model, lambda m: m(X))
    return [c.decision for c in report.calls["layers.0"] if c.target() == "prime_ac::tag.default"]


def test_an_untargeted_tag_is_the_tensor_itself():
    x = torch.randn(3)
    assert prime_ac.tag(x, "never_targeted_by_any_policy") is x


def test_the_tag_operator_passes_opcheck():
    x = torch.randn(3, 4, requires_grad=True)
    # the compiled path is covered by the compile test below
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.prime_ac.tag.default, (x, "h"), test_utils=checks)


def test_a_tag_target_keeps_the_tagged_tensor_with_bitwise_grads():
    def step(model):
        model.zero_grad(set_to_none=True)
        model(X).backward()
        return grads(model)

    reference = step(_tagged(None))
    kept = _tagged(["tag:hidden"])
    assert _tag_decisions(kept) == ["kept"]
    assert_bitwise_equal(step(kept), reference)
    assert _tag_decisions(_tagged(["tag:hidden", "!mlp/aten::addmm"])) == ["kept"]
    # the tag is called in the block's own code, outside any submodule: no scope reaches it
    assert _tag_decisions(_tagged(["inner/tag:hidden"])) == ["replayed"]


@pytest.mark.slow
def test_compiled_regions_decide_scopes_and_tags_as_eager_does():
    model = _tagged(["tag:hidden", "mlp.0/aten::addmm", "!mlp.2/aten::addmm", "aten::addmm"])
    scoped = checkpoint_state(model.layers[0]).policy.scoped
    seen = []
    keeps = scoped.keeps

    def spy(op, args, sid, rid=0):
        decision = keeps(op, args, sid, rid)
        seen.append(
            (str(op), args[1] if op is torch.ops.prime_ac.tag.default else None, sid, decision)
        )
        return decision

    scoped.keeps = spy
    x = X.clone().requires_grad_()
    model(x).backward()
    eager, eager_grad = set(seen), x.grad.clone()
    seen.clear()
    x.grad = None
    # fullgraph: a graph break would run the region eagerly and prove nothing
    torch.compile(model, backend="aot_eager", fullgraph=True)(x).backward()
    assert set(seen) == eager
    paths = {scoped.tracker.paths[sid]: decision for op, _, sid, decision in eager if "addmm" in op}
    # only submodules a scope ends at are tracked: "inner" runs in the block's scope
    assert paths == {(): True, ("mlp", "0"): True, ("mlp", "2"): False}
    torch.testing.assert_close(x.grad, eager_grad)


def test_own_regions_take_scoped_targets_once_the_region_is_tracked():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = _Tagged()
    reference = block(X).sum()
    reference.backward()
    expected = grads(block)
    block.zero_grad(set_to_none=True)
    policy = prime_ac.make_policy("selective", ["mlp.0/aten::addmm"])
    policy.scoped.tracker.track(block)
    context_fn = prime_ac.context_fn(policy=policy)
    checkpoint(block, X, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert_bitwise_equal(grads(block), expected)
    sids = {policy.scoped.tracker.paths[k[2]]: v for k, v in policy.scoped._decisions.items()}
    assert sids == {(): False, ("mlp", "0"): True}


def test_a_budget_plan_reapplied_as_scoped_targets_keeps_the_same_calls():
    model = _dense()
    prime_ac.checkpoint_blocks(
        model,
        mode="selective",
        targets="auto",
        budget={f"layers.{i}": 40_000 for i in range(len(model.layers))},  # bytes per block
        profile=_loss,
    )
    plan = checkpoint_state(model.layers[0]).plan
    planned = prime_ac.audit(model, _loss)
    targets = plan.as_targets()
    assert all(isinstance(parse_target(t), ScopedTarget) for t in targets)
    kept = _kept(planned)
    assert 0 < len(kept) < 7  # some matmuls, not all: only scopes can say which
    reapplied = prime_ac.audit(_dense(targets), _loss)
    assert _kept(reapplied) == kept
    assert reapplied.block_kept_bytes() == planned.block_kept_bytes()
    assert reapplied.block_kept_bytes()["layers.0"] == plan.kept_bytes
    assert reapplied.replayed_flops == planned.replayed_flops == 2 * plan.replayed_flops


def test_as_targets_uses_forced_replay_for_block_level_keeps_and_refuses_partial_scopes():
    mm = "aten::mm.default"
    plan = BlockPlan("b", 0, (), 0, 0, calls=(("", mm, "kept"), ("ffn.w1", mm, "replayed")))
    assert plan.as_targets() == [mm, f"!ffn.w1/{mm}"]
    partial = BlockPlan("b", 0, (), 0, 0, calls=(("attn", mm, "kept"), ("attn", mm, "replayed")))
    with pytest.raises(ValueError, match="keeps some calls of aten::mm.default in \\['attn'\\]"):
        partial.as_targets()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("!aten::mm", "write '!<scope>/aten::mm'"),
        ("attention..wq/aten::mm", "the scope 'attention..wq' must be a dotted submodule path"),
        ("a/b/aten::mm", "must be a dotted submodule path"),
        ("attention/", "invalid operator target ''"),
        ("attention/aten::mm.default.x", "invalid operator target"),
        ("tag:", "the tag name '' must be an identifier"),
        ("tag:two words", "must be an identifier"),
    ],
)
def test_malformed_scoped_targets_name_the_fix(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        prime_ac.checkpoint_blocks(_dense(), mode="selective", targets=[text])
    with pytest.raises(ValueError):
        ACConfig(mode="selective", targets=[text])


def test_a_namespace_called_tag_stays_an_operator_target():
    assert str(parse_target("tag::op")) == "tag::op"
    assert parse_target("attention/tag::op").operator is not None


def test_scoped_strings_round_trip():
    for text in [
        "attention/aten::mm",
        "!feed_forward.w1/aten::mm.default",
        "tag:attn_out",
        "*.w2/tag:x",
    ]:
        assert str(parse_target(text)) == text
    config = ACConfig(mode="selective", targets=["attention/aten::mm", "!w1/aten::mm", "tag:h"])
    assert config.targets == ("attention/aten::mm", "!w1/aten::mm", "tag:h")


def test_a_scope_matching_no_submodule_is_reported_like_an_unknown_operator(caplog):
    with pytest.raises(ValueError, match="'attn/aten::mm' names a scope that matches no submodule"):
        prime_ac.checkpoint_blocks(
            _dense(), mode="selective", targets=["attn/aten::mm"], strict=True
        )
    with pytest.raises(
        ValueError, match="'attention/aten::nonexistent' names no registered operator"
    ):
        prime_ac.checkpoint_blocks(
            _dense(), mode="selective", targets=["attention/aten::nonexistent"], strict=True
        )
    with caplog.at_level(logging.WARNING, logger="prime_ac"):
        prime_ac.checkpoint_blocks(_dense(), mode="selective", targets=["attn/aten::mm"])
    assert "matches no submodule" in caplog.text


def _hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_scope_hooks_exist_only_while_a_policy_has_scoped_targets():
    model = _dense(["aten::mm", "tag:x"])
    assert _hooks(model) == 0  # no scope, no hook: the per-op path is unchanged
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["attention/aten::mm"])
    assert _hooks(model) > 0
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::mm"])
    assert _hooks(model) == 0
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["attention/aten::mm"])
    prime_ac.unwrap_blocks(model)
    assert _hooks(model) == 0


def _fsdp_body(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard

    gc.freeze()
    base = _dense()
    targets = ["attention/aten::mm", "!attention.wo/aten::mm"]

    def figures(model):
        report = prime_ac.audit(model, _loss)
        return report.held_bytes, report.replayed_flops, _kept(report)

    single = copy.deepcopy(base)
    prime_ac.checkpoint_blocks(single, mode="selective", targets=targets)
    expected = figures(single)
    assert expected[2] == ["attention.wk", "attention.wq", "attention.wv"]
    for order in ("ac-then-fsdp", "fsdp-then-ac"):
        model = copy.deepcopy(base)
        if order == "fsdp-then-ac":
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
        prime_ac.checkpoint_blocks(model, mode="selective", targets=targets)
        if order == "ac-then-fsdp":
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
        assert figures(model) == expected, order
        _loss(model).backward()


@pytest.mark.slow
def test_scoped_targets_keep_the_same_calls_under_fsdp2_in_both_orders():
    run_distributed(_fsdp_body, 2, timeout=300)


@pytest.mark.parametrize("restore", ["deepcopy", "pickle"])
def test_a_copy_with_scoped_targets_keeps_its_own_scopes_and_the_original_its_own(restore):
    """The copy's scope hooks push and pop on the copy's own tracker: the copy keeps what the
    original keeps, and the original keeps the same bytes as before the copy."""
    reference = _step(_dense())
    model = _dense(["attention/aten::mm"])
    before = prime_ac.audit(model, _loss)
    copied = copy.deepcopy(model) if restore == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert_bitwise_equal(_step(copied), reference)
    report = prime_ac.audit(copied, _loss)
    assert (
        _kept(report)
        == _kept(before)
        == ["attention.wk", "attention.wo", "attention.wq"] + ["attention.wv"]
    )
    assert report.held_bytes == before.held_bytes
    assert_bitwise_equal(_step(model), reference)
    assert prime_ac.audit(model, _loss).held_bytes == before.held_bytes
    # the copy's hooks are its tracker's: re-configuring the copy leaves none behind
    prime_ac.checkpoint_blocks(copied, mode="full")
    assert not any(m._forward_pre_hooks for m in copied.modules())
    assert any(m._forward_pre_hooks for m in model.modules())
