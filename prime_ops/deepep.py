"""DeepEP expert-parallel dispatch and combine as ops (namespace ``deepep``): prime_ops' design.

:class:`Dispatcher` runs ``deepep::dispatcher_dispatch`` / ``deepep::dispatcher_combine`` (and
their ``_backward`` ops): a dispatcher object per layer group, expert alignment, the received
top-k indices returned, equal layouts sharing one handle. prime-rl's own schemas
(``deepep::dispatch(x, topk_idx, topk_weights, num_experts)``, ``deepep::combine(x, handle_id,
num_tokens)``) are in :mod:`prime_ops.deepep_prime_rl`; they return other outputs, so the two
designs cannot share a name.

DeepEP's dispatch is a paired collective with a host sync and a stateful layout handle: it must
run exactly once per forward, never again in a checkpoint recompute (prime_ac keeps namespace
``deepep`` in every mode). Making dispatch and combine single opaque ops is what lets a dispatch
mode see and cache them.

A DeepEP handle is a tuple of tensors that cannot cross an op schema, so it travels as a small
CPU int64 tensor ``[dispatcher key, handle id]`` naming an entry in that dispatcher's table.
Dispatches whose layouts are equal share one id, so the same dispatch run twice (eager and
compiled, or a recompute check) returns equal outputs. A ``weakref.finalize`` on each returned
tensor's storage drops its reference to the entry: every alias (view, detach, the copy a
checkpoint cache keeps, autograd's saved tensor) shares the storage, so a layout lives exactly as
long as something can still use it, and no longer.

``Dispatcher`` owns the buffer: ``deep_ep.Buffer`` (``backend="deepep"``) or
:class:`prime_ops.deepep_reference.ReferenceBuffer` (``backend="reference"``, any process group,
CPU included). It is created at construction: a buffer created lazily inside the first
checkpointed forward would add collectives that the recompute does not replay.

Every check on the inputs runs before any communication. In the default mode a bad input raises
on the rank that has it alone, while its peers may already be waiting in the dispatch (until the
group's timeout): the error says so first. In checked mode (``PRIME_OPS_CHECK_COLLECTIVES=1`` or
:func:`prime_ops.groups.set_checked`, docs/collectives.md) the ranks exchange their checks' verdicts
and their settings (``num_experts``, hidden size, dtype, top-k) first, so every rank raises.

DeepEP has kernel configs for :data:`EP_SIZES` ranks only; other group sizes are refused at
construction, before any buffer is made.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from prime_ops.backends import import_backend
from prime_ops.collectives import _run_checks
from prime_ops.deepep_reference import ReferenceBuffer
from prime_ops.devices import check_same_device
from prime_ops.groups import Fingerprint

__all__ = ["EP_SIZES", "Dispatched", "Dispatcher", "live_handles"]

BUILD = (
    "then build DeepEP from source (PyPI has no working DeepEP): git clone "
    "https://github.com/deepseek-ai/DeepEP && cd DeepEP && ./install.sh (the extra installs the "
    "NVSHMEM its internode and low-latency kernels need; see docs/backends.md)"
)
BACKENDS = ("deepep", "reference")
EP_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
"""Group sizes DeepEP has dispatch and combine configs for (``Buffer.get_dispatch_config`` /
``get_combine_config``, ``deep_ep/buffers/legacy.py`` @ dd758caf4518, DeepEP 2.1.0; the same in
1.x's ``deep_ep/buffer.py``); for any other size DeepEP's size hints assert "Unsupported number
of EP ranks"."""

_keys = itertools.count(1)
# Ops receive a dispatcher as an int (a schema cannot carry the object): this weak table is the
# only way back from the int to the object. It never keeps a Dispatcher alive.
_DISPATCHERS: weakref.WeakValueDictionary[int, Dispatcher] = weakref.WeakValueDictionary()


def live_handles() -> int:
    """How many dispatch handles of live dispatchers are alive; for leak checks."""
    return sum(d.live_handles() for d in list(_DISPATCHERS.values()))


class _Entry:
    """A live layout: the backend's handle, its row counts, and how many tensors refer to it."""

    def __init__(self, layout: Any, num_tokens: int, num_recv: int, signature: tuple) -> None:
        self.layout = layout
        self.num_tokens = num_tokens  # rows this rank sent (rows combine returns)
        self.num_recv = num_recv  # rows this rank received (rows combine takes)
        self.signature = signature  # host-side summary: layouts compared only when it matches
        self.refs = 0


def _same_layout(a: Any, b: Any) -> bool:
    """Backend handles (tuples of tensors, ints and lists) compared by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
            and torch.equal(a, b)
        )
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same_layout(x, y) for x, y in zip(a, b, strict=True))
        )
    return a is b or (isinstance(a, (int, float, bool, str)) and a == b)


def _check_backend_and_group(backend: str, group, hint: str = "", op: str = "Dispatcher") -> int:
    """The backend name and a group size DeepEP has configs for (returned); ``hint`` ends the
    group-size error."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(group, dist.ProcessGroup) and not callable(getattr(group, "size", None)):
        raise TypeError(
            f"{op}: group must be a torch.distributed.ProcessGroup (torch.distributed.group.WORLD, "
            f"a torch.distributed.new_group result or a DeviceMesh's get_group()), got {group!r}"
        )
    ranks = group.size()
    if ranks not in EP_SIZES:
        raise ValueError(
            f"the group has {ranks} rank(s); DeepEP has dispatch/combine configs for "
            f"{', '.join(map(str, EP_SIZES))} ranks only (Buffer.get_dispatch_config){hint}"
        )
    return ranks


def _size_hints(deep_ep, ranks: int, hidden_bytes: int) -> tuple[int, int]:
    """DeepEP's NVLink and RDMA buffer sizes for dispatch and combine of ``hidden_bytes`` rows."""
    configs = (deep_ep.Buffer.get_dispatch_config(ranks), deep_ep.Buffer.get_combine_config(ranks))
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, ranks) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, ranks) for c in configs)
    return nvl, rdma


