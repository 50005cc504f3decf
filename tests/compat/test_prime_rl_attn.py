"""prime-rl's calls of the ``prime_rl_attn`` varlen ops, made exactly as prime-rl makes them.

Mirrors prime-rl ``src/prime_rl/trainer/models/layers/attn.py`` (the newest version in the
search index, id 70364901472: FA2/FA3/FA4 all registered as custom ops; see
docs/attention.md#prime-rl-compatibility for the schema table): ``flash_attn_4_varlen_op``,
``flash_attn_2_varlen_op``, ``flash_attn_3_varlen_op`` and ``FlashAttention._compute_attention``
/ ``forward`` (q, k, v reach the op as transposed views). The FlashAttention libraries are
replaced by stand-in modules that record the exact call and compute with the float64 reference
below (plain PyTorch, independent of prime_ops), so outputs and gradients are checked on CPU;
``sdpa_varlen`` (FA4's schema) runs the same calls through prime_ops' own CPU kernel.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from itertools import pairwise

import pytest
import torch

from prime_ops.attn.varlen import BACKENDS

OPS = torch.ops.prime_rl_attn


def _visible(len_q, len_k, causal, left, right):
    pos = torch.arange(len_q)[:, None] + len_k - len_q
    key = torch.arange(len_k)[None, :]
    seen = torch.ones(len_q, len_k, dtype=torch.bool)
    if causal:
        seen &= key <= pos
    if right is not None and right >= 0:
        seen &= key <= pos + right
    if left is not None and left >= 0:
        seen &= key >= pos - left
    return seen


def _probs(q, k, seen, scale):
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - lse[..., None]), lse


def reference(q, k, v, cu_q, cu_k, *, causal, scale, left=None, right=None):
    """float64 attention per packed sequence; queries aligned to the end of their keys, windows
    ``None`` or negative for unbounded. Returns ``(out [T, H, Dv], lse [H, T])``."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(pairwise(cu_q.tolist()), pairwise(cu_k.tolist()), strict=True):
        seen = _visible(q1 - q0, k1 - k0, causal, left, right)
        keys, values = (t[k0:k1].repeat_interleave(groups, 1) for t in (k, v))
        probs, lse = _probs(q[q0:q1], keys, seen, scale)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def reference_grads(dout, q, k, v, cu_q, cu_k, *, causal, scale, left=None, right=None):
    """The softmax-attention gradients written out in float64 (stand-in kernels run below
    autograd, so they cannot differentiate :func:`reference`; the tests check these against
    autograd of it)."""
    dout, q, k, v = (t.detach().double() for t in (dout, q, k, v))
    groups = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, q1), (k0, k1) in zip(pairwise(cu_q.tolist()), pairwise(cu_k.tolist()), strict=True):
        seen = _visible(q1 - q0, k1 - k0, causal, left, right)
        keys, values = (t[k0:k1].repeat_interleave(groups, 1) for t in (k, v))
        probs, _ = _probs(q[q0:q1], keys, seen, scale)
        do = dout[q0:q1]
        out = torch.einsum("hqk,khd->qhd", probs, values)
        dprobs = torch.einsum("qhd,khd->hqk", do, values)
        delta = (do * out).sum(-1).transpose(0, 1)[..., None]
        dscores = probs * (dprobs - delta) * scale
        dq[q0:q1] = torch.einsum("hqk,khd->qhd", dscores, keys)
        dk_full = torch.einsum("hqk,qhd->khd", dscores, q[q0:q1])
        dv_full = torch.einsum("hqk,qhd->khd", probs, do)
        dk[k0:k1] = dk_full.unflatten(1, (k.shape[1], groups)).sum(2)
        dv[k0:k1] = dv_full.unflatten(1, (k.shape[1], groups)).sum(2)
    return dq, dk, dv


def same(a, b):
    """The same memory and layout (autograd hands kernels new tensor objects of saved ones)."""
    return (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())


class Recorder(list):
    def only(self, name):
        found = [kwargs for called, kwargs in self if called == name]
        assert len(found) == 1, self
        return found[0]


