"""prime_rl_attn varlen ops: the sdpa reference against a naive per-sequence softmax, fakes,
validation, and the FA2/FA3/FA4 adapters against stand-in modules that record each call."""

from __future__ import annotations

import dataclasses
import sys
import types
from itertools import pairwise

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import prime_ops
from prime_ops.attn import flash, varlen_attention
from prime_ops.attn.args import VarlenArgs
from prime_ops.attn.varlen import BACKENDS, OPS

INF = float("inf")


# --------------------------------------------------------------------------- naive reference


def naive_attention(q, k, v, cu_q, cu_k, *, causal, scale, window, softcap):
    """Per sequence and head, in float64: softmax over an explicitly built visibility mask."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(pairwise(cu_q.tolist()), pairwise(cu_k.tolist()), strict=True):
        lq, lk = q1 - q0, k1 - k0
        mask = torch.zeros(lq, lk, dtype=torch.bool)
        for i in range(lq):
            for j in range(lk):
                behind = i + lk - lq - j  # how far key j lies behind query i
                mask[i, j] = (
                    (not causal or behind >= 0)
                    and (window[0] < 0 or behind <= window[0])
                    and (window[1] < 0 or -behind <= window[1])
                )
        any_key = mask.any(-1, keepdim=True)
        out_s = torch.zeros(lq, q.shape[1], v.shape[2], dtype=torch.float64)
        lse_s = torch.zeros(q.shape[1], lq, dtype=torch.float64)
        per_head_out, per_head_lse = [], []
        for h in range(q.shape[1]):
            s = q[q0:q1, h] @ k[k0:k1, h // groups].T * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~mask, -INF).masked_fill(~any_key, 0.0)
            p = torch.where(any_key, torch.softmax(s, -1), 0.0)
            per_head_out.append(p @ v[k0:k1, h // groups])
            per_head_lse.append(torch.where(any_key[:, 0], torch.logsumexp(s, -1), -INF))
        if lq:
            out_s = torch.stack(per_head_out, 1)
            lse_s = torch.stack(per_head_lse, 0)
        outs.append(out_s)
        lses.append(lse_s)
    return torch.cat(outs), torch.cat(lses, 1)


def packed(lengths_q, h, hkv, d, dv=None, dtype=torch.float32, lengths_k=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths_k = lengths_q if lengths_k is None else lengths_k
    tq, tk = sum(lengths_q), sum(lengths_k)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    q, k, v = rand(tq, h, d), rand(tk, hkv, d), rand(tk, hkv, dv or d)

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    return q, k, v, cu(lengths_q), cu(lengths_k), max(lengths_q), max(lengths_k)


CASES = {
    "plain": dict(lengths=[5, 9, 2], h=2, hkv=2, d=16),
    "causal_gqa": dict(lengths=[7, 1, 12], h=4, hkv=2, d=16, causal=True),
    "mqa_window_causal": dict(lengths=[11, 6], h=4, hkv=1, d=8, causal=True, window=(3, 0)),
    "window_both_sides": dict(lengths=[10, 4], h=2, hkv=1, d=8, window=(2, 1)),
    "softcap_causal": dict(lengths=[9, 3], h=2, hkv=2, d=16, causal=True, softcap=2.0),
    "length_one": dict(lengths=[1, 1, 1], h=2, hkv=1, d=8, causal=True),
    "many_short_with_empty": dict(
        lengths=[1, 3, 0, 2, 4, 1, 2, 3, 1, 1, 2, 4], h=2, hkv=1, d=8, causal=True
    ),
    "value_head_dim": dict(lengths=[6, 5], h=2, hkv=2, d=16, dv=8, causal=True),
    # More queries than keys: bottom-right alignment leaves the first queries with no key.
    "cross_no_key_rows": dict(lengths=[6, 4], lengths_k=[3, 4], h=2, hkv=1, d=8, causal=True),
    "explicit_scale": dict(lengths=[5, 7], h=2, hkv=2, d=16, scale=0.3),
}


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(name, torch.float32) for name in CASES]
    + [("causal_gqa", torch.bfloat16), ("softcap_causal", torch.bfloat16)]
    + [("window_both_sides", torch.float64)],
)
def test_sdpa_matches_naive(name, dtype):
    case = dict(CASES[name])
    causal, window = case.pop("causal", False), case.pop("window", (-1, -1))
    softcap, scale = case.pop("softcap", 0.0), case.pop("scale", None)
    lengths = case.pop("lengths")
    q, k, v, cu_q, cu_k, max_q, max_k = packed(lengths, dtype=dtype, **case)
    out, lse = varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        causal=causal,
        softmax_scale=scale,
        window_size=window,
        softcap=softcap,
    )
    ref_scale = scale if scale is not None else q.shape[-1] ** -0.5
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = naive_attention(
        *leaves, cu_q, cu_k, causal=causal, scale=ref_scale, window=window, softcap=softcap
    )
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    if dtype == torch.float64:
        tol = dict(atol=1e-12, rtol=1e-12)
    assert out.dtype == dtype and out.shape == ref_out.shape
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert lse.dtype == lse_dtype and lse.shape == (q.shape[1], q.shape[0])
    torch.testing.assert_close(out.double(), ref_out, **tol)
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    torch.testing.assert_close(lse.double(), ref_lse, **tol)

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (out * grad_out).sum().backward()
    (ref_out * grad_out.double()).sum().backward()
    grad_tol = dict(atol=5e-2, rtol=5e-2) if dtype == torch.bfloat16 else tol
    for ours, ref in zip((q, k, v), leaves, strict=True):
        assert ours.grad.dtype == dtype
        torch.testing.assert_close(ours.grad.double(), ref.grad, **grad_tol)


def test_rows_without_keys_get_zero_output_and_gradient():
    q, k, v, cu_q, cu_k, max_q, max_k = packed([4], lengths_k=[2], h=1, hkv=1, d=8)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert lse[0, :2].isneginf().all() and lse[0, 2:].isfinite().all()
    assert (out[:2] == 0).all()
    out.sum().backward()
    assert (q.grad[:2] == 0).all() and q.grad.isfinite().all() and k.grad.isfinite().all()


def test_lse_carries_no_gradient():
    q, k, v, cu, _, max_len, _ = packed([3, 4], h=2, hkv=2, d=8)
    out, lse = varlen_attention(q, k, v, cu, cu, max_len, max_len)
    assert out.requires_grad and not lse.requires_grad


@pytest.mark.slow
def test_opcheck_forward_and_backward():
    q, k, v, cu_q, cu_k, max_q, max_k = packed([5, 3, 6], h=4, hkv=2, d=8)
    # sdpa_varlen takes FA4's schema: ..., causal, window left/right, then scale and softcap.
    args = (q, k, v, cu_q, cu_k, max_q, max_k, True, 4, -1, 0.35, 3.0)
    torch.library.opcheck(torch.ops.prime_rl_attn.sdpa_varlen.default, args)
    out, lse = torch.ops.prime_rl_attn.sdpa_varlen(*args)
    detached = [t.detach() for t in (q, k, v)]
    bwd_args = (torch.randn_like(out).detach(), *detached, out.detach(), lse, *args[3:])
    torch.library.opcheck(torch.ops.prime_rl_attn.sdpa_varlen_backward.default, bwd_args)


# --------------------------------------------------------------------------- validation


def _bad(**overrides):
    q, k, v, cu_q, cu_k, max_q, max_k = packed([4, 4], h=4, hkv=2, d=8)
    args = dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(q=torch.randn(8, 3, 8)), "multiple of k/v's heads"),
        (dict(q=torch.randn(8, 4)), r"q must be \[tokens, heads, head_dim\]"),
        (dict(v=torch.randn(6, 2, 8)), "k and v must agree"),
        (dict(k=torch.randn(8, 2, 16)), "same head dim"),
        (dict(q=torch.randn(8, 4, 8, dtype=torch.float16)), "share a dtype"),
        (dict(cu_seqlens_q=torch.tensor([0, 4, 8])), "int32"),
        (dict(cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32)), "same number of sequences"),
        (
            dict(cu_seqlens_q=torch.tensor([0, 4, 7], dtype=torch.int32)),
            "end at the packed length 8",
        ),
        (
            dict(cu_seqlens_k=torch.tensor([0, 9, 8], dtype=torch.int32), max_seqlen_k=9),
            "non-decreasing",
        ),
        (dict(max_seqlen_q=3), "longer than max_seqlen 3"),
        (dict(window_size=(-2, 0)), "window_size entries must be >= -1"),
        (dict(softcap=-1.0), "softcap must be finite and >= 0"),
        (dict(softcap=float("inf")), "softcap must be finite and >= 0 .*; got inf"),
        (dict(backend="flash"), "not an attention backend"),
        (dict(backend="fa2"), "runs on cuda tensors; got cpu. Use backend='sdpa'"),
    ],
)
def test_invalid_arguments_raise_before_launch(overrides, message):
    with pytest.raises(ValueError, match=message):
        varlen_attention(**_bad(**overrides))


@pytest.mark.parametrize(
    ("backend", "d", "dv", "message"),
    [
        ("fa2", 264, 264, r"'fa2' cannot run head dims \(q/k 264, v 264\): .* 1 to 256"),
        ("fa2", 64, 32, "v's head dim equal to q's"),
        ("fa3", 12, 12, "'fa3' .* positive multiples of 8"),
        ("fa3", 128, 96, r"q/k in \(128, 192\] with v in \(96, 128\]"),
        ("fa2", 64, 64, "takes"),  # float32 is not a flash dtype
    ],
)
def test_backend_limits_checked_on_fake_cuda(backend, d, dv, message):
    dtype = torch.float32 if message == "takes" else torch.bfloat16
    with FakeTensorMode(), pytest.raises(ValueError, match=message):
        q = torch.empty(8, 2, d, dtype=dtype, device="cuda")
        kv = torch.empty(8, 2, d, dtype=dtype, device="cuda")
        v = torch.empty(8, 2, dv, dtype=dtype, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        varlen_attention(q, kv, v, cu, cu, 8, 8, backend=backend)


# (q/k head dim, v head dim) -> accepted, written out from each library's rule (see the
# docstrings of flash.fa*_head_dims for the source lines), not computed by the code under test.
FA3_FORWARD = {
    (64, 64): True,
    (256, 256): True,
    (264, 264): False,  # q/k above 256
    (12, 12): False,  # not a multiple of 8
    (192, 128): True,  # q/k in (128, 192], v in (96, 128]
    (136, 104): True,
    (128, 96): False,  # q/k 128 is not in (128, 192]
    (192, 96): False,  # v 96 is not in (96, 128]
    (200, 128): False,
    (64, 512): True,  # q/k <= 64, v <= 512
    (32, 8): True,
    (72, 512): False,
    (64, 520): False,
    (128, 64): False,
}
FA4_SM100 = {
    (128, 128): True,
    (8, 8): True,
    (64, 128): True,
    (136, 136): False,  # 129-255 refused ...
    (160, 160): False,
    (192, 192): False,
    (255, 255): False,
    (192, 128): True,  # ... except (192, 128)
    (256, 256): True,  # ... and (256, 256)
    (256, 128): False,
    (64, 512): True,
    (512, 512): True,
    (128, 512): False,
    (12, 12): False,
}
FA4_SM90 = {
    (160, 160): True,
    (256, 256): True,
    (192, 128): True,
    (264, 264): False,
    (12, 12): False,
}


@pytest.mark.parametrize(
    ("check", "arch", "table"),
    [
        (flash.fa3_head_dims, 90, FA3_FORWARD),
        (flash.fa4_head_dims, 100, FA4_SM100),
        (flash.fa4_head_dims, 110, FA4_SM100),
        (flash.fa4_head_dims, 90, FA4_SM90),
    ],
)
def test_head_dim_limits_follow_the_libraries(check, arch, table):
    for (d, dv), accepted in table.items():
        if accepted:
            check(d, dv, arch, False)
        else:
            with pytest.raises(ValueError, match=r"backend 'fa[34]' cannot run head dims"):
                check(d, dv, arch, False)


def test_head_dim_limits_of_backward_and_arch():
    flash.fa3_head_dims(64, 512, 90, False)
    with pytest.raises(ValueError, match="FA3's backward supports head dims up to 256"):
        flash.fa3_head_dims(64, 512, 90, True)
    with pytest.raises(ValueError, match="only on Hopper"):
        flash.fa3_head_dims(192, 128, 80, False)
    flash.fa3_head_dims(128, 128, 80, False)
    flash.fa3_head_dims(192, 128, None, False)  # arch unknown while tracing: not refused
    with pytest.raises(ValueError, match="no backward on SM8x"):
        flash.fa4_head_dims(128, 128, 80, True)
    flash.fa4_head_dims(160, 160, None, True)
    flash.fa2_head_dims(12, 12, 80, True)  # padded to 16 by the adapter


@pytest.mark.parametrize("arch", [100, 103, 120])
def test_fa3_refused_from_sm100_on(arch):
    """FA3's SM90 kernels (sm_90a only) are what it picks on every arch from SM90 up."""
    with pytest.raises(ValueError, match=rf"'fa3' has no kernel for SM{arch}: .*use 'fa4'"):
        flash.fa3_head_dims(128, 128, arch, False)
    flash.fa3_head_dims(128, 128, 86, True)  # FA3's SM8x kernels
    flash.fa3_head_dims(128, 128, None, True)  # arch unknown while tracing: not refused


