"""Behaviour of checkpoint_blocks on real models: replay counts, exact gradients, mandatory ops."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ac_models import CALLS, CountingModel, assert_bitwise_equal, grads
from torch import nn

import prime_ac


def _step(model, x):
    CALLS["count"] = 0
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = model(x)
    out.backward()
    return out.detach(), x.grad, grads(model), CALLS["count"]


@pytest.fixture
def reference():
    torch.manual_seed(0)
    return CountingModel(), torch.randn(5, 8)


@pytest.mark.parametrize(
    "settings, expected_calls",
    [
        (None, 4),
        ({"mode": "full"}, 8),
        ({"mode": "selective", "targets": ["prime_ac_test"]}, 4),
        ({"mode": "selective", "targets": ["prime_ac_test::scaled_tanh"]}, 4),
        ({"mode": "selective", "targets": ["prime_ac_test::scaled_tanh.default"]}, 4),
        ({"mode": "selective", "targets": ["aten::mm"]}, 8),
        ({"mode": "selective"}, 8),  # the defaults don't name the test op
        ({"mode": "selective", "targets": []}, 8),
        ({"mode": "full", "freq": 2}, 6),
        ({"mode": "selective", "targets": ["prime_ac_test"], "freq": 3}, 4),
    ],
)
def test_forward_calls_and_bitwise_gradients(reference, settings, expected_calls):
    model, x = reference
    out0, xgrad0, grads0, calls0 = _step(model, x)
    assert calls0 == 4
    wrapped = copy.deepcopy(model)
    if settings is not None:
        prime_ac.checkpoint_blocks(wrapped, **settings)
    out, xgrad, grads1, calls = _step(wrapped, x)
    assert calls == expected_calls
    assert torch.equal(out, out0)
    assert torch.equal(xgrad, xgrad0)
    assert_bitwise_equal(grads1, grads0)


def test_mandatory_ops_added_by_the_caller_are_kept_in_full_mode(reference):
    model, x = reference
    prime_ac.checkpoint_blocks(model, mode="full", mandatory=["prime_ac_test::scaled_tanh"])
    assert _step(model, x)[3] == 4


# --- MoE routing telemetry: counted once per forward, in every mode --------------------------

import prime_ops  # noqa: E402, F401  (provides prime_rl::record_moe_routing_statistics)

if not hasattr(torch.ops.prime_rl, "record_moe_routing_statistics"):

    @torch.library.custom_op(
        "prime_rl::record_moe_routing_statistics",
        mutates_args=("tokens_per_expert", "routing_confidence_sum"),
    )
    def _record(
        tokens_per_expert: torch.Tensor,
        routing_confidence_sum: torch.Tensor,
        token_counts: torch.Tensor,
        confidence: torch.Tensor,
    ) -> None:
        tokens_per_expert.add_(token_counts)
        routing_confidence_sum.add_(confidence)


class RoutedBlock(nn.Module):
    def __init__(self, dim=8, n_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.norm = nn.RMSNorm(dim)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts))
        self.register_buffer("confidence_sum", torch.zeros(n_experts))

    def forward(self, x):
        h = self.norm(x)
        scores = self.router(h).softmax(-1)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        counts = torch.zeros_like(self.tokens_per_expert).index_add(
            0, chosen.flatten(), torch.ones(chosen.numel())
        )
        confidence = torch.zeros_like(self.confidence_sum).index_add(
            0, chosen.flatten(), weights.detach().flatten()
        )
        torch.ops.prime_rl.record_moe_routing_statistics(
            self.tokens_per_expert, self.confidence_sum, counts, confidence
        )
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, expert(h[rows]) * weights[rows, slot, None])
        return x + out


class RoutedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(RoutedBlock() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.parametrize(
    "settings",
    [None, {"mode": "full"}, {"mode": "selective"}, {"mode": "selective", "targets": []}],
)
def test_routing_statistics_count_once(settings):
    torch.manual_seed(0)
    model, x = RoutedModel(), torch.randn(16, 8)
    reference = copy.deepcopy(model)
    reference(x).backward()
    if settings is not None:
        prime_ac.checkpoint_blocks(model, **settings)
    loss = model(x)
    after_forward = [layer.tokens_per_expert.clone() for layer in model.layers]
    loss.backward()
    for layer, counted, ref in zip(model.layers, after_forward, reference.layers, strict=True):
        assert counted.sum() == 16 * 2  # every token routed to top_k experts, once
        assert torch.equal(layer.tokens_per_expert, counted), "backward changed the counters"
        assert torch.equal(layer.tokens_per_expert, ref.tokens_per_expert)
        assert torch.equal(layer.confidence_sum, ref.confidence_sum)
    assert_bitwise_equal(grads(model), grads(reference))


# --- replay robustness ------------------------------------------------------------------------


class ProfiledOnRecompute(nn.Module):
    """Enters record_function only when torch is recomputing: what FSDP2's hooks do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        if self.forwards % 2 == 0:
            with torch.profiler.record_function("only-in-recompute"):
                return torch.relu(self.lin(x))
        return torch.relu(self.lin(x))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_profiler_markers_only_in_recompute_do_not_break_replay(mode):
    sac_ignored = set(torch.utils.checkpoint.SAC_IGNORED_OPS)
    torch.manual_seed(0)
    model = nn.Sequential(ProfiledOnRecompute(), ProfiledOnRecompute())
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    reference(x).sum().backward()
    prime_ac.checkpoint_blocks(model, mode=mode, blocks=lambda name, m: name in {"0", "1"})
    model(x).sum().backward()
    assert model[0].forwards == 2
    assert_bitwise_equal(grads(model), grads(reference))
    assert set(torch.utils.checkpoint.SAC_IGNORED_OPS) == sac_ignored


