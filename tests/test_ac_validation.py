"""What checkpoint_blocks tells the user, and that a failing call leaves the model as it was.

Covers: a block's own keyword arguments reach it; operators without a ``.default`` overload are
valid targets; misleading or ignored arguments raise ValueError/TypeError naming the argument
before the model changes; unknown targets are reported on every call; FLOP formulas for grouped
and scaled GEMMs.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from ac_models import CountingModel, assert_bitwise_equal, grads
from torch import nn

import prime_ac
from prime_ac.measure import operator_flops
from prime_ac.targets import Target

# --- item 4: every argument of the block reaches the block ---------------------------------------

KWARGS = ("early_stop", "debug", "determinism_check", "use_reentrant", "context_fn")


class KwargBlock(nn.Module):
    """Uses the keyword names torch.utils.checkpoint takes for itself."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x, *, scale, preserve_rng_state=False, **flags):
        assert sorted(flags) == sorted(KWARGS), flags
        out = torch.tanh(self.lin(self.norm(x))) * scale
        return out * 2 if preserve_rng_state and flags["debug"] == "yes" else out


class KwargModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(KwargBlock() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            flags = dict.fromkeys(KWARGS, "yes")
            x = layer(x, scale=torch.tensor(0.5), preserve_rng_state=True, **flags)
        return x.sum()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_blocks_own_keyword_arguments_reach_it(mode):
    torch.manual_seed(0)
    model, x = KwargModel(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    expected = reference(x)
    expected.backward()
    prime_ac.checkpoint_blocks(model, mode=mode)
    out = model(x)
    out.backward()
    assert torch.equal(out, expected)
    assert_bitwise_equal(grads(model), grads(reference))


# --- item 6: targets ----------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["aten::mul", "aten::add", "aten::mul.Tensor", "aten::mm"])
def test_operators_without_a_default_overload_are_valid_targets(target):
    assert Target.parse(target).problem() is None
    prime_ac.checkpoint_blocks(CountingModel(), mode="selective", targets=[target], strict=True)


def test_target_problems_say_what_is_wrong():
    assert "only mutates its arguments" in Target.parse("aten::add_").problem()
    assert Target.parse("aten::nonexistent").problem() == "names no registered operator"
    reason = Target.parse("aten::mul.bogus").problem()
    assert "no registered overload" in reason and "Tensor" in reason
    assert Target.parse("aten::add_").problem(mandatory=True) is None  # kept so it runs once


def test_a_kept_multiply_is_really_kept():
    model, x = KwargModel(), torch.randn(3, 4)
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::mul"])
    report = prime_ac.audit(model, lambda m: m(x))
    assert {r.decision for r in report.ops if r.op == "aten::mul.Tensor"} == {"kept"}


def test_unknown_targets_are_reported_once_per_configuration(caplog):
    # a name in a namespace no library has loaded yet stays legal (its backend may load later);
    # the same configuration applied again (a second model, FastVideo's per-run setup) says it once
    seen = []
    for targets in (["aten::mm", "nosuchns_once::op"],) * 2 + (["nosuchns_once::op"],):
        with caplog.at_level(logging.DEBUG, logger="prime_ac"):  # debug: a namespace not loaded
            caplog.clear()
            prime_ac.checkpoint_blocks(CountingModel(), mode="selective", targets=targets)
        seen.append(
            ["nosuchns_once::op" in r.getMessage() for r in caplog.records if "for now" in r.msg]
        )
    assert seen == [[True], [], [True]]  # the third call is another configuration


# --- item 6: arguments that would be ignored or are malformed -------------------------------------


def _state(model):
    """Everything checkpoint_blocks may change: each module's class and checkpoint settings."""
    return [(n, type(m), m.__dict__.get("_prime_ac")) for n, m in model.named_modules()]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"targets": ["aten::mm"]}, ValueError, r"targets=\['aten::mm'\].*mode='selective'"),
        ({"mode": "full", "targets": ["aten::mm"]}, ValueError, "mode='full'"),
        ({"config": prime_ac.ACConfig("selective"), "freq": 2}, ValueError, "freq="),
        ({"config": prime_ac.ACConfig("selective"), "mode": "full"}, ValueError, "mode="),
        ({"config": {"mode": "full"}}, TypeError, r"ACConfig.from_dict"),
        ({"config": "selective"}, TypeError, "config="),
        ({"blocks": []}, ValueError, r"blocks=\[\] selects no block"),
        ({"blocks": 42}, TypeError, "blocks=42"),
        ({"blocks": lambda name, m: False}, ValueError, "accepted no module"),
        ({"blocks": ["layers", "layers"]}, ValueError, "selects .layers.0. twice"),
        ({"mode": "selective", "targets": "auto", "budget": math.nan, "profile": len}, ValueError, "budget=nan"),
        ({"mode": "selective", "targets": "auto", "budget": math.inf, "profile": len}, ValueError, "budget=inf"),
        ({"mode": "selective", "targets": "auto", "budget": {"layers.9": 10}, "profile": len}, ValueError, r"\['layers.9'\], which are not blocks"),
        ({"mode": "selective", "targets": "auto", "budget": {"layers.0": 10}, "profile": len}, ValueError, r"no entry for checkpointed block\(s\) \['layers.1'"),
        ({"mode": "selective", "targets": "auto", "budget": 0.5, "profile": 3}, TypeError, "profile=3 is not callable"),
        ({"mode": "selective", "profile": len}, ValueError, 'profile= applies only with targets="auto"'),
        ({"mandatory": ["aten:mm"]}, ValueError, "aten:mm"),
    ],
)  # fmt: skip
def test_bad_arguments_raise_naming_them_before_the_model_changes(kwargs, error, message):
    model = CountingModel()
    prime_ac.checkpoint_blocks(model, mode="selective", freq=2)
    before = _state(model)
    with pytest.raises(error, match=message):
        prime_ac.checkpoint_blocks(model, **kwargs)
    assert _state(model) == before


