"""What a configuration says after its first step, and the budget in the user's units.

- an op list that keeps nothing is reported (naming what the blocks called instead), and
  ``strict=True`` raises;
- a block whose kept results reach what no AC holds for it (1 MiB or more) runs without
  checkpointing from then on (``skip_worse=False``: warned about, and the audit lists it);
  ``targets="auto"`` never plans such a block;
- a fractional budget is a share of the whole model's activation memory without AC.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from ac_models import assert_bitwise_equal
from torch import nn

import prime_ac
from prime_ac.actions import Action
from prime_ac.measure import track_step
from prime_ac.models import build_model
from prime_ac.wrapping import checkpoint_state


class Biased(nn.Module):
    """Biased linears dispatch aten::addmm, never aten::mm."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class LoRA(nn.Module):
    """A frozen base projection with a trainable low-rank adapter (peft's LoRA on a frozen base):
    autograd saves almost nothing for the frozen matmuls, selective keeps all their outputs."""

    def __init__(self, dim: int = 64, rank: int = 2):
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.a = nn.Linear(dim, rank, bias=False)
        self.b = nn.Linear(rank, dim, bias=False)

    def forward(self, x):
        for base in self.base:
            x = base(x) + 0.5 * x
        return x + self.b(self.a(x))


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _stack(block, n=2):
    torch.manual_seed(0)
    return nn.Sequential(*(block() for _ in range(n)))


def _step(model, x):
    model(x).square().sum().backward()


def test_an_op_list_that_matches_nothing_is_reported_with_what_was_called(caplog):
    caplog.set_level(logging.WARNING, logger="prime_ac")
    model, x = _stack(Biased), torch.randn(4, 16, requires_grad=True)
    targets = ["aten::mm", "aten::_scaled_dot_product_flash_attention"]
    prime_ac.checkpoint_blocks(model, mode="selective", targets=targets)
    caplog.clear()  # what is said when wrapping is another matter
    _step(model, x)
    text = caplog.text
    assert "'aten::mm' (the blocks called aten::addmm" in text
    assert "'aten::_scaled_dot_product_flash_attention'" in text
    caplog.clear()
    _step(model, x)  # once per configuration
    assert "matched no operator call" not in caplog.text


def test_matching_targets_are_silent(caplog):
    caplog.set_level(logging.WARNING, logger="prime_ac")
    model, x = _stack(Biased), torch.randn(4, 16)
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::addmm", "aten::gelu"])
    _step(model, x)
    assert "matched no operator call" not in caplog.text


def test_a_list_naming_each_devices_kernel_is_silent_where_one_matched(caplog):
    """FastVideo-style lists name mm beside addmm and each device's SDPA kernel: the ones the
    device does not call are not reported while a sibling matched."""
    caplog.set_level(logging.WARNING, logger="prime_ac")
    model, x = _stack(Biased), torch.randn(4, 16)
    targets = ["aten::mm", "aten::addmm", "aten::gelu"]
    prime_ac.checkpoint_blocks(model, mode="selective", targets=targets, strict=True)
    _step(model, x)
    assert "matched no operator call" not in caplog.text


def test_strict_raises_on_the_first_step_for_targets_that_kept_nothing():
    model, x = _stack(Biased), torch.randn(4, 16)
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::mm"], strict=True)
    with pytest.raises(ValueError, match=r"'aten::mm'.*aten::addmm.*strict=True"):
        _step(model, x)


def _lora_stack():
    """Two LoRA blocks large enough to matter: selective keeps 3 MiB of frozen matmul outputs
    per block, where no AC holds about 2 MiB (the adapter's input and the block's output)."""
    return _stack(lambda: LoRA(dim=256)), torch.randn(1024, 256, requires_grad=True)


# The frozen matmuls' outputs made mandatory: no backward reads them, but mandatory results are
# never dropped, so these blocks stay above no AC after the first step (the bypass's case)
UNREAD_MANDATORY = {"mandatory": ["aten::addmm"]}


