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

from prime_ops.attn import ring_attention, ring_shard, varlen_attention
from prime_ops.groups import set_checked

OPS = torch.ops.prime_rl_attn
WAITING = (
    r"\[\S+ raised this on rank \d of 2 before sending anything; the other ranks may be waiting"
)
EVERY = "Every rank raises this error"


def _packed():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    return q, k, v, cu, cu, 5, 5


# (changes to the raw op's arguments, message); sdpa_varlen takes FA4's schema (causal, window
# left/right, then prime_ops' scale and softcap)
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
    # 0 heads and head dim 0 raised ZeroDivisionError (issue 31)
    ({"q": torch.randn(8, 0, 8)}, r"q needs at least one head .*got shape \(8, 0, 8\)"),
    (
        {"q": torch.randn(8, 4, 0), "k": torch.randn(8, 2, 0), "v": torch.randn(8, 2, 0)},
        r"q needs at least one head and a head dim >= 1; got shape \(8, 4, 0\)",
    ),
]


def _raw_args(change):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, causal=True,
                left=-1, right=-1, scale=0.3, softcap=0.0)  # fmt: skip
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
    q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale, softcap = args
    with pytest.raises(ValueError, match=message):
        varlen_attention(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=scale,
            window_size=(left, right), softcap=softcap,
        )  # fmt: skip


def test_varlen_backward_refuses_gradients_of_another_shape():
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    out, lse = OPS.sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, True, -1, -1, 0.3, 0.0)
    rest = (cu_q, cu_k, max_q, max_k, True, -1, -1, 0.3, 0.0)
    with pytest.raises(ValueError, match=r"dout must have shape \(8, 4, 8\); got \(8, 4, 4\)"):
        OPS.sdpa_varlen_backward(torch.randn(8, 4, 4), q, k, v, out, lse, *rest)
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 8\); got \(8, 4\)"):
        OPS.sdpa_varlen_backward(torch.randn(8, 4, 8), q, k, v, out, lse.T, *rest)


def _front(**change):
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                max_seqlen_k=max_k, causal=True)  # fmt: skip
    return varlen_attention(**(args | change))


# issue 31: each raised AttributeError, ZeroDivisionError or an unrelated TypeError before
FRONT = {
    "q_none": ({"q": None}, TypeError, "q must be a torch.Tensor, got NoneType"),
    "k_list": ({"k": [[0.0]]}, TypeError, "k must be a torch.Tensor, got list"),
    "zero_heads": (
        {"q": torch.randn(8, 0, 8), "k": torch.randn(8, 0, 8), "v": torch.randn(8, 0, 8)},
        ValueError,
        r"q needs at least one head and a head dim >= 1; got shape \(8, 0, 8\)",
    ),
    "zero_head_dim": (
        {"q": torch.randn(8, 4, 0), "k": torch.randn(8, 2, 0), "v": torch.randn(8, 2, 0)},
        ValueError,
        r"q needs at least one head and a head dim >= 1; got shape \(8, 4, 0\)",
    ),
    "softcap_str": ({"softcap": "1"}, TypeError, "softcap must be a float, got '1'"),
    "scale_str": ({"softmax_scale": "0.3"}, TypeError, "softmax_scale must be a float"),
    "window_triple": (
        {"window_size": (1, 2, 3)},
        ValueError,
        r"window_size must be a pair \(left, right\) .*; got \(1, 2, 3\)",
    ),
    "window_int": ({"window_size": 4}, ValueError, "window_size must be a pair"),
    "window_float": ({"window_size": (1.5, 0)}, TypeError, "window_size_left must be an int"),
    "max_seqlen_str": ({"max_seqlen_q": "5"}, TypeError, "max_seqlen_q must be an int .*'5'"),
    "causal_int": ({"causal": 1}, TypeError, "causal must be a bool, got 1"),
    "backend_none": ({"backend": None}, ValueError, "backend=None is not an attention backend"),
}


@pytest.mark.parametrize("case", sorted(FRONT))
def test_front_names_the_bad_argument(case):
    change, error, message = FRONT[case]
    with pytest.raises(error, match=message):
        _front(**change)


