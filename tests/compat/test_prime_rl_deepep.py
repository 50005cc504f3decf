"""prime-rl's calls of the ``deepep`` ops, made exactly as prime-rl makes them.

Contract: prime-rl ``src/prime_rl/trainer/distributed/deepep.py`` and ``handles.py`` @
b32dd9d7b181: the four op schemas, ``_create_buffer`` and ``DeepEPTokenDispatcher.dispatch`` /
``combine`` (the only callers of the ops). The calls into ``deep_ep.Buffer`` are checked against a
recording stand-in; outputs and gradients on 2 gloo ranks through the reference backend, against
a single-process float64 model of the whole MoE layer written with plain autograd (every rank
builds every rank's inputs from one seed).
"""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch
from dist_utils import run_distributed
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import prime_ops  # noqa: F401  (registers the ops)
from prime_ops import deepep_prime_rl

PRIME_RL_COMMIT = "b32dd9d7b181"
PRIME_RL_SCHEMAS = {  # torch infers SymInt from prime-rl's ``int`` annotations
    "dispatch": (
        "(Tensor x, Tensor topk_idx, Tensor topk_weights, SymInt num_experts) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "combine": "(Tensor x, Tensor handle_id, SymInt num_tokens) -> Tensor",
    "dispatch_backward": (
        "(Tensor grad_x, Tensor grad_topk_weights, Tensor handle_id, SymInt num_tokens) "
        "-> (Tensor, Tensor)"
    ),
    "combine_backward": "(Tensor grad, Tensor handle_id, SymInt num_recv_tokens) -> Tensor",
}
HIDDEN, TOPK, EXPERTS = 8, 2, 4


def test_schemas_are_prime_rls():
    for name, schema in PRIME_RL_SCHEMAS.items():
        assert str(getattr(torch.ops.deepep, name).default._schema) == f"deepep::{name}{schema}"


@pytest.fixture
def no_buffer(monkeypatch):
    monkeypatch.setattr(deepep_prime_rl, "_current", None)


# --- the calls into deep_ep.Buffer, against a recording stand-in ------------------------------


class _Config:
    def get_nvl_buffer_size_hint(self, hidden_bytes, ranks):
        return 1000 + hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes, ranks):
        return 10 * ranks


class _Buffer:
    """Records every call; results only have the right shapes (rank 0 owns experts 0 and 1 and
    receives every token once). Semantics are tested on gloo below."""

    calls: list = []
    num_sms = 24
    get_dispatch_config = staticmethod(lambda ranks: _Config())
    get_combine_config = staticmethod(lambda ranks: _Config())

    def __init__(self, *args, **kwargs):
        self.calls.append(("Buffer", args, kwargs))

    def get_dispatch_layout(self, *args, **kwargs):
        self.calls.append(("get_dispatch_layout", args, kwargs))
        topk_idx, num_experts = args
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        in_rank = torch.ones(topk_idx.shape[0], 2, dtype=torch.bool)
        return torch.tensor([topk_idx.shape[0]] * 2), None, per_expert, in_rank, None

    def dispatch(self, x, **kwargs):
        self.calls.append(("dispatch", x, kwargs))
        if "handle" in kwargs:
            return x.clone(), None, None, None, None, None
        recv_idx = torch.where(kwargs["topk_idx"] < 2, kwargs["topk_idx"], -1)
        counts = [int((recv_idx == e).sum()) for e in range(2)]
        weights = torch.where(recv_idx >= 0, kwargs["topk_weights"], 0.0)
        return x.clone(), recv_idx, weights, counts, "layout", None

    def combine(self, x, handle, **kwargs):
        self.calls.append(("combine", x, handle, kwargs))
        weights = kwargs.get("topk_weights")
        return x.clone(), None if weights is None else weights.clone(), None


class _Group:
    def size(self):
        return 2