def _bypassed(caplog):
    return [r.getMessage() for r in caplog.records if "runs without checkpointing" in r.message]


def test_a_block_holding_at_least_no_ac_runs_without_checkpointing_from_then_on(caplog):
    caplog.set_level(logging.WARNING, logger="prime_ac")
    model, x = _lora_stack()
    reference = copy.deepcopy(model)
    _step(reference, x)
    prime_ac.checkpoint_blocks(model, mode="selective", **UNREAD_MANDATORY)
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # logged, not warned
        _step(model, x)
    assert_bitwise_equal(grads(model), grads(reference))

    first = checkpoint_state(model[0]).watch.bytes
    assert all(kept >= no_ac > 0 for kept, no_ac in first.values()), first
    logged = _bypassed(caplog)
    assert len(logged) == 2 and all(
        f"block '{b}' keeps" in m for b, m in zip("01", logged, strict=True)
    )
    kept, no_ac = first["0"]
    assert f"keeps {kept / 2**20:.2f} MiB" in logged[0]
    assert f"would hold {no_ac / 2**20:.2f} MiB" in logged[0]
    assert all(checkpoint_state(block).bypassed for block in model)

    caplog.clear()
    model.zero_grad(set_to_none=True)
    _step(model, x)  # the second step runs the blocks plain, and says nothing again
    assert_bitwise_equal(grads(model), grads(reference))
    assert _bypassed(caplog) == []
    report = prime_ac.audit(model, lambda m: m(x).square().sum())
    assert sorted(report.blocks_bypassed) == ["0", "1"]
    assert report.replayed_ops == 0 and report.held_bytes == report.held_bytes_no_ac
    assert report.blocks_worse_than_no_ac() == []
    assert "held at least what no AC holds: 0, 1" in str(report)

    prime_ac.checkpoint_blocks(model, mode="full")  # a new configuration checkpoints again
    assert not any(checkpoint_state(block).bypassed for block in model)
    assert prime_ac.audit(model, lambda m: m(x).square().sum()).replayed_ops > 0


def test_skip_worse_false_keeps_checkpointing_and_warns():
    model, x = _lora_stack()
    prime_ac.checkpoint_blocks(model, mode="selective", skip_worse=False, **UNREAD_MANDATORY)
    with pytest.warns(UserWarning, match=r"block '0' keeps .* without checkpointing autograd"):
        _step(model, x)
    assert not any(checkpoint_state(block).bypassed for block in model)
    report = prime_ac.audit(model, lambda m: m(x).square().sum())
    assert report.blocks_worse_than_no_ac() == ["0", "1"] and report.blocks_bypassed == {}
    assert "blocks holding at least what no AC holds for them: 0, 1" in str(report)


def test_blocks_below_the_reported_size_are_silent_and_stay_checkpointed(caplog):
    """A tiny LoRA stack keeps more than no AC too, but a few KiB: not worth a word."""
    caplog.set_level(logging.WARNING, logger="prime_ac")
    model, x = _stack(LoRA), torch.randn(8, 64, requires_grad=True)
    prime_ac.checkpoint_blocks(model, mode="selective", **UNREAD_MANDATORY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, x)
    first = checkpoint_state(model[0]).watch.bytes
    assert all(no_ac <= kept < prime_ac.watch.REPORTED_BYTES for kept, no_ac in first.values())
    assert _bypassed(caplog) == [] and not checkpoint_state(model[0]).bypassed


def test_a_validation_pass_is_no_first_step():
    model, x = _lora_stack()
    prime_ac.checkpoint_blocks(model, mode="selective", **UNREAD_MANDATORY)
    with torch.no_grad():
        model(x)
    assert checkpoint_state(model[0]).watch.bytes == {}
    _step(model, x)
    assert checkpoint_state(model[0]).bypassed


def test_skip_worse_takes_a_bool():
    with pytest.raises(TypeError, match=r"skip_worse='yes' must be True"):
        prime_ac.checkpoint_blocks(_stack(LoRA), skip_worse="yes")


