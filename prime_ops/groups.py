"""Process groups for the communicating ops, and the checked mode that keeps bad calls from hanging.

A collective whose ranks disagree (split sizes, shapes, dtypes, the packed layout of a ring) does
not fail cleanly: gloo aborts the process or returns uninitialised rows, NCCL hangs, and an
error raised on one rank before communicating leaves its peers waiting in the collective. So:

- Default mode: every check that needs no communication runs on each rank before anything is
  sent, and an error raised there says that the other ranks may be waiting (and how to turn on
  checked mode). What it cannot see is listed in docs/collectives.md.
- Checked mode: the front first gathers a small fingerprint of every rank's call (an error flag,
  splits, and a digest of the op's name, shapes, dtypes, device types, layouts, ``cu_seqlens``
  and flags) with one small all-gather, and every rank raises the same ``ValueError`` if any
  rank's call raised (whatever the exception: a ``group=`` that is no group, a bad argument, a
  meta or sparse tensor) or the calls do not fit together, before the real collective starts.
  It costs that collective and a host sync per call (measured in
  ``benchmarks/collectives_overhead.py``); it runs in eager mode and is skipped while compiling.

The mode belongs to the process group, not to a call: a rank that checks while its peer does
not would meet the peer's collective with its fingerprint exchange (a hang, or an abort in gloo).
``PRIME_OPS_CHECK_COLLECTIVES`` sets it for every group; the first eager front call on a group
compares the setting of every rank (one all-gather of one value, once per group) and every rank
raises if they differ. :func:`set_checked` changes it for one group, as a collective.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from prime_ops._compat import all_gather_single, resolve_process_group

__all__ = [
    "CHECK_ENV",
    "Fingerprint",
    "agree",
    "checked_mode",
    "exchange_device",
    "peers_may_wait",
    "rank_local",
    "resolve",
    "resolve_call",
    "resolve_name",
    "resolve_name_call",
    "set_checked",
]

CHECK_ENV = "PRIME_OPS_CHECK_COLLECTIVES"
_OFF = ("", "0", "false", "no", "off")
# group -> the mode its ranks agreed on (by object: a re-created group may reuse the name)
_modes: weakref.WeakKeyDictionary[dist.ProcessGroup, bool] = weakref.WeakKeyDictionary()


def _env_mode() -> bool:
    return os.environ.get(CHECK_ENV, "").strip().lower() not in _OFF


def exchange_device(group: dist.ProcessGroup) -> torch.device:
    """Where the group's own small exchanges run: the CPU when its backend has gloo, else the
    current CUDA device (NCCL communicates CUDA tensors only)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _agree_on_mode(group: dist.ProcessGroup, enabled: bool, source: str) -> bool:
    """Every rank's requested mode, exchanged; every rank raises if they differ."""
    device = exchange_device(group)
    modes = torch.empty(group.size(), dtype=torch.int64, device=device)
    all_gather_single(modes, torch.tensor([int(enabled)], device=device), group=group)
    values = [bool(v) for v in modes.tolist()]
    if len(set(values)) > 1:
        listed = ", ".join(f"rank {r}: {'on' if v else 'off'}" for r, v in enumerate(values))
        raise ValueError(
            f"checked mode must be the same on every rank of the group; got {listed} (from "
            f"{source}). Set {CHECK_ENV} alike on every rank, or call "
            "prime_ops.groups.set_checked(enabled, group) on every rank. Nothing was sent."
        )
    return enabled


def set_checked(enabled: bool, group: dist.ProcessGroup | None = None) -> None:
    """Turn checked mode on or off for ``group`` (None: the default group), on every rank.

    A collective, like ``torch.distributed.barrier``: every rank of the group calls it, with the
    same ``enabled``; ranks that disagree all raise ``ValueError`` and the mode stays as it was.
    """
    group = resolve(group, "set_checked")
    _modes[group] = _agree_on_mode(group, bool(enabled), "set_checked")


