"""prime_ops.deepep.Dispatcher: deepep::dispatcher_dispatch / dispatcher_combine.

Semantics and gradients run on 2 and 4 gloo ranks through the reference backend (DeepEP's rules
over all_to_all) against a single-process float64 model written with plain autograd. The exact
calls into ``deep_ep.Buffer`` are checked against a recording stand-in.
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
from torch.library import opcheck
from torch.utils.checkpoint import CheckpointPolicy

import prime_ops
from prime_ops import deepep

HIDDEN, TOPK, EXPERTS = 8, 2, 4


# --- recording stand-in for deep_ep ------------------------------------------------------------


class _Config:
    def get_nvl_buffer_size_hint(self, hidden_bytes, ranks):
        return 1000 + hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes, ranks):
        return 10 * ranks


class _Buffer:
    """Records every call to deep_ep.Buffer. Its results only have the right shapes (every token
    "arrives" once): semantics are tested on gloo with the reference backend."""

    calls: list = []

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, **kwargs):
        self.calls.append(("Buffer", group, num_nvl_bytes, num_rdma_bytes, kwargs))

    get_dispatch_config = staticmethod(lambda ranks: _Config())
    get_combine_config = staticmethod(lambda ranks: _Config())

    def get_dispatch_layout(self, topk_idx, num_experts):
        self.calls.append(("get_dispatch_layout", topk_idx, num_experts))
        per_expert = torch.bincount(topk_idx.flatten(), minlength=num_experts).int()
        in_rank = torch.ones(topk_idx.shape[0], 2, dtype=torch.bool)
        per_rank = torch.tensor([topk_idx.shape[0]] * 2, dtype=torch.int32)
        return per_rank, None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, **kwargs):
        if handle is not None:
            self.calls.append(("cached_dispatch", x, handle, kwargs))
            return x.clone(), None, None, None, None, None
        self.calls.append(("dispatch", x, kwargs))
        align = kwargs["expert_alignment"]
        counts = [-(-int(c) // align) * align for c in kwargs["num_tokens_per_expert"][:2]]
        topk_idx, topk_weights = kwargs["topk_idx"], kwargs["topk_weights"]
        layout = (topk_idx.clone(), x.shape[0])  # equal routing, equal layout
        self.calls.append(("layout", layout))
        recv_idx = torch.where(topk_idx < 2, topk_idx, -1)
        recv_weights = torch.where(recv_idx >= 0, topk_weights, 0.0)
        return x.clone(), recv_idx, recv_weights, counts, layout, None

    def combine(self, x, handle, topk_weights=None, **kwargs):
        self.calls.append(("combine", x, handle, topk_weights, kwargs))
        weights = None if topk_weights is None else topk_weights.clone()
        return x.clone(), weights, None


class _Group:
    def __init__(self, ranks=2):
        self.ranks = ranks

    def size(self):
        return self.ranks

    def rank(self):
        return 0


@pytest.fixture
def backend(monkeypatch):
    module = types.ModuleType("deep_ep")
    module.Buffer = _Buffer
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    monkeypatch.setattr(_Buffer, "calls", [])
    return _Buffer.calls


def _names(calls):
    return [c[0] for c in calls if c[0] != "layout"]


def _inputs(tokens=5, gen_seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(gen_seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16().requires_grad_(requires_grad)
    scores = torch.randn(tokens, EXPERTS, generator=gen).softmax(-1)
    weights, idx = torch.topk(scores, TOPK)
    return x, idx, weights.requires_grad_(requires_grad)


def _dispatcher(**kwargs):
    return deepep.Dispatcher(_Group(), num_experts=EXPERTS, hidden=HIDDEN, **kwargs)


# --- front and adapter -------------------------------------------------------------------------


def test_dispatcher_creates_the_buffer_at_construction(backend):
    group = _Group(2)
    dispatcher = deepep.Dispatcher(group, num_experts=EXPERTS, hidden=HIDDEN)
    assert backend == [("Buffer", group, 1000 + 2 * HIDDEN, 20, {})]
    assert dispatcher.num_local_experts == 2
    deepep.Dispatcher(group, num_experts=4, hidden=8, num_nvl_bytes=7, num_rdma_bytes=0, x=1)
    assert backend[-1] == ("Buffer", group, 7, 0, {"x": 1})


def test_dispatch_and_combine_make_the_exact_backend_calls(backend):
    dispatcher = _dispatcher(expert_alignment=4)
    x, idx, weights = _inputs()
    out = dispatcher.dispatch(x, idx, weights)
    layout_call, dispatch_call, (_, layout) = backend[1:4]
    assert layout_call[0] == "get_dispatch_layout"
    assert layout_call[1] is idx and layout_call[2] == EXPERTS
    assert dispatch_call[1] is x
    kwargs = dispatch_call[2]
    assert kwargs["topk_idx"] is idx and kwargs["topk_weights"] is weights
    assert kwargs["expert_alignment"] == 4
    assert (
        kwargs["num_tokens_per_expert"].tolist()
        == torch.bincount(idx.flatten(), minlength=EXPERTS).tolist()
    )
    assert set(kwargs) == {
        "topk_idx",
        "topk_weights",
        "num_tokens_per_rank",
        "num_tokens_per_rdma_rank",
        "is_token_in_rank",
        "num_tokens_per_expert",
        "expert_alignment",
    }
    assert out.tokens_per_expert.dtype == torch.int64 and out.tokens_per_expert.device.type == "cpu"
    assert out.handle.dtype == torch.int64 and out.handle.tolist() == [dispatcher.key, 0]
    assert out.num_tokens == 5
    combined = dispatcher.combine(out.x * 2, out)
    name, cx, chandle, cweights, _ = backend[-1]
    assert name == "combine" and chandle is layout and cweights is None
    torch.testing.assert_close(combined, x * 2)


def test_topk_idx_travels_in_deep_eps_index_type(backend, monkeypatch):
    monkeypatch.setattr(sys.modules["deep_ep"], "topk_idx_t", torch.int32, raising=False)
    dispatcher = _dispatcher()
    x, idx, weights = _inputs()
    out = dispatcher.dispatch(x, idx, weights)
    layout_call, dispatch_call = backend[1:3]
    assert layout_call[1].dtype == torch.int32 and dispatch_call[2]["topk_idx"].dtype == torch.int32
    assert torch.equal(layout_call[1], idx.int()) and out.topk_idx.dtype == torch.int64


def test_backward_is_a_masked_combine_and_a_cached_dispatch(backend):
    dispatcher = _dispatcher()
    x, idx, weights = _inputs(requires_grad=True)
    d = dispatcher.dispatch(x, idx, weights)
    h = d.x * d.topk_weights.sum(-1, keepdim=True).bfloat16()
    dispatcher.combine(h, d).float().sum().backward()
    (_, layout) = next(c for c in backend if c[0] == "layout")
    assert _names(backend)[-4:] == ["dispatch", "combine", "cached_dispatch", "combine"]
    cached, backward_combine = backend[-2], backend[-1]
    assert cached[2] is layout and backward_combine[2] is layout
    # The weight gradients travel back zeroed where the received index is -1 (masked copy).
    sent = backward_combine[3]
    assert torch.all(sent[d.topk_idx < 0] == 0) and torch.all(sent[d.topk_idx >= 0] != 0)


# --- handle lifetime ---------------------------------------------------------------------------


def test_handles_do_not_leak(backend):
    dispatcher = _dispatcher()
    x, idx, weights = _inputs()
    for _ in range(300):
        out = dispatcher.dispatch(x, idx, weights)
        dispatcher.combine(out.x, out)
    del out
    gc.collect()
    assert dispatcher.live_handles() == 0
    x, idx, weights = _inputs(requires_grad=True)
    for _ in range(50):
        out = dispatcher.dispatch(x, idx, weights)
        dispatcher.combine(out.x, out).float().sum().backward()
    assert dispatcher.live_handles() == 1 and deepep.live_handles() >= 1
    del out
    gc.collect()
    assert dispatcher.live_handles() == 0


def test_handle_values_are_stable_and_aliases_resolve(backend):
    dispatcher = _dispatcher()
    x, idx, weights = _inputs()
    first, second = dispatcher.dispatch(x, idx, weights), dispatcher.dispatch(x, idx, weights)
    # Equal layouts share one handle value (what compiled-vs-eager comparisons need) ...
    assert torch.equal(first.handle, second.handle) and dispatcher.live_handles() == 1
    # ... different layouts do not.
    other = dispatcher.dispatch(x, idx.flip(-1), weights)
    assert other.handle.tolist() == [dispatcher.key, 1] and dispatcher.live_handles() == 2
    alias = first.handle.detach()[0:2]
    out = first._replace(handle=alias)
    del first, second
    gc.collect()
    torch.testing.assert_close(dispatcher.combine(out.x, out), x)  # no use after free
    assert dispatcher.live_handles() == 2


def test_released_and_fabricated_handles(backend):
    dispatcher, other = _dispatcher(), _dispatcher()
    x, idx, weights = _inputs()
    out = dispatcher.dispatch(x, idx, weights)
    copy = out.handle.clone()
    torch.testing.assert_close(dispatcher.combine(out.x, out._replace(handle=copy)), x)
    with pytest.raises(ValueError, match=f"belongs to Dispatcher {dispatcher.key}, not"):
        other.combine(out.x, out)
    with pytest.raises(ValueError, match=r"x must have shape \[5, 8\]"):
        dispatcher.combine(out.x[:4], out)
    with pytest.raises(ValueError, match="num_tokens=4 but the handle's dispatch sent 5"):
        dispatcher.combine(out.x, out._replace(num_tokens=4))
    fabricated = torch.tensor([dispatcher.key, 7])
    with pytest.raises(ValueError, match=r"unknown DeepEP handle \[\d+, 7\]"):
        dispatcher.combine(out.x, out._replace(handle=fabricated))
    out = out._replace(handle=copy)
    gc.collect()
    with pytest.raises(ValueError, match="handle 0 was already released"):
        dispatcher.combine(out.x, out)
    assert _names(backend).count("combine") == 1  # every check ran before communication


# --- fakes -------------------------------------------------------------------------------------


def test_fakes_on_fake_cuda_without_deep_ep(backend, monkeypatch):
    dispatcher = _dispatcher()
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # from here on the backend is absent
    calls = len(backend)
    # Autograd on fake CUDA tensors aborts a CPU-only build, so backward ops are called directly.
    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(6, HIDDEN, dtype=torch.bfloat16, device="cuda")
        idx = torch.empty(6, TOPK, dtype=torch.int64, device="cuda")
        weights = torch.empty(6, TOPK, device="cuda")
        out = dispatcher.dispatch(x, idx, weights)
        received = out.x.shape[0]
        assert isinstance(received, torch.SymInt)  # data-dependent
        assert out.x.device.type == "cuda" and out.x.shape[1] == HIDDEN
        assert out.topk_idx.shape == (received, TOPK) and out.topk_weights.shape[0] == received
        assert out.tokens_per_expert.shape == (2,) and out.tokens_per_expert.device.type == "cpu"
        assert out.handle.shape == (2,) and out.handle.device.type == "cpu"
        combined = dispatcher.combine(out.x, out)
        assert combined.shape == (6, HIDDEN) and combined.device.type == "cuda"
        gx, gw = torch.ops.deepep.dispatcher_dispatch_backward(
            out.x, out.topk_weights, out.topk_idx, out.handle, dispatcher.key, 6
        )
        assert gx.shape == (6, HIDDEN) and gw.shape == (6, TOPK)
        back = torch.ops.deepep.dispatcher_combine_backward(
            combined, out.handle, dispatcher.key, received
        )
        assert back.shape[0] == received
    assert len(backend) == calls  # fakes never call the backend


# --- prime_ac ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op",
    [
        f"{prefix}{name}"
        for prefix in ("", "dispatcher_")
        for name in ("dispatch", "combine", "dispatch_backward", "combine_backward")
    ],
)
def test_deepep_ops_are_mandatory_in_every_mode(op):
    import prime_ac

    overload = getattr(torch.ops.deepep, op).default
    for policy in (
        prime_ac.make_policy("full"),
        prime_ac.make_policy("selective"),
        prime_ac.make_policy("selective", targets=[]),
    ):
        assert policy(None, overload) == CheckpointPolicy.MUST_SAVE


class _MoE(torch.nn.Module):
    def __init__(self, dispatcher, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.dispatcher = dispatcher
        self.router = torch.nn.Parameter(torch.randn(HIDDEN, EXPERTS, generator=gen))
        self.expert = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen))

    def forward(self, x):
        weights, idx = torch.topk((x.float() @ self.router).softmax(-1), TOPK)
        d = self.dispatcher.dispatch(x, idx, weights)
        h = torch.tanh(d.x.float() @ self.expert) * d.topk_weights.sum(-1, keepdim=True)
        return x + self.dispatcher.combine(h.bfloat16(), d)


class _Model(torch.nn.Module):
    def __init__(self, dispatcher):
        super().__init__()
        self.layers = torch.nn.ModuleList(_MoE(dispatcher, seed) for seed in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_never_calls_deep_ep_again(backend, mode):
    import prime_ac

    model = _Model(_dispatcher())
    x, _, _ = _inputs(requires_grad=True)
    model(x).float().sum().backward()
    expected = [x.grad] + [p.grad for p in model.parameters()]
    plain_calls = _names(backend)
    x.grad = None
    model.zero_grad()
    del backend[:]
    assert prime_ac.checkpoint_blocks(model, mode=mode, blocks="layers") == [
        "layers.0",
        "layers.1",
    ]
    model(x).float().sum().backward()
    # The same backend calls as without checkpointing: none is replayed.
    assert _names(backend) == plain_calls[1:]
    assert _names(backend).count("dispatch") == 2
    got = [x.grad] + [p.grad for p in model.parameters()]
    for g, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(g, ref)


# --- errors (all raised before any backend call) ------------------------------------------------


def test_missing_deep_ep_gives_the_build_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)
    with pytest.raises(prime_ops.BackendUnavailable, match=r"git clone .*DeepEP.*install\.sh") as e:
        _dispatcher()
    # the extra installs NVSHMEM; DeepEP itself is built from source
    assert "pip install 'prime-ops[deepep]'" in str(e.value)


def test_bad_construction(backend):
    for ranks in (1, 3, 12):
        with pytest.raises(ValueError, match=f"the group has {ranks} rank"):
            deepep.Dispatcher(_Group(ranks), num_experts=24, hidden=HIDDEN)
    with pytest.raises(ValueError, match="num_experts=3 must be a positive multiple"):
        deepep.Dispatcher(_Group(2), num_experts=3, hidden=HIDDEN)
    for hidden in (0, 12):
        with pytest.raises(ValueError, match=f"hidden={hidden} must be a positive multiple of 8"):
            deepep.Dispatcher(_Group(2), num_experts=4, hidden=hidden)
    with pytest.raises(ValueError, match="backend must be one of"):
        deepep.Dispatcher(_Group(2), num_experts=4, hidden=8, backend="nccl")
    assert backend == []


def test_group_sizes_deep_ep_has_no_config_for_are_refused_before_any_buffer(backend):
    """DeepEP's configs cover 2, 4, ..., 160 ranks (``deep_ep/buffers/legacy.py``); 40, 56, 72
    are multiples of 8 that main accepted and DeepEP's size hints then refused."""
    from prime_ops import deepep_prime_rl

    for ranks in (40, 56, 72, 80, 112, 192, 6, 12):
        for make, kwargs in (
            (deepep.Dispatcher, {"num_experts": ranks * 2, "hidden": HIDDEN}),
            (deepep_prime_rl.create_buffer, {"hidden_bytes": HIDDEN * 2}),
        ):
            with pytest.raises(ValueError, match=f"the group has {ranks} rank") as info:
                make(_Group(ranks), **kwargs)
            assert "2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160 ranks only" in str(info.value)
    assert backend == []
    for ranks in deepep.EP_SIZES:
        deepep.Dispatcher(_Group(ranks), num_experts=ranks, hidden=HIDDEN)
    assert len(backend) == len(deepep.EP_SIZES)