def test_full_mode_on_the_same_blocks_says_nothing():
    model, x = _stack(LoRA), torch.randn(8, 64, requires_grad=True)
    prime_ac.checkpoint_blocks(model, mode="full")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, x)


def test_auto_never_plans_a_block_above_no_ac():
    model, x = _stack(LoRA), torch.randn(8, 64, requires_grad=True)
    reference = copy.deepcopy(model)
    _step(reference, x)

    def loss(m):
        return m(x).square().sum()

    # bytes for anything per block; the whole model's no-AC memory
    for budget in ({"0": 10**9, "1": 10**9}, 1.0):
        wrapped = copy.deepcopy(model)
        prime_ac.checkpoint_blocks(
            wrapped, mode="selective", targets="auto", budget=budget, profile=loss
        )
        report = prime_ac.audit(wrapped, loss)
        plans = [checkpoint_state(block).plan for block in wrapped]
        if budget != 1.0:  # no checkpoint fits each block, holds least there, replays nothing
            assert [p.checkpointed for p in plans] == [False, False]
            assert report.replayed_flops == 0
        assert report.held_bytes <= report.held_bytes_no_ac
        assert report.blocks_worse_than_no_ac() == []
        for plan in plans:
            assert plan.checkpointed or plan.replayed_flops == 0
        wrapped.zero_grad(set_to_none=True)
        _step(wrapped, x)
        assert_bitwise_equal(grads(wrapped), grads(reference))


@pytest.mark.parametrize("budget", [0.3, 0.5])
def test_a_fraction_budget_is_of_the_whole_models_memory(budget):
    model = build_model("dense", n_layers=2)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))

    def loss(m):
        return m.loss(tokens)

    full = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(full, mode="full")
    full_share = prime_ac.audit(full, loss)
    prime_ac.checkpoint_blocks(model, mode="selective", targets="auto", budget=budget, profile=loss)
    report = prime_ac.audit(model, loss)
    assert full_share.held_bytes < report.held_bytes <= budget * report.held_bytes_no_ac
    assert report.replayed_flops < full_share.replayed_flops


def test_compiled_regions_are_kept_by_default():
    hop = getattr(torch._higher_order_ops.wrap, "inductor_compiled_code", None)
    if hop is None:
        pytest.skip("this torch has no inductor_compiled_code (torch 2.13+)")
    assert prime_ac.make_policy("selective").classify(hop) is Action.KEEP
    assert prime_ac.make_policy("full").classify(hop) is Action.REPLAY


class GatheringLoRA(LoRA):
    """A LoRA block whose input is all-gathered first (sequence parallelism); with matmul-only
    targets its recompute replays the gather."""

    def forward(self, x):
        from prime_ops import collectives

        return super().forward(collectives.all_gather(x, dim=0))[: x.shape[0]]


def _several_ranks_keep_a_block_that_replays_a_collective(rank, world_size):
    model = _stack(lambda: GatheringLoRA(dim=256))
    reference = copy.deepcopy(model)
    x = torch.randn(1024, 256, requires_grad=True, generator=torch.Generator().manual_seed(rank))
    _step(reference, x)
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::mm"], **UNREAD_MANDATORY)
    with pytest.warns(
        UserWarning,
        match=r"stays checkpointed: its recompute replays prime_rl_collectives\.all_gather",
    ):
        _step(model, x)
    assert_bitwise_equal(grads(model), grads(reference))
    assert not any(checkpoint_state(block).bypassed for block in model)


@pytest.mark.slow
def test_on_several_ranks_a_block_replaying_a_collective_is_never_bypassed():
    """Each rank judges its blocks by its own bytes: were one rank to bypass a block another
    keeps checkpointed, the two would replay different collectives in backward and hang."""
    from dist_utils import run_distributed

    run_distributed(_several_ranks_keep_a_block_that_replays_a_collective, 2, timeout=60)


# --- kept results no backward reads: dropped where a block holds more than no AC ----------------


