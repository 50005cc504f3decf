"""DeepEP expert-parallel dispatch and combine as ops (namespace ``deepep``).

DeepEP's dispatch is a paired collective with a host sync and a stateful layout handle: it must
run exactly once per forward, never again in a checkpoint recompute (prime_ac keeps namespace
``deepep`` in every mode). Making dispatch and combine single opaque ops is what lets a dispatch
mode see and cache them.

A DeepEP handle is a tuple of tensors that cannot cross an op schema, so it travels as a small
CPU int64 tensor holding a key into a registry. The registry entry is released by a
``weakref.finalize`` on that tensor's storage: every alias (view, detach, the copy a checkpoint
cache keeps, autograd's saved tensor) shares the storage, so the handle lives exactly as long as
something can still use it, and no longer.

``Dispatcher`` owns the ``deep_ep.Buffer``. It is created at construction: a buffer created
lazily inside the first checkpointed forward would add collectives that the recompute does not
replay.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, NamedTuple

import torch

from prime_ops.backends import import_backend

__all__ = ["Dispatched", "Dispatcher", "live_handles"]

_BUILD = (
    "DeepEP is built from source (PyPI's deep-ep does not build): git clone "
    "https://github.com/deepseek-ai/DeepEP && cd DeepEP && ./install.sh (NVSHMEM is needed for "
    "internode and low-latency kernels; see docs/backends.md)"
)

_keys = itertools.count(1)
_DISPATCHERS: weakref.WeakValueDictionary[int, Dispatcher] = weakref.WeakValueDictionary()
_HANDLES: dict[int, tuple[Any, Any]] = {}


def live_handles() -> int:
    """How many DeepEP handles are alive (referenced by some tensor); for leak checks."""
    return len(_HANDLES)


def _own_handle(buffer: Any, handle: Any) -> torch.Tensor:
    key = next(_keys)
    _HANDLES[key] = (buffer, handle)
    token = torch.tensor([key], dtype=torch.int64)
    weakref.finalize(token.untyped_storage(), _HANDLES.pop, key, None)
    return token


def _resolve_handle(token: torch.Tensor) -> tuple[Any, Any]:
    _check_token(token)
    key = int(token[0])
    try:
        return _HANDLES[key]
    except KeyError:
        raise RuntimeError(
            f"DeepEP handle {key} was already released: a handle lives as long as the tensor "
            "deepep::dispatch returned (or a view or detached alias of it); a clone made after "
            "that tensor died does not keep it"
        ) from None


def _check_token(token: torch.Tensor) -> None:
    if token.dtype != torch.int64 or tuple(token.shape) != (1,) or token.device.type != "cpu":
        raise ValueError(
            "handle must be the CPU int64 tensor of shape (1,) that deepep::dispatch returned, got "
            f"dtype {token.dtype}, shape {tuple(token.shape)} on {token.device}"
        )


def _check_dispatch(x, topk_idx, topk_weights, num_experts, num_local_experts) -> None:
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(
            f"x must be a [tokens, hidden] bfloat16 tensor (DeepEP's normal kernels send bf16), "
            f"got dtype {x.dtype} and shape {tuple(x.shape)}"
        )
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx must be int64 [tokens, topk] with tokens={x.shape[0]}, got dtype "
            f"{topk_idx.dtype} and shape {tuple(topk_idx.shape)}"
        )
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights must be float32 with the shape of topk_idx {tuple(topk_idx.shape)}, "
            f"got dtype {topk_weights.dtype} and shape {tuple(topk_weights.shape)}"
        )
    if num_local_experts <= 0 or num_experts % num_local_experts:
        raise ValueError(
            f"num_local_experts={num_local_experts} must be positive and divide "
            f"num_experts={num_experts}"
        )


# --- dispatch -----------------------------------------------------------------------------------


@torch.library.custom_op("deepep::dispatch", mutates_args=())
def _dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    dispatcher: int,
    num_experts: int,
    num_local_experts: int,
    expert_alignment: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_dispatch(x, topk_idx, topk_weights, num_experts, num_local_experts)
    buffer = _lookup_dispatcher(dispatcher).buffer
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
        topk_idx, num_experts
    )
    recv_x, recv_idx, recv_weights, counts, handle, _ = buffer.dispatch(
        x,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        expert_alignment=expert_alignment,
    )
    tokens_per_expert = torch.tensor(counts, dtype=torch.int64)
    return recv_x, recv_idx, recv_weights, tokens_per_expert, _own_handle(buffer, handle)


@_dispatch.register_fake
def _(x, topk_idx, topk_weights, dispatcher, num_experts, num_local_experts, expert_alignment):
    _check_dispatch(x, topk_idx, topk_weights, num_experts, num_local_experts)
    received = torch.library.get_ctx().new_dynamic_size()
    topk = topk_idx.shape[1]
    return (
        x.new_empty(received, x.shape[1]),
        topk_idx.new_empty(received, topk),
        topk_weights.new_empty(received, topk),
        torch.empty(num_local_experts, dtype=torch.int64, device="cpu"),
        torch.empty(1, dtype=torch.int64, device="cpu"),
    )


@torch.library.custom_op("deepep::dispatch_backward", mutates_args=())
def _dispatch_backward(
    grad_recv_x: torch.Tensor,
    grad_recv_topk_weights: torch.Tensor,
    handle: torch.Tensor,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    buffer, layout = _resolve_handle(handle)
    grad_x, grad_weights, _ = buffer.combine(
        grad_recv_x, layout, topk_weights=grad_recv_topk_weights
    )
    return grad_x, grad_weights


@_dispatch_backward.register_fake
def _(grad_recv_x, grad_recv_topk_weights, handle, num_tokens):
    _check_token(handle)
    return (
        grad_recv_x.new_empty(num_tokens, grad_recv_x.shape[1]),
        grad_recv_topk_weights.new_empty(num_tokens, grad_recv_topk_weights.shape[1]),
    )


def _dispatch_setup(ctx, inputs, output):
    ctx.save_for_backward(output[4])
    ctx.num_tokens = inputs[0].shape[0]
    ctx.recv = [(t.shape, t.dtype, t.device) for t in (output[0], output[2])]


def _dispatch_grad(ctx, grad_recv_x, _idx, grad_recv_weights, _counts, _handle):
    (handle,) = ctx.saved_tensors
    grads = [
        torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
        for g, (shape, dtype, device) in zip(
            (grad_recv_x, grad_recv_weights), ctx.recv, strict=True
        )
    ]
    grad_x, grad_weights = torch.ops.deepep.dispatch_backward(*grads, handle, ctx.num_tokens)
    return grad_x, None, grad_weights, None, None, None, None


_dispatch.register_autograd(_dispatch_grad, setup_context=_dispatch_setup)


# --- combine ------------------------------------------------------------------------------------


@torch.library.custom_op("deepep::combine", mutates_args=())
def _combine(x: torch.Tensor, handle: torch.Tensor, num_tokens: int) -> torch.Tensor:
    buffer, layout = _resolve_handle(handle)
    combined, _, _ = buffer.combine(x, layout)
    return combined


@_combine.register_fake
def _(x, handle, num_tokens):
    _check_token(handle)
    return x.new_empty(num_tokens, x.shape[1])


@torch.library.custom_op("deepep::combine_backward", mutates_args=())
def _combine_backward(grad: torch.Tensor, handle: torch.Tensor, num_recv: int) -> torch.Tensor:
    buffer, layout = _resolve_handle(handle)
    # A cached dispatch: the handle replays the forward's layout, no new routing and no host sync.
    grad_x, *_ = buffer.dispatch(grad, handle=layout)
    return grad_x


@_combine_backward.register_fake
def _(grad, handle, num_recv):
    return grad.new_empty(num_recv, grad.shape[1])


def _combine_setup(ctx, inputs, output):
    x, handle, _ = inputs
    ctx.save_for_backward(handle)
    ctx.num_recv = x.shape[0]


def _combine_grad(ctx, grad):
    (handle,) = ctx.saved_tensors
    return torch.ops.deepep.combine_backward(grad.contiguous(), handle, ctx.num_recv), None, None


_combine.register_autograd(_combine_grad, setup_context=_combine_setup)


# --- front --------------------------------------------------------------------------------------


class Dispatched(NamedTuple):
    """What :meth:`Dispatcher.dispatch` returns; pass it whole to :meth:`Dispatcher.combine`."""

    x: torch.Tensor
    """Received tokens ``[received, hidden]``: each token once per destination rank."""
    topk_idx: torch.Tensor
    """Local expert index of each received token's choices; -1 where the expert is elsewhere."""
    topk_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    """CPU int64 ``[num_local_experts]``, counts aligned to ``expert_alignment``."""
    handle: torch.Tensor
    num_tokens: int
    """Tokens this rank sent: the row count combine returns."""


