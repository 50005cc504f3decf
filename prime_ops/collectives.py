"""Differentiable collectives as one opaque operator each: namespace ``prime_rl_collectives``.

The schemas are prime-rl's (``src/prime_rl/trainer/distributed/collectives.py`` @ 3be02f75c7b9,
see docs/collectives.md, "prime-rl compatibility"): a trainer that registered these names itself
can import prime_ops instead and keep its calls.

Expert and context parallelism move activations between ranks inside a transformer block. As
registered custom ops, each collective is a single node that autograd, torch.compile and
checkpoint policies (``prime_ac`` targets the whole namespace) all see the same way. Every op's
backward is its adjoint collective, itself one of these ops, so double backward and recompute
stay inside the namespace.

The ops take the process group by name (``ProcessGroup.group_name``): a schema carries strings,
not Python objects. The fronts below take a ``ProcessGroup`` (default: the world group).
Arguments are validated before any communication starts. A call that is valid on each rank but
does not fit its peers' calls (splits that disagree, shapes or dtypes that differ) cannot be seen
from one rank: the fronts' checked mode (a setting of the process group:
``PRIME_OPS_CHECK_COLLECTIVES=1`` or :func:`prime_ops.groups.set_checked`) compares every rank's
call first and raises on all of them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from prime_ops._compat import all_gather_single, is_fake, reduce_scatter_single
from prime_ops.groups import (
    Fingerprint,
    agree,
    checked_mode,
    rank_local,
    resolve_call,
    resolve_name,
)

__all__ = [
    "all_gather",
    "all_to_all_single",
    "all_to_all_single_async",
    "all_to_all_single_equal",
    "reduce_scatter_sum",
    "sync_all_to_all",
]

NAMESPACE = "prime_rl_collectives"


# --- validation (shared by kernels and fakes; never communicates) ----------------------------


def _check_tensor(x: object, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")


def _check_int(name: str, value: object, op: str) -> int:
    """An int (a SymInt while tracing is specialised to its value); bools are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_rank(x: torch.Tensor, op: str) -> None:
    _check_tensor(x, op)
    if x.layout != torch.strided:
        raise ValueError(
            f"{op}: x has layout {x.layout}; the collectives move dense tensors, so pass "
            "x.to_dense()"
        )
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension, got a 0-d tensor")


def _check_sendable(x: object, op: str) -> None:
    """What only a front can check before communicating: x holds data. An op called on a meta
    tensor runs its fake (that is how tracing works) and returns at once, while the peers wait
    in the collective; fake tensors (tracing, FakeTensorMode) are what fakes are for."""
    _check_rank(x, op)
    if x.device.type == "meta" and not is_fake(x):
        raise ValueError(
            f"{op}: x is on the meta device, which holds no data: this rank would return at "
            "once while its peers wait in the collective. Pass a tensor on the group's device"
        )


def _check_group_size(group_size: object, group: dist.ProcessGroup, op: str) -> int:
    size = _check_int("group_size", group_size, op)
    if size != group.size():
        raise ValueError(
            f"{op}: group_size={size} but the group {group.group_name!r} has {group.size()} "
            "ranks; pass group.size() (the output shape is computed from group_size)"
        )
    return size


def _check_dim(x: torch.Tensor, dim: int, op: str) -> int:
    _check_rank(x, op)
    dim = _check_int("dim", dim, op)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{op}: dim={dim} is out of range for x of shape {tuple(x.shape)}; "
            f"pass a dim in [{-x.dim()}, {x.dim() - 1}]"
        )
    return dim % x.dim()


def _check_divisible(x: torch.Tensor, dim: int, world: int, op: str) -> None:
    if x.shape[dim] % world != 0:
        raise ValueError(
            f"{op}: x.shape[{dim}]={x.shape[dim]} is not divisible by the group size {world}; "
            f"{op} splits dim {dim} into {world} equal parts, so pad it to a multiple of {world}"
        )


def _check_split_tensor(name: str, splits: torch.Tensor, world: int) -> None:
    if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer (int64) tensor, got dtype {splits.dtype}")
    if splits.dim() != 1 or splits.numel() != world:
        raise ValueError(
            f"{name} has shape {tuple(splits.shape)} but the group has {world} ranks; "
            f"pass one split size per rank (shape ({world},))"
        )