class _LoRALinear(nn.Module):
    """peft's LoRA on a frozen base linear: ``base(x) + B(A(x)) * scale``."""

    def __init__(self, i: int, o: int, rank: int = 8):
        super().__init__()
        self.base = nn.Linear(i, o, bias=False).requires_grad_(False)
        self.lora_A, self.lora_B = nn.Linear(i, rank, bias=False), nn.Linear(rank, o, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * 2.0


class _RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d), requires_grad=False)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _LoRALlamaLayer(nn.Module):
    """A Llama decoder layer with LoRA on q, k, v and o (peft's target_modules), the rest frozen."""

    def __init__(self, d: int = 256, heads: int = 4, ff: int = 688):
        super().__init__()
        self.heads = heads
        self.input_layernorm, self.post_attention_layernorm = _RMSNorm(d), _RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (_LoRALinear(d, d) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down_proj = nn.Linear(ff, d, bias=False)
        for frozen in (self.gate_proj, self.up_proj, self.down_proj):
            frozen.requires_grad_(False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.input_layernorm(x)
        q, k, v = (
            p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class _LoRALlama(nn.Module):
    def __init__(self, layers: int = 2, d: int = 256, vocab: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, d).requires_grad_(False)
        self.layers = nn.ModuleList(_LoRALlamaLayer(d) for _ in range(layers))
        self.norm = _RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False).requires_grad_(False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.head(self.norm(x)).flatten(0, 1), ids.flatten())


def test_selective_on_a_lora_llama_holds_no_more_than_no_ac_for_the_whole_model():
    # the peft case (LoRA on q, k, v, o of a 2-layer hidden-256 Llama, 514 tokens): selective
    # kept the frozen base GEMMs' outputs, which no backward reads: 111.1% of no AC for the
    # whole model while each block looked within reach of its own. The first step drops them.
    torch.manual_seed(0)
    reference = _LoRALlama()
    ids = torch.randint(0, 512, (1, 514), generator=torch.Generator().manual_seed(1))

    def loss(m):
        return m(ids)

    before = copy.deepcopy(reference)
    prime_ac.checkpoint_blocks(before, mode="selective", blocks="layers")
    as_asked = prime_ac.audit(before, loss)  # the audit's step drops nothing: the list as asked
    assert as_asked.held_bytes > as_asked.held_bytes_no_ac  # 18,970,716 B against 17,068,916

    model = copy.deepcopy(reference)
    prime_ac.checkpoint_blocks(model, mode="selective", blocks="layers")
    first = track_step(model, loss)[0]  # the first step already drops them, in its recompute too
    after = prime_ac.audit(model, loss)
    assert first == after.held_bytes <= after.held_bytes_no_ac  # 9,496,668 B: 55.6%
    assert after.blocks_bypassed == {} and all(checkpoint_state(b).active for b in model.layers)
    # 9 per layer: the frozen q, k, v, o, down GEMMs and the 4 adapters' up-projections
    dropped = [checkpoint_state(b).context_fn()[0].rules.dropped for b in model.layers]
    assert [sum(map(len, d.values())) for d in dropped] == [9, 9]

    reference.zero_grad(set_to_none=True)
    loss(reference).backward()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss(model).backward()
        assert_bitwise_equal(grads(model), grads(reference))


def test_a_dense_block_below_no_ac_keeps_what_it_was_asked_to():
    # prime-rl's bytes: a block holding no more than no AC drops nothing, read or not
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    held = []
    for steps in (0, 1):
        model = build_model("dense", n_layers=2)
        prime_ac.checkpoint_blocks(model, mode="selective")
        for _ in range(steps):
            model.loss(tokens).backward()
        held.append(prime_ac.audit(model, lambda m: m.loss(tokens)).held_bytes)
        states = [checkpoint_state(m) for m in model.modules() if checkpoint_state(m) is not None]
        assert len(states) == 2 and all(not s.context_fn()[0].rules.dropped for s in states)
    assert held[0] == held[1]
