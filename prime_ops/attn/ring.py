"""Ring (context-parallel) attention over a process group: ``prime_rl_attn::ring_attention``.

prime_ops' own design, beside prime-rl's all-gather ``prime_rl_ring::attention``
(:mod:`prime_ops.attn.prime_rl_ring`): here no rank ever holds more than two k/v shards, and
every rank takes the global ``cu_seqlens``.

Each of the ``W`` ranks holds the same-sized contiguous shard of the packed token dimension of
q, k and v; ``cu_seqlens`` describes the whole packed batch, so sequences may cross shards.
Key/value shards travel around the ring by point-to-point sends, overlapped with the attention
of the shard in hand, and the partial results merge through their log-sum-exp.

Causal masking across shards needs no special kernel: a key shard from an earlier rank lies
wholly before the local queries (plain attention within each sequence), the rank's own shard is
causal with queries and keys aligned, and later shards are skipped. The backward runs the same
ring; each shard's key/value gradients travel with it and arrive at their owner after ``W``
steps. Any backend of :mod:`prime_ops.attn.varlen` computes the steps. Partial results are
accumulated in fp32, or in fp64 for fp64 inputs (so float64 gradient checks are exact).

Every rank must pass the same ``cu_seqlens`` and flags; a rank cannot see that its peers'
differ, so in checked mode (a setting of the process group, see :mod:`prime_ops.groups`)
:func:`ring_attention` compares a fingerprint of every rank's call before the first send.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import Tensor

from prime_ops import native
from prime_ops.attn.args import VarlenArgs
from prime_ops.attn.sdpa import lse_dtype
from prime_ops.attn.seqlens import can_read, shard_cu_seqlens, spans
from prime_ops.attn.varlen import (
    _default_scale,
    _empty_outputs,
    _register_autograd,
    check_arguments,
    get_backend,
    head_dim_strided,
)
from prime_ops.groups import (
    Fingerprint,
    agree,
    checked_mode,
    rank_local,
    resolve_call,
    resolve_name,
)

__all__ = ["merge_partial", "ring_attention"]

_NO_WINDOW = (-1, -1)
_KV_TAG, _GRAD_TAG = 0, 1


def _exchange(send: Tensor, group, rank: int, world: int, tag: int) -> tuple[Tensor, list]:
    """Send ``send`` to the next rank and receive the previous rank's buffer, as one batch (a
    ring of unbatched NCCL sends deadlocks); returns the buffer and the requests to wait on
    before reading it. The caller keeps ``send`` alive until then."""
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, group=group, tag=tag, group_peer=(rank + 1) % world),
        dist.P2POp(dist.irecv, recv, group=group, tag=tag, group_peer=(rank - 1) % world),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


def _pack(*tensors: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def _unpack(flat: Tensor, like: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    k, v = like
    return flat[: k.numel()].view(k.shape), flat[k.numel() :].view(v.shape)


def merge_partial(
    out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge a partial attention result into the running one through their log-sum-exp.

    ``out`` ``[T, H, Dv]`` and ``lse`` ``[H, T]`` are the running result (in the accumulation
    dtype), ``part_*`` a step's; rows where both lse are ``-inf`` stay ``0`` / ``-inf``. With the
    native kernels built this is one ``prime_rl::merge_attn_states`` call: the same formula, with
    libm's exp/log1p instead of torch's vectorised ones (results agree to about 1 ulp).
    """
    part_out, part_lse = part_out.to(out.dtype), part_lse.to(lse.dtype)
    native_lse = torch.float64 if out.dtype == torch.float64 else torch.float32
    if lse.dtype == native_lse and native.has_kernel("merge_attn_states", out.device):
        return native.merge_attn_states(out, lse, part_out, part_lse)
    merged = torch.logaddexp(lse, part_lse)
    finite = merged.masked_fill(merged == float("-inf"), 0.0)
    old_w = torch.exp(lse - finite).transpose(0, 1).unsqueeze(-1)
    new_w = torch.exp(part_lse - finite).transpose(0, 1).unsqueeze(-1)
    return out * old_w + part_out * new_w, merged


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _steps(rank: int, world: int, causal: bool):
    """``(step, (source rank, step is causal))`` for the steps that compute; causal rings skip
    the shards that lie after the local queries."""
    for step in range(world):
        src = (rank - step) % world
        if not (causal and src > rank):
            yield step, (src, causal and src == rank)