def _check_splits(x: torch.Tensor, output_splits, input_splits, world: int) -> None:
    """Metadata checks of an all-to-all (kernel and fake): one int split per rank, on the CPU or
    on x's device (splits on ``meta`` with a real x would run the fake as the kernel)."""
    _check_rank(x, "all_to_all_single")
    for name, splits in (("output_splits", output_splits), ("input_splits", input_splits)):
        _check_split_tensor(name, splits, world)
        if splits.device.type != "cpu" and splits.device != x.device:
            raise ValueError(
                f"all_to_all_single: {name} is on {splits.device} but x is on {x.device}; "
                "put the split sizes on the CPU or on x's device"
            )


def _split_sizes(name: str, splits: torch.Tensor) -> list[int]:
    """Read split sizes to the host (a device sync when they live on an accelerator)."""
    sizes = splits.tolist()
    if any(s < 0 for s in sizes):
        raise ValueError(f"{name} must not contain negative sizes, got {sizes}")
    return sizes


def _all_to_all_sizes(x, output_splits, input_splits, world: int) -> tuple[list[int], list[int]]:
    _check_splits(x, output_splits, input_splits, world)
    out_sizes = _split_sizes("output_splits", output_splits)
    in_sizes = _split_sizes("input_splits", input_splits)
    if sum(in_sizes) != x.shape[0]:
        raise ValueError(
            f"all_to_all_single: input_splits {in_sizes} sum to {sum(in_sizes)} but x has "
            f"{x.shape[0]} rows along dim 0; input_splits[i] is the number of rows sent to rank i"
        )
    return out_sizes, in_sizes


# --- all_to_all_single ----------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::all_to_all_single", mutates_args=())
def _all_to_all_single(
    x: torch.Tensor, output_splits: torch.Tensor, input_splits: torch.Tensor, group_name: str
) -> torch.Tensor:
    """Rows ``x[sum(input_splits[:i]) : ...]`` go to rank i; rank i's rows arrive in order."""
    op = "all_to_all_single"
    group = resolve_name(group_name, op)
    with rank_local(op, group):
        out_sizes, in_sizes = _all_to_all_sizes(x, output_splits, input_splits, group.size())
    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_sizes, in_sizes, group=group)
    return out


@_all_to_all_single.register_fake
def _(x, output_splits, input_splits, group_name):
    world = resolve_name(group_name, "all_to_all_single").size()
    _check_splits(x, output_splits, input_splits, world)
    # The received row count is the sum of output_splits: known only at run time.
    rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, *x.shape[1:]))


def _all_to_all_single_setup(ctx, inputs, output):
    x, output_splits, input_splits, group_name = inputs
    ctx.rows = x.shape[0]
    ctx.group_name = group_name
    ctx.save_for_backward(output_splits, input_splits)


def _all_to_all_single_backward(ctx, grad):
    output_splits, input_splits = ctx.saved_tensors
    # The adjoint sends every gradient row back where its activation came from.
    grad_x = _all_to_all_single(grad, input_splits, output_splits, ctx.group_name)
    # Under compile the returned row count is a fresh unbacked size; it equals x's by
    # construction, and saying so lets autograd match the gradient's shape to x's.
    torch._check(grad_x.shape[0] == ctx.rows)
    return grad_x, None, None, None


_all_to_all_single.register_autograd(
    _all_to_all_single_backward, setup_context=_all_to_all_single_setup
)