@pytest.mark.parametrize("group", ["WORLD", None, 0])
def test_a_group_that_is_no_group_is_named(backend, group):
    from prime_ops import deepep_prime_rl

    with pytest.raises(TypeError, match="Dispatcher: group must be a torch.distributed.Process"):
        deepep.Dispatcher(group, num_experts=4, hidden=HIDDEN)
    with pytest.raises(TypeError, match="create_buffer: group must be a torch.distributed.Proc"):
        deepep_prime_rl.create_buffer(group, HIDDEN * 2, backend="reference")
    assert backend == []


def test_none_for_a_tensor_is_named(backend, monkeypatch):
    """A schema's Tensor lets None through to the kernel and the fake: both name the argument."""
    from prime_ops import deepep_prime_rl

    dispatcher = _dispatcher()
    x, idx, weights = _inputs()
    monkeypatch.setattr(deepep_prime_rl, "_current", None)
    deepep_prime_rl.create_buffer(_Group(2), HIDDEN * 2, backend="reference")
    key = dispatcher.key
    handle_id = torch.tensor([1])
    cases = [
        (torch.ops.deepep.dispatch, (None, idx, weights, 4), "deepep::dispatch: x must be"),
        (torch.ops.deepep.dispatch, (x, None, weights, 4), "dispatch: topk_idx must be a"),
        (torch.ops.deepep.dispatch, (x, idx, None, 4), "dispatch: topk_weights must be a"),
        (torch.ops.deepep.combine, (None, handle_id, 5), "deepep::combine: x must be a"),
        (torch.ops.deepep.combine, (x, None, 5), "deepep::combine: handle_id must be a"),
        (torch.ops.deepep.combine_backward, (x, None, 5), "combine: handle_id must be a"),
        (torch.ops.deepep.dispatcher_dispatch, (None, idx, weights, key, 4, 2, 1), "x must be"),
        (torch.ops.deepep.dispatcher_combine, (x, None, key, 5), "handle must be a tensor"),
    ]
    for op, args, match in cases:
        with pytest.raises(TypeError, match=match):
            op(*args)
        with FakeTensorMode() as mode, pytest.raises(TypeError, match=match):
            op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert _names(backend) == ["Buffer"]