def test_create_buffer_and_the_ops_make_deep_eps_calls(monkeypatch, no_buffer):
    """prime-rl ``DeepEPTokenDispatcher.__init__`` -> ``_create_buffer(group, hidden_size * 2)``,
    then ``dispatch`` / ``combine`` through the ops, and both backwards."""
    module = types.ModuleType("deep_ep")
    module.Buffer = _Buffer
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    monkeypatch.setattr(_Buffer, "calls", [])
    calls, group = _Buffer.calls, _Group()
    deepep_prime_rl.create_buffer(group, HIDDEN * 2, num_qps_per_rank=_Buffer.num_sms)
    assert calls == [("Buffer", (group, 1000 + HIDDEN * 2, 20), {"num_qps_per_rank": 24})]
    deepep_prime_rl.create_buffer(group, HIDDEN * 2)  # big enough: kept, as prime-rl keeps it
    assert len(calls) == 1

    x = torch.randn(3, HIDDEN).bfloat16().requires_grad_()
    scores = torch.tensor([[0.7, 0.3], [0.6, 0.0], [0.5, 0.5]], requires_grad=True)
    idx = torch.tensor([[0, 2], [1, 3], [3, 1]])
    # DeepEPTokenDispatcher.dispatch
    top_scores = scores.float().contiguous()
    idx = idx.masked_fill(top_scores == 0, -1).contiguous()
    recv_x, recv_scores, order, counts, handle_id = torch.ops.deepep.dispatch(
        x, idx, top_scores, EXPERTS
    )
    name, args, kwargs = calls[1]
    assert name == "get_dispatch_layout" and torch.equal(args[0], idx) and args[1] == EXPERTS
    assert kwargs == {}
    name, sent, kwargs = calls[2]
    assert name == "dispatch" and torch.equal(sent, x)
    assert sorted(kwargs) == sorted(
        ["topk_idx", "topk_weights", "num_tokens_per_rank", "num_tokens_per_rdma_rank",
         "is_token_in_rank", "num_tokens_per_expert"]
    )  # fmt: skip
    assert torch.equal(kwargs["topk_idx"], idx) and torch.equal(kwargs["topk_weights"], scores)
    # Pairs of local experts 0 and 1, grouped by expert: (0, 0) -> 0, (1, 0) and (2, 1) -> 1.
    assert order.tolist() == [0, 2, 5] and counts.tolist() == [1, 2]
    assert counts.dtype == torch.int64 and handle_id.shape == (1,)

    token_indices = order // idx.shape[1]
    routed = (recv_x[token_indices].float() * recv_scores.flatten()[order][:, None]).bfloat16()
    out = routed.new_zeros(recv_x.shape).index_add(0, token_indices, routed)
    y = torch.ops.deepep.combine(out, handle_id, x.shape[0])  # DeepEPTokenDispatcher.combine
    assert calls[3][0] == "combine" and calls[3][2] == "layout" and calls[3][3] == {}
    y.float().sum().backward()
    names = [c[0] for c in calls[4:]]
    assert names == ["dispatch", "combine"]  # combine's backward, then dispatch's
    assert set(calls[4][2]) == {"handle"} and calls[4][2]["handle"] == "layout"
    assert calls[5][2] == "layout" and set(calls[5][3]) == {"topk_weights"}
    # The weight gradient combine sums is masked to the choices rank 0 received.
    assert torch.all(calls[5][3]["topk_weights"][idx.ge(2) | idx.lt(0)] == 0)
    assert x.grad.shape == x.shape and scores.grad.shape == scores.shape


def test_fakes_trace_with_data_dependent_sizes(no_buffer):
    """The fakes let dynamo trace the region (prime-rl's fakes mint the received row count)."""
    deepep_prime_rl.create_buffer(_Group2(), HIDDEN * 2, backend="reference")
    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(5, HIDDEN, dtype=torch.bfloat16)
        idx, w = torch.zeros(5, TOPK, dtype=torch.int64), torch.empty(5, TOPK)
        recv_x, recv_w, order, counts, handle_id = torch.ops.deepep.dispatch(x, idx, w, EXPERTS)
        assert recv_x.shape[1] == HIDDEN and recv_w.shape[1] == TOPK and counts.shape == (2,)
        assert handle_id.shape == (1,) and handle_id.device.type == "cpu"
        assert torch.ops.deepep.combine(recv_x, handle_id, 5).shape == (5, HIDDEN)
        gx, gw = torch.ops.deepep.dispatch_backward(recv_x, recv_w, handle_id, 5)
        assert gx.shape == (5, HIDDEN) and gw.shape == (5, TOPK)
        back = torch.ops.deepep.combine_backward(x, handle_id, recv_x.shape[0])
        assert back.shape == recv_x.shape