# --- all_to_all_single_equal ----------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::all_to_all_single_equal", mutates_args=())
def _all_to_all_single_equal(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Dim 0 splits into group-size equal chunks; chunk i goes to rank i."""
    op = "all_to_all_single_equal"
    group = resolve_name(group_name, op)
    with rank_local(op, group):
        _check_rank(x, op)
        _check_divisible(x, 0, group.size(), op)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


@_all_to_all_single_equal.register_fake
def _(x, group_name):
    world = resolve_name(group_name, "all_to_all_single_equal").size()
    _check_rank(x, "all_to_all_single_equal")
    _check_divisible(x, 0, world, "all_to_all_single_equal")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_to_all_single_equal_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


def _all_to_all_single_equal_backward(ctx, grad):
    # An equal all-to-all is a transpose of (rank, chunk): its own inverse and adjoint.
    return _all_to_all_single_equal(grad, ctx.group_name), None


_all_to_all_single_equal.register_autograd(
    _all_to_all_single_equal_backward, setup_context=_all_to_all_single_equal_setup
)


# --- all_gather / reduce_scatter_sum --------------------------------------------------------

# prime-rl's schemas, as torch infers them from its ``int`` annotations (SymInt); ``dim`` picks
# the layout, so the kernels and fakes specialise it. ``group_size`` gives the output shape
# without resolving the group; it must equal the group's size.
_GATHER_SCHEMA = "(Tensor x, SymInt dim, SymInt group_size, str group_name) -> Tensor"


@torch.library.custom_op(f"{NAMESPACE}::all_gather", mutates_args=(), schema=_GATHER_SCHEMA)
def _all_gather(x: torch.Tensor, dim: int, group_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    group = resolve_name(group_name, "all_gather")
    with rank_local("all_gather", group):
        dim = _check_dim(x, dim, "all_gather")
        _check_group_size(group_size, group, "all_gather")
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((group.size() * src.shape[0], *src.shape[1:]))
    all_gather_single(out, src, group=group)
    return out.movedim(0, dim).contiguous()


@_all_gather.register_fake
def _(x, dim, group_size, group_name):
    group = resolve_name(group_name, "all_gather")
    dim = _check_dim(x, dim, "all_gather")
    shape = list(x.shape)
    shape[dim] *= _check_group_size(group_size, group, "all_gather")
    return x.new_empty(shape)


def _gather_scatter_setup(ctx, inputs, output):
    _, ctx.dim, ctx.group_size, ctx.group_name = inputs


def _all_gather_backward(ctx, grad):
    # Every rank's copy of the gathered tensor fed its own loss: sum them, keep our chunk.
    return _reduce_scatter_sum(grad, ctx.dim, ctx.group_size, ctx.group_name), None, None, None


_all_gather.register_autograd(_all_gather_backward, setup_context=_gather_scatter_setup)


@torch.library.custom_op(f"{NAMESPACE}::reduce_scatter_sum", mutates_args=(), schema=_GATHER_SCHEMA)
def _reduce_scatter_sum(
    x: torch.Tensor, dim: int, group_size: int, group_name: str
) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's equal chunk along ``dim``."""
    op = "reduce_scatter_sum"
    group = resolve_name(group_name, op)
    with rank_local(op, group):
        dim = _check_dim(x, dim, op)
        _check_group_size(group_size, group, op)
        _check_divisible(x, dim, group.size(), op)
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // group.size(), *src.shape[1:]))
    reduce_scatter_single(out, src, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim).contiguous()


@_reduce_scatter_sum.register_fake
def _(x, dim, group_size, group_name):
    group = resolve_name(group_name, "reduce_scatter_sum")
    dim = _check_dim(x, dim, "reduce_scatter_sum")
    world = _check_group_size(group_size, group, "reduce_scatter_sum")
    _check_divisible(x, dim, world, "reduce_scatter_sum")
    shape = list(x.shape)
    shape[dim] //= world
    return x.new_empty(shape)


def _reduce_scatter_sum_backward(ctx, grad):
    # Each rank's chunk of the sum depends on every rank's input with weight one.
    return _all_gather(grad, ctx.dim, ctx.group_size, ctx.group_name), None, None, None


_reduce_scatter_sum.register_autograd(
    _reduce_scatter_sum_backward, setup_context=_gather_scatter_setup
)


# --- all_to_all_single_async ----------------------------------------------------------------

# Pending exchanges by handle: the work and the send buffer, kept alive until waited for, or
# until the handle tensor dies unsynced (then :func:`_drop` waits and lets them go, so a handle
# never synced holds nothing for the life of the process).
_pending: dict[int, tuple[dist.Work, torch.Tensor]] = {}
_issued = 0  # handles are 1, 2, ...; a handle above this was never issued on this process


def _drop(ident: int) -> None:
    """The handle died unsynced: finish its exchange (the peers take part in it anyway) and
    release the work and the send buffer."""
    pending = _pending.pop(ident, None)
    if pending is not None:
        pending[0].wait()


@torch.library.custom_op(f"{NAMESPACE}::all_to_all_single_async", mutates_args=())
def _all_to_all_single_async(
    x: torch.Tensor, output_splits: torch.Tensor, input_splits: torch.Tensor, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_all_to_all_single` without waiting: ``(output, handle)``, where ``output`` holds
    the received rows only after :func:`sync_all_to_all` (handle)."""
    global _issued
    op = "all_to_all_single_async"
    group = resolve_name(group_name, op)
    with rank_local(op, group):
        out_sizes, in_sizes = _all_to_all_sizes(x, output_splits, input_splits, group.size())
    src = x.contiguous()
    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    work = dist.all_to_all_single(out, src, out_sizes, in_sizes, group=group, async_op=True)
    _issued += 1
    _pending[_issued] = (work, src)
    handle = torch.tensor([_issued], dtype=torch.int64)
    # not at interpreter exit: the group may be gone by then, and nothing is left to free
    weakref.finalize(handle, _drop, _issued).atexit = False
    return out, handle


@_all_to_all_single_async.register_fake
def _(x, output_splits, input_splits, group_name):
    world = resolve_name(group_name, "all_to_all_single_async").size()
    _check_splits(x, output_splits, input_splits, world)
    rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, *x.shape[1:])), torch.empty(1, dtype=torch.int64)


def _all_to_all_single_async_backward(ctx, grad, grad_handle):
    if grad is None:
        return None, None, None, None
    output_splits, input_splits = ctx.saved_tensors
    # The forward overlapped its transfer with other work; the adjoint exchange waits.
    grad_x = _all_to_all_single(grad, input_splits, output_splits, ctx.group_name)
    torch._check(grad_x.shape[0] == ctx.rows)
    return grad_x, None, None, None


_all_to_all_single_async.register_autograd(
    _all_to_all_single_async_backward, setup_context=_all_to_all_single_setup
)


@torch.compiler.disable
def sync_all_to_all(handle: torch.Tensor | int | None) -> None:
    """Wait for the exchange :func:`all_to_all_single_async` started (prime-rl's
    ``sync_all_to_all``): after it, the output holds the received rows. ``None`` and a handle
    already waited for return at once; a handle never issued on this process raises. A graph
    break under torch.compile, by design: call it where the output is first needed."""
    if handle is None:
        return
    if isinstance(handle, torch.Tensor):
        if handle.device.type == "meta" or is_fake(handle):
            raise ValueError(
                "sync_all_to_all: handle is a meta or fake tensor, which a traced or meta call "
                "of all_to_all_single_async returns; no exchange was started for it. Sync the "
                "handle of a real call (outside torch.compile, sync_all_to_all is a graph break)"
            )
        if handle.numel() != 1 or handle.dtype != torch.int64:
            raise ValueError(
                "sync_all_to_all: handle must be the int64 tensor of one element that "
                f"all_to_all_single_async returned; got dtype {handle.dtype}, shape "
                f"{tuple(handle.shape)}"
            )
        handle = int(handle.item())
    elif isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(
            "sync_all_to_all: handle must be the tensor all_to_all_single_async returned, an int "
            f"or None; got {type(handle).__name__} {handle!r}"
        )
    if not 1 <= handle <= _issued:
        raise ValueError(
            f"sync_all_to_all: handle {handle} was never issued on this process (handles so "
            f"far: 1 to {_issued}); pass the handle all_to_all_single_async returned"
        )
    pending = _pending.pop(handle, None)
    if pending is not None:
        pending[0].wait()


# --- checked mode: what each rank's call must agree on ---------------------------------------


def _where(x: torch.Tensor) -> dict[str, str]:
    """Device type (not index: ranks of one group use different GPUs) and dtype of x."""
    return {"x.dtype": str(x.dtype), "x.device": x.device.type, "x.layout": str(x.layout)}


def _layout(x: torch.Tensor, dim: int | None = None) -> Fingerprint:
    """Equal-size collectives: every rank's x has the same shape, dtype and device type (and the
    same dim)."""
    shared = {"x.shape": tuple(x.shape), **_where(x)}
    return Fingerprint(shared if dim is None else {**shared, "dim": dim})


# --- fronts ---------------------------------------------------------------------------------


def _ints(value: object) -> bool:
    """An int (not a bool), or a list or tuple of such (nested lists fail the shape check)."""
    if isinstance(value, (list, tuple)):
        return all(_ints(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


def _as_splits(name: str, splits: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if isinstance(splits, torch.Tensor):
        return splits
    if not isinstance(splits, (list, tuple)) or not _ints(splits):
        raise TypeError(
            f"{name} must be a list of ints (rows per rank) or an integer tensor, got {splits!r}"
        )
    return torch.tensor(splits, dtype=torch.int64)


def _run_checks(op: str, group: dist.ProcessGroup, describe, local=None) -> None:
    """Checked mode: ``describe`` runs inside the fingerprint exchange. Default mode: ``local``
    (default: ``describe``) runs alone, without communicating, and its error says that the
    peers may be waiting; the op's own checks run in the same way."""
    if checked_mode(group):
        agree(op, group, describe)
    else:
        with rank_local(op, group):
            (describe if local is None else local)()


def _variable_split_checks(op, x, output_splits, input_splits, group, check_x=_check_sendable):
    """The checks of a variable-split all-to-all front; returns the splits as tensors."""
    splits = []

    def convert():  # default mode: the op reads the sizes (a sync for device tensors) once
        check_x(x, op)
        splits[:] = (
            _as_splits("output_splits", output_splits),
            _as_splits("input_splits", input_splits),
        )

    def describe():
        convert()
        recv, send = _all_to_all_sizes(x, *splits, group.size())
        shared = {"x.shape[1:]": tuple(x.shape[1:]), **_where(x)}
        return Fingerprint(shared, tuple(send), tuple(recv))

    _run_checks(op, group, describe, convert)
    return splits


def all_to_all_single(
    x: torch.Tensor,
    output_splits: torch.Tensor | Sequence[int],
    input_splits: torch.Tensor | Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Exchange variable-size row blocks of ``x`` (dim 0) with every rank of ``group``.

    ``input_splits[i]`` rows go to rank i; ``output_splits[i]`` rows arrive from rank i. Splits
    are lists of ints or integer tensors (CPU or on ``x``'s device; the sizes are read to the
    host). The gradient is the same exchange with the splits swapped. In checked mode (see
    :mod:`prime_ops.groups`) every rank first checks that the splits, trailing shapes, dtypes
    and device types of all ranks fit together.

    Example (2 ranks; rank 0 sends 1 row to itself and 2 to rank 1)::

        send = [1, 2] if rank == 0 else [3, 0]
        recv = [1, 3] if rank == 0 else [2, 0]
        out = all_to_all_single(torch.randn(sum(send), 8), recv, send)
    """
    op = "all_to_all_single"
    group = resolve_call(group, op)
    splits = _variable_split_checks(op, x, output_splits, input_splits, group)
    return _all_to_all_single(x, *splits, group.group_name)


def all_to_all_single_async(
    x: torch.Tensor,
    output_splits: torch.Tensor | Sequence[int],
    input_splits: torch.Tensor | Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`all_to_all_single` that returns before the rows arrive: ``(output, handle)``.

    Work issued between this call and ``sync_all_to_all(handle)`` (another chunk's experts, say)
    overlaps the exchange; read ``output`` only after the sync. The gradient is the adjoint
    exchange, which waits. prime-rl's ``all_to_all_single_async`` / ``sync_all_to_all`` pair.

    Example (2 ranks, as :func:`all_to_all_single`)::

        out, handle = all_to_all_single_async(torch.randn(sum(send), 8), recv, send)
        ...  # independent work
        sync_all_to_all(handle)
    """
    op = "all_to_all_single_async"
    group = resolve_call(group, op)
    splits = _variable_split_checks(op, x, output_splits, input_splits, group)
    return _all_to_all_single_async(x, *splits, group.group_name)


def all_to_all_single_equal(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Split dim 0 into group-size equal chunks, send chunk i to rank i, receive in rank order.
    Checked mode: every rank's x must match in shape, dtype and device type.
    """
    op = "all_to_all_single_equal"
    group = resolve_call(group, op)

    def describe():
        _check_sendable(x, op)
        _check_divisible(x, 0, group.size(), op)
        return _layout(x)

    _run_checks(op, group, describe)
    return _all_to_all_single_equal(x, group.group_name)


def all_gather(
    x: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Concatenate ``x`` from every rank along ``dim``; the gradient is a sum reduce-scatter.
    prime-rl's front, ``all_gather(x, dim, group)``. Checked mode: shape, dtype, device type and
    dim must match on every rank.
    """
    op = "all_gather"
    group = resolve_call(group, op)

    def describe():
        _check_sendable(x, op)
        return _layout(x, _check_dim(x, dim, op))

    _run_checks(op, group, describe)
    return _all_gather(x, dim, group.size(), group.group_name)


def reduce_scatter_sum(
    x: torch.Tensor, dim: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sum ``x`` over ranks and return this rank's chunk along ``dim``; gradient: all-gather.
    Checked mode: shape, dtype, device type and dim must match on every rank.
    """
    op = "reduce_scatter_sum"
    group = resolve_call(group, op)

    def describe():
        _check_sendable(x, op)
        checked_dim = _check_dim(x, dim, op)
        _check_divisible(x, checked_dim, group.size(), op)
        return _layout(x, checked_dim)

    _run_checks(op, group, describe)
    return _reduce_scatter_sum(x, dim, group.size(), group.group_name)