def _checks(op: str, group, describe) -> None:
    """Run ``describe`` (the call's checks on this rank, returning its
    :class:`~prime_ops.groups.Fingerprint`) as the collectives' fronts do: across the group in
    checked mode, alone in the default mode with the peers-may-wait hint first. A stand-in group
    (no ProcessGroup: tests) runs the checks alone."""
    if isinstance(group, dist.ProcessGroup):
        _run_checks(op, group, describe)
    else:
        describe()


def _check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    # One host read before any communication: an out-of-range expert would silently route
    # nowhere in DeepEP (its layout kernel skips it).
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        raise ValueError(
            f"topk_idx values must lie in [-1, num_experts={num_experts}) (-1 selects no expert), "
            f"got {topk_idx[bad][:8].tolist()}"
        )


def _check_tensors(op: str, **tensors) -> None:
    """Tensor arguments that are no tensor (None included: a schema's Tensor lets it through)."""
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {value!r}")


class Dispatcher:
    """Expert-parallel dispatch/combine over ``group`` through one DeepEP-style buffer.

    Create it before the first checkpointed forward (its construction is collective over
    ``group``). ``backend="deepep"`` uses ``deep_ep.Buffer`` (CUDA; ``num_nvl_bytes`` /
    ``num_rdma_bytes`` default to DeepEP's size hints for bf16 tokens of width ``hidden``; extra
    keyword arguments go to ``deep_ep.Buffer``); ``backend="reference"`` computes the same
    results with ``all_to_all_single`` on any group (gloo on CPU). ``expert_alignment`` rounds
    each local expert's received count up to a multiple (the rows themselves stay unpadded).

    Example (2 gloo ranks)::

        d = Dispatcher(group, num_experts=4, hidden=8, backend="reference")
        out = d.dispatch(x, topk_idx, topk_weights)  # x bf16 [T, 8], topk_idx int64 [T, k]
        y = d.combine(expert_outputs, out)  # [T, 8], summed over the ranks that got each token
    """

    def __init__(
        self,
        group: torch.distributed.ProcessGroup,
        *,
        num_experts: int,
        hidden: int,
        backend: str = "deepep",
        expert_alignment: int = 1,
        num_nvl_bytes: int | None = None,
        num_rdma_bytes: int | None = None,
        **buffer_kwargs: Any,
    ) -> None:
        ranks = _check_backend_and_group(
            backend, group, "; with one rank no token moves: call the experts directly"
        )
        if num_experts <= 0 or num_experts % ranks:
            raise ValueError(
                f"num_experts={num_experts} must be a positive multiple of the group size {ranks}"
            )
        if hidden <= 0 or hidden % 8:
            raise ValueError(
                f"hidden={hidden} must be a positive multiple of 8 (DeepEP moves bf16 rows in "
                "16-byte units)"
            )
        if expert_alignment < 1:
            raise ValueError(f"expert_alignment must be >= 1, got {expert_alignment}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ranks
        self.hidden = hidden
        self.expert_alignment = expert_alignment
        self.backend = backend
        self.group = group
        # DeepEP's kernels take top-k indices as its build's ``topk_idx_t`` (int64 unless built
        # with EP_NUM_TOPK_IDX_BITS=32); the ops take and return int64 whatever the build.
        self.topk_idx_dtype = torch.int64
        if backend == "reference":
            self.buffer = ReferenceBuffer(group)
        else:
            deep_ep = import_backend("deep_ep", extra="deepep", build=BUILD)
            self.topk_idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
            self.buffer = _deep_ep_buffer(
                deep_ep, group, hidden, num_nvl_bytes, num_rdma_bytes, buffer_kwargs
            )
        self.key = next(_keys)
        self._handles: dict[int, _Entry] = {}
        self._next_id = 0
        _DISPATCHERS[self.key] = self

    def live_handles(self) -> int:
        """How many of this dispatcher's layouts are alive (referenced by some tensor)."""
        return len(self._handles)

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> Dispatched:
        """Send each token to the ranks of its ``topk_idx`` experts."""
        out = torch.ops.deepep.dispatcher_dispatch(
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
        return torch.ops.deepep.dispatcher_combine(
            x, dispatched.handle, self.key, dispatched.num_tokens
        )

    def _own(self, layout: Any, num_tokens: int, num_recv: int, counts: list[int]) -> torch.Tensor:
        """A handle tensor for ``layout``; a live entry with an equal layout is shared."""
        signature = (num_tokens, num_recv, tuple(counts))
        ident = next(
            (
                i
                for i, e in self._handles.items()
                if e.signature == signature and _same_layout(e.layout, layout)
            ),
            None,
        )
        if ident is None:
            ident = self._next_id
            self._next_id += 1
            self._handles[ident] = _Entry(layout, num_tokens, num_recv, signature)
        self._handles[ident].refs += 1
        token = torch.tensor([self.key, ident], dtype=torch.int64)
        weakref.finalize(token.untyped_storage(), self._release, ident)
        return token

    def _release(self, ident: int) -> None:
        entry = self._handles[ident]
        entry.refs -= 1
        if entry.refs == 0:
            del self._handles[ident]

    def _resolve(self, token: torch.Tensor) -> _Entry:
        _check_token(token)
        owner, ident = token.tolist()
        if owner != self.key:
            raise ValueError(
                f"handle belongs to Dispatcher {owner}, not to this one ({self.key}): combine "
                "with the dispatcher that dispatched"
            )
        if ident in self._handles:
            return self._handles[ident]
        if 0 <= ident < self._next_id:
            raise ValueError(
                f"DeepEP handle {ident} was already released: a handle lives as long as the "
                "tensor deepep::dispatcher_dispatch returned (or a view or detached alias of it); "
                "a clone kept after that tensor died does not keep it"
            )
        raise ValueError(
            f"unknown DeepEP handle {token.tolist()}: pass the handle tensor "
            "deepep::dispatcher_dispatch returned (or a view, detached alias or clone of it)"
        )


class Dispatched(NamedTuple):
    """What :meth:`Dispatcher.dispatch` returns; pass it whole to :meth:`Dispatcher.combine`."""

    x: torch.Tensor
    """Received tokens ``[received, hidden]``: by source rank, then by token index there."""
    topk_idx: torch.Tensor
    """Local expert index of each received token's choices; -1 where the expert is elsewhere."""
    topk_weights: torch.Tensor
    """The routing weights of the received choices; 0 where ``topk_idx`` is -1."""
    tokens_per_expert: torch.Tensor
    """CPU int64 ``[num_local_experts]``, counts rounded up to ``expert_alignment``."""
    handle: torch.Tensor
    num_tokens: int
    """Tokens this rank sent: the row count combine returns."""


def _deep_ep_buffer(deep_ep, group, hidden, num_nvl_bytes, num_rdma_bytes, buffer_kwargs):
    nvl, rdma = _size_hints(deep_ep, group.size(), hidden * torch.bfloat16.itemsize)
    num_nvl_bytes = nvl if num_nvl_bytes is None else num_nvl_bytes
    num_rdma_bytes = rdma if num_rdma_bytes is None else num_rdma_bytes
    return deep_ep.Buffer(
        group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes, **buffer_kwargs
    )


def _lookup(key: int) -> Dispatcher:
    try:
        return _DISPATCHERS[key]
    except KeyError:
        raise RuntimeError(
            f"no live prime_ops.deepep.Dispatcher with key {key}: create the Dispatcher first and "
            "keep a reference to it while its ops run"
        ) from None


# --- checks (shapes, dtypes and devices: the same in kernels and fakes) --------------------------


def _check_token(token: torch.Tensor) -> None:
    if token.dtype != torch.int64 or tuple(token.shape) != (2,) or token.device.type != "cpu":
        raise ValueError(
            "handle must be the CPU int64 tensor of shape (2,) that deepep::dispatcher_dispatch "
            f"returned, got dtype {token.dtype}, shape {tuple(token.shape)} on {token.device}"
        )


def _check_rows(name: str, t: torch.Tensor, rows: int | torch.SymInt, cols: int | None) -> None:
    if t.dim() != 2 or t.shape[0] != rows or (cols is not None and t.shape[1] != cols):
        want = f"[{rows}, {cols if cols is not None else '*'}]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _check_x(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(
            f"{name} must be a [tokens, hidden] bfloat16 tensor (DeepEP's normal kernels move "
            f"bf16), got dtype {x.dtype} and shape {tuple(x.shape)}"
        )
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def _check_topk(x, topk_idx, topk_weights, weights_hint: str = "") -> None:
    """A dispatch's routing: int64 ``topk_idx`` and float32 ``topk_weights``, both contiguous
    ``[tokens of x, topk]``; ``weights_hint`` says in the error how the caller makes the weights."""
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx must be int64 [tokens, topk] with tokens={x.shape[0]}, got dtype "
            f"{topk_idx.dtype} and shape {tuple(topk_idx.shape)}"
        )
    _check_rows("topk_idx", topk_idx, x.shape[0], None)
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights must be float32 with the shape of topk_idx {tuple(topk_idx.shape)}"
            f"{weights_hint}, got dtype {topk_weights.dtype} and shape "
            f"{tuple(topk_weights.shape)}"
        )
    _check_rows("topk_weights", topk_weights, x.shape[0], topk_idx.shape[1])