class _Group2:
    def size(self):
        return 2

    def rank(self):
        return 0


# --- semantics and gradients on 2 gloo ranks ----------------------------------------------------


def _all_inputs(world, tokens=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, HIDDEN, generator=gen).bfloat16() for _ in range(world)]
    scores = [torch.rand(tokens, TOPK, generator=gen) for _ in range(world)]
    idx = [torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(tokens)])
           for _ in range(world)]  # fmt: skip
    scores[0][1, 1] = 0.0  # a zero score: prime-rl routes that choice nowhere (-1)
    weights = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=gen) / 3
    return xs, scores, idx, weights


def _reference(xs, scores, idx, weights):
    """float64: y[t] = sum_k s[t, k] * x[t] @ W[idx[t, k]], with grads by plain autograd; a
    choice whose score is 0 is routed nowhere (prime-rl masks it to -1), so it gets no grad."""
    x = torch.cat(xs).double().requires_grad_()
    s = torch.cat(scores).double().requires_grad_()
    w = weights.double().requires_grad_()
    i = torch.cat(idx)
    per_choice = torch.einsum("th,tkhd->tkd", x, w[i])
    used = torch.where(s.detach() != 0, s, 0.0)
    y = (per_choice * used[..., None]).sum(1)
    return x, s, w, y


def _close(got, ref, rel=3e-2):
    err = (got.double() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max error {err} vs {ref.abs().max().item()}"


def _moe_body(rank, world):
    import torch.distributed as dist

    xs, scores, idx, weights = _all_inputs(world)
    local = EXPERTS // world
    deepep_prime_rl.create_buffer(dist.group.WORLD, HIDDEN * 2, backend="reference")
    x = xs[rank].clone().requires_grad_()
    top = scores[rank].clone().requires_grad_()
    w = weights[rank * local : (rank + 1) * local].clone().requires_grad_()

    # DeepEPTokenDispatcher.dispatch (score_before_experts=True)
    top_scores = top.float().contiguous()
    selected = idx[rank].masked_fill(top_scores == 0, -1).contiguous()
    recv_x, recv_scores, order, counts, handle_id = torch.ops.deepep.dispatch(
        x, selected, top_scores, EXPERTS
    )
    token_indices = order // selected.shape[1]
    sorted_scores = recv_scores.flatten()[order]
    routed = (recv_x[token_indices].float() * sorted_scores.reshape(-1, 1)).to(x.dtype)
    # the local experts, one GEMM per expert over its rows (counts are per local expert)
    outs = [part.float() @ w[e] for e, part in enumerate(routed.split(counts.tolist()))]
    routed_output = torch.cat(outs).to(x.dtype)
    # DeepEPTokenDispatcher.combine -> _scatter_routed_output -> deepep::combine
    dim = routed_output.shape[-1]
    scattered = routed_output.new_zeros((recv_x.shape[0], dim)).scatter_add(
        0, token_indices.reshape(-1, 1).expand(-1, dim), routed_output
    )
    y = torch.ops.deepep.combine(scattered, handle_id, x.shape[0])

    rx, rs, rw, ry = _reference(xs, scores, idx, weights)
    rows = slice(rank * x.shape[0], (rank + 1) * x.shape[0])
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    _close(y, ry[rows].detach())
    grad = torch.randn(ry.shape, generator=torch.Generator().manual_seed(1))
    (ry * grad).sum().backward()
    (y.float() * grad[rows]).sum().backward()
    _close(x.grad, rx.grad[rows])
    _close(top.grad, rs.grad[rows])
    _close(w.grad, rw.grad[rank * local : (rank + 1) * local])
    if rank == 0:
        assert top.grad[1, 1] == 0  # the zero-score choice went nowhere

    # Handles are freed as prime-rl frees them: with the last tensor sharing handle_id's storage.
    assert deepep_prime_rl.live_handles() == 1
    del recv_x, recv_scores, order, counts, handle_id, token_indices, sorted_scores
    del routed, outs, routed_output, scattered, y
    gc.collect()
    assert deepep_prime_rl.live_handles() == 0


@pytest.mark.slow
def test_prime_rl_moe_layer_on_two_ranks():
    run_distributed(_moe_body, 2)