def test_max_seqlen_none_means_the_packed_length():
    """prime-rl passes None to FA4's op: no host read, bounded by the packed length."""
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    explicit = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    for got in (
        varlen_attention(q, k, v, cu_q, cu_k, causal=True),
        varlen_attention(q, k, v, cu_q, cu_k, None, None, causal=True),
        OPS.sdpa_varlen(q, k, v, cu_q, cu_k, None, None, True, None, None),
        OPS.sdpa_varlen(q, k, v, cu_q, cu_k, None, 5, True, None, None),
    ):
        for a, b in zip(explicit, got, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="longer than max_seqlen 4"):  # an int still bounds
        varlen_attention(q, k, v, cu_q, cu_k, 4, None, causal=True)


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
        # the front turned softcap="1" into 1.0 where varlen_attention raised (issue 31)
        (lambda: ring_attention(q, q, q, cu, 16, softcap="1"), "softcap must be a float, got '1'"),
        (lambda: ring_attention(q, q, q, cu, 16, softmax_scale="0.3"),
         "softmax_scale must be a float, got '0.3'"),
        (lambda: ring_attention(q, q, q, cu, 16, causal="yes"), "causal must be a bool, got 'yes'"),
        (lambda: OPS.ring_attention(q, q, q, cu, 16, False, 0.3, math.inf, name, "sdpa"),
         "softcap must be finite"),
        (lambda: OPS.ring_attention(q, q, q, cu, 16, False, math.nan, 0.0, name, "sdpa"),
         "softmax_scale must be finite"),
    ]  # fmt: skip
    for call, message in default:
        with pytest.raises((ValueError, TypeError), match=f"(?s)^{WAITING}.*{message}"):
            call()
    set_checked(True)
    one = rank == 1
    checked = [  # one rank's error, of any type, reaches both
        (lambda: ring_attention(None if one else q, q, q, cu, 16), "rank 1 .*TypeError: q must"),
        (lambda: ring_attention(q, q, q, cu, 16, softcap="1" if one else 0.0),
         "rank 1 .*TypeError: softcap must be a float, got '1'"),
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


@pytest.mark.parametrize("windows_left_out", [(11, 11, True), (16, 16, False), (1, 1, True)])
def test_fa4_current_order_without_windows_is_refused(windows_left_out):
    """``(q, k, v, cu, cu, 11, 11, True)`` bound the older 8-argument overload as causal=True
    with window (11, 1) and ran sliding-window attention (issue 37)."""
    q, k, v, cu_q, cu_k, _, _ = _packed()
    with pytest.raises(
        TypeError, match=r"got \d+ where a bool causal belongs .*current call takes 10"
    ):
        OPS.flash_attn_4_varlen(q, k, v, cu_q, cu_k, *windows_left_out)
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (q, k, v, cu_q, cu_k)]
    with mode, pytest.raises(TypeError, match="where a bool causal belongs"):
        OPS.flash_attn_4_varlen(*fakes, *windows_left_out)


_CU = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
# issue 37: decreasing offsets returned bounds that lost sequences, causal="no" ran causal, a
# rank out of range raised StopIteration / IndexError
RING_SHARD = {
    "decreasing": (
        (torch.tensor([0, 12, 5, 16], dtype=torch.int32), True, 0, 2),
        ValueError,
        r"cu_seqlens must start at 0 and never decrease; got \[0, 12, 5, 16\]",
    ),
    "not_from_0": (
        (torch.tensor([2, 16], dtype=torch.int32), True, 0, 2),
        ValueError,
        "start at 0",
    ),
    "causal_str": ((_CU, "no", 0, 2), TypeError, "causal must be a bool, got 'no'"),
    "rank_high": ((_CU, True, 2, 2), ValueError, "rank must lie in .*got rank 2, world_size 2"),
    "rank_negative": ((_CU, True, -1, 2), ValueError, "got rank -1"),
    "world_0": ((_CU, True, 0, 0), ValueError, "world_size be >= 1"),
    "rank_float": ((_CU, True, 0.0, 2), TypeError, "rank must be an int, got 0.0"),
    "cu_2d": ((_CU.view(1, 4), True, 0, 2), ValueError, r"1-D integer tensor .*shape \(1, 4\)"),
    "cu_empty": ((_CU[:0], True, 0, 2), ValueError, r"1-D integer .*shape \(0,\)"),
    "cu_float": ((_CU.float(), True, 0, 2), ValueError, "1-D integer tensor"),
    "cu_list": (([0, 16], True, 0, 2), TypeError, "cu_seqlens must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", sorted(RING_SHARD))
def test_ring_shard_names_the_bad_argument(case):
    args, error, message = RING_SHARD[case]
    with pytest.raises(error, match=message):
        ring_shard(*args)


# Issue 37: a half-done switch was silent. prime-rl's own registration left in place and
# prime_ops both ran torch.library.custom_op for the same name, and torch let the module
# imported last replace the other's op.
PRIME_RL_REGISTRATION = """
import torch


@torch.library.custom_op("prime_rl_attn::flash_attn_4_varlen", mutates_args=())
def flash_attn_4_varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None, max_seqlen_k: int | None,
    causal: bool, window_size_left: int | None, window_size_right: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0])
"""


@pytest.mark.parametrize("first", ["prime_rl", "prime_ops"])
def test_another_modules_registration_of_an_op_raises_naming_both(first, tmp_path):
    import subprocess
    import sys

    (tmp_path / "prime_rl_attn_left_in_place.py").write_text(PRIME_RL_REGISTRATION)
    imports = ["prime_rl_attn_left_in_place", "prime_ops"]
    if first == "prime_ops":
        imports.reverse()
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
    code += "".join(f"import {name}\n" for name in imports)
    code += "print('both imported')\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1 and "both imported" not in run.stdout, run.stdout + run.stderr
    assert (
        "RuntimeError: prime_rl_attn::flash_attn_4_varlen is registered by both "
        "prime_rl_attn_left_in_place and prime_ops (prime_ops.attn.varlen)" in run.stderr
    ), run.stderr


def test_prime_ops_op_survives_a_refused_registration():
    """After the refusal, prime_ops' op is still the one registered (nothing half-replaced)."""
    namespace = {}
    with pytest.raises(RuntimeError, match="registered by both"):
        exec(compile(PRIME_RL_REGISTRATION, "prime_rl_attn_left_in_place", "exec"), namespace)
    schema = str(OPS.flash_attn_4_varlen.default._schema)
    assert "float? softmax_scale=None" in schema  # prime_ops' schema, not the copy's
    q, k, v, cu_q, cu_k, max_q, max_k = _packed()
    out, _ = OPS.sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, True, None, None)
    assert torch.isfinite(out).all()


