"""Recording stand-ins for the FlashAttention libraries and the float64 reference they compute
with (plain PyTorch, independent of prime_ops), shared by the prime-rl compat tests.

Each stand-in has the entry point prime_ops' adapter calls (``prime_ops/attn/flash.py``), takes
its arguments by the library's names and conventions (FA4: windows None; FA2: +inf lse rows are
not produced here because the compat calls are causal self-attention), and records each call.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from itertools import pairwise

import torch

from prime_ops.attn.varlen import BACKENDS


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


def fa4_module(calls: Recorder):
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


def fa2_module(calls: Recorder):
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


def fa3_ops(calls: Recorder):
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


def install(monkeypatch=None) -> Recorder:
    """Put the three stand-ins in place of the libraries and allow the flash backends on CPU
    tensors; with ``monkeypatch`` everything is undone after the test (without: for the rest of
    a child process)."""
    recorded = Recorder()

    def setitem(mapping, key, value):
        if monkeypatch is None:
            mapping[key] = value
        else:
            monkeypatch.setitem(mapping, key, value)

    for name in ("flash_attn", "flash_attn.cute", "flash_attn_3", "flash_attn_3._C"):
        setitem(sys.modules, name, types.ModuleType(name))
    setitem(sys.modules, "flash_attn.cute.interface", fa4_module(recorded))
    setitem(sys.modules, "flash_attn.flash_attn_interface", fa2_module(recorded))
    if monkeypatch is None:
        torch.ops.flash_attn_3 = fa3_ops(recorded)
    else:
        monkeypatch.setattr(torch.ops, "flash_attn_3", fa3_ops(recorded), raising=False)
    for name in ("fa2", "fa3", "fa4"):
        setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], device_types=None))
    return recorded