def test_fa3_refused_on_fake_cuda_for_a_blackwell_device(monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_100")
    with FakeTensorMode(), pytest.raises(ValueError, match="'fa3' has no kernel for SM100"):
        q = torch.empty(8, 2, 128, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        varlen_attention(q, q, q, cu, cu, 8, 8, backend="fa3")


def test_fa4_softcap_refused_in_the_sm100_head_dim_256_backward(monkeypatch):
    monkeypatch.delenv("FLASH_ATTENTION_HD256_GENERIC_BWD", raising=False)
    for arch in (100, 110):
        with pytest.raises(ValueError, match=rf"'fa4' .* SM{arch} backward .* softcap=5.0"):
            flash.fa4_softcap(256, 256, arch, 5.0)
        flash.fa4_softcap(256, 256, arch, 0.0)
        flash.fa4_softcap(128, 128, arch, 5.0)
    flash.fa4_softcap(256, 256, 90, 5.0)
    flash.fa4_softcap(256, 256, None, 5.0)
    monkeypatch.setenv("FLASH_ATTENTION_HD256_GENERIC_BWD", "1")  # FA4's general kernel
    flash.fa4_softcap(256, 256, 100, 5.0)


@pytest.mark.parametrize(
    ("release", "refused"),
    [
        ("4.0.0b28", True),
        ("4.0.0b36", True),
        ("4.0.0b39", False),
        ("4.0.0b40", False),
        ("4.0.0", False),
        ("4.1.2", False),
    ],
)
def test_fa4_softcap_limit_follows_the_installed_release(monkeypatch, release, refused):
    """flash-attn-4 4.0.0b39 dropped the dedicated SM100 (256, 256) backward that has no
    softcap: from that release on the call is FA4's to take, not refused."""
    monkeypatch.delenv("FLASH_ATTENTION_HD256_GENERIC_BWD", raising=False)
    versions = {"flash-attn-4": release}
    monkeypatch.setattr(flash.importlib.metadata, "version", versions.__getitem__)
    if refused:
        with pytest.raises(ValueError, match=r"softcap=5.0\) before flash-attn-4 4.0.0b39"):
            flash.fa4_softcap(256, 256, 100, 5.0)
    else:
        flash.fa4_softcap(256, 256, 100, 5.0)


def test_fa4_softcap_backward_refused_while_tracing(monkeypatch):
    """The fake of FA4's backward refuses what its kernel would: a trace fails, not step 1."""
    monkeypatch.delenv("FLASH_ATTENTION_HD256_GENERIC_BWD", raising=False)
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_100")
    forward, backward = OPS["fa4"]
    with FakeTensorMode():
        q = torch.empty(8, 2, 256, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        rest = (cu, cu, 8, 8, True, None, None, 0.0625, 5.0)
        out, lse = forward(q, q, q, *rest)  # the forward takes softcap
        with pytest.raises(ValueError, match=r"'fa4' .* SM100 backward .* softcap=5.0"):
            backward(out, q, q, q, out, lse, *rest)
        monkeypatch.setenv("FLASH_ATTENTION_HD256_GENERIC_BWD", "1")
        dq, _, _ = backward(out, q, q, q, out, lse, *rest)
        assert dq.shape == q.shape


def test_fa4_head_dims_refused_on_fake_cuda_for_the_device_arch(monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_100")
    with FakeTensorMode():
        q = torch.empty(8, 2, 160, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match=r"'fa4' .* SM100 .* 129-255"):
            varlen_attention(q, q, q, cu, cu, 8, 8, backend="fa4")
        monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90")
        out, _ = varlen_attention(q, q, q, cu, cu, 8, 8, backend="fa4")
        assert out.shape == q.shape


def test_mixed_devices_are_refused_by_forward_and_backward():
    """Offsets on meta with q on the CPU would dispatch to the fake and return garbage."""
    q, k, v, cu, _, n, _ = packed([3, 5], h=2, hkv=1, d=8)
    meta_cu = cu.to("meta")
    with pytest.raises(ValueError, match="cu_seqlens_q on meta"):
        varlen_attention(q, k, v, meta_cu, meta_cu, n, n)
    out, lse = varlen_attention(q, k, v, cu, cu, n, n)
    bwd = torch.ops.prime_rl_attn.sdpa_varlen_backward
    args = (cu, cu, n, n, False, -1, -1, 0.3, 0.0)
    with pytest.raises(ValueError, match="dout on meta"):
        bwd(out.detach().to("meta"), q, k, v, out.detach(), lse, *args)
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 8\)"):
        bwd(out.detach(), q, k, v, out.detach(), lse.t(), *args)


def test_op_names_are_prime_rls():
    """prime-rl registers and its users' target lists name ``flash_attn_{2,3,4}_varlen``."""
    ops = torch.ops.prime_rl_attn
    for name in ("sdpa", "flash_attn_2", "flash_attn_3", "flash_attn_4"):
        for suffix in ("_varlen", "_varlen_backward"):
            assert hasattr(ops, name + suffix), name + suffix
    for old in ("fa2_varlen", "fa3_varlen", "fa4_varlen"):
        assert not hasattr(ops, old)


# --------------------------------------------------------------------------- fakes


def _block_backend_imports(monkeypatch):
    for name in (
        "flash_attn",
        "flash_attn.flash_attn_interface",
        "flash_attn.cute",
        "flash_attn.cute.interface",
        "flash_attn_3",
        "flash_attn_3._C",
    ):
        monkeypatch.setitem(sys.modules, name, None)  # any import attempt would now raise


def _ops(backend):
    op = BACKENDS[backend].op
    ops = torch.ops.prime_rl_attn
    return getattr(ops, f"{op}_varlen"), getattr(ops, f"{op}_varlen_backward")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fakes_on_meta_give_shapes_dtypes_strides(backend, monkeypatch):
    _block_backend_imports(monkeypatch)
    fwd, bwd = _ops(backend)
    q = torch.empty(40, 8, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(56, 2, 64, dtype=torch.bfloat16, device="meta")
    v = torch.empty(56, 2, 64, dtype=torch.bfloat16, device="meta")
    cu_q = torch.empty(5, dtype=torch.int32, device="meta")
    cu_k = torch.empty(5, dtype=torch.int32, device="meta")
    rest = trailing(backend, cu_q, cu_k, 16, 20, True, 0.125, -1, -1, 0.0)
    out, lse = fwd(q, k, v, *rest)
    assert (out.shape, out.dtype, out.stride()) == ((40, 8, 64), torch.bfloat16, (512, 64, 1))
    assert (lse.shape, lse.dtype, lse.stride()) == ((8, 40), torch.float32, (40, 1))
    grads = bwd(out, q, k, v, out, lse, *rest)
    for grad, like in zip(grads, (q, k, v), strict=True):
        assert (grad.shape, grad.dtype, grad.stride()) == (like.shape, like.dtype, like.stride())

    leaves = [t.requires_grad_() for t in (q, k, v)]  # registered autograd, through the front
    out, _ = varlen_attention(*leaves, cu_q, cu_k, 16, 20, causal=True, backend=backend)
    out.sum().backward()
    assert [t.grad.shape for t in leaves] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("backend", ["fa2", "fa3", "fa4"])
def test_front_under_fake_cuda_never_imports_backend(backend, monkeypatch):
    _block_backend_imports(monkeypatch)
    _, bwd = _ops(backend)
    with FakeTensorMode():
        q = torch.empty(32, 4, 128, dtype=torch.float16, device="cuda")
        k = torch.empty(32, 1, 128, dtype=torch.float16, device="cuda")
        v = torch.empty(32, 1, 128, dtype=torch.float16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        out, lse = varlen_attention(q, k, v, cu, cu, 20, 20, causal=True, backend=backend)
        assert out.shape == (32, 4, 128) and out.device.type == "cuda"
        assert lse.shape == (4, 32) and lse.dtype == torch.float32 and lse.device.type == "cuda"
        rest = trailing(backend, cu, cu, 20, 20, True, 0.1, -1, -1, 0.0)
        dq, dk, dv = bwd(out, q, k, v, out, lse, *rest)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert dk.device.type == "cuda"


@pytest.mark.parametrize(
    ("adapter", "modules", "how"),
    [
        (flash.fa2_forward, ["flash_attn", "flash_attn.flash_attn_interface"], r"prime-ops\[fa2\]"),
        # FA3 has nothing on the package index: the message gives the real build step only.
        (flash.fa3_forward, ["flash_attn_3", "flash_attn_3._C"], r"with: FA3 has no .*/hopper"),
        (
            flash.fa4_forward,
            ["flash_attn", "flash_attn.cute", "flash_attn.cute.interface"],
            r"prime-ops\[fa4\]",
        ),
    ],
)
def test_missing_backend_says_how_to_install(adapter, modules, how, monkeypatch):
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
    q, k, v, cu, _, n, _ = packed([4], h=1, hkv=1, d=8)
    with pytest.raises(prime_ops.BackendUnavailable, match=how) as info:
        adapter(*bundle(q, k, v, cu, cu, n, n, False, 0.5, -1, -1, 0.0))
    assert "prime-ops[fa3]" not in str(info.value)


# --------------------------------------------------------------------------- adapters

REFERENCE = BACKENDS["sdpa"]


def bundle(q, k, v, *rest):
    """``(q, k, v, VarlenArgs)`` from the contract's 12 positional values, as adapters take."""
    return q, k, v, VarlenArgs(*rest)


def trailing(backend, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap):
    """The op of ``backend``'s arguments after q, k, v in its own schema's order."""
    a = VarlenArgs(cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap)
    return (cu_q, cu_k, *BACKENDS[backend].schema.values(a))


def ref_forward(q, k, v, *rest):
    return REFERENCE.forward(q, k, v, rest[0] if len(rest) == 1 else VarlenArgs(*rest))


def ref_backward(dout, q, k, v, out, lse, *rest):
    a = rest[0] if len(rest) == 1 else VarlenArgs(*rest)
    return REFERENCE.backward(dout, q, k, v, out, lse, a)


class Recorder:
    """Records the arguments a stand-in entry point received, by parameter name."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def record(self, name, args: dict):
        self.calls.append((name, args))

    def only(self, name):
        found = [args for called, args in self.calls if called == name]
        assert len(found) == 1, self.calls
        return found[0]


def _adapter_inputs(causal=True, window=(-1, -1), softcap=0.0):
    q, k, v, cu_q, cu_k, max_q, max_k = packed([5, 4], lengths_k=[2, 4], h=4, hkv=2, d=8)
    q, k, v = (t.detach() for t in (q, k, v))
    return bundle(q, k, v, cu_q, cu_k, max_q, max_k, causal, 0.25, *window, softcap)


def _reference_grads(args, dout):
    out, lse = ref_forward(*args)
    return out, lse, ref_backward(dout, *args[:3], out, lse, *args[3:])


def _fa2_standin(recorder):
    """flash_attn 2.8.3's two varlen entry points, with their exact parameter names."""

    def _flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
        block_table=None,
        leftpad_k=None,
        seqused_k=None,
        zero_tensors=False,
    ):
        recorder.record("fwd", dict(locals()))
        heads, heads_k, head_size = q.shape[1], k.shape[1], q.shape[2]
        if head_size % 8 or head_size > 256:  # flash_api.cpp mha_varlen_fwd's TORCH_CHECKs
            raise RuntimeError("head_size must be a multiple of 8, at most 256")
        if max_seqlen_q == 1 and heads > heads_k and window_size_left < 0 and window_size_right < 0:
            # mha_varlen_fwd's seqlenq_ngroups_swapped path: reshape by batch size.
            batch = cu_seqlens_q.shape[0] - 1
            q.reshape(batch, heads_k, heads // heads_k, head_size)
        out, lse = ref_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal,
            softmax_scale,
            window_size_left,
            window_size_right,
            softcap,
        )
        lse = lse.masked_fill(lse == -INF, INF)  # FA2 marks rows without keys with +inf
        return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)

    def _flash_attn_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
        zero_tensors=False,
    ):
        recorder.record("bwd", dict(locals()))
        lse = softmax_lse.masked_fill(softmax_lse == INF, -INF)
        grads = ref_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal,
            softmax_scale,
            window_size_left,
            window_size_right,
            softcap,
        )
        for buf, grad in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(grad)
        return torch.empty(q.shape[1], q.shape[0] + 128)

    module = types.ModuleType("flash_attn.flash_attn_interface")
    module._flash_attn_varlen_forward = _flash_attn_varlen_forward
    module._flash_attn_varlen_backward = _flash_attn_varlen_backward
    return module


def test_fa2_adapter_exact_call_and_lse_convention(monkeypatch):
    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", _fa2_standin(recorder))
    args = _adapter_inputs(window=(3, -1), softcap=1.5)
    q, k, v, a = args
    cu_q, cu_k = a.cu_seqlens_q, a.cu_seqlens_k
    out, lse = flash.fa2_forward(*args)
    call = recorder.only("fwd")
    assert call["q"] is q and call["k"] is k and call["v"] is v
    assert call["cu_seqlens_q"] is cu_q and call["cu_seqlens_k"] is cu_k
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (5, 4)
    assert call["dropout_p"] == 0.0 and call["softmax_scale"] == 0.25 and call["causal"] is True
    assert (call["window_size_left"], call["window_size_right"]) == (3, -1)
    assert call["softcap"] == 1.5 and call["return_softmax"] is False
    assert call["alibi_slopes"] is None
    ref_out, ref_lse = ref_forward(*args)
    assert lse.isneginf().any() and not lse.isposinf().any()  # +inf normalised to -inf
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(out, ref_out)

    dout = torch.randn_like(out)
    dq, dk, dv = flash.fa2_backward(dout, q, k, v, out, lse, *args[3:])
    call = recorder.only("bwd")
    assert call["dout"] is dout and call["out"] is out
    assert torch.equal(call["softmax_lse"].isposinf(), lse.isneginf())  # back to FA2's +inf
    assert call["dq"] is dq and call["dk"] is dk and call["dv"] is dv
    assert call["deterministic"] is False and call["rng_state"] is None
    assert (call["window_size_left"], call["window_size_right"], call["softcap"]) == (3, -1, 1.5)
    for ours, ref in zip((dq, dk, dv), _reference_grads(args, dout)[2], strict=True):
        torch.testing.assert_close(ours, ref)


def _install_fa2(monkeypatch, recorder):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", _fa2_standin(recorder))


@pytest.mark.parametrize(
    ("lengths_q", "expected_max_q"),
    [([1, 0, 1, 1], 2), ([0, 0, 0], 2), ([1, 1, 1], 1)],  # empty sequences: general path
)
def test_fa2_single_query_gqa_with_empty_sequences(lengths_q, expected_max_q, monkeypatch):
    recorder = Recorder()
    _install_fa2(monkeypatch, recorder)
    q, k, v, cu_q, cu_k, _, max_k = packed(
        lengths_q, lengths_k=[3, 2, 4, 1][: len(lengths_q)], h=4, hkv=2, d=8
    )
    q, k, v = (t.detach() for t in (q, k, v))
    args = bundle(q, k, v, cu_q, cu_k, 1, max_k, True, 0.3, -1, -1, 0.0)
    out, lse = flash.fa2_forward(*args)
    assert recorder.only("fwd")["max_seqlen_q"] == expected_max_q
    ref_out, ref_lse = ref_forward(*args)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


def test_fa2_pads_head_dims_to_a_multiple_of_8(monkeypatch):
    recorder = Recorder()
    _install_fa2(monkeypatch, recorder)
    q, k, v, cu_q, cu_k, max_q, max_k = packed([5, 3], h=2, hkv=1, d=12)
    q, k, v = (t.detach() for t in (q, k, v))
    args = bundle(q, k, v, cu_q, cu_k, max_q, max_k, True, 0.3, -1, -1, 0.0)
    out, lse = flash.fa2_forward(*args)
    assert recorder.only("fwd")["q"].shape[-1] == 16 and out.shape == (8, 2, 12)
    assert out.is_contiguous()
    dout = torch.randn_like(out)
    grads = flash.fa2_backward(dout, q, k, v, out, lse, *args[3:])
    assert recorder.only("bwd")["dout"].shape[-1] == 16
    ref_out, _, ref_grads = _reference_grads(args, dout)
    torch.testing.assert_close(out, ref_out)
    for ours, ref in zip(grads, ref_grads, strict=True):
        assert ours.shape == ref.shape and ours.is_contiguous()
        torch.testing.assert_close(ours, ref)


def _fa3_standin(recorder):
    """torch.ops.flash_attn_3.fwd / .bwd with their schema's parameter names and defaults."""

    def fwd(
        q,
        k,
        v,
        k_new=None,
        v_new=None,
        q_v=None,
        out=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        cu_seqlens_k_new=None,
        seqused_q=None,
        seqused_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        page_table=None,
        kv_batch_idx=None,
        leftpad_k=None,
        rotary_cos=None,
        rotary_sin=None,
        seqlens_rotary=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        softmax_scale=None,
        is_causal=False,
        window_size_left=-1,
        window_size_right=-1,
        attention_chunk=0,
        softcap=0.0,
        is_rotary_interleaved=False,
        scheduler_metadata=None,
        num_splits=0,
        pack_gqa=None,
        sm_margin=0,
    ):
        recorder.record("fwd", dict(locals()))
        out, lse = ref_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            is_causal,
            softmax_scale,
            window_size_left,
            window_size_right,
            softcap,
        )
        if k.shape[0] == 0:  # flash_api.cpp mha_fwd: no kernel, out zeroed, lse filled with +inf
            lse = torch.full_like(lse, INF)
        return out, lse, torch.empty(0), torch.empty(0)

    def bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq=None,
        dk=None,
        dv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        seqused_q=None,
        seqused_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        softmax_scale=None,
        is_causal=False,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        deterministic=False,
        sm_margin=0,
    ):
        recorder.record("bwd", dict(locals()))
        grads = ref_backward(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            is_causal,
            softmax_scale,
            window_size_left,
            window_size_right,
            softcap,
        )
        for buf, grad in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(grad)
        # Like the real op: softmax_d, lse_log2 and fp32 accumulators, not the gradients.
        return tuple(torch.full((1,), float("nan")) for _ in range(5))

    return types.SimpleNamespace(fwd=fwd, bwd=bwd)


