"""Bad input to the ``prime_rl_attn`` ops: a clear error, never NaN output or a hang.

The varlen ops are called through the front, the fake and the raw ``torch.ops.prime_rl_attn``
op; ring attention runs on 2 gloo ranks (one run for every case, groups time out after 30 s, so
a rank left waiting fails the test instead of stalling CI), in the default and checked modes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch._subclasses.fake_tensor import FakeTensorMode

from prime_ops.attn import ring_attention, varlen_attention
from prime_ops.groups import set_checked

OPS = torch.ops.prime_rl_attn
WAITING = r"rank \d of 2 before sending anything; the other ranks may be waiting"
EVERY = "Every rank raises this error"


def _packed():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    return q, k, v, cu, cu, 5, 5


# (changes to the raw op's arguments, message): softcap, causal and scale come last
RAW = [
    # softcap=inf passed the >= 0 check and returned all-NaN out and lse (issue 24)
    ({"softcap": math.inf}, r"softcap must be finite and >= 0 .*; got inf"),
    ({"softcap": math.nan}, "softcap must be finite and >= 0 .*; got nan"),
    ({"softcap": -1.0}, "softcap must be finite and >= 0"),
    ({"scale": math.inf}, "softmax_scale must be finite; got inf"),
    ({"scale": math.nan}, "softmax_scale must be finite; got nan"),
    ({"left": -2}, "window_size entries must be >= -1"),
    ({"max_q": -1}, "max_seqlen_q/k must be >= 0"),
    ({"q": torch.randn(8, 4, 16)}, "same head dim"),
    ({"q": torch.randn(8, 3, 8)}, "multiple of k/v's heads"),
    ({"cu_q": torch.tensor([0, 3, 8])}, "cu_seqlens_q must be a 1-D int32 tensor"),
    ({"cu_k": torch.tensor([0, 8], dtype=torch.int32)}, "same number of sequences"),
    ({"v": torch.randn(7, 2, 8)}, "k and v must agree"),
]


def _raw_args(change):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, causal=True,
                scale=0.3, left=-1, right=-1, softcap=0.0)  # fmt: skip
    args.update(change)
    return tuple(args.values())


@pytest.mark.parametrize(("change", "message"), RAW, ids=[",".join(c) for c, _ in RAW])
def test_varlen_refused_alike_by_front_fake_and_op(change, message):
    args = _raw_args(change)
    with pytest.raises(ValueError, match=message):
        OPS.sdpa_varlen(*args)
    mode = FakeTensorMode()
    fakes = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with mode, pytest.raises(ValueError, match=message):
        OPS.sdpa_varlen(*fakes)
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap = args
    with pytest.raises(ValueError, match=message):
        varlen_attention(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=scale,
            window_size=(left, right), softcap=softcap,
        )  # fmt: skip


def test_varlen_backward_refuses_gradients_of_another_shape():
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    out, lse = OPS.sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, True, 0.3, -1, -1, 0.0)
    rest = (cu_q, cu_k, max_q, max_k, True, 0.3, -1, -1, 0.0)
    with pytest.raises(ValueError, match=r"dout must have shape \(8, 4, 8\); got \(8, 4, 4\)"):
        OPS.sdpa_varlen_backward(torch.randn(8, 4, 4), q, k, v, out, lse, *rest)
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 8\); got \(8, 4\)"):
        OPS.sdpa_varlen_backward(torch.randn(8, 4, 8), q, k, v, out, lse.T, *rest)


def test_a_large_finite_softcap_works():
    """The largest softcaps still cap nothing in practice and must give finite results."""
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    plain = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k)
    capped = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softcap=1e30)
    for a, b in zip(plain, capped, strict=True):
        torch.testing.assert_close(a, b)


def _ring_body(rank, world):
    q = torch.randn(8, 2, 8)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    name = dist.group.WORLD.group_name
    default = [  # every rank makes the same bad call
        (lambda: ring_attention(q, q, q, cu, 16, softcap=math.inf), "softcap must be finite"),
        (lambda: ring_attention(None, q, q, cu, 16), "q must be a torch.Tensor, got NoneType"),
        (lambda: ring_attention(q, q, q, [0, 16], 16), "cu_seqlens_q must be a torch.Tensor"),
        (lambda: ring_attention(q, q, q, cu, 16, softcap="x"), "could not convert string"),
        (lambda: OPS.ring_attention(q, q, q, cu, 16, False, 0.3, math.inf, name, "sdpa"),
         "softcap must be finite"),
        (lambda: OPS.ring_attention(q, q, q, cu, 16, False, math.nan, 0.0, name, "sdpa"),
         "softmax_scale must be finite"),
    ]  # fmt: skip
    for call, message in default:
        with pytest.raises((ValueError, TypeError), match=f"{message}.*{WAITING}"):
            call()
    set_checked(True)
    one = rank == 1
    checked = [  # one rank's error, of any type, reaches both
        (lambda: ring_attention(None if one else q, q, q, cu, 16), "rank 1 .*TypeError: q must"),
        (lambda: ring_attention(q, q, q, cu, 16, softcap="x" if one else 0.0),
         "rank 1 .*ValueError: could not convert"),
        (lambda: ring_attention(q, q, q, cu, 16, softcap=math.inf if one else 0.0),
         "rank 1 .*softcap must be finite"),
        (lambda: ring_attention(q, q, q, cu, 16, softcap=1.0 + rank), "softcap must be the same"),
    ]  # fmt: skip
    for call, message in checked:
        with pytest.raises(ValueError, match=f"{message}.*{EVERY}"):
            call()
    out, lse = ring_attention(q, q, q, cu, 16)  # still in step
    assert out.shape == q.shape and torch.isfinite(lse).all()
    set_checked(False)


def test_bad_ring_calls_raise_on_every_rank():
    run_distributed(_ring_body, 2, timeout=60)