class ChangesOnRecompute(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        h = self.lin(x)
        return torch.sigmoid(h) if self.forwards > 1 else torch.relu(h)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_replayed_operator_mismatch_is_as_tolerated_as_plain_checkpoint(mode):
    # Neither relu nor sigmoid is kept: the recompute receives no kept result in the wrong
    # place, so (like torch.utils.checkpoint) prime_ac does not raise. Mismatches on kept
    # operators raise: tests/test_ac_semantics.py.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ChangesOnRecompute())
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8)
    prime_ac.checkpoint_blocks(model, mode=mode, blocks=lambda name, m: name == "1")
    model(x).sum().backward()
    h = plain[0](x)
    torch.utils.checkpoint.checkpoint(plain[1], h, use_reentrant=False).sum().backward()
    assert_bitwise_equal(grads(model), grads(plain))


def test_dropout_gradients_match_with_rng_state_preserved():
    class DropoutBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return F.dropout(self.lin(x), p=0.5, training=True)

    torch.manual_seed(0)
    model = nn.Sequential(DropoutBlock(), DropoutBlock())
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    torch.manual_seed(1)
    reference(x).sum().backward()
    prime_ac.checkpoint_blocks(model, mode="full")
    torch.manual_seed(1)
    model(x).sum().backward()
    assert_bitwise_equal(grads(model), grads(reference))


# --- torch.compile -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings, expected_calls",
    [({"mode": "full"}, 8), ({"mode": "selective", "targets": ["prime_ac_test"]}, 4)],
)
def test_compile_keeps_the_same_operators(reference, settings, expected_calls):
    torch._dynamo.reset()
    model, x = reference
    out0, xgrad0, grads0, _ = _step(model, x)
    whole = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(whole, **settings)
    compiled = torch.compile(whole, fullgraph=True)
    out, xgrad, grads1, calls = _step(compiled, x)
    assert calls == expected_calls
    torch.testing.assert_close(out, out0)
    torch.testing.assert_close(xgrad, xgrad0)
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[f"_orig_mod.{name}"], g)

    per_block = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(per_block, **settings)
    for block in per_block.layers:
        block.compile(fullgraph=True)
    out, xgrad, grads2, calls = _step(per_block, x)
    assert calls == expected_calls
    torch.testing.assert_close(xgrad, xgrad0)
    for name, g in grads0.items():
        torch.testing.assert_close(grads2[name], g)