def _fa4_module(calls: Recorder):
    """``flash_attn.cute.interface`` (flash-attn-4 4.0.0b*): ``_flash_attn_fwd`` returns 4 items
    (beta19+), ``_flash_attn_bwd(q, k, v, out, dout, lse, ...)``; windows use None."""
    module = types.ModuleType("flash_attn.cute.interface")

    def _flash_attn_fwd(q, k, v, **kwargs):
        calls.append(("fwd", dict(kwargs, q=q, k=k, v=v)))
        how = dict(causal=kwargs["causal"], scale=kwargs["softmax_scale"])
        how.update(left=kwargs["window_size_left"], right=kwargs["window_size_right"])
        out, lse = reference(q, k, v, kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"], **how)
        return out.to(q.dtype), lse.float(), None, None

    def _flash_attn_bwd(q, k, v, out, dout, lse, **kwargs):
        calls.append(("bwd", dict(kwargs, q=q, k=k, v=v, out=out, dout=dout, lse=lse)))
        how = dict(causal=kwargs["causal"], scale=kwargs["softmax_scale"])
        how.update(left=kwargs["window_size_left"], right=kwargs["window_size_right"])
        cu = (kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"])
        grads = reference_grads(dout, q, k, v, *cu, **how)
        return tuple(g.to(q.dtype) for g in grads)

    module._flash_attn_fwd, module._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    return module


def _fa2_module(calls: Recorder):
    """``flash_attn.flash_attn_interface`` (2.8.3): +inf lse for rows without keys, backward into
    the given dq/dk/dv. Every argument is taken by name, as prime_ops' adapter passes them."""
    module = types.ModuleType("flash_attn.flash_attn_interface")

    def _flash_attn_varlen_forward(q, k, v, **kwargs):
        calls.append(("fwd", dict(kwargs, q=q, k=k, v=v)))
        how = dict(causal=kwargs["causal"], scale=kwargs["softmax_scale"])
        how.update(left=kwargs["window_size_left"], right=kwargs["window_size_right"])
        out, lse = reference(q, k, v, kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"], **how)
        return out.to(q.dtype), lse.float(), None, None

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, **kwargs):
        calls.append(("bwd", dict(kwargs, q=q, k=k, v=v, dq=dq)))
        how = dict(causal=kwargs["causal"], scale=kwargs["softmax_scale"])
        how.update(left=kwargs["window_size_left"], right=kwargs["window_size_right"])
        cu = (kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"])
        grads = reference_grads(dout, q, k, v, *cu, **how)
        for buf, grad in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(grad)
        return None

    module._flash_attn_varlen_forward = _flash_attn_varlen_forward
    module._flash_attn_varlen_backward = _flash_attn_varlen_backward
    return module


def _fa3_ops(calls: Recorder):
    """``torch.ops.flash_attn_3`` (hopper/ build): ``fwd`` returns (out, lse, ...), ``bwd``
    writes dq/dk/dv; ``is_causal``."""

    def fwd(q, k, v, **kwargs):
        calls.append(("fwd", dict(kwargs, q=q, k=k, v=v)))
        how = dict(causal=kwargs["is_causal"], scale=kwargs["softmax_scale"])
        how.update(left=kwargs["window_size_left"], right=kwargs["window_size_right"])
        out, lse = reference(q, k, v, kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"], **how)
        return out.to(q.dtype), lse.float(), None, None

    def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, **kwargs):
        calls.append(("bwd", dict(kwargs, q=q, k=k, v=v)))
        how = dict(causal=kwargs["is_causal"], scale=kwargs["softmax_scale"])
        how.update(left=kwargs["window_size_left"], right=kwargs["window_size_right"])
        cu = (kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"])
        grads = reference_grads(dout, q, k, v, *cu, **how)
        for buf, grad in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(grad)

    return types.SimpleNamespace(fwd=fwd, bwd=bwd)


@pytest.fixture
def calls(monkeypatch):
    """The three libraries replaced by recording stand-ins, the flash backends allowed on CPU."""
    recorded = Recorder()
    for name in ("flash_attn", "flash_attn.cute", "flash_attn_3", "flash_attn_3._C"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", _fa4_module(recorded))
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", _fa2_module(recorded))
    monkeypatch.setattr(torch.ops, "flash_attn_3", _fa3_ops(recorded), raising=False)
    for name in ("fa2", "fa3", "fa4"):
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], device_types=None))
    return recorded


def prime_rl_inputs(dtype=torch.bfloat16, heads=4, kv_heads=2, head_dim=16, seed=0):
    """q, k, v as ``FlashAttention.forward`` hands them to ``_compute_attention``: projected,
    viewed ``[1, T, H, D]``, transposed to ``[1, H, T, D]`` for rope (a new tensor), transposed
    back and indexed ``[0]``: ``[T, H, D]`` views whose head dim alone is contiguous."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    tokens = int(cu[-1])

    def rotated(h):
        after_rope = torch.randn(1, h, tokens, head_dim, generator=gen).to(dtype)
        return after_rope.requires_grad_().transpose(1, 2)[0]

    q, k, v = rotated(heads), rotated(kv_heads), rotated(kv_heads)
    assert not q.is_contiguous() and q.stride(-1) == 1
    return q, k, v, cu, 7


def check_against_reference(q, k, v, cu, out, lse, *, left=None, right=None, tol):
    scale = q.shape[-1] ** -0.5
    how = dict(causal=True, scale=scale, left=left, right=right)
    ref_out, ref_lse = reference(q, k, v, cu, cu, **how)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(reference(*leaves, cu, cu, **how)[0], leaves, dout.double())
    written_out = reference_grads(dout, q, k, v, cu, cu, **how)
    for ours, ref, formula in zip(grads, ref_grads, written_out, strict=True):
        torch.testing.assert_close(formula, ref, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ours.double(), ref, **tol)


BF16 = dict(atol=2e-2, rtol=2e-2)


# --- flash_attn_4_varlen -------------------------------------------------------------------


@pytest.mark.parametrize("sliding_window", [None, 4])
def test_flash_attn_4_varlen_as_flash_attn_4_varlen_op_calls_it(calls, sliding_window):
    """attn.py ``flash_attn_4_varlen_op`` as ``_compute_attention`` calls it (FA4: cu_seqlens
    by keyword, no max_seqlen, window ``(sliding_window - 1, 0)`` or ``(None, None)``)."""
    q, k, v, cu, _ = prime_rl_inputs()
    window = (None, None) if sliding_window is None else (sliding_window - 1, 0)
    out, lse = OPS.flash_attn_4_varlen(q, k, v, cu, cu, None, None, True, window[0], window[1])
    call = calls.only("fwd")
    assert call["q"] is q and call["k"] is k and call["v"] is v  # strides passed on, no copy
    assert call["cu_seqlens_q"] is cu and call["cu_seqlens_k"] is cu
    assert (call["window_size_left"], call["window_size_right"]) == window
    assert call["causal"] is True and call["return_lse"] is True and call["softcap"] is None
    assert call["softmax_scale"] == q.shape[-1] ** -0.5  # FA4's own default, as prime-rl gets
    # None is FA4's "no bound given": the packed length bounds every sequence.
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (16, 16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == (16, 4, 16) and lse.shape == (4, 16)
    check_against_reference(q, k, v, cu, out, lse, left=window[0], right=window[1], tol=BF16)
    bwd = calls.only("bwd")
    assert all(same(bwd[name], t) for name, t in (("q", q), ("out", out), ("lse", lse)))
    assert (bwd["window_size_left"], bwd["window_size_right"]) == window


def test_flash_attn_4_varlen_with_max_seqlen_and_prime_ops_extras(calls):
    """The 10 arguments with ints, then prime_ops' extras by keyword after them."""
    q, k, v, cu, max_len = prime_rl_inputs()
    out, _ = OPS.flash_attn_4_varlen(q, k, v, cu, cu, max_len, max_len, True, None, None)
    assert (calls.only("fwd")["max_seqlen_q"], calls.only("fwd")["max_seqlen_k"]) == (7, 7)
    calls.clear()
    capped, _ = OPS.flash_attn_4_varlen(
        q, k, v, cu, cu, max_len, max_len, True, None, None, softmax_scale=0.2, softcap=5.0
    )
    call = calls.only("fwd")
    assert call["softmax_scale"] == 0.2 and call["softcap"] == 5.0


def test_flash_attn_4_varlen_older_8_argument_call(calls):
    """prime-rl's older attn.py (index id 71599495014): ``_flash_attn_4_varlen(q, k, v,
    cu_seqlens_q, cu_seqlens_k, causal, window_size_left, window_size_right)``; it binds to the
    ``no_max_seqlen`` overload, which runs the default one (autograd included)."""
    q, k, v, cu, _ = prime_rl_inputs()
    out, lse = OPS.flash_attn_4_varlen(q, k, v, cu, cu, True, None, None)
    assert calls.only("fwd")["max_seqlen_q"] == 16
    check_against_reference(q, k, v, cu, out, lse, tol=BF16)
    schema = OPS.flash_attn_4_varlen.no_max_seqlen._schema
    assert [a.name for a in schema.arguments][5:] == [
        "causal",
        "window_size_left",
        "window_size_right",
    ]


# --- flash_attn_2_varlen / flash_attn_3_varlen ---------------------------------------------


@pytest.mark.parametrize("op", ["flash_attn_2_varlen", "flash_attn_3_varlen"])
@pytest.mark.parametrize("sliding_window", [None, 4])
def test_flash_attn_2_and_3_varlen_as_their_varlen_ops_call_them(calls, op, sliding_window):
    """attn.py ``flash_attn_2_varlen_op`` / ``flash_attn_3_varlen_op``: ``(q, k, v, cu, cu,
    max_seqlen, max_seqlen, softmax_scale, causal, *window_size)``, scale ``D ** -0.5``."""
    q, k, v, cu, max_len = prime_rl_inputs()
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    scale = q.shape[-1] ** -0.5
    out, lse = getattr(OPS, op)(q, k, v, cu, cu, max_len, max_len, scale, True, *window)
    call = calls.only("fwd")
    assert call["q"] is q and call["k"] is k and call["v"] is v
    assert (call["max_seqlen_q"], call["max_seqlen_k"], call["softmax_scale"]) == (7, 7, scale)
    assert (call["window_size_left"], call["window_size_right"]) == window
    assert call["softcap"] == 0.0
    check_against_reference(q, k, v, cu, out, lse, left=window[0], right=window[1], tol=BF16)
    assert same(calls.only("bwd")["q"], q)


# --- the schemas, argument by argument -----------------------------------------------------

# prime-rl's schemas, written out from attn.py (names, types, order); prime_ops' extras follow.
PRIME_RL_SCHEMAS = {
    "flash_attn_4_varlen": "q:Tensor k:Tensor v:Tensor cu_seqlens_q:Tensor cu_seqlens_k:Tensor "
    "max_seqlen_q:int? max_seqlen_k:int? causal:bool window_size_left:int? "
    "window_size_right:int?",
    "flash_attn_4_varlen_backward": "dout:Tensor q:Tensor k:Tensor v:Tensor out:Tensor lse:Tensor "
    "cu_seqlens_q:Tensor cu_seqlens_k:Tensor max_seqlen_q:int? max_seqlen_k:int? causal:bool "
    "window_size_left:int? window_size_right:int?",
}
for _n in (2, 3):
    PRIME_RL_SCHEMAS[f"flash_attn_{_n}_varlen"] = (
        "q:Tensor k:Tensor v:Tensor cu_seqlens_q:Tensor cu_seqlens_k:Tensor max_seqlen_q:int "
        "max_seqlen_k:int softmax_scale:float causal:bool window_size_left:int "
        "window_size_right:int"
    )
    PRIME_RL_SCHEMAS[f"flash_attn_{_n}_varlen_backward"] = (
        "dout:Tensor q:Tensor k:Tensor v:Tensor out:Tensor lse:Tensor cu_seqlens_q:Tensor "
        "cu_seqlens_k:Tensor max_seqlen_q:int max_seqlen_k:int softmax_scale:float causal:bool "
        "window_size_left:int window_size_right:int"
    )


@pytest.mark.parametrize("name", sorted(PRIME_RL_SCHEMAS))
def test_schema_starts_with_prime_rls_and_extras_have_defaults(name):
    arguments = getattr(OPS, name).default._schema.arguments
    ours = " ".join(f"{a.name}:{a.type}" for a in arguments)
    ours = re.sub(r"Optional\[(\w+)\]", r"\1?", ours)
    theirs = PRIME_RL_SCHEMAS[name]
    assert ours.startswith(theirs + " ") or ours == theirs, ours
    extras = arguments[len(theirs.split()) :]
    assert extras and all(a.has_default_value() for a in extras)
    returns = getattr(OPS, name).default._schema.returns
    assert len(returns) == (2 if name.endswith("_varlen") else 3)


# --- the CPU kernel under the FA4 schema, eager and compiled -------------------------------


def _compute_attention(q, k, v, cu):
    """``_compute_attention``'s FA4 branch (``out, _ = self.func(...)``), on prime_ops' sdpa."""
    out, _ = OPS.sdpa_varlen(q, k, v, cu, cu, None, None, True, None, None)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_varlen_takes_prime_rls_fa4_call_on_cpu(dtype):
    q, k, v, cu, _ = prime_rl_inputs(dtype=dtype)
    out, lse = OPS.sdpa_varlen(q, k, v, cu, cu, None, None, True, None, None)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    check_against_reference(q, k, v, cu, out, lse, tol=tol)


@pytest.mark.slow
def test_prime_rl_call_compiles_with_fullgraph():
    """prime-rl compiles each block (``fullgraph=True``); the op must trace without a break."""
    q, k, v, cu, _ = prime_rl_inputs(dtype=torch.float32)
    compiled = torch.compile(_compute_attention, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, cu)
    eager = _compute_attention(q, k, v, cu)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    eager_grads = torch.autograd.grad(eager, (q, k, v), dout)
    for a, b in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