def checked_mode(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs in checked mode: what :func:`set_checked` set, else
    ``PRIME_OPS_CHECK_COLLECTIVES`` as every rank agreed at the group's first call. Always False
    while compiling (the exchange reads its result on the host)."""
    if torch.compiler.is_compiling():
        return False
    mode = _modes.get(group)
    if mode is None:
        mode = _modes[group] = _agree_on_mode(group, _env_mode(), CHECK_ENV)
    return mode


def resolve(group: Any, op: str) -> dist.ProcessGroup:
    """The ProcessGroup a front was given (None: the default group), with clear errors for a
    missing default group, a group passed by name, and a group this rank is not a member of."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{op}: torch.distributed is not initialized: call "
            "torch.distributed.init_process_group() first"
        )
    if group is None:
        return dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{op}: rank {dist.get_rank()} is not a member of the group it passed as group= "
            "(torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER on ranks outside "
            "the group); call the op only on the group's member ranks"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{op}: group must be a torch.distributed.ProcessGroup or None (the default group); "
            f"got {group!r}. Pass torch.distributed.group.WORLD or a group from "
            "torch.distributed.new_group, not its name"
        )
    return group


def resolve_call(group: Any, op: str) -> dist.ProcessGroup:
    """:func:`resolve` for a front's call, where a ``group=`` that is not a group at all must
    not strand the peers: in checked mode the error joins the fingerprint exchange of the default
    group, the group the peers of a rank with a mistyped ``group=`` most likely passed, so every
    rank raises it. (A rank outside the group it passed is not awaited by that group's members;
    it raises alone.)"""
    try:
        return resolve(group, op)
    except ValueError as exc:
        if group is dist.GroupMember.NON_GROUP_MEMBER or not checked_mode(dist.group.WORLD):
            raise

        def rejected(error: ValueError = exc) -> Fingerprint:
            raise error

        agree(op, dist.group.WORLD, rejected)
        raise  # unreachable: agree raised on every rank


def resolve_name(group_name: str, op: str) -> dist.ProcessGroup:
    """The live group behind an op's ``group_name`` argument. Its error starts with
    :func:`peers_may_wait`: the peers of a rank with a wrong name are in the collective."""
    try:
        return resolve_process_group(group_name)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(
            f"{peers_may_wait(op, None)} {op}: group_name={group_name!r} names no live process "
            "group on this rank (is the rank a member of it?); pass the group_name of a "
            "ProcessGroup created by torch.distributed, or use the prime_ops fronts, which take "
            "the group itself"
        ) from exc


def resolve_name_call(group_name: str, op: str) -> dist.ProcessGroup:
    """:func:`resolve_name` for a raw op that runs checked mode itself: in checked mode a name
    that resolves to no group joins the default group's fingerprint exchange (as
    :func:`resolve_call` does), so peers that passed that group raise too instead of waiting."""
    try:
        return resolve_name(group_name, op)
    except ValueError as exc:
        if not dist.is_initialized() or not checked_mode(dist.group.WORLD):
            raise

        def rejected(error: ValueError = exc) -> Fingerprint:
            raise error

        agree(op, dist.group.WORLD, rejected)
        raise  # unreachable: agree raised on every rank


def peers_may_wait(op: str, group: dist.ProcessGroup | None) -> str:
    """What an error raised on one rank before communicating says first (``group`` None: a
    group that could not be resolved)."""
    where = "this rank" if group is None else f"rank {group.rank()} of {group.size()}"
    return (
        f"[{op} raised this on {where} before sending anything; the other ranks may be waiting "
        f"in the collective until the group's timeout. Checked mode catches it: set {CHECK_ENV}=1 "
        "on every rank (or call prime_ops.groups.set_checked(True) on every rank) so that every "
        "rank checks the call together and raises the same error]"
    )


@contextmanager
def rank_local(op: str, group: dist.ProcessGroup) -> Iterator[None]:
    """Put :func:`peers_may_wait` before an error raised inside, on groups of 2+ ranks."""
    try:
        yield
    except Exception as exc:
        if group.size() > 1 and exc.args and isinstance(exc.args[0], str):
            exc.args = (f"{peers_may_wait(op, group)} {exc.args[0]}", *exc.args[1:])
        raise


