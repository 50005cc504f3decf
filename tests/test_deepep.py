"""deepep::dispatch / deepep::combine against a single-rank stand-in for deep_ep."""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils.checkpoint import CheckpointPolicy

import prime_ops
from prime_ops import deepep

HIDDEN, TOPK, EXPERTS = 8, 2, 4


class _Config:
    def get_nvl_buffer_size_hint(self, hidden_bytes, ranks):
        return 1000 + hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes, ranks):
        return 10 * ranks


class _Buffer:
    """deep_ep.Buffer on one rank: every token stays here, so dispatch and combine copy.

    Records every call; the layout handle is an opaque object whose identity tests follow.
    """

    calls: list = []

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, **kwargs):
        self.calls.append(("Buffer", group, num_nvl_bytes, num_rdma_bytes, kwargs))

    get_dispatch_config = staticmethod(lambda ranks: _Config())
    get_combine_config = staticmethod(lambda ranks: _Config())

    def get_dispatch_layout(self, topk_idx, num_experts):
        self.calls.append(("get_dispatch_layout", topk_idx, num_experts))
        per_expert = torch.bincount(topk_idx.flatten(), minlength=num_experts).int()
        in_rank = torch.ones(topk_idx.shape[0], 1, dtype=torch.bool)
        return torch.tensor([topk_idx.shape[0]], dtype=torch.int32), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, **kwargs):
        if handle is not None:
            self.calls.append(("cached_dispatch", x, handle, kwargs))
            return x.clone(), None, None, None, None, None
        self.calls.append(("dispatch", x, kwargs))
        align = kwargs["expert_alignment"]
        counts = [-(-int(c) // align) * align for c in kwargs["num_tokens_per_expert"]]
        layout = object()
        self.calls.append(("layout", layout))
        topk_idx, topk_weights = kwargs["topk_idx"], kwargs["topk_weights"]
        return x.clone(), topk_idx.clone(), topk_weights.clone(), counts, layout, None

    def combine(self, x, handle, topk_weights=None, **kwargs):
        self.calls.append(("combine", x, handle, topk_weights, kwargs))
        weights = None if topk_weights is None else topk_weights.clone()
        return x.clone(), weights, None


class _Group:
    def __init__(self, ranks=1):
        self.ranks = ranks

    def size(self):
        return self.ranks


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


# --- front and adapter -------------------------------------------------------------------------


def test_dispatcher_creates_the_buffer_at_construction(backend):
    group = _Group(2)
    dispatcher = deepep.Dispatcher(group, num_experts=EXPERTS, hidden=HIDDEN)
    assert backend == [("Buffer", group, 1000 + 2 * HIDDEN, 20, {})]
    assert dispatcher.num_local_experts == 2
    deepep.Dispatcher(group, num_experts=4, hidden=8, num_nvl_bytes=7, num_rdma_bytes=0, x=1)
    assert backend[-1] == ("Buffer", group, 7, 0, {"x": 1})


def test_dispatch_and_combine_make_the_exact_backend_calls(backend):
    dispatcher = deepep.Dispatcher(_Group(), num_experts=EXPERTS, hidden=HIDDEN, expert_alignment=4)
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
    assert torch.equal(out.x, x) and torch.equal(out.topk_idx, idx)
    assert out.tokens_per_expert.dtype == torch.int64 and out.tokens_per_expert.device.type == "cpu"
    assert all(c % 4 == 0 for c in out.tokens_per_expert.tolist())
    assert out.handle.dtype == torch.int64 and out.handle.shape == (1,)
    assert out.num_tokens == 5
    combined = dispatcher.combine(out.x * 2, out)
    name, cx, chandle, cweights, _ = backend[-1]
    assert name == "combine" and chandle is layout and cweights is None
    torch.testing.assert_close(combined, x * 2)


def test_gradients_are_combine_and_cached_dispatch(backend):
    dispatcher = deepep.Dispatcher(_Group(), num_experts=EXPERTS, hidden=HIDDEN)
    x, idx, weights = _inputs(requires_grad=True)
    expert = torch.randn(HIDDEN, HIDDEN).bfloat16()

    def moe(x, weights, through_deepep):
        if through_deepep:
            d = dispatcher.dispatch(x, idx, weights)
            h = (d.x @ expert) * d.topk_weights.sum(-1, keepdim=True).bfloat16()
            return dispatcher.combine(h, d)
        return (x @ expert) * weights.sum(-1, keepdim=True).bfloat16()

    moe(x, weights, True).float().sum().backward()
    grads = x.grad, weights.grad
    (_, layout) = next(c for c in backend if c[0] == "layout")
    assert _names(backend) == [
        "Buffer",
        "get_dispatch_layout",
        "dispatch",
        "combine",
        "cached_dispatch",
        "combine",
    ]
    cached, backward_combine = backend[-2], backend[-1]
    assert cached[2] is layout and backward_combine[2] is layout
    assert backward_combine[3] is not None  # the top-k weight gradients travel back too
    x.grad = weights.grad = None
    moe(x, weights, False).float().sum().backward()
    torch.testing.assert_close(grads[0], x.grad)
    torch.testing.assert_close(grads[1], weights.grad)


# --- handle lifetime ---------------------------------------------------------------------------


def test_handles_do_not_leak(backend):
    dispatcher = deepep.Dispatcher(_Group(), num_experts=EXPERTS, hidden=HIDDEN)
    before = deepep.live_handles()
    x, idx, weights = _inputs()
    for _ in range(3000):
        out = dispatcher.dispatch(x, idx, weights)
        dispatcher.combine(out.x, out)
    del out
    gc.collect()
    assert deepep.live_handles() == before
    x, idx, weights = _inputs(requires_grad=True)
    for _ in range(300):
        out = dispatcher.dispatch(x, idx, weights)
        dispatcher.combine(out.x, out).float().sum().backward()
    del out
    gc.collect()
    assert deepep.live_handles() == before


def test_aliases_keep_the_handle_and_copies_do_not(backend):
    dispatcher = deepep.Dispatcher(_Group(), num_experts=EXPERTS, hidden=HIDDEN)
    x, idx, weights = _inputs()
    out = dispatcher.dispatch(x, idx, weights)
    alias, copy = out.handle.detach()[0:1], out.handle.clone()
    out = out._replace(handle=alias)
    gc.collect()
    torch.testing.assert_close(dispatcher.combine(out.x, out), x)  # no use after free
    del alias
    out = out._replace(handle=copy)
    gc.collect()
    with pytest.raises(RuntimeError, match="already released"):
        dispatcher.combine(out.x, out)


# --- fakes -------------------------------------------------------------------------------------


def test_fakes_on_fake_cuda_without_deep_ep(backend, monkeypatch):
    dispatcher = deepep.Dispatcher(_Group(2), num_experts=EXPERTS, hidden=HIDDEN)
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
        assert out.handle.shape == (1,) and out.handle.device.type == "cpu"
        combined = dispatcher.combine(out.x, out)
        assert combined.shape == (6, HIDDEN) and combined.device.type == "cuda"
        gx, gw = torch.ops.deepep.dispatch_backward(out.x, out.topk_weights, out.handle, 6)
        assert gx.shape == (6, HIDDEN) and gw.shape == (6, TOPK)
        back = torch.ops.deepep.combine_backward(combined, out.handle, received)
        assert back.shape[0] == received
    assert len(backend) == calls  # fakes never call the backend


# --- prime_ac ----------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["dispatch", "combine", "dispatch_backward", "combine_backward"])
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

    dispatcher = deepep.Dispatcher(_Group(), num_experts=EXPERTS, hidden=HIDDEN)
    model = _Model(dispatcher)
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


# --- errors ------------------------------------------------------------------------------------


def test_missing_deep_ep_names_extra_and_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)
    with pytest.raises(prime_ops.BackendUnavailable, match=r"prime-ops\[deepep\].*install\.sh"):
        deepep.Dispatcher(_Group(), num_experts=EXPERTS, hidden=HIDDEN)


def test_bad_inputs(backend):
    with pytest.raises(ValueError, match="num_experts=3 must be a positive multiple"):
        deepep.Dispatcher(_Group(2), num_experts=3, hidden=HIDDEN)
    dispatcher = deepep.Dispatcher(_Group(), num_experts=EXPERTS, hidden=HIDDEN)
    x, idx, weights = _inputs()
    with pytest.raises(ValueError, match="x must be a \\[tokens, hidden\\] bfloat16"):
        dispatcher.dispatch(x.float(), idx, weights)
    with pytest.raises(ValueError, match="topk_idx must be int64"):
        dispatcher.dispatch(x, idx.int(), weights)
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        dispatcher.dispatch(x, idx, weights.bfloat16())
    out = dispatcher.dispatch(x, idx, weights)
    with pytest.raises(ValueError, match="handle must be the CPU int64 tensor"):
        dispatcher.combine(out.x, out._replace(handle=out.handle.int()))
    with pytest.raises(RuntimeError, match="no live prime_ops.deepep.Dispatcher"):
        torch.ops.deepep.dispatch(x, idx, weights, -1, EXPERTS, EXPERTS, 1)