class Dispatcher:
    """Expert-parallel dispatch/combine over ``group`` through one DeepEP ``Buffer``.

    Create it before the first checkpointed forward (its construction is collective over
    ``group``). ``num_nvl_bytes``/``num_rdma_bytes`` default to DeepEP's own size hints for bf16
    tokens of width ``hidden``. ``expert_alignment`` pads each local expert's received rows to a
    multiple (128 makes the result directly usable by ``prime_rl::grouped_fp8_gemm`` on CUDA).
    Extra keyword arguments go to ``deep_ep.Buffer``.
    """

    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        *,
        num_experts: int,
        hidden: int,
        num_nvl_bytes: int | None = None,
        num_rdma_bytes: int | None = None,
        expert_alignment: int = 1,
        **buffer_kwargs: Any,
    ) -> None:
        deep_ep = import_backend("deep_ep", extra="deepep", build=_BUILD)
        ranks = group.size()
        if num_experts <= 0 or num_experts % ranks:
            raise ValueError(
                f"num_experts={num_experts} must be a positive multiple of the group size {ranks}"
            )
        if expert_alignment < 1:
            raise ValueError(f"expert_alignment must be >= 1, got {expert_alignment}")
        hidden_bytes = hidden * torch.bfloat16.itemsize
        configs = (
            deep_ep.Buffer.get_dispatch_config(ranks),
            deep_ep.Buffer.get_combine_config(ranks),
        )
        if num_nvl_bytes is None:
            num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, ranks) for c in configs)
        if num_rdma_bytes is None:
            num_rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden_bytes, ranks) for c in configs)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ranks
        self.expert_alignment = expert_alignment
        self.buffer = deep_ep.Buffer(
            group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes, **buffer_kwargs
        )
        self.key = next(_keys)
        _DISPATCHERS[self.key] = self

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        """Send each token to the ranks of its ``topk_idx`` experts (``deepep::dispatch``)."""
        out = torch.ops.deepep.dispatch(
            x,
            topk_idx,
            topk_weights,
            self.key,
            self.num_experts,
            self.num_local_experts,
            self.expert_alignment,
        )
        return Dispatched(*out, num_tokens=x.shape[0])

    def combine(self, x: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Sum expert outputs ``x`` (rows of ``dispatched.x``) back to their source tokens.

        The sum is unweighted: scale rows by ``dispatched.topk_weights`` before combining.
        """
        return torch.ops.deepep.combine(x, dispatched.handle, dispatched.num_tokens)


def _lookup_dispatcher(key: int) -> Dispatcher:
    try:
        return _DISPATCHERS[key]
    except KeyError:
        raise RuntimeError(
            f"no live prime_ops.deepep.Dispatcher with key {key}: create the Dispatcher first and "
            "keep a reference to it while its ops run"
        ) from None