def test_bad_dispatch_inputs(backend):
    dispatcher = _dispatcher()
    x, idx, weights = _inputs()
    bad = [
        ((x.float(), idx, weights), "x must be a \\[tokens, hidden\\] bfloat16"),
        ((x.T.contiguous().T, idx, weights), "x must be a \\[tokens, hidden\\]|contiguous"),
        ((torch.zeros(5, 16, dtype=torch.bfloat16), idx, weights), "x has 16 columns but"),
        ((x, idx.int(), weights), "topk_idx must be int64"),
        ((x, idx.T.contiguous().T, weights), "topk_idx must be contiguous"),
        ((x, idx, weights.bfloat16()), "topk_weights must be float32"),
        ((x, idx, weights.T.contiguous().T), "topk_weights must be contiguous"),
        ((x, idx.masked_fill(idx == 1, EXPERTS), weights), r"\[-1, num_experts=4\).*\[4"),
        ((x, idx.masked_fill(idx == 1, -2), weights), r"\[-1, num_experts=4\).*\[-2"),
        ((x, idx.to("meta"), weights), "one device, got x on cpu, topk_idx on meta"),
        ((x.to("meta"), idx, weights), "one device, got x on meta"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            dispatcher.dispatch(*args)
    with pytest.raises(RuntimeError, match="no live prime_ops.deepep.Dispatcher"):
        torch.ops.deepep.dispatcher_dispatch(x, idx, weights, -1, EXPERTS, 2, 1)
    with pytest.raises(ValueError, match="differ from Dispatcher"):
        torch.ops.deepep.dispatcher_dispatch(x, idx, weights, dispatcher.key, EXPERTS, 2, 4)
    out = dispatcher.dispatch(x, idx, weights)
    with pytest.raises(ValueError, match="handle must be the CPU int64 tensor"):
        dispatcher.combine(out.x, out._replace(handle=out.handle.int()))
    assert _names(backend) == ["Buffer", "get_dispatch_layout", "dispatch"]


# --- the reference backend on gloo --------------------------------------------------------------


def _rank_inputs(rank, world, experts, topk, seed=0):
    """Rank ``rank``'s tokens, routing (with -1 slots and an unrouted token) and loss weights."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    tokens = (6, 0, 5, 3)[rank] if world == 4 else 7 - rank
    x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
    idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :topk]  # distinct experts
    idx = idx.masked_fill(torch.rand(tokens, topk, generator=gen) < 0.2, -1)
    if tokens:
        idx[-1] = -1
    weights = torch.rand(tokens, topk, generator=gen)
    grad = torch.randn(tokens, HIDDEN, generator=gen)
    return x, idx, weights, grad


def _experts(experts):
    return torch.randn(experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7)) / 3


def _expert_fn(x, idx, weights, experts_w):
    """A rank's expert work on its received rows: the routed mixture plus a term that reads every
    weight slot (masked ones too), so a wrong masking rule changes the weight gradient."""
    y = weights.sum(-1, keepdim=True) * x
    for k in range(idx.shape[1]):
        chosen = idx[:, k].clamp(min=0)
        h = torch.tanh(torch.einsum("th,thd->td", x, experts_w[chosen]))
        y = y + torch.where(idx[:, k : k + 1] >= 0, weights[:, k : k + 1] * h, 0.0)
    return y


def _reference(world, experts, topk):
    """Every rank's output and input gradients, in one process, float64, plain autograd."""
    local = experts // world
    w_all = _experts(experts).double()
    outs, grads = [], []
    for r in range(world):
        x, idx, weights, grad = _rank_inputs(r, world, experts, topk)
        x = x.double().requires_grad_()
        weights = weights.double().requires_grad_()
        out = torch.zeros_like(x)
        for j in range(world):
            mine = (idx >= j * local) & (idx < (j + 1) * local)
            rows = mine.any(-1)
            local_idx = torch.where(mine, idx - j * local, -1)[rows]
            masked = torch.where(mine, weights, 0.0)[rows]
            h = _expert_fn(x[rows], local_idx, masked, w_all[j * local : (j + 1) * local])
            out = out.index_add(0, rows.nonzero()[:, 0], h)
        (out * grad.double()).sum().backward()
        outs.append(out.detach())
        grads.append((x.grad, weights.grad))
    return outs, grads


def _close(got, ref, rel=1e-2):
    err = (got.double() - ref).abs().max() if got.numel() else 0.0
    assert err <= rel * max(ref.abs().max().item() if ref.numel() else 0.0, 1.0), float(err)


def _reference_body(rank, world):
    group = torch.distributed.group.WORLD
    experts, topk = 2 * world, 3
    local = experts // world
    dispatcher = deepep.Dispatcher(
        group, num_experts=experts, hidden=HIDDEN, backend="reference", expert_alignment=4
    )
    x, idx, weights, grad = _rank_inputs(rank, world, experts, topk)
    x.requires_grad_()
    weights.requires_grad_()
    d = dispatcher.dispatch(x, idx, weights)

    # Layout, ordering and masking, as DeepEP's own intranode test checks them.
    inputs = [_rank_inputs(r, world, experts, topk) for r in range(world)]
    rows, idxs, ws = [], [], []
    for sx, sidx, sw, _ in inputs:
        mine = (sidx >= rank * local) & (sidx < (rank + 1) * local)
        sel = mine.any(-1)  # ordered by source rank, then token index
        rows.append(sx[sel])
        idxs.append(torch.where(mine, sidx - rank * local, -1)[sel])
        ws.append(torch.where(mine, sw, 0.0)[sel])
    assert torch.equal(d.x, torch.cat(rows))
    assert torch.equal(d.topk_idx, torch.cat(idxs))
    assert torch.equal(d.topk_weights, torch.cat(ws))
    counts = [int((d.topk_idx == e).sum()) for e in range(local)]
    assert d.tokens_per_expert.tolist() == [-(-c // 4) * 4 for c in counts]

    # Forward and every input gradient against the single-process model.
    h = _expert_fn(d.x.float(), d.topk_idx, d.topk_weights, _experts(experts)[rank * local :])
    out = dispatcher.combine(h.bfloat16(), d)
    (out.float() * grad).sum().backward()
    ref_outs, ref_grads = _reference(world, experts, topk)
    _close(out, ref_outs[rank])
    _close(x.grad, ref_grads[rank][0])
    _close(weights.grad, ref_grads[rank][1])
    del d, out
    gc.collect()
    assert dispatcher.live_handles() == 0
    if world == 2:  # one process start for these checks
        _opchecks(rank, world)
        _fault_checks(rank, world)


def _fault_checks(rank, world):
    """One rank's bad call: in the default mode its error says first that the peers may wait
    (every rank makes the same bad call here, so none waits); in checked mode a bad call on one
    rank, or settings that differ across ranks, make every rank raise before any dispatch."""
    from prime_ops import deepep_prime_rl
    from prime_ops.groups import set_checked

    group = torch.distributed.group.WORLD
    dispatcher = deepep.Dispatcher(group, num_experts=4, hidden=HIDDEN, backend="reference")
    deepep_prime_rl.create_buffer(group, HIDDEN * 2, backend="reference")
    x, idx, weights, _ = _rank_inputs(rank, world, 4, 2)
    out_of_range = idx.masked_fill(idx == 1, 9)
    for op, call in (
        ("deepep::dispatcher_dispatch", lambda i: dispatcher.dispatch(x, i, weights)),
        ("deepep::dispatch", lambda i: torch.ops.deepep.dispatch(x, i, weights, 4)),
    ):
        with pytest.raises(ValueError, match="topk_idx values must lie") as info:
            call(out_of_range)
        message = str(info.value)
        assert message.startswith(f"[{op} raised this on rank {rank} of 2"), message
        assert "may be waiting" in message and "Checked mode catches it" in message
    set_checked(True, group)
    try:
        for call in (
            lambda i: dispatcher.dispatch(x, i, weights),
            lambda i: torch.ops.deepep.dispatch(x, i, weights, 4),
        ):
            with pytest.raises(ValueError, match="rank 0 of the group rejected its call"):
                call(out_of_range if rank == 0 else idx)
        experts = 4 if rank == 0 else 8  # locally valid, different across ranks
        with pytest.raises(ValueError, match="do not fit together: num_experts"):
            torch.ops.deepep.dispatch(x, idx, weights, experts)
        d = dispatcher.dispatch(x, idx, weights)
        recv_x, _, _, _, handle_id = torch.ops.deepep.dispatch(x, idx, weights, 4)
        with pytest.raises(ValueError, match="rank 1 of the group rejected its call"):
            torch.ops.deepep.combine(recv_x, handle_id, x.shape[0] + (rank == 1))
        with pytest.raises(ValueError, match="rank 0 of the group rejected its call"):
            dispatcher.combine(d.x[1:] if rank == 0 else d.x, d)
        torch.testing.assert_close(
            torch.ops.deepep.combine(recv_x, handle_id, x.shape[0]), dispatcher.combine(d.x, d)
        )
    finally:
        set_checked(False, group)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_reference_backend_matches_single_process_autograd_and_opcheck(world):
    run_distributed(_reference_body, world, timeout=90)


def _opchecks(rank, world):
    group = torch.distributed.group.WORLD
    dispatcher = deepep.Dispatcher(group, num_experts=4, hidden=HIDDEN, backend="reference")
    x, idx, weights, _ = _rank_inputs(rank, world, 4, 2)
    x.requires_grad_()
    weights.requires_grad_()
    args = (x, idx, weights, dispatcher.key, 4, 2, 1)
    opcheck(torch.ops.deepep.dispatcher_dispatch.default, args)
    d = dispatcher.dispatch(x.detach(), idx, weights.detach())
    recv = d.x.clone().requires_grad_()
    combine_args = (recv, d.handle, dispatcher.key, d.num_tokens)
    opcheck(torch.ops.deepep.dispatcher_combine.default, combine_args)
    back = (d.x, d.topk_weights, d.topk_idx, d.handle, dispatcher.key, d.num_tokens)
    opcheck(torch.ops.deepep.dispatcher_dispatch_backward.default, back)
    grad = x.detach() * 2
    back_args = (grad, d.handle, dispatcher.key, len(d.x))
    opcheck(torch.ops.deepep.dispatcher_combine_backward.default, back_args)