def _check_dispatch(x, topk_idx, topk_weights, num_experts, num_local_experts) -> None:
    check_same_device(
        "deepep::dispatcher_dispatch", x=x, topk_idx=topk_idx, topk_weights=topk_weights
    )
    _check_x("x", x)
    _check_topk(x, topk_idx, topk_weights)
    if num_local_experts <= 0 or num_experts % num_local_experts:
        raise ValueError(
            f"num_local_experts={num_local_experts} must be positive and divide "
            f"num_experts={num_experts}"
        )


# --- dispatch -----------------------------------------------------------------------------------


def _route(buffer, index_dtype, x, topk_idx, topk_weights, num_experts, **dispatch_kwargs):
    """DeepEP's layout of ``topk_idx`` (as the build's ``index_dtype``; its values checked by
    :func:`_check_expert_ids`), then the dispatch along it; returns ``(recv_x, recv_idx,
    recv_weights, counts, layout)``."""
    topk_idx = topk_idx.to(index_dtype)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
        topk_idx, num_experts
    )
    *received, _ = buffer.dispatch(
        x,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        **dispatch_kwargs,
    )
    return received


@torch.library.custom_op("deepep::dispatcher_dispatch", mutates_args=())
def _dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    dispatcher: int,
    num_experts: int,
    num_local_experts: int,
    expert_alignment: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    owner = _lookup(dispatcher)
    settings = (num_experts, num_local_experts, expert_alignment)

    def describe() -> Fingerprint:
        _check_tensors(
            "deepep::dispatcher_dispatch", x=x, topk_idx=topk_idx, topk_weights=topk_weights
        )
        _check_dispatch(x, topk_idx, topk_weights, num_experts, num_local_experts)
        if settings != (owner.num_experts, owner.num_local_experts, owner.expert_alignment):
            raise ValueError(
                f"(num_experts, num_local_experts, expert_alignment)={settings} differ from "
                f"Dispatcher {dispatcher}'s; call Dispatcher.dispatch"
            )
        if x.shape[1] != owner.hidden:
            raise ValueError(
                f"x has {x.shape[1]} columns but the Dispatcher's hidden={owner.hidden}"
            )
        _check_expert_ids(topk_idx, num_experts)
        return Fingerprint({"settings": settings, "hidden": x.shape[1], "topk": topk_idx.shape[1]})

    _checks("deepep::dispatcher_dispatch", owner.group, describe)
    recv_x, recv_idx, recv_weights, counts, layout = _route(
        owner.buffer, owner.topk_idx_dtype, x, topk_idx, topk_weights, num_experts,
        expert_alignment=expert_alignment,
    )  # fmt: skip
    handle = owner._own(layout, x.shape[0], recv_x.shape[0], counts)
    tokens_per_expert = torch.tensor(counts, dtype=torch.int64)
    return recv_x, recv_idx.to(torch.int64), recv_weights, tokens_per_expert, handle