@dataclass(frozen=True)
class Fingerprint:
    """What one rank's call must agree on with its peers'.

    ``shared``: named values every rank must give equally (shapes, dtypes, digests, flags).
    ``send`` / ``recv``: for an all-to-all, rows this rank sends to / expects from each rank; rank
    ``s``'s ``send[r]`` must equal rank ``r``'s ``recv[s]``.
    """

    shared: dict[str, Any]  # the op's name joins it in :func:`agree`
    send: tuple[int, ...] = ()
    recv: tuple[int, ...] = ()


def _digest(shared: dict[str, Any]) -> int:
    raw = hashlib.sha256(repr(sorted(shared.items())).encode()).digest()
    return int.from_bytes(raw[:8], "little", signed=True)


def _mismatch(prints: Sequence[Fingerprint]) -> str | None:
    for field in prints[0].shared:
        problem = _same_on_every_rank(field, [p.shared.get(field) for p in prints])
        if problem is not None:
            return problem
    if not all(p.send for p in prints):
        return None
    for src, sender in enumerate(prints):
        for dst, receiver in enumerate(prints):
            if sender.send[dst] != receiver.recv[src]:
                return (
                    f"rank {src} sends {sender.send[dst]} rows to rank {dst} (its "
                    f"input_splits[{dst}]) but rank {dst} expects {receiver.recv[src]} (its "
                    f"output_splits[{src}])"
                )
    return None


def agree(op: str, group: dist.ProcessGroup, describe: Callable[[], Fingerprint]) -> None:
    """Checked mode: raise the same ValueError on every rank unless every rank's call fits.

    ``describe()`` runs this rank's own checks and returns its :class:`Fingerprint` (to which
    ``op`` is added); whatever it raises, this rank still joins the exchange with its error flag
    set, so its peers raise too instead of waiting in the collective. One all-gather of
    ``2 + 2 * world`` int64 values (on :func:`exchange_device`) carries the flag, a digest of
    ``shared`` and the splits; only when that shows a problem does a second exchange
    (``all_gather_object``) bring every rank's details, so that all ranks raise the same message.
    """
    world = group.size()
    cause: Exception | None = None
    try:
        error, mine = None, describe()
        # The op takes part: ranks that call different collectives with the same shapes differ.
        mine = Fingerprint({"op": op, **mine.shared}, mine.send, mine.recv)
    except Exception as exc:  # noqa: BLE001 -- any error must reach the peers, not strand them
        cause = exc
        error, mine = f"{type(exc).__name__}: {exc}", None
    row = [1, 0, *[0] * 2 * world]
    if mine is not None:
        splits = [*mine.send, *mine.recv] or [0] * 2 * world
        if len(splits) != 2 * world:
            error, mine = f"{op}: expected {world} splits per direction, got {splits}", None
        else:
            row = [0, _digest(mine.shared), *splits]
    device = exchange_device(group)
    table = torch.empty(world * len(row), dtype=torch.int64, device=device)
    all_gather_single(table, torch.tensor(row, device=device), group=group)
    rows = table.view(world, len(row)).tolist()  # the same on every rank: so is the branch
    digests_agree = all(r[1] == rows[0][1] for r in rows)
    splits_fit = all(
        rows[s][2 + d] == rows[d][2 + world + s] for s in range(world) for d in range(world)
    )
    if not any(r[0] for r in rows) and digests_agree and splits_fit:
        return
    details: list[Any] = [None] * world
    dist.all_gather_object(details, (error, mine), group=group)
    suffix = f"Every rank raises this error (checked mode, {CHECK_ENV}); nothing was sent."
    for rank, (message, _) in enumerate(details):
        if message is not None:
            failure = ValueError(
                f"{op}: rank {rank} of the group rejected its call: {message}. {suffix}"
            )
            raise failure from (cause if rank == group.rank() else None)
    problem = _mismatch([fingerprint for _, fingerprint in details]) or "fingerprints differ"
    raise ValueError(f"{op}: the ranks' calls do not fit together: {problem}. {suffix}")


def _same_on_every_rank(what: str, values: Sequence[Any]) -> str | None:
    """None if every rank gave the same value, else the values by rank."""
    if all(value == values[0] for value in values):
        return None
    listed = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
    return f"{what} must be the same on every rank; got {listed}"