def _step(cu_q, cu_k, max_len, causal, softmax_scale, softcap) -> VarlenArgs:
    return VarlenArgs(cu_q, cu_k, max_len, max_len, causal, softmax_scale, *_NO_WINDOW, softcap)


def _check(
    q, k, v, cu_seqlens, max_seqlen, softmax_scale, softcap, backend, grads=None, causal=False
):
    spec = get_backend(backend)
    a = _step(cu_seqlens, cu_seqlens, max_seqlen, causal, softmax_scale, softcap)
    check_arguments(spec, q, k, v, a, grads=grads)
    if k.shape[0] != q.shape[0]:
        raise ValueError(
            f"ring attention needs q, k, v shards of the same length; got {q.shape[0]} query and "
            f"{k.shape[0]} key tokens"
        )


@torch.library.custom_op("prime_rl_attn::ring_attention", mutates_args=())
def _ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    causal: bool,
    softmax_scale: float,
    softcap: float,
    group_name: str,
    backend: str,
) -> tuple[Tensor, Tensor]:
    group = resolve_name(group_name, "ring_attention")
    with rank_local("ring_attention", group):
        _check(q, k, v, cu_seqlens, max_seqlen, softmax_scale, softcap, backend)
    spec = get_backend(backend)
    rank, world = group.rank(), group.size()
    tokens = q.shape[0]
    cu_q = shard_cu_seqlens(cu_seqlens, rank * tokens, tokens)
    max_len = min(max_seqlen, tokens)
    acc = _accumulate_dtype(q.dtype)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=acc, device=q.device)
    lse = torch.full((q.shape[1], tokens), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    computing = dict(_steps(rank, world, causal))
    kv = _pack(k, v, dtype=k.dtype)
    for step in range(world):
        current, reqs = kv, []
        if step + 1 < world:  # the next shard travels while this one is used
            kv, reqs = _exchange(current, group, rank, world, _KV_TAG)
        if step in computing:
            src, step_causal = computing[step]
            k_s, v_s = _unpack(current, (k, v))
            cu_k = shard_cu_seqlens(cu_seqlens, src * tokens, tokens)
            step_args = _step(cu_q, cu_k, max_len, step_causal, softmax_scale, softcap)
            part_out, part_lse = spec.forward(head_dim_strided(q), k_s, v_s, step_args)
            out, lse = merge_partial(out, lse, part_out, part_lse)
        _wait(reqs)
    return out.to(q.dtype), lse


@_ring_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, softcap, group_name, backend):
    _check(q, k, v, cu_seqlens, max_seqlen, softmax_scale, softcap, backend)
    return _empty_outputs(q, v)


@torch.library.custom_op("prime_rl_attn::ring_attention_backward", mutates_args=())
def _ring_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    causal: bool,
    softmax_scale: float,
    softcap: float,
    group_name: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    group = resolve_name(group_name, "ring_attention_backward")
    grads = (dout, out, lse)
    with rank_local("ring_attention_backward", group):
        _check(q, k, v, cu_seqlens, max_seqlen, softmax_scale, softcap, backend, grads)
    spec = get_backend(backend)
    rank, world = group.rank(), group.size()
    tokens = q.shape[0]
    cu_q = shard_cu_seqlens(cu_seqlens, rank * tokens, tokens)
    max_len = min(max_seqlen, tokens)
    computing = dict(_steps(rank, world, causal))
    acc = _accumulate_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    kv = _pack(k, v, dtype=k.dtype)
    dkv, dkv_reqs = torch.zeros(kv.numel(), dtype=acc, device=q.device), []
    for step in range(world):
        current, kv_reqs = kv, []
        if step + 1 < world:
            kv, kv_reqs = _exchange(current, group, rank, world, _KV_TAG)
        partial = None
        if step in computing:
            src, step_causal = computing[step]
            k_s, v_s = _unpack(current, (k, v))
            cu_k = shard_cu_seqlens(cu_seqlens, src * tokens, tokens)
            step_args = _step(cu_q, cu_k, max_len, step_causal, softmax_scale, softcap)
            q_s = head_dim_strided(q)
            dq_s, dk_s, dv_s = spec.backward(dout, q_s, k_s, v_s, out, lse, step_args)
            dq += dq_s
            partial = _pack(dk_s, dv_s, dtype=acc)
        _wait(dkv_reqs)  # dkv now holds the accumulator of this step's shard
        if partial is not None:
            dkv += partial
        if world > 1:  # pass it on; after the last step this hands each one to its owner
            sent = dkv
            dkv, dkv_reqs = _exchange(sent, group, rank, world, _GRAD_TAG)
        _wait(kv_reqs)
    _wait(dkv_reqs)
    dk, dv = _unpack(dkv, (k, v))  # views of one buffer: copy, outputs may not alias
    return dq.to(q.dtype), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True)


