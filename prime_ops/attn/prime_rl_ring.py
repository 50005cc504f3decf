"""prime-rl's context-parallel attention, ``prime_rl_ring::attention``, with its schema.

Mirrors prime-rl ``src/prime_rl/trainer/models/layers/ring_attn.py`` (``ring_attention_forward``
and ``ring_attention_backward``, newest version in the index; see docs/attention.md for the
commit). Despite the name it is all-gather context parallelism (ring-flash-attn's "llama3"
variant), not a ring of point-to-point sends:

- every rank holds ``T`` consecutive tokens of the packed batch in q, k and v;
- k and v are all-gathered ``heads_k_stride`` kv heads at a time (the next group's gather
  overlaps this group's attention), so the buffers hold ``W * T`` tokens of a few heads;
- the local queries attend to the gathered keys ``[local_k_slice_start, local_k_slice_stop)``
  with per-rank offsets ``cu_seqlens_q`` / ``cu_seqlens_k`` (:func:`ring_shard` computes them
  as prime-rl's ring-flash-attn does), through any backend of :mod:`prime_ops.attn.varlen`;
- the backward gathers again, computes the key/value gradients of the gathered slice and
  reduce-scatters (sums) them back to their owners.

The schema is prime-rl's 15 arguments, then prime_ops' extras with defaults::

    attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
              local_k_slice_start: int, local_k_slice_stop: int, heads_k_stride: int,
              causal: bool, group_name: str, window_size_left: int, window_size_right: int,
              attention_backend: str, softmax_scale: float? = None, softcap: float = 0.0)
        -> (out [T, H, Dv], lse [H, T])

``attention_backend`` takes prime-rl's ``"flash_attention_2|3|4"`` and prime_ops' backend names
(``"sdpa"`` runs on any device). prime-rl fixes the scale at ``head_dim ** -0.5``, which is the
default here. Gradients are reduced in fp32 for half inputs (prime-rl reduces in the input
dtype). :func:`prime_ops.attn.ring_attention` (``prime_rl_attn::ring_attention``) is prime_ops'
own design beside it: a ring of point-to-point shard exchanges that never holds more than two
shards of k/v, taking the global ``cu_seqlens``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from prime_ops._compat import all_gather_single, reduce_scatter_single
from prime_ops.attn.args import VarlenArgs
from prime_ops.attn.varlen import (
    Backend,
    _empty_outputs,
    _register_autograd,
    check_arguments,
    get_backend,
    head_dim_strided,
)
from prime_ops.groups import Fingerprint, agree, checked_mode, rank_local, resolve_name_call

__all__ = ["RingShard", "ring_shard"]

# prime-rl's attention_backend values, and the prime_ops backend each one runs.
PRIME_RL_BACKENDS = {
    "flash_attention_2": "fa2",
    "flash_attention_3": "fa3",
    "flash_attention_4": "fa4",
}


class RingShard(NamedTuple):
    """What ``prime_rl_ring::attention`` takes on one rank, besides q, k, v and the group."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    local_k_slice: slice


def ring_shard(cu_seqlens: Tensor, causal: bool, rank: int, world_size: int) -> RingShard:
    """Per-rank offsets for ``prime_rl_ring::attention`` from the global ``cu_seqlens`` (the
    values prime-rl takes from ring-flash-attn's ``update_ring_flash_attn_params``).

    Rank ``r`` holds tokens ``[r * T, (r + 1) * T)``; its queries see the keys from the start of
    their first sequence, up to the end of its own tokens (causal) or of its last sequence.
    Reads the offsets on the host.

    Example::

        cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
        ring_shard(cu, True, 1, 2).local_k_slice  # slice(5, 16): sequence 2 starts at 5
    """
    bounds = _global_bounds(cu_seqlens)
    if not isinstance(causal, bool):
        raise TypeError(f"ring_shard: causal must be a bool, got {causal!r}")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"ring_shard: {name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"ring_shard: rank must lie in [0, world_size) and world_size be >= 1; got rank "
            f"{rank}, world_size {world_size}"
        )
    total = bounds[-1]
    if total % world_size:
        raise ValueError(
            f"cu_seqlens must end at a multiple of world_size {world_size}; got {total}"
        )
    per_rank = total // world_size
    begin, end = rank * per_rank, (rank + 1) * per_rank
    first = next(i for i, b in enumerate(bounds) if b >= begin)  # first offset at or after
    if bounds[first] != begin:  # `begin` lies inside a sequence: start at that sequence
        first -= 1
    last = next(i for i, b in enumerate(bounds) if b >= end)
    inner = bounds[first : last + 1]
    k_start = inner[0]
    k_stop = end if causal else inner[-1]
    cu_q = [min(max(b - begin, 0), per_rank) for b in inner]
    cu_k = [b - k_start for b in inner[:-1]] + [k_stop - k_start]
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:], strict=False)]
    lengths_k = [b - a for a, b in zip(cu_k, cu_k[1:], strict=False)]
    as_offsets = dict(dtype=torch.int32, device=cu_seqlens.device)
    return RingShard(
        torch.tensor(cu_q, **as_offsets),
        torch.tensor(cu_k, **as_offsets),
        max(lengths_q, default=0),
        max(lengths_k, default=0),
        slice(k_start, k_stop),
    )