def test_nested_selections_raise():
    inner = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2)))
    model = nn.Sequential(inner, nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="selects '0.0' inside the selected block '0'"):
        prime_ac.checkpoint_blocks(model, blocks=["", "0"])
    assert not any(type(m).__name__.startswith("Checkpointed") for m in model.modules())


def test_a_non_module_model_is_a_type_error():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        prime_ac.checkpoint_blocks({"layers": []})


def test_a_config_with_arguments_it_does_not_set_is_fine():
    model = CountingModel()
    config = prime_ac.ACConfig.from_dict({"mode": "selective", "freq": 2})
    assert prime_ac.checkpoint_blocks(model, config=config, blocks="layers") == [
        "layers.0",
        "layers.2",
    ]


# --- issue 17: all or nothing -------------------------------------------------------------------


@pytest.mark.parametrize(
    "profile, error, message",
    [
        (lambda m: 1 / 0, ZeroDivisionError, "division"),
        (lambda m: None, TypeError, "profile= must return the loss"),
        (lambda m: torch.ones(3), TypeError, r"shape \(3,\)"),
    ],
)
def test_a_failing_profile_leaves_every_block_as_it_was(profile, error, message):
    model = CountingModel()
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::mm"], freq=2)
    before = _state(model)
    with pytest.raises(error, match=message):
        prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=0.5, profile=profile
        )
    assert _state(model) == before
    assert [n for n, _ in prime_ac.wrapping.wrapped_blocks(model)] == ["layers.0", "layers.2"]


def test_a_failing_profile_on_a_plain_model_leaves_it_plain():
    model = CountingModel()
    before = _state(model)
    with pytest.raises(ZeroDivisionError):
        prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=0.5, profile=lambda m: 1 / 0
        )
    assert _state(model) == before
    assert all(type(layer).__name__ == "CountingBlock" for layer in model.layers)


# --- item 6: FLOPs ------------------------------------------------------------------------------


def _flops(op, *args):
    return operator_flops(op, args, {}, op(*args))


def test_grouped_mm_flops_are_2mnk_per_group():
    g, m, k, n = 3, 5, 4, 8  # CPU kernel: strides multiple of 16 bytes
    offs = torch.tensor([2, 7, 15], dtype=torch.int32)
    a, b = torch.randn(15, k), torch.randn(g, k, n)  # groups along M (MoE experts)
    assert _flops(torch.ops.aten._grouped_mm.default, a, b, offs) == 2 * 15 * k * n
    a3 = torch.randn(g, m, k)  # batched
    assert _flops(torch.ops.aten._grouped_mm.default, a3, b) == 2 * g * m * k * n
    a2, b2 = torch.randn(m, 12), torch.randn(12, n)  # groups along K (weight gradients)
    offs_k = torch.tensor([4, 8, 12], dtype=torch.int32)
    assert _flops(torch.ops.aten._grouped_mm.default, a2, b2, offs_k) == 2 * m * 12 * n


def test_scaled_gemm_flops():
    # formulas read shapes only: check them on meta tensors (the kernels need a GPU)
    out = torch.empty(15, 6, device="meta")
    a, b = torch.empty(15, 4, device="meta"), torch.empty(3, 4, 6, device="meta")
    args = (a, b, torch.empty(15, device="meta"), torch.empty(3, 6, device="meta"))
    grouped = torch.ops.aten._scaled_grouped_mm.default
    assert operator_flops(grouped, args, {}, out) == 2 * 15 * 4 * 6
    a, b = torch.empty(5, 4, device="meta"), torch.empty(4, 6, device="meta")
    scaled = torch.ops.aten._scaled_mm.default
    one = torch.empty((), device="meta")
    assert operator_flops(scaled, (a, b, one, one), {}, torch.empty(5, 6, device="meta")) == (
        2 * 5 * 4 * 6
    )


def test_flex_attention_flops_count_like_sdpa():
    b, h, s, d = 1, 2, 8, 4
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    flex = torch.ops.higher_order.flex_attention  # a higher-order op: no overload packet
    # 2 * s * s * d for q @ k^T and again for p @ v, per batch and head
    assert operator_flops(flex, (q, k, v), {}, None) == b * h * 2 * (2 * s * s * d)