@_dispatch.register_fake
def _(x, topk_idx, topk_weights, dispatcher, num_experts, num_local_experts, expert_alignment):
    _check_tensors("deepep::dispatcher_dispatch", x=x, topk_idx=topk_idx, topk_weights=topk_weights)
    _check_dispatch(x, topk_idx, topk_weights, num_experts, num_local_experts)
    received = torch.library.get_ctx().new_dynamic_size()
    topk = topk_idx.shape[1]
    return (
        x.new_empty(received, x.shape[1]),
        topk_idx.new_empty(received, topk),
        topk_weights.new_empty(received, topk),
        torch.empty(num_local_experts, dtype=torch.int64, device="cpu"),
        torch.empty(2, dtype=torch.int64, device="cpu"),
    )


def _check_dispatch_backward(grad_recv_x, grad_recv_topk_weights, recv_topk_idx, handle):
    _check_token(handle)
    check_same_device(
        "deepep::dispatcher_dispatch_backward",
        grad_recv_x=grad_recv_x,
        grad_recv_topk_weights=grad_recv_topk_weights,
        recv_topk_idx=recv_topk_idx,
    )
    _check_x("grad_recv_x", grad_recv_x)
    rows = grad_recv_x.shape[0]
    _check_rows("recv_topk_idx", recv_topk_idx, rows, None)
    _check_rows("grad_recv_topk_weights", grad_recv_topk_weights, rows, recv_topk_idx.shape[1])