# Issue 37: prime_rl_ring::attention (which prime-rl calls raw) put its group_name and backend
# errors before any hint, and checked mode did not cover it: ranks whose heads_k_stride, token
# count or dtype differed aborted the job.


def _raw_ring(q, k, v, stride=1, name=None, backend="sdpa"):
    tokens, stop = q.shape[0], q.shape[0] * dist.get_world_size()
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (tokens, stop))
    group_name = dist.group.WORLD.group_name if name is None else name
    return torch.ops.prime_rl_ring.attention(
        q, k, v, cu_q, cu_k, tokens, stop, 0, stop, stride, False, group_name, -1, -1, backend
    )


def _raw_ring_body(rank, world):
    q, kv = torch.randn(8, 4, 8), torch.randn(8, 2, 8)
    default = [  # every rank makes the same bad call: the hint comes first
        (lambda: _raw_ring(q, kv, kv, name="no such group"),
         r"\[prime_rl_ring::attention raised this on this rank before sending anything; the "
         r"other ranks may be waiting.*Checked mode catches it.*group_name='no such group'"),
        (lambda: _raw_ring(q, kv, kv, backend="flash"),
         f"{WAITING}.*attention_backend='flash' is not a ring attention backend"),
        (lambda: _raw_ring(q, kv, kv, stride=3), f"{WAITING}.*heads_k_stride must divide"),
    ]  # fmt: skip
    for call, message in default:
        with pytest.raises(ValueError, match=f"(?s)^{message}"):
            call()
    set_checked(True)
    one = rank == 1
    checked = [  # valid on each rank, but not together; or one rank's own mistake
        (lambda: _raw_ring(q, kv, kv, stride=1 + rank),
         "do not fit together: heads_k_stride must be the same on every rank"),
        (lambda: _raw_ring(*(torch.randn(8 + 8 * rank, h, 8) for h in (4, 2, 2))),
         r"do not fit together: q.shape must be the same on every rank"),
        (lambda: _raw_ring(*(t.double() if one else t for t in (q, kv, kv))),
         "do not fit together: q.dtype must be the same"),
        (lambda: _raw_ring(q, kv, kv, stride=3 if one else 1),
         "rank 1 of the group rejected its call: ValueError: .*heads_k_stride must divide"),
        (lambda: _raw_ring(q, kv, kv, backend="flash" if one else "sdpa"),
         "rank 1 of the group rejected its call: ValueError: attention_backend='flash'"),
        # a group_name naming no group joins the default group's exchange
        (lambda: _raw_ring(q, kv, kv, name="no such group" if one else None),
         r"rank 1 of the group rejected its call: ValueError: \[prime_rl_ring::attention "
         r"raised this on this rank .*group_name='no such group'"),
    ]  # fmt: skip
    for call, message in checked:
        with pytest.raises(ValueError, match=f"{message}.*{EVERY}"):
            call()
    # the backward is checked too: one rank's gradient of another shape
    out, lse = _raw_ring(q, kv, kv)
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (8, 16))
    rest = (cu_q, cu_k, 8, 16, 0, 16, 1, False, dist.group.WORLD.group_name, -1, -1, "sdpa")
    dout = torch.randn(8, 4, 8 + 8 * rank)
    with pytest.raises(ValueError, match=f"rank 1 .*dout must have shape.*{EVERY}"):
        torch.ops.prime_rl_ring.attention_backward(dout, q, kv, kv, out, lse, *rest)
    out, lse = _raw_ring(q, kv, kv)  # still in step
    assert out.shape == q.shape and torch.isfinite(lse).all()
    set_checked(False)


def test_raw_prime_rl_ring_calls_say_peers_wait_first_and_checked_mode_catches_them():
    run_distributed(_raw_ring_body, 2, timeout=60)
