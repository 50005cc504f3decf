"""quack::prime_linear / quack::prime_grouped_linear: reference kernels, fakes, QuACK adapter."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck
from torch.utils.checkpoint import CheckpointPolicy

import prime_ops
from prime_ops import quack


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def _grouped_case(gen, counts=(2, 0, 3), k=6, n=4):
    x = torch.randn(sum(counts), k, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(len(counts), n, k, generator=gen, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return x, w, offsets


# --- reference kernels -------------------------------------------------------------------------


def test_linear_matches_torch_with_gradients(gen):
    args = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((2, 3, 6), (4, 6), (4,))]
    args = [a.requires_grad_() for a in args]
    out = quack.linear(*args)
    ref_args = [a.detach().clone().requires_grad_() for a in args]
    ref = F.linear(*ref_args)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for a, r in zip(args, ref_args, strict=True):
        torch.testing.assert_close(a.grad, r.grad)
    assert torch.autograd.gradcheck(quack.linear, ref_args)


def test_linear_bf16_accumulates_in_fp32(gen):
    x, w = torch.randn(3, 64, generator=gen), torch.randn(5, 64, generator=gen)
    out = quack.linear(x.bfloat16(), w.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, (x.bfloat16().float() @ w.bfloat16().float().T).bfloat16())


def test_grouped_linear_matches_per_expert_linear(gen):
    x, w, offsets = _grouped_case(gen)
    assert torch.autograd.gradcheck(quack.grouped_linear, (x, w, offsets))
    out = quack.grouped_linear(x, w, offsets)
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0].T, x[2:] @ w[2].T]))


def test_opcheck_all_ops(gen):
    x, w, b = (torch.randn(*s, generator=gen, requires_grad=True) for s in ((3, 6), (4, 6), (4,)))
    opcheck(torch.ops.quack.prime_linear.default, (x, w, b))
    opcheck(torch.ops.quack.prime_linear.default, (x, w, None))
    opcheck(
        torch.ops.quack.prime_linear_backward.default, (torch.randn(3, 4), x.detach(), w.detach())
    )
    x, w, offsets = _grouped_case(gen)
    opcheck(torch.ops.quack.prime_grouped_linear.default, (x, w, offsets))
    grad = torch.randn(5, 4, dtype=torch.float64)
    opcheck(
        torch.ops.quack.prime_grouped_linear_backward.default,
        (grad, x.detach(), w.detach(), offsets),
    )


# --- gated MLP ---------------------------------------------------------------------------------


def test_gate_up_columns_are_interleaved(gen):
    w_gate, w_up = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    w = quack.interleave_gate_up(w_gate, w_up)
    assert torch.equal(w[0::2], w_gate) and torch.equal(w[1::2], w_up)
    x = torch.randn(2, 6, generator=gen)
    preact = quack.linear(x, w)
    torch.testing.assert_close(quack.swiglu(preact), F.silu(x @ w_gate.T) * (x @ w_up.T))


@pytest.mark.parametrize("grouped", [False, True])
def test_gated_mlp_matches_plain_swiglu(gen, grouped):
    experts = 3 if grouped else None
    lead = (experts,) if grouped else ()
    w_gate, w_up = (torch.randn(*lead, 5, 6, generator=gen, dtype=torch.float64) for _ in "gu")
    w_down = torch.randn(*lead, 6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w_gate_up = quack.interleave_gate_up(w_gate, w_up).requires_grad_()
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32) if grouped else None

    def plain(x, w_gate_up, w_down):
        if not grouped:
            return F.silu(x @ w_gate_up[0::2].T) * (x @ w_gate_up[1::2].T) @ w_down.T
        rows = [x[:2], x[2:2], x[2:]]
        return torch.cat(
            [
                (F.silu(r @ w_gate_up[e, 0::2].T) * (r @ w_gate_up[e, 1::2].T)) @ w_down[e].T
                for e, r in enumerate(rows)
            ]
        )

    torch.testing.assert_close(
        quack.gated_mlp(x, w_gate_up, w_down, offsets), plain(x, w_gate_up, w_down)
    )
    assert torch.autograd.gradcheck(lambda *a: quack.gated_mlp(*a, offsets), (x, w_gate_up, w_down))


# --- fakes -------------------------------------------------------------------------------------


def test_fakes_on_meta():
    x, w = torch.empty(7, 6, device="meta"), torch.empty(4, 6, device="meta")
    assert quack.linear(x, w, torch.empty(4, device="meta")).shape == (7, 4)
    ew, offsets = (
        torch.empty(3, 4, 6, device="meta"),
        torch.empty(3, dtype=torch.int32, device="meta"),
    )
    assert quack.grouped_linear(x, ew, offsets).shape == (7, 4)


def test_fakes_on_fake_cuda_without_quack(monkeypatch):
    monkeypatch.setitem(sys.modules, "quack", None)
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", None)
    # Autograd on fake CUDA tensors aborts a CPU-only build, so backward ops are called directly.
    with FakeTensorMode():
        x = torch.empty(7, 6, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(8, 6, device="cuda", dtype=torch.bfloat16)
        ew = torch.empty(3, 8, 6, device="cuda", dtype=torch.bfloat16)
        offsets = torch.empty(3, dtype=torch.int32, device="cuda")
        out = quack.gated_mlp(x, w, torch.empty(6, 4, device="cuda", dtype=torch.bfloat16))
        assert out.shape == (7, 6) and out.device.type == "cuda" and out.dtype == torch.bfloat16
        gx, gw = torch.ops.quack.prime_linear_backward(
            torch.empty(7, 8, device="cuda", dtype=torch.bfloat16), x, w
        )
        assert gx.shape == x.shape and gw.shape == w.shape
        assert quack.grouped_linear(x, ew, offsets).shape == (7, 8)
        gx, gw = torch.ops.quack.prime_grouped_linear_backward(
            torch.empty(7, 8, device="cuda", dtype=torch.bfloat16), x, ew, offsets
        )
        assert gx.shape == x.shape and gw.shape == ew.shape


# --- QuACK adapter -----------------------------------------------------------------------------


@pytest.fixture
def gemm_calls(monkeypatch):
    """A stand-in quack.gemm_interface whose gemm records its call and computes A @ B."""
    calls = []

    def gemm(A, B, bias=None, cu_seqlens_m=None, cu_seqlens_k=None):
        calls.append((A, B, bias, cu_seqlens_m, cu_seqlens_k))
        if cu_seqlens_m is not None:
            bounds = cu_seqlens_m.tolist()
            return torch.cat(
                [
                    A[s:e] @ B[i]
                    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
                ]
            )
        if cu_seqlens_k is not None:
            bounds = cu_seqlens_k.tolist()
            return torch.stack(
                [A[:, s:e] @ B[s:e] for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
            )
        return A @ B + (0 if bias is None else bias)

    module = types.ModuleType("quack.gemm_interface")
    module.gemm = gemm
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", module)
    return calls


def test_linear_adapter_exact_calls(gen, gemm_calls):
    x, w, b = (torch.randn(*s, generator=gen) for s in ((3, 6), (4, 6), (4,)))
    out = quack._quack_linear(x, w, b)
    ((A, B, bias, cu_m, cu_k),) = gemm_calls
    assert A is x and bias is b and cu_m is None and cu_k is None
    assert B.shape == (6, 4) and B.data_ptr() == w.data_ptr()  # weight.mT: (K, N), no copy
    torch.testing.assert_close(out, F.linear(x, w, b))
    g = torch.randn(3, 4, generator=gen)
    gx, gw = quack._quack_linear_backward(g, x, w)
    (A1, B1, *_), (A2, B2, *_) = gemm_calls[1:]
    assert A1 is g and B1 is w and B2 is x and A2.shape == (4, 3)
    torch.testing.assert_close(gx, g @ w)
    torch.testing.assert_close(gw, g.T @ x)


def test_grouped_adapter_passes_cu_seqlens(gen, gemm_calls):
    x, w, offsets = _grouped_case(gen)
    x, w = x.detach(), w.detach()
    out = quack._quack_grouped(x, w, offsets)
    ((A, B, _, cu_m, _),) = gemm_calls
    assert A is x and B.shape == (3, 6, 4) and cu_m.tolist() == [0, 2, 2, 5]
    assert cu_m.dtype == torch.int32
    torch.testing.assert_close(out, torch.ops.quack.prime_grouped_linear(x, w, offsets))
    g = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    gx, gw = quack._quack_grouped_backward(g, x, w, offsets)
    (_, B1, _, cu1, _), (A2, B2, _, _, cu2) = gemm_calls[1:]
    assert B1 is w and cu1.tolist() == [0, 2, 2, 5] and cu2.tolist() == [0, 2, 2, 5]
    assert A2.shape == (4, 5) and B2 is x
    ref_x, ref_w = torch.ops.quack.prime_grouped_linear_backward(g, x, w, offsets)
    torch.testing.assert_close(gx, ref_x)
    torch.testing.assert_close(gw, ref_w)


def test_missing_quack_names_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "quack", None)
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", None)
    with pytest.raises(prime_ops.BackendUnavailable, match=r"prime-ops\[quack\]"):
        quack._quack_linear(torch.ones(1, 1), torch.ones(1, 1), None)


# --- names -------------------------------------------------------------------------------------


def test_names_never_clash_with_quack():
    assert not set(quack.OP_NAMES) & quack.QUACK_OP_NAMES
    registered = set(torch._C._dispatch_get_all_op_names())
    assert {f"quack::{n}" for n in quack.OP_NAMES} <= registered


def test_clash_is_detected_with_a_clear_error():
    with pytest.raises(RuntimeError, match=r"cannot register quack::gemm_gated_out"):
        quack._check_names_free(["gemm_gated_out"])
    lib = torch.library.Library("quack", "FRAGMENT")  # noqa: F841  (kept alive for the check)
    lib.define("prime_test_clash(Tensor x) -> Tensor")
    with pytest.raises(RuntimeError, match=r"quack::prime_test_clash.*already defined"):
        quack._check_names_free(["prime_test_clash", "prime_unused"])
    quack._check_names_free(["prime_unused"])


# --- bad input ---------------------------------------------------------------------------------


def test_bad_inputs():
    x, w = torch.randn(3, 6), torch.randn(4, 6)
    with pytest.raises(ValueError, match="same K"):
        quack.linear(x, torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        quack.linear(x, w, torch.randn(3))
    with pytest.raises(TypeError, match="share a dtype"):
        quack.linear(x, w.double())
    with pytest.raises(ValueError, match="even number of columns"):
        quack.swiglu(torch.randn(2, 5))
    with pytest.raises(ValueError, match="same shape"):
        quack.interleave_gate_up(w, x)
    ew = torch.randn(2, 4, 6)
    with pytest.raises(ValueError, match="non-decreasing"):
        quack.grouped_linear(x, ew, torch.tensor([3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="finish at the row count"):
        quack.grouped_linear(x, ew, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D int32"):
        quack.grouped_linear(x, ew, torch.tensor([1, 3]))


def test_mixed_devices_are_refused():
    # A meta tensor among CPU tensors routes the call to the fake, which would hand back
    # uninitialised memory as the result.
    x, w, ew = torch.randn(3, 6), torch.randn(4, 6), torch.randn(2, 4, 6)
    offsets = torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(
        ValueError, match="one device, got x on cpu, weight on cpu, offsets on meta"
    ):
        quack.grouped_linear(x, ew, offsets.to("meta"))
    with pytest.raises(ValueError, match="one device, got x on cpu, weight on meta"):
        quack.linear(x, w.to("meta"))
    with pytest.raises(ValueError, match="bias on meta"):
        quack.linear(x, w, torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        torch.ops.quack.prime_linear_backward(torch.randn(3, 4, device="meta"), x, w)
    with pytest.raises(ValueError, match="one device"):
        torch.ops.quack.prime_grouped_linear_backward(x, x, ew, offsets.to("meta"))


# --- prime_ac ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["prime_linear", "prime_grouped_linear"])
def test_prime_ac_keeps_quack_gemms_in_selective(name):
    import prime_ac

    op = getattr(torch.ops.quack, name).default
    assert prime_ac.make_policy("selective")(None, op) == CheckpointPolicy.MUST_SAVE
    assert prime_ac.make_policy("full")(None, op) == CheckpointPolicy.PREFER_RECOMPUTE
    silu = torch.ops.aten.silu.default
    assert prime_ac.make_policy("selective")(None, silu) == CheckpointPolicy.PREFER_RECOMPUTE


class _MLP(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w_gate_up = torch.nn.Parameter(torch.randn(8, 6, generator=gen))
        self.w_down = torch.nn.Parameter(torch.randn(6, 4, generator=gen))

    def forward(self, x):
        return x + quack.gated_mlp(x, self.w_gate_up, self.w_down)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_MLP(seed) for seed in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(("mode", "gemms"), [("selective", 4), ("full", 8)])
def test_selective_replays_only_the_activation(monkeypatch, mode, gemms):
    import prime_ac

    model, x = _Model(), torch.randn(3, 6, requires_grad=True)
    model(x).sum().backward()
    expected = [x.grad] + [p.grad for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    prime_ac.checkpoint_blocks(model, mode=mode, blocks="layers")
    gemm_calls, silu_calls = [], []
    real = quack._reference_linear
    monkeypatch.setattr(quack, "_reference_linear", lambda *a: gemm_calls.append(1) or real(*a))

    class CountSilu(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.silu.default:
                silu_calls.append(1)
            return func(*args, **(kwargs or {}))

    with CountSilu():
        model(x).sum().backward()
    assert len(gemm_calls) == gemms  # forward 2 per block, plus their replay in full mode
    assert len(silu_calls) == 4  # the activation runs in the forward and again in the recompute
    got = [x.grad] + [p.grad for p in model.parameters()]
    for g, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(g, ref)