@torch.library.custom_op("deepep::dispatcher_dispatch_backward", mutates_args=())
def _dispatch_backward(
    grad_recv_x: torch.Tensor,
    grad_recv_topk_weights: torch.Tensor,
    recv_topk_idx: torch.Tensor,
    handle: torch.Tensor,
    dispatcher: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_dispatch_backward(grad_recv_x, grad_recv_topk_weights, recv_topk_idx, handle)
    owner = _lookup(dispatcher)
    entry = owner._resolve(handle)
    _check_rows("grad_recv_x", grad_recv_x, entry.num_recv, owner.hidden)
    if num_tokens != entry.num_tokens:
        raise ValueError(
            f"num_tokens={num_tokens} but the handle's dispatch sent {entry.num_tokens}"
        )
    # Dispatch copies a weight to a rank only where that rank owns the expert and sends 0
    # elsewhere (received index -1); the adjoint of that masked copy is a masked sum.
    masked = grad_recv_topk_weights.masked_fill(recv_topk_idx < 0, 0.0)
    grad_x, grad_weights, _ = owner.buffer.combine(grad_recv_x, entry.layout, topk_weights=masked)
    return grad_x, grad_weights


@_dispatch_backward.register_fake
def _(grad_recv_x, grad_recv_topk_weights, recv_topk_idx, handle, dispatcher, num_tokens):
    _check_dispatch_backward(grad_recv_x, grad_recv_topk_weights, recv_topk_idx, handle)
    return (
        grad_recv_x.new_empty(num_tokens, grad_recv_x.shape[1]),
        grad_recv_topk_weights.new_empty(num_tokens, grad_recv_topk_weights.shape[1]),
    )


def _dispatch_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[4])
    ctx.dispatcher = inputs[3]
    ctx.num_tokens = inputs[0].shape[0]
    ctx.recv = [(t.shape, t.dtype, t.device) for t in (output[0], output[2])]