def test_fa3_adapter_exact_call_and_outputs(monkeypatch):
    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "flash_attn_3", types.ModuleType("flash_attn_3"))
    monkeypatch.setitem(sys.modules, "flash_attn_3._C", types.ModuleType("flash_attn_3._C"))
    monkeypatch.setattr(torch.ops, "flash_attn_3", _fa3_standin(recorder), raising=False)
    args = _adapter_inputs(causal=False, window=(2, 1))
    q, k, v, a = args
    cu_q, cu_k = a.cu_seqlens_q, a.cu_seqlens_k
    out, lse = flash.fa3_forward(*args)
    call = recorder.only("fwd")
    assert call["q"] is q and call["cu_seqlens_q"] is cu_q and call["cu_seqlens_k"] is cu_k
    assert call["is_causal"] is False and call["softmax_scale"] == 0.25
    assert (call["window_size_left"], call["window_size_right"]) == (2, 1)
    assert call["out"] is None and call["q_v"] is None and call["softcap"] == 0.0
    ref_out, ref_lse = ref_forward(*args)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)

    dout = torch.randn_like(out)
    dq, dk, dv = flash.fa3_backward(dout, q, k, v, out, lse, *args[3:])
    call = recorder.only("bwd")
    assert call["dout"] is dout and call["out"] is out and call["softmax_lse"] is lse
    assert call["dq"] is dq and call["dk"] is dk and call["dv"] is dv  # written in place
    assert call["deterministic"] is False and call["is_causal"] is False
    for ours, ref in zip((dq, dk, dv), _reference_grads(args, dout)[2], strict=True):
        torch.testing.assert_close(ours, ref)