def _global_bounds(cu_seqlens: Tensor) -> list[int]:
    """The offsets as ints, refused unless they are the global layout: a 1-D integer tensor
    starting at 0 that never decreases (decreasing offsets lost sequences silently)."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"ring_shard: cu_seqlens must be a torch.Tensor, got {cu_seqlens!r}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(
            "ring_shard: cu_seqlens must be a 1-D integer tensor of batch + 1 offsets; got "
            f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
        )
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or any(b < a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"ring_shard: cu_seqlens must start at 0 and never decrease; got {bounds}")
    return bounds


def _backend(attention_backend: str) -> Backend:
    if not isinstance(attention_backend, str):
        raise TypeError(f"attention_backend must be a str, got {attention_backend!r}")
    name = PRIME_RL_BACKENDS.get(attention_backend, attention_backend)
    try:
        return get_backend(name)
    except ValueError:
        choices = sorted(PRIME_RL_BACKENDS) + ["sdpa", "fa2", "fa3", "fa4"]
        raise ValueError(
            f"attention_backend={attention_backend!r} is not a ring attention backend; choose "
            f"one of {choices}"
        ) from None


def _args(q, cu_q, cu_k, max_q, max_k, causal, left, right, scale, softcap) -> VarlenArgs:
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return VarlenArgs(cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap)


def _check(q, k, v, world, start, stop, stride, spec, a, grads=None) -> None:
    """The op's own rules, then the varlen contract on the keys the local queries see (zero-
    stride stand-ins: no memory). ``world`` None (the fakes: tracing needs no live group)
    checks the slice against nothing but itself."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim]; got {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must agree in tokens and heads; got {k.shape} and {v.shape}")
    heads_k = k.shape[1]
    if not 1 <= stride <= heads_k or heads_k % stride:
        raise ValueError(f"heads_k_stride must divide k's {heads_k} heads; got {stride}")
    gathered = None if world is None else world * k.shape[0]
    if not 0 <= start <= stop or (gathered is not None and stop > gathered):
        raise ValueError(
            f"local_k_slice [{start}, {stop}) must lie within the {gathered or 'gathered'} "
            "key tokens"
        )
    seen = (stop - start, heads_k)
    k_seen = k.new_empty(()).expand(*seen, k.shape[2])
    v_seen = v.new_empty(()).expand(*seen, v.shape[2])
    check_arguments(spec, q, k_seen, v_seen, a, grads=grads)


def _fingerprint(spec: Backend, stride: int, a: VarlenArgs, **tensors: Tensor) -> Fingerprint:
    """What every rank's call must share: the gathers move equal shards of one dtype in equal
    head groups, and every rank computes the same attention. (The offsets, max_seqlen and the
    key slice are each rank's own.)"""
    shared: dict = {f"{name}.shape": tuple(t.shape) for name, t in tensors.items()}
    shared |= {f"{name}.dtype": str(t.dtype) for name, t in tensors.items()}
    shared |= {"device": tensors["q"].device.type, "heads_k_stride": stride}
    shared |= {"attention_backend": spec.name, "causal": a.causal, "softcap": a.softcap}
    shared |= {"softmax_scale": a.softmax_scale}
    shared |= {"window": (a.window_size_left, a.window_size_right)}
    return Fingerprint(shared)


def _agree_or_check(op: str, group, describe) -> None:
    """Run ``describe`` (the checks; it returns the call's fingerprint): in checked mode inside
    the exchange that compares every rank's call, else alone, its error saying first that the
    peers may be waiting."""
    if checked_mode(group):
        agree(op, group, describe)
    else:
        with rank_local(op, group):
            describe()


def _gather(x: Tensor, heads: slice, group, world: int, async_op: bool):
    """All-gather ``x[:, heads]`` of every rank into ``[W * T, h, D]``; returns (buffer, work)."""
    part = x[:, heads].contiguous()
    buf = part.new_empty(world * part.shape[0], *part.shape[1:])
    return buf, all_gather_single(buf, part, group=group, async_op=async_op)


def _head_groups(q: Tensor, k: Tensor, stride: int):
    """``(kv heads, query heads)`` slices, ``stride`` kv heads per group."""
    per_kv = q.shape[1] // k.shape[1]
    for h in range(0, k.shape[1], stride):
        yield slice(h, h + stride), slice(h * per_kv, (h + stride) * per_kv)