class GroupedExperts(nn.Module):
    """HF MoE experts' default path: one ``torch._grouped_mm`` over tokens sorted by expert."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(2, 8, 16) / 4)
        self.down = nn.Parameter(torch.randn(2, 16, 8) / 4)
        self.norm, self.act = nn.LayerNorm(8), nn.ReLU()

    def forward(self, x):
        offs = torch.tensor([3, 6], dtype=torch.int32)  # tokens 0-2 to expert 0, 3-5 to expert 1
        h = self.act(torch._grouped_mm(self.norm(x), self.up, offs=offs))
        return x + torch._grouped_mm(h, self.down, offs=offs)


def test_auto_keeps_expert_gemms_once_they_have_flops():
    model, x = nn.Sequential(GroupedExperts(), GroupedExperts()), torch.randn(6, 8)
    prime_ac.checkpoint_blocks(
        model, mode="selective", targets="auto", budget=1.0, profile=lambda m: m(x).square().sum()
    )
    kept = {
        str(op) for name in ("0", "1") for op, _ in model.get_submodule(name)._prime_ac.plan.kept
    }
    assert kept == {"aten._grouped_mm.default"}


def test_cpu_flash_attention_flops_with_grouped_query_heads():
    b, h, h_kv, s, d = 2, 4, 2, 8, 16
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, h_kv, s, d), torch.randn(b, h_kv, s, d)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    # q @ k^T and p @ v for every query head: 2 * s * s * d FLOPs each
    assert operator_flops(op, (q, k, v), {}, None) == b * h * 2 * (2 * s * s * d)


def test_a_failing_profile_keeps_the_scope_hooks_of_blocks_it_would_drop():
    model = CountingModel()
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["proj/aten::addmm"])
    hooks = [len(layer.proj._forward_pre_hooks) for layer in model.layers]
    assert all(hooks)  # scoped targets track submodules
    before = _state(model)
    with pytest.raises(ZeroDivisionError):
        prime_ac.checkpoint_blocks(
            model, mode="selective", targets="auto", budget=0.5, freq=2, profile=lambda m: 1 / 0
        )
    assert _state(model) == before
    assert [len(layer.proj._forward_pre_hooks) for layer in model.layers] == hooks


class CachedBlock(nn.Module):
    """Appends its keys to a cache and attends over it, as a KV-cache update does."""

    def __init__(self):
        super().__init__()
        self.k, self.o = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, cache=None):
        keys = self.k(x)
        if isinstance(cache, list):
            cache.append(keys)
            keys = torch.cat(cache)
        return self.o((x @ keys.T).softmax(-1) @ keys)


class CachedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(CachedBlock() for _ in range(2))

    def forward(self, x, caches):
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cache=cache)
        return x.sum()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_list_cache_is_filled_once_and_the_recompute_reads_it_as_the_forward_did(mode):
    """A list (per-layer state, not a transformers Cache) is copied for the recompute: the forward
    appends to the model's list once, the recompute reads and appends to its copy."""
    torch.manual_seed(0)
    plain, x = CachedModel(), torch.randn(3, 4)
    model = copy.deepcopy(plain)
    prime_ac.checkpoint_blocks(model, mode=mode)
    prefix = torch.randn(2, 4)
    expected, caches = [[prefix], []], [[prefix], []]
    plain(x, expected).backward()
    model(x, caches).backward()
    assert [len(cache) for cache in caches] == [2, 1]
    for cache, reference in zip(caches, expected, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(cache, reference, strict=True))
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    with torch.no_grad():  # generation: nothing is recomputed
        model(x, caches)
    assert [len(cache) for cache in caches] == [3, 2]


class EmptyOrFilledCache(list):
    """A list-backed cache with transformers' ``get_seq_length`` (0 while empty)."""

    def get_seq_length(self) -> int:
        return sum(len(keys) for keys in self)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_an_empty_cache_in_training_is_left_out_and_a_filled_one_refused(mode):
    """transformers' own checkpointing turns an unused training cache off; prime_ac runs the
    block without an empty one (gradients as without AC) and refuses one that holds entries."""
    torch.manual_seed(0)
    plain, x = CachedModel(), torch.randn(3, 4)
    model = copy.deepcopy(plain)
    prime_ac.checkpoint_blocks(model, mode=mode)
    plain(x, [None, None]).backward()
    caches = [EmptyOrFilledCache(), EmptyOrFilledCache()]
    with pytest.warns(UserWarning, match=r"'layers.0' runs without its empty cache.*use_cache"):
        model(x, caches).backward()
    assert caches == [[], []]  # the blocks ran without the cache, so nothing was appended
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    filled = [EmptyOrFilledCache([torch.randn(3, 4)]), EmptyOrFilledCache()]
    with pytest.raises(ValueError, match=r"'layers.0' got cache=EmptyOrFilledCache.*use_cache"):
        model(x, filled)