def test_fa3_lse_is_minus_inf_when_the_batch_has_no_keys(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_3", types.ModuleType("flash_attn_3"))
    monkeypatch.setitem(sys.modules, "flash_attn_3._C", types.ModuleType("flash_attn_3._C"))
    monkeypatch.setattr(torch.ops, "flash_attn_3", _fa3_standin(Recorder()), raising=False)
    q, k, v, cu_q, cu_k, max_q, _ = packed([3, 2], lengths_k=[0, 0], h=2, hkv=1, d=8)
    out, lse = flash.fa3_forward(*bundle(q, k, v, cu_q, cu_k, max_q, 0, False, 0.3, -1, -1, 0.0))
    assert lse.isneginf().all() and (out == 0).all()


def _fa4_standin(recorder):
    """flash_attn.cute.interface's private entry points (4.0.0b19+ names and order)."""

    def _flash_attn_fwd(
        q,
        k,
        v,
        qv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        seqused_q=None,
        seqused_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        min_seqlen_k=None,
        page_table=None,
        softmax_scale=None,
        causal=False,
        softcap=None,
        window_size_left=None,
        window_size_right=None,
        learnable_sink=None,
        return_lse=False,
        out=None,
        lse=None,
    ):
        recorder.record("fwd", dict(locals()))
        out, lse = ref_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal,
            softmax_scale,
            -1 if window_size_left is None else window_size_left,
            -1 if window_size_right is None else window_size_right,
            softcap or 0.0,
        )
        return out, lse, None, None  # beta19+ returns four items

    def _flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale=None,
        causal=False,
        softcap=0.0,
        window_size_left=None,
        window_size_right=None,
        m_block_size=64,
        n_block_size=128,
        num_threads=256,
        pack_gqa=False,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        seqused_q=None,
        seqused_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        deterministic=False,
        dq=None,
        dk=None,
        dv=None,
    ):
        recorder.record("bwd", dict(locals()))
        return ref_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal,
            softmax_scale,
            -1 if window_size_left is None else window_size_left,
            -1 if window_size_right is None else window_size_right,
            softcap,
        )

    module = types.ModuleType("flash_attn.cute.interface")
    module._flash_attn_fwd = _flash_attn_fwd
    module._flash_attn_bwd = _flash_attn_bwd
    return module


