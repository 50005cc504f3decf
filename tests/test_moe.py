"""Routing telemetry op and the reference expert-parallel MoE, with and without prime_ac."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed
from torch import nn
from torch.utils.checkpoint import checkpoint

import prime_ops  # noqa: F401  (registers the ops)
from prime_ops.expert_parallel import ExpertParallelMoE
from prime_ops.moe import record_moe_routing_statistics

DIM, HIDDEN, EXPERTS, TOP_K = 8, 16, 4, 2


class _Block(nn.Module):
    def __init__(self, ep_group):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = ExpertParallelMoE(DIM, HIDDEN, EXPERTS, TOP_K, ep_group=ep_group)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class _Model(nn.Module):
    def __init__(self, ep_group=None, n_blocks=2):
        super().__init__()
        self.layers = nn.ModuleList(_Block(ep_group) for _ in range(n_blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _stats(model):
    return [
        (b.moe.tokens_per_expert.clone(), b.moe.routing_confidence_sum.clone())
        for b in model.layers
    ]


def _fwd_bwd(model, x, grad_out):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(grad_out)
    return out.detach(), x.grad


# --- the telemetry op -----------------------------------------------------------------------


def test_record_adds_in_place_and_passes_opcheck():
    tokens, confidence = torch.zeros(4), torch.zeros(())
    record_moe_routing_statistics(tokens, confidence, torch.tensor([1, 0, 2, 3]), torch.tensor(1.5))
    record_moe_routing_statistics(tokens, confidence, torch.tensor([1, 1, 0, 0]), torch.tensor(0.5))
    assert tokens.tolist() == [2.0, 1.0, 2.0, 3.0]
    assert confidence.item() == 2.0
    args = (torch.zeros(4), torch.zeros(()), torch.tensor([1, 0, 2, 3]), torch.tensor(1.5))
    torch.library.opcheck(torch.ops.prime_rl.record_moe_routing_statistics.default, args)


def test_record_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"token_counts has shape \(3,\) but tokens_per_expert"):
        record_moe_routing_statistics(
            torch.zeros(4), torch.zeros(()), torch.ones(3), torch.ones(())
        )
    with pytest.raises(ValueError, match=r"confidence has shape \(2,\) .* 0-d sum"):
        record_moe_routing_statistics(torch.zeros(4), torch.zeros(()), torch.ones(4), torch.ones(2))
    # A meta tensor among CPU ones would route the call to the fake and skip the update.
    with pytest.raises(ValueError, match="one device, got .*token_counts on meta"):
        record_moe_routing_statistics(
            torch.zeros(4), torch.zeros(()), torch.ones(4, device="meta"), torch.ones(())
        )


def test_plain_checkpoint_double_counts_which_is_what_the_op_prevents():
    # The hazard the mandatory op exists for: a policy-free recompute replays the add.
    torch.manual_seed(0)
    moe = ExpertParallelMoE(DIM, HIDDEN, EXPERTS, TOP_K)
    x = torch.randn(6, DIM, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum().item() == 2 * 6 * TOP_K


# --- the reference MoE on one process -------------------------------------------------------


def test_moe_matches_per_token_dense_computation():
    torch.manual_seed(0)
    moe = ExpertParallelMoE(DIM, HIDDEN, EXPERTS, TOP_K)
    x = torch.randn(3, 5, DIM, requires_grad=True)
    out = moe(x)

    flat = x.reshape(-1, DIM)
    weights, experts = torch.softmax(flat @ moe.router.weight.T, -1).topk(TOP_K, -1)
    rows = []
    for t in range(flat.shape[0]):
        row = 0
        for j in range(TOP_K):
            e = experts[t, j]
            hidden = F.silu(flat[t] @ moe.w_gate[e]) * (flat[t] @ moe.w_up[e])
            row = row + weights[t, j] * (hidden @ moe.w_down[e])
        rows.append(row)
    want = torch.stack(rows).reshape(x.shape)
    torch.testing.assert_close(out, want)

    params = (x, moe.router.weight, moe.w_gate, moe.w_up, moe.w_down)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, params, grad_out)
    expected = torch.autograd.grad(want, params, grad_out)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    assert (
        moe.tokens_per_expert.tolist()
        == torch.bincount(experts.flatten(), minlength=EXPERTS).tolist()
    )
    torch.testing.assert_close(moe.routing_confidence_sum, weights.sum().detach())


def test_moe_rejects_bad_top_k():
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, num_experts=4\]"):
        ExpertParallelMoE(DIM, HIDDEN, EXPERTS, 5)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_prime_ac_counts_routing_once_and_keeps_gradients(mode):
    prime_ac = pytest.importorskip("prime_ac")
    torch.manual_seed(0)
    plain = _Model()
    wrapped = copy.deepcopy(plain)
    assert prime_ac.checkpoint_blocks(wrapped, mode=mode, blocks="layers") == [
        "layers.0",
        "layers.1",
    ]
    x, grad_out = torch.randn(10, DIM), torch.randn(10, DIM)
    want = _fwd_bwd(plain, x, grad_out)
    got = _fwd_bwd(wrapped, x, grad_out)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    for (tokens, conf), (want_tokens, want_conf) in zip(
        _stats(wrapped), _stats(plain), strict=True
    ):
        assert tokens.sum().item() == 10 * TOP_K
        torch.testing.assert_close(tokens, want_tokens)
        torch.testing.assert_close(conf, want_conf)
    for (name, p), q in zip(wrapped.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


# --- expert parallel on 2 ranks against one process -----------------------------------------


def _shard_like(ep_model, full_model):
    with torch.no_grad():
        for ep_block, block in zip(ep_model.layers, full_model.layers, strict=True):
            ep_block.norm.load_state_dict(block.norm.state_dict())
            ep_block.moe.router.weight.copy_(block.moe.router.weight)
            mine = slice(ep_block.moe.local_experts.start, ep_block.moe.local_experts.stop)
            for name in ("w_gate", "w_up", "w_down"):
                getattr(ep_block.moe, name).copy_(getattr(block.moe, name)[mine])


def _ep_body(rank, world):
    import prime_ac

    exchanges = []
    real_all_to_all = dist.all_to_all_single

    def counting_all_to_all(*args, **kwargs):
        exchanges.append(1)
        return real_all_to_all(*args, **kwargs)

    # Count the exchanges the ops make (this rank's process only): what each AC mode replays.
    dist.all_to_all_single = counting_all_to_all

    group = dist.group.WORLD
    with pytest.raises(ValueError, match="num_experts=3 is not divisible by the EP group size 2"):
        ExpertParallelMoE(DIM, HIDDEN, 3, 1, ep_group=group)

    torch.manual_seed(0)
    full = _Model()
    counts = [5 + 3 * r for r in range(world)]  # uneven token counts per rank
    x_all, grad_all = torch.randn(sum(counts), DIM), torch.randn(sum(counts), DIM)
    want_out, want_x_grad = _fwd_bwd(full, x_all, grad_all)
    mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))

    # Per block: 3 exchanges forward (counts, tokens out, tokens back), 2 backward; full AC
    # replays the 3 forward ones, selective keeps their results (prime_rl_collectives is a target).
    for mode, expected_exchanges in ((None, 10), ("full", 16), ("selective", 10)):
        exchanges.clear()
        model = _Model(ep_group=group)
        _shard_like(model, full)
        if mode is not None:
            assert len(prime_ac.checkpoint_blocks(model, mode=mode, blocks="layers")) == 2
        out, x_grad = _fwd_bwd(model, x_all[mine], grad_all[mine])
        assert len(exchanges) == expected_exchanges, (mode, len(exchanges))
        torch.testing.assert_close(out, want_out[mine], msg=f"mode={mode}")
        torch.testing.assert_close(x_grad, want_x_grad[mine], msg=f"mode={mode}")
        for ep_block, block in zip(model.layers, full.layers, strict=True):
            ep, ref = ep_block.moe, block.moe
            experts = slice(ep.local_experts.start, ep.local_experts.stop)
            for name in ("w_gate", "w_up", "w_down"):
                torch.testing.assert_close(
                    getattr(ep, name).grad, getattr(ref, name).grad[experts], msg=f"{mode} {name}"
                )
            # Replicated parameters: each rank holds the gradient of its own tokens.
            for p, q in (
                (ep.router.weight, ref.router.weight),
                (ep_block.norm.weight, block.norm.weight),
            ):
                summed = p.grad.clone()
                dist.all_reduce(summed)
                torch.testing.assert_close(summed, q.grad, msg=f"mode={mode}")
            # Routing statistics counted once: the ranks' counts add up to the reference's.
            tokens, conf = ep.tokens_per_expert.clone(), ep.routing_confidence_sum.clone()
            assert tokens.sum().item() == counts[rank] * TOP_K, f"mode={mode}"
            dist.all_reduce(tokens)
            dist.all_reduce(conf)
            torch.testing.assert_close(tokens, ref.tokens_per_expert, msg=f"mode={mode}")
            torch.testing.assert_close(conf, ref.routing_confidence_sum, msg=f"mode={mode}")

    # A rank without tokens still serves its experts to the other rank.
    model = _Model(ep_group=group)
    _shard_like(model, full)
    mine = slice(0, 0) if rank == 0 else slice(0, sum(counts))
    out, x_grad = _fwd_bwd(model, x_all[mine], grad_all[mine])
    torch.testing.assert_close(out, want_out[mine])
    assert x_grad.shape == out.shape


@pytest.mark.slow
def test_expert_parallel_on_2_ranks_matches_one_process_under_prime_ac():
    run_distributed(_ep_body, 2)