@_ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, causal, scale, softcap, group, backend):
    _check(q, k, v, cu_seqlens, max_seqlen, scale, softcap, backend, (dout, out, lse))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_register_autograd(_ring_attention, _ring_attention_backward, num_offsets=1)


def _fingerprint(q, k, v, cu_seqlens, max_seqlen, causal, softmax_scale, softcap, backend):
    """What every rank's call must agree on; shapes are per shard, so they must match too."""
    return Fingerprint(
        {
            "q/k/v shard shapes": tuple(tuple(t.shape) for t in (q, k, v)),
            "dtype": str(q.dtype),
            "cu_seqlens (sha256 prefix)": hashlib.sha256(
                str(cu_seqlens.tolist()).encode()
            ).hexdigest()[:16],
            "max_seqlen": max_seqlen,
            "causal": causal,
            "softmax_scale": softmax_scale,
            "softcap": softcap,
            "backend": backend,
        }
    )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backend: str = "sdpa",
    check_cu_seqlens: bool = True,
) -> tuple[Tensor, Tensor]:
    """Self-attention over a packed batch sharded by tokens across ``group``; ``(out, lse)`` for
    the local queries, equal to full attention. Every rank must call it with same-sized shards
    (shard ``r`` holds packed tokens ``[r * T, (r + 1) * T)``) and the same ``cu_seqlens``
    (``cu_seqlens[-1] == T * group.size()``). Arguments otherwise as in
    :func:`prime_ops.attn.varlen_attention`; sliding windows are not supported.

    In checked mode (see :mod:`prime_ops.groups`) every rank first compares its shapes, dtype,
    ``cu_seqlens`` (a digest), ``max_seqlen``, flags and backend with its peers', and every rank
    raises the same ValueError if they differ (one small collective). ``check_cu_seqlens=False``
    skips reading ``cu_seqlens`` in the default mode (a host sync on a GPU).

    Example (2 ranks, 16 packed tokens in 3 sequences, 8 per rank)::

        cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
        q, k, v = (torch.randn(8, 4, 16) for _ in range(3))  # this rank's shard
        out, lse = ring_attention(q, k, v, cu, 7, causal=True)
    """
    op = "ring_attention"
    group = resolve_call(group, op)
    flags = []

    def check_locally(read_cu_seqlens: bool) -> None:
        if not isinstance(q, Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        scale = _default_scale(q) if softmax_scale is None else softmax_scale
        # varlen_attention's type checks see the values as given, before float() converts them
        _check(q, k, v, cu_seqlens, max_seqlen, scale, softcap, backend, causal=causal)
        flags[:] = (float(scale), float(softcap), backend)
        if read_cu_seqlens:
            spans(cu_seqlens, q.shape[0] * group.size(), max_seqlen, "cu_seqlens")

    readable = not isinstance(cu_seqlens, Tensor) or can_read(cu_seqlens)
    if checked_mode(group) and readable:

        def describe():
            check_locally(True)
            return _fingerprint(q, k, v, cu_seqlens, max_seqlen, causal, *flags)

        agree(op, group, describe)
    else:
        with rank_local(op, group):
            check_locally(check_cu_seqlens and readable)
    return _ring_attention(
        q, k, v, cu_seqlens, max_seqlen, causal, *flags[:2], group.group_name, backend
    )