@pytest.mark.parametrize(
    ("window", "softcap", "expected_window", "expected_softcap"),
    [((-1, -1), 0.0, (None, None), None), ((3, -1), 2.0, (3, None), 2.0)],
)
def test_fa4_adapter_exact_call_window_and_backward_order(
    window, softcap, expected_window, expected_softcap, monkeypatch
):
    recorder = Recorder()
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", _fa4_standin(recorder))
    args = _adapter_inputs(window=window, softcap=softcap)
    q, k, v, a = args
    cu_q, cu_k = a.cu_seqlens_q, a.cu_seqlens_k
    out, lse = flash.fa4_forward(*args)
    call = recorder.only("fwd")
    assert call["q"] is q and call["k"] is k and call["v"] is v and call["qv"] is None
    assert call["cu_seqlens_q"] is cu_q and call["cu_seqlens_k"] is cu_k
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (5, 4)
    assert (call["window_size_left"], call["window_size_right"]) == expected_window
    assert call["softcap"] == expected_softcap and call["return_lse"] is True
    assert call["causal"] is True and call["softmax_scale"] == 0.25
    ref_out, ref_lse = ref_forward(*args)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)

    dout = torch.randn_like(out)
    dq, dk, dv = flash.fa4_backward(dout, q, k, v, out, lse, *args[3:])
    call = recorder.only("bwd")
    # q, k, v, out, dout, lse: FA4's order, which differs from FA2/FA3 (dout first).
    assert call["out"] is out and call["dout"] is dout and call["lse"] is lse
    assert (call["window_size_left"], call["window_size_right"]) == expected_window
    assert call["softcap"] == softcap and call["cu_seqlens_k"] is cu_k
    for ours, ref in zip((dq, dk, dv), _reference_grads(args, dout)[2], strict=True):
        torch.testing.assert_close(ours, ref)


