"""prime-rl's DeepEP ops, with prime-rl's schemas: ``deepep::dispatch`` and ``deepep::combine``.

Contract: prime-rl ``src/prime_rl/trainer/distributed/deepep.py`` and ``handles.py`` @
b32dd9d7b181 (the op schemas, the fakes, the autograd and ``DeepEPTokenDispatcher``'s calls)::

    deepep::dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, SymInt num_experts)
        -> (recv_x, recv_topk_weights, expert_order, num_recv_tokens_per_expert, handle_id)
    deepep::combine(Tensor x, Tensor handle_id, SymInt num_tokens) -> Tensor
    deepep::dispatch_backward(Tensor grad_x, Tensor grad_topk_weights, Tensor handle_id,
        SymInt num_tokens) -> (Tensor, Tensor)
    deepep::combine_backward(Tensor grad, Tensor handle_id, SymInt num_recv_tokens) -> Tensor

``expert_order`` indexes the flattened ``[received, topk]`` (token, choice) pairs whose expert is
local, grouped by local expert (stable); ``num_recv_tokens_per_expert`` (int64, on ``x``'s
device) counts them. The ops use one process-wide buffer, as prime-rl's module-level ``_buffer``:
call :func:`create_buffer` (prime-rl's ``_create_buffer``) before the first forward.

Handles as prime-rl keeps them: ``handle_id`` is a CPU int64 tensor of shape ``(1,)``; the DeepEP
layout it names lives exactly as long as some tensor shares that tensor's storage (the dispatch
output, the copy autograd saves, a checkpoint cache's copy) and is freed when the last one dies.
Each dispatch gets a new id. :func:`live_handles` counts the live ones, for leak checks.

What prime_ops adds: every check on the inputs runs before any communication (in the default mode
bad input raises on the rank that has it, saying first that its peers may be waiting; in checked
mode every rank raises, as in :mod:`prime_ops.deepep`); ``backend="reference"`` runs the same
ops on any process group (gloo on CPU) through
:class:`prime_ops.deepep_reference.ReferenceBuffer`; and the gradient of ``topk_weights`` is
masked to the choices each rank received (DeepEP's combine sums every rank's returned weights, so
without the mask a rank's gradient for a choice it does not own would leak in; prime-rl's own
call pattern gives those zero gradient, so its results are unchanged).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, NamedTuple

import torch

from prime_ops.backends import import_backend
from prime_ops.deepep import (
    BUILD,
    _check_backend_and_group,
    _check_expert_ids,
    _check_rows,
    _check_tensors,
    _check_topk,
    _check_x,
    _checks,
    _dense_grads,
    _route,
    _size_hints,
)
from prime_ops.deepep_reference import ReferenceBuffer
from prime_ops.devices import check_same_device
from prime_ops.groups import Fingerprint

__all__ = ["create_buffer", "live_handles"]

PRIME_RL_COMMIT = "b32dd9d7b181"


class _Buffer(NamedTuple):
    buffer: Any  # deep_ep.Buffer or ReferenceBuffer
    group: Any
    backend: str
    num_nvl_bytes: int
    num_rdma_bytes: int
    topk_idx_dtype: torch.dtype  # DeepEP's topk_idx_t (int64 unless built with 32-bit indices)


_current: _Buffer | None = None


def create_buffer(
    group: torch.distributed.ProcessGroup,
    hidden_bytes: int,
    *,
    backend: str = "deepep",
    **buffer_kwargs: Any,
) -> Any:
    """Create (or keep) the buffer the ``deepep::`` ops use; returns it.

    As prime-rl's ``_create_buffer``: sizes come from DeepEP's dispatch and combine size hints
    for ``hidden_bytes`` per token, and the buffer is replaced only when the group changes or a
    larger one is needed. Extra keyword arguments go to ``deep_ep.Buffer`` (prime-rl passes
    ``num_qps_per_rank=Buffer.num_sms``; DeepEP 2.1 also takes ``low_latency_mode``,
    ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl``, ``explicitly_destroy``,
    ``enable_shrink``). The group must have a size DeepEP has configs for
    (:data:`prime_ops.deepep.EP_SIZES`). ``backend="reference"`` uses
    :class:`~prime_ops.deepep_reference.ReferenceBuffer` (any group, CPU included). Create it
    before the first checkpointed forward: its construction is collective.

    Example (2 gloo ranks)::

        create_buffer(group, hidden_bytes=8 * 2, backend="reference")
        # on GPUs, as prime-rl: create_buffer(group, hidden * 2, num_qps_per_rank=Buffer.num_sms)
        recv_x, recv_w, order, counts, handle_id = torch.ops.deepep.dispatch(x, idx, w, 4)
    """
    global _current
    ranks = _check_backend_and_group(backend, group, op="create_buffer")
    if hidden_bytes <= 0 or hidden_bytes % 16:
        raise ValueError(
            f"hidden_bytes={hidden_bytes} must be a positive multiple of 16 (DeepEP moves rows "
            "in 16-byte units; prime-rl passes hidden_size * 2 for bf16)"
        )
    if backend == "reference":
        if _current is None or _current.group is not group or _current.backend != backend:
            _current = _Buffer(ReferenceBuffer(group), group, backend, 0, 0, torch.int64)
        return _current.buffer
    deep_ep = import_backend("deep_ep", extra="deepep", build=BUILD)
    nvl, rdma = _size_hints(deep_ep, ranks, hidden_bytes)
    if (
        _current is None
        or _current.backend != backend
        or _current.group is not group
        or _current.num_nvl_bytes < nvl
        or _current.num_rdma_bytes < rdma
    ):
        buffer = deep_ep.Buffer(group, nvl, rdma, **buffer_kwargs)
        index_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        _current = _Buffer(buffer, group, backend, nvl, rdma, index_dtype)
    return _current.buffer


def _buffer() -> _Buffer:
    if _current is None:
        raise RuntimeError(
            "no DeepEP buffer: call prime_ops.deepep_prime_rl.create_buffer(group, hidden_bytes) "
            "before the first deepep::dispatch (prime-rl's DeepEPTokenDispatcher does it in its "
            "constructor)"
        )
    return _current


# --- handles ------------------------------------------------------------------------------------


class _Handle(NamedTuple):
    layout: Any  # the backend's dispatch handle
    num_tokens: int  # rows this rank sent (rows combine returns)
    num_recv: int  # rows this rank received (rows combine takes)
    received: torch.Tensor  # bool [num_recv, topk]: which received choices are local


_handles: dict[int, _Handle] = {}
_ids = itertools.count(1)


def live_handles() -> int:
    """How many dispatch handles are alive (some tensor still shares their id's storage)."""
    return len(_handles)


def _store(handle: _Handle) -> torch.Tensor:
    ident = next(_ids)
    _handles[ident] = handle
    handle_id = torch.tensor([ident], dtype=torch.int64)
    # Every alias (view, detach, a saved or cached copy of the same tensor) shares this storage.
    weakref.finalize(handle_id.untyped_storage(), _handles.pop, ident, None)
    return handle_id


def _check_handle_id(handle_id: torch.Tensor) -> None:
    if (
        handle_id.dtype != torch.int64
        or tuple(handle_id.shape) != (1,)
        or handle_id.device.type != "cpu"
    ):
        raise ValueError(
            "handle_id must be the CPU int64 tensor of shape (1,) that deepep::dispatch returned, "
            f"got dtype {handle_id.dtype}, shape {tuple(handle_id.shape)} on {handle_id.device}"
        )


def _lookup(handle_id: torch.Tensor) -> _Handle:
    _check_handle_id(handle_id)
    ident = int(handle_id.item())
    if ident not in _handles:
        raise ValueError(
            f"handle_id {ident} names no live dispatch: a handle lives as long as the handle_id "
            "tensor deepep::dispatch returned (or a view or saved copy of it); pass that tensor"
        )
    return _handles[ident]


# --- dispatch -----------------------------------------------------------------------------------


def _check_dispatch(x, topk_idx, topk_weights, num_experts) -> int:
    """Shapes and dtypes (the same in kernel and fake); returns the local expert count."""
    check_same_device("deepep::dispatch", x=x, topk_idx=topk_idx, topk_weights=topk_weights)
    _check_x("x", x)
    if x.shape[1] % 8:
        raise ValueError(
            f"x has {x.shape[1]} columns; DeepEP moves bf16 rows in 16-byte units, so hidden must "
            "be a multiple of 8"
        )
    _check_topk(x, topk_idx, topk_weights, " (prime-rl passes top_scores.float())")
    ranks = _buffer().group.size()
    if num_experts <= 0 or num_experts % ranks:
        raise ValueError(
            f"num_experts={num_experts} must be a positive multiple of the group size {ranks}"
        )
    return num_experts // ranks


@torch.library.custom_op("deepep::dispatch", mutates_args=())
def _dispatch(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send each token to the ranks of its experts (prime-rl's ``deepep::dispatch``)."""
    op = "deepep::dispatch"
    state = _buffer()
    local = []

    def describe() -> Fingerprint:
        _check_tensors(op, x=x, topk_idx=topk_idx, topk_weights=topk_weights)
        local.append(_check_dispatch(x, topk_idx, topk_weights, num_experts))
        _check_expert_ids(topk_idx, num_experts)
        settings = {"num_experts": num_experts, "hidden": x.shape[1], "topk": topk_idx.shape[1]}
        return Fingerprint(settings)

    _checks(op, state.group, describe)
    local = local[0]
    recv_x, recv_idx, recv_weights, counts, layout = _route(
        state.buffer, state.topk_idx_dtype, x, topk_idx, topk_weights, num_experts
    )
    recv_idx = recv_idx.to(torch.int64)
    flat = recv_idx.flatten()
    # The counts are already on the host, so the order is sliced without a device sync.
    expert_order = torch.argsort(flat.masked_fill(flat < 0, local), stable=True)[: sum(counts)]
    counts = torch.tensor(counts, dtype=torch.int64, pin_memory=x.is_cuda)
    counts = counts.to(x.device, non_blocking=True)
    handle = _Handle(layout, x.shape[0], recv_x.shape[0], recv_idx >= 0)
    return recv_x, recv_weights, expert_order, counts, _store(handle)


@_dispatch.register_fake
def _(x, topk_idx, topk_weights, num_experts):
    _check_tensors("deepep::dispatch", x=x, topk_idx=topk_idx, topk_weights=topk_weights)
    local = _check_dispatch(x, topk_idx, topk_weights, num_experts)
    ctx = torch.library.get_ctx()
    received = ctx.new_dynamic_size()
    return (
        x.new_empty(received, x.shape[1]),
        topk_weights.new_empty(received, topk_weights.shape[1]),
        topk_idx.new_empty(ctx.new_dynamic_size()),
        topk_idx.new_empty(local),
        torch.empty(1, dtype=torch.int64),
    )


def _check_dispatch_backward(grad_x, grad_topk_weights, handle_id) -> None:
    _check_handle_id(handle_id)
    check_same_device(
        "deepep::dispatch_backward", grad_x=grad_x, grad_topk_weights=grad_topk_weights
    )
    _check_x("grad_x", grad_x)
    _check_rows("grad_topk_weights", grad_topk_weights, grad_x.shape[0], None)
    if grad_topk_weights.dtype != torch.float32:
        raise ValueError(f"grad_topk_weights must be float32, got {grad_topk_weights.dtype}")


@torch.library.custom_op("deepep::dispatch_backward", mutates_args=())
def _dispatch_backward(
    grad_x: torch.Tensor, grad_topk_weights: torch.Tensor, handle_id: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_dispatch_backward(grad_x, grad_topk_weights, handle_id)
    handle = _lookup(handle_id)
    _check_rows("grad_x", grad_x, handle.num_recv, None)
    _check_rows("grad_topk_weights", grad_topk_weights, handle.num_recv, handle.received.shape[1])
    if num_tokens != handle.num_tokens:
        raise ValueError(
            f"num_tokens={num_tokens} but the handle's dispatch sent {handle.num_tokens}"
        )
    # A rank receives a choice's weight only where it owns the expert (0 elsewhere, a constant):
    # the adjoint of that masked copy is a masked sum.
    masked = grad_topk_weights.masked_fill(~handle.received, 0.0)
    grad_x, grad_weights, _ = _buffer().buffer.combine(grad_x, handle.layout, topk_weights=masked)
    return grad_x, grad_weights


@_dispatch_backward.register_fake
def _(grad_x, grad_topk_weights, handle_id, num_tokens):
    _check_dispatch_backward(grad_x, grad_topk_weights, handle_id)
    return (
        grad_x.new_empty(num_tokens, grad_x.shape[1]),
        grad_topk_weights.new_empty(num_tokens, grad_topk_weights.shape[1]),
    )


def _dispatch_setup(ctx, inputs, output):
    x, _, topk_weights, _ = inputs
    recv_x, recv_weights, *_, handle_id = output
    ctx.save_for_backward(handle_id)
    ctx.num_tokens = x.shape[0]
    ctx.received = [(t.shape, t.dtype, t.device) for t in (recv_x, recv_weights)]


def _dispatch_grad(ctx, grad_recv_x, grad_recv_topk_weights, *_):
    (handle_id,) = ctx.saved_tensors
    grads = _dense_grads((grad_recv_x, grad_recv_topk_weights), ctx.received)
    grad_x, grad_topk_weights = torch.ops.deepep.dispatch_backward(
        *grads, handle_id, ctx.num_tokens
    )
    return grad_x, None, grad_topk_weights, None


_dispatch.register_autograd(_dispatch_grad, setup_context=_dispatch_setup)


# --- combine ------------------------------------------------------------------------------------


def _check_replay(name: str, t: torch.Tensor, handle_id: torch.Tensor) -> None:
    """What an op that replays a dispatch's layout on ``t`` checks in its kernel and its fake."""
    _check_tensors("deepep::combine", **{name: t, "handle_id": handle_id})
    _check_handle_id(handle_id)
    _check_x(name, t)


@torch.library.custom_op("deepep::combine", mutates_args=())
def _combine(x: torch.Tensor, handle_id: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum each token's rows back on the rank that sent it (prime-rl's ``deepep::combine``)."""
    state = _buffer()
    handles = []

    def describe() -> Fingerprint:
        _check_replay("x", x, handle_id)
        handles.append(_lookup(handle_id))
        _check_rows("x", x, handles[0].num_recv, None)
        if num_tokens != handles[0].num_tokens:
            raise ValueError(
                f"num_tokens={num_tokens} but the handle's dispatch sent {handles[0].num_tokens} "
                "tokens (pass the row count of dispatch's x)"
            )
        return Fingerprint({"hidden": x.shape[1]})

    _checks("deepep::combine", state.group, describe)
    combined, _, _ = state.buffer.combine(x, handles[0].layout)
    return combined


@_combine.register_fake
def _(x, handle_id, num_tokens):
    _check_replay("x", x, handle_id)
    return x.new_empty(num_tokens, x.shape[1])


@torch.library.custom_op("deepep::combine_backward", mutates_args=())
def _combine_backward(
    grad: torch.Tensor, handle_id: torch.Tensor, num_recv_tokens: int
) -> torch.Tensor:
    _check_replay("grad", grad, handle_id)
    handle = _lookup(handle_id)
    _check_rows("grad", grad, handle.num_tokens, None)
    if num_recv_tokens != handle.num_recv:
        raise ValueError(
            f"num_recv_tokens={num_recv_tokens} but the handle's dispatch received "
            f"{handle.num_recv}"
        )
    # A cached dispatch: the handle replays the forward's layout, no new routing, no host sync.
    grad_x, *_ = _buffer().buffer.dispatch(grad, handle=handle.layout)
    return grad_x


@_combine_backward.register_fake
def _(grad, handle_id, num_recv_tokens):
    _check_replay("grad", grad, handle_id)
    return grad.new_empty(num_recv_tokens, grad.shape[1])


def _combine_setup(ctx, inputs, output):
    x, handle_id, _ = inputs
    ctx.save_for_backward(handle_id)
    ctx.num_recv_tokens = x.shape[0]


def _combine_grad(ctx, grad):
    (handle_id,) = ctx.saved_tensors
    grad_x = torch.ops.deepep.combine_backward(grad.contiguous(), handle_id, ctx.num_recv_tokens)
    return grad_x, None, None


_combine.register_autograd(_combine_grad, setup_context=_combine_setup)
