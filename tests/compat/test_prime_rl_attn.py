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

import re

import pytest
import torch

from tests.compat.flash_standins import install, reference, reference_grads, same

OPS = torch.ops.prime_rl_attn


@pytest.fixture
def calls(monkeypatch):
    """The three libraries replaced by recording stand-ins, the flash backends allowed on CPU."""
    return install(monkeypatch)


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