def test_views_with_a_contiguous_head_dim_reach_the_kernel_uncopied(monkeypatch):
    """prime-rl passes ``x.transpose(1, 2)[0]`` views: FlashAttention takes their strides, so
    the adapter hands over the very tensor; a head dim with another stride is copied once."""
    recorder = Recorder()
    _install_fa2(monkeypatch, recorder)
    monkeypatch.setitem(BACKENDS, "fa2", dataclasses.replace(BACKENDS["fa2"], device_types=None))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, 9, 8, generator=gen).bfloat16().transpose(0, 1) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, lse = varlen_attention(q, k, v, cu, cu, causal=True, backend="fa2")
    call = recorder.only("fwd")
    assert call["q"] is q and call["k"] is k and call["v"] is v and not q.is_contiguous()
    dense = varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, causal=True)
    torch.testing.assert_close((out, lse), dense, rtol=0, atol=0)

    recorder.calls.clear()
    every_other = torch.randn(9, 4, 16, generator=gen).bfloat16()[..., ::2]  # head dim stride 2
    out, _ = varlen_attention(every_other, k, v, cu, cu, causal=True, backend="fa2")
    copied = recorder.only("fwd")["q"]
    assert copied.is_contiguous() and torch.equal(copied, every_other)
    dense = varlen_attention(every_other.contiguous(), k, v, cu, cu, causal=True)[0]
    torch.testing.assert_close(out, dense, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["sdpa", "fa2"])