def _dense_grads(grads, outputs) -> list[torch.Tensor]:
    """A dispatch's incoming gradients made contiguous, zeros where autograd passed None (an
    unused output); ``outputs`` holds each output's ``(shape, dtype, device)``."""
    return [
        torch.zeros(shape, dtype=dtype, device=device) if g is None else g.contiguous()
        for g, (shape, dtype, device) in zip(grads, outputs, strict=True)
    ]


def _dispatch_grad(ctx, grad_recv_x, _idx, grad_recv_weights, _counts, _handle):
    recv_idx, handle = ctx.saved_tensors
    grads = _dense_grads((grad_recv_x, grad_recv_weights), ctx.recv)
    grad_x, grad_weights = torch.ops.deepep.dispatcher_dispatch_backward(
        *grads, recv_idx, handle, ctx.dispatcher, ctx.num_tokens
    )
    return grad_x, None, grad_weights, None, None, None, None


_dispatch.register_autograd(_dispatch_grad, setup_context=_dispatch_setup)


# --- combine ------------------------------------------------------------------------------------


@torch.library.custom_op("deepep::dispatcher_combine", mutates_args=())
def _combine(
    x: torch.Tensor, handle: torch.Tensor, dispatcher: int, num_tokens: int
) -> torch.Tensor:
    owner = _lookup(dispatcher)
    entries = []

    def describe() -> Fingerprint:
        _check_tensors("deepep::dispatcher_combine", x=x, handle=handle)
        _check_token(handle)
        _check_x("x", x)
        entries.append(owner._resolve(handle))
        _check_rows("x", x, entries[0].num_recv, owner.hidden)
        if num_tokens != entries[0].num_tokens:
            raise ValueError(
                f"num_tokens={num_tokens} but the handle's dispatch sent {entries[0].num_tokens}"
            )
        return Fingerprint({"hidden": x.shape[1]})

    _checks("deepep::dispatcher_combine", owner.group, describe)
    combined, _, _ = owner.buffer.combine(x, entries[0].layout)
    return combined


@_combine.register_fake
def _(x, handle, dispatcher, num_tokens):
    _check_tensors("deepep::dispatcher_combine", x=x, handle=handle)
    _check_token(handle)
    _check_x("x", x)
    return x.new_empty(num_tokens, x.shape[1])


@torch.library.custom_op("deepep::dispatcher_combine_backward", mutates_args=())
def _combine_backward(
    grad: torch.Tensor, handle: torch.Tensor, dispatcher: int, num_recv: int
) -> torch.Tensor:
    _check_token(handle)
    _check_x("grad", grad)
    owner = _lookup(dispatcher)
    entry = owner._resolve(handle)
    _check_rows("grad", grad, entry.num_tokens, owner.hidden)
    if num_recv != entry.num_recv:
        raise ValueError(f"num_recv={num_recv} but the handle's dispatch received {entry.num_recv}")
    # A cached dispatch: the handle replays the forward's layout, no new routing and no host sync.
    grad_x, *_ = owner.buffer.dispatch(grad, handle=entry.layout)
    return grad_x


@_combine_backward.register_fake
def _(grad, handle, dispatcher, num_recv):
    _check_token(handle)
    _check_x("grad", grad)
    return grad.new_empty(num_recv, grad.shape[1])


def _combine_setup(ctx, inputs, output):
    x, handle, dispatcher, _ = inputs
    ctx.save_for_backward(handle)
    ctx.dispatcher = dispatcher
    ctx.num_recv = x.shape[0]


def _combine_grad(ctx, grad):
    (handle,) = ctx.saved_tensors
    grad_x = torch.ops.deepep.dispatcher_combine_backward(
        grad.contiguous(), handle, ctx.dispatcher, ctx.num_recv
    )
    return grad_x, None, None, None


_combine.register_autograd(_combine_grad, setup_context=_combine_setup)