def _gathered_groups(k: Tensor, v: Tensor, q: Tensor, stride: int, group, world: int):
    """Per head group: ``(kv heads, q heads, gathered k, gathered v)``; the next group's gathers
    run while the caller computes on this one."""
    groups = list(_head_groups(q, k, stride))
    pending = [_gather(t, groups[0][0], group, world, True) for t in (k, v)]
    for i, (kv_heads, q_heads) in enumerate(groups):
        for _, work in pending:
            work.wait()
        (k_all, _), (v_all, _) = pending
        if i + 1 < len(groups):
            pending = [_gather(t, groups[i + 1][0], group, world, True) for t in (k, v)]
        yield kv_heads, q_heads, k_all, v_all


@torch.library.custom_op("prime_rl_ring::attention", mutates_args=())
def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    local_k_slice_start: int,
    local_k_slice_stop: int,
    heads_k_stride: int,
    causal: bool,
    group_name: str,
    window_size_left: int,
    window_size_right: int,
    attention_backend: str,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    op = "prime_rl_ring::attention"
    group = resolve_name_call(group_name, op)
    world = group.size()
    a = _args(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
              window_size_left, window_size_right, softmax_scale, softcap)  # fmt: skip
    start, stop = local_k_slice_start, local_k_slice_stop

    def describe() -> Fingerprint:
        spec = _backend(attention_backend)
        _check(q, k, v, world, start, stop, heads_k_stride, spec, a)
        return _fingerprint(spec, heads_k_stride, a, q=q, k=k, v=v)

    _agree_or_check(op, group, describe)
    spec = _backend(attention_backend)
    outs, lses = [], []
    for _, q_heads, k_all, v_all in _gathered_groups(k, v, q, heads_k_stride, group, world):
        out, lse = spec.forward(
            head_dim_strided(q[:, q_heads]), k_all[start:stop], v_all[start:stop], a
        )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=0)


@_attention.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, start, stop, stride, causal, group_name, left, right,
      attention_backend, softmax_scale=None, softcap=0.0):  # fmt: skip
    spec = _backend(attention_backend)
    a = _args(q, cu_q, cu_k, max_q, max_k, causal, left, right, softmax_scale, softcap)
    _check(q, k, v, None, start, stop, stride, spec, a)
    return _empty_outputs(q, v)


@torch.library.custom_op("prime_rl_ring::attention_backward", mutates_args=())
def _attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    softmax_lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    local_k_slice_start: int,
    local_k_slice_stop: int,
    heads_k_stride: int,
    causal: bool,
    group_name: str,
    window_size_left: int,
    window_size_right: int,
    attention_backend: str,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    op = "prime_rl_ring::attention_backward"
    group = resolve_name_call(group_name, op)
    world = group.size()
    a = _args(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
              window_size_left, window_size_right, softmax_scale, softcap)  # fmt: skip
    start, stop = local_k_slice_start, local_k_slice_stop

    def describe() -> Fingerprint:
        spec = _backend(attention_backend)
        _check(q, k, v, world, start, stop, heads_k_stride, spec, a, (dout, out, softmax_lse))
        return _fingerprint(spec, heads_k_stride, a, q=q, k=k, v=v, dout=dout)

    _agree_or_check(op, group, describe)
    spec = _backend(attention_backend)
    acc = torch.promote_types(k.dtype, torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for kv_heads, q_heads, k_all, v_all in _gathered_groups(k, v, q, heads_k_stride, group, world):
        dq_h, dk_h, dv_h = spec.backward(
            head_dim_strided(dout[:, q_heads]),
            head_dim_strided(q[:, q_heads]),
            k_all[start:stop],
            v_all[start:stop],
            head_dim_strided(out[:, q_heads]),
            softmax_lse[q_heads].contiguous(),
            a,
        )
        dq[:, q_heads] = dq_h
        for grad, full, dst in ((dk_h, k_all, dk), (dv_h, v_all, dv)):
            spread = full.new_zeros(full.shape, dtype=acc)  # zero outside the local slice
            spread[start:stop] = grad
            mine = spread.new_empty(k.shape[0], *spread.shape[1:])
            reduce_scatter_single(mine, spread, group=group)
            dst[:, kv_heads] = mine
    return dq, dk, dv


@_attention_backward.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, start, stop, stride, causal,
      group_name, left, right, attention_backend, softmax_scale=None, softcap=0.0):  # fmt: skip
    spec = _backend(attention_backend)
    a = _args(q, cu_q, cu_k, max_q, max_k, causal, left, right, softmax_scale, softcap)
    _check(q, k, v, None, start, stop, stride, spec, a, (dout, out, lse))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_register_autograd(_attention, _attention_backward)