def test_transposed_views_give_the_gradients_of_their_copies(backend, monkeypatch):
    _install_fa2(monkeypatch, Recorder())
    monkeypatch.setitem(BACKENDS, "fa2", dataclasses.replace(BACKENDS["fa2"], device_types=None))
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(h, 11, 8, generator=gen).bfloat16().requires_grad_() for h in (4, 2, 2)]
    views = [t.transpose(0, 1) for t in base]
    copies = [t.detach().transpose(0, 1).contiguous().requires_grad_() for t in base]
    cu = torch.tensor([0, 6, 11], dtype=torch.int32)
    dout = torch.randn(11, 4, 8, generator=gen).bfloat16()
    for q, k, v in (views, copies):
        out, _ = varlen_attention(q, k, v, cu, cu, causal=True, backend=backend)
        (out.float() * dout.float()).sum().backward()
    for b, copy in zip(base, copies, strict=True):
        torch.testing.assert_close(b.grad.transpose(0, 1), copy.grad, rtol=0, atol=0)


@pytest.fixture
def flash_standins(monkeypatch):
    """The three libraries replaced by their recording stand-ins, and the flash backends allowed
    on CPU tensors, so the registered ``flash_attn_*`` ops run their real adapters on CPU."""
    _install_fa2(monkeypatch, Recorder())
    for name in ("flash_attn_3", "flash_attn_3._C", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(torch.ops, "flash_attn_3", _fa3_standin(Recorder()), raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", _fa4_standin(Recorder()))
    for name in ("fa2", "fa3", "fa4"):
        spec = BACKENDS[name]
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(spec, device_types=None))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fa2", "fa3", "fa4"])
def test_opcheck_flash_ops_through_standins(backend, flash_standins):
    q, k, v, cu_q, cu_k, max_q, max_k = packed(
        [5, 3, 6], lengths_k=[5, 4, 6], h=4, hkv=2, d=8, dtype=torch.bfloat16
    )
    fwd, bwd = _ops(backend)
    args = (q, k, v, *trailing(backend, cu_q, cu_k, max_q, max_k, True, 0.35, 4, -1, 0.0))
    torch.library.opcheck(fwd.default, args)
    out, lse = fwd(*args)
    detached = [t.detach() for t in (q, k, v)]
    bwd_args = (torch.randn_like(out).detach(), *detached, out.detach(), lse, *args[3:])
    torch.library.opcheck(bwd.default, bwd_args)


# --------------------------------------------------------------------------- compile + AC


class AttentionBlock(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cu_seqlens, max_seqlen: int):
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).unbind(1)
        out, _ = varlen_attention(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            causal=True,
            check_cu_seqlens=False,
        )
        return x + self.proj(out.flatten(1))


class AttentionModel(nn.Module):
    def __init__(self, n_blocks=2, dim=16):
        super().__init__()
        self.layers = nn.ModuleList(AttentionBlock(dim) for _ in range(n_blocks))

    def forward(self, x, cu_seqlens, max_seqlen: int):
        for layer in self.layers:
            x = layer(x, cu_seqlens, max_seqlen)
        return x.square().mean()


@pytest.fixture
def count_attention_forwards(monkeypatch):
    """Swaps a counting sdpa forward into the registry; returns a function that runs forward and
    backward of a model and says how often the attention forward kernel ran."""
    calls = []
    spec = BACKENDS["sdpa"]

    def counting_forward(*args):
        calls.append(1)
        return spec.forward(*args)

    monkeypatch.setitem(BACKENDS, "sdpa", dataclasses.replace(spec, forward=counting_forward))

    def run(model, *inputs):
        calls.clear()
        model(*inputs).backward()
        return len(calls)

    return run


@pytest.mark.slow
def test_compiled_checkpointed_blocks_keep_attention_and_match_eager(count_attention_forwards):
    prime_ac = pytest.importorskip("prime_ac")
    torch.manual_seed(0)
    x = torch.randn(12, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    reference = AttentionModel()
    full, selective = AttentionModel(), AttentionModel()
    full.load_state_dict(reference.state_dict())
    selective.load_state_dict(reference.state_dict())

    assert count_attention_forwards(reference, x, cu, 7) == 2
    prime_ac.checkpoint_blocks(full, mode="full")
    assert count_attention_forwards(full, x, cu, 7) == 4  # recomputed once per block

    prime_ac.checkpoint_blocks(selective, mode="selective")
    torch._dynamo.reset()
    compiled = torch.compile(selective, fullgraph=True)  # a graph break would raise
    assert count_attention_forwards(compiled, x, cu, 7) == 2  # kept, not recomputed
    for (name, ours), theirs in zip(
        selective.named_parameters(), reference.parameters(), strict=True
    ):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=name)
