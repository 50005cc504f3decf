"""Process groups for the communicating ops, and the checked mode that keeps bad calls from hanging.

A collective whose ranks disagree (split sizes, shapes, dtypes, the packed layout of a ring) does
not fail cleanly: gloo aborts the process or returns uninitialised rows, NCCL hangs, and an
error raised on one rank before communicating leaves its peers waiting in the collective. So:

- Default mode: every check that needs no communication runs on each rank before anything is
  sent, and an error raised there says that the other ranks may be waiting (and how to turn on
  checked mode).
- Checked mode (``checked=True`` on a front, or ``PRIME_OPS_CHECK_COLLECTIVES=1``): the front
  first gathers a small fingerprint of every rank's call (the rank's own validation result,
  splits, and a digest of shapes, dtypes, ``cu_seqlens`` and flags) with one small all-gather,
  and every rank raises the same ``ValueError`` if any rank's call is invalid or the calls do
  not fit together, before the real collective starts. It costs that collective and a host sync
  per call (measured in ``benchmarks/collectives_overhead.py``); it runs in eager mode and is
  skipped while compiling.
"""

from __future__ import annotations

import hashlib
import os
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
    "peers_may_wait",
    "rank_local",
    "resolve",
    "resolve_name",
]

CHECK_ENV = "PRIME_OPS_CHECK_COLLECTIVES"
_OFF = ("", "0", "false", "no", "off")


def checked_mode(checked: bool | None) -> bool:
    """``checked`` if given, else whether ``PRIME_OPS_CHECK_COLLECTIVES`` is set (not 0/false);
    always False while compiling (the exchange reads its result on the host)."""
    if torch.compiler.is_compiling():
        return False
    if checked is not None:
        return bool(checked)
    return os.environ.get(CHECK_ENV, "").strip().lower() not in _OFF


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


def resolve_name(group_name: str, op: str) -> dist.ProcessGroup:
    """The live group behind an op's ``group_name`` argument."""
    try:
        return resolve_process_group(group_name)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"{op}: group_name={group_name!r} names no live process group on this rank (is the "
            "rank a member of it?); pass the group_name of a ProcessGroup created by "
            "torch.distributed, or use the prime_ops fronts, which take the group itself"
        ) from exc


def peers_may_wait(op: str, group: dist.ProcessGroup) -> str:
    return (
        f"[{op} raised this on rank {group.rank()} of {group.size()} before sending anything; "
        "the other ranks may be waiting in the collective until the group's timeout. Pass "
        f"checked=True or set {CHECK_ENV}=1 so that every rank checks the call together and "
        "raises the same error]"
    )


@contextmanager
def rank_local(op: str, group: dist.ProcessGroup) -> Iterator[None]:
    """Append :func:`peers_may_wait` to a ValueError raised inside, on groups of 2+ ranks."""
    try:
        yield
    except ValueError as exc:
        if group.size() > 1 and exc.args:
            exc.args = (f"{exc.args[0]} {peers_may_wait(op, group)}", *exc.args[1:])
        raise


@dataclass(frozen=True)
class Fingerprint:
    """What one rank's call must agree on with its peers'.

    ``shared``: named values every rank must give equally (shapes, dtypes, digests, flags).
    ``send`` / ``recv``: for an all-to-all, rows this rank sends to / expects from each rank; rank
    ``s``'s ``send[r]`` must equal rank ``r``'s ``recv[s]``.
    """

    shared: dict[str, Any]
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


def agree(
    op: str,
    group: dist.ProcessGroup,
    describe: Callable[[], Fingerprint],
    device: torch.device,
) -> None:
    """Checked mode: raise the same ValueError on every rank unless every rank's call fits.

    ``describe()`` runs this rank's own checks (raising ValueError) and returns its
    :class:`Fingerprint`. One all-gather of ``2 + 2 * world`` int64 values on ``device`` (the
    collective's own device, as NCCL needs) carries an error flag, a digest of ``shared`` and the
    splits; only when that shows a problem does a second exchange (``all_gather_object``) bring
    every rank's details, so that all ranks raise the same message.
    """
    world = group.size()
    try:
        error, mine = None, describe()
    except ValueError as exc:
        error, mine = str(exc), None
    row = [1, 0, *[0] * 2 * world]
    if mine is not None:
        splits = [*mine.send, *mine.recv] or [0] * 2 * world
        row = [0, _digest(mine.shared), *splits]
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
    suffix = f"Every rank raises this error ({CHECK_ENV} / checked=True); nothing was sent."
    for rank, (message, _) in enumerate(details):
        if message is not None:
            raise ValueError(
                f"{op}: rank {rank} of the group rejected its call: {message}. {suffix}"
            )
    problem = _mismatch([fingerprint for _, fingerprint in details]) or "fingerprints differ"
    raise ValueError(f"{op}: the ranks' calls do not fit together: {problem}. {suffix}")


def _same_on_every_rank(what: str, values: Sequence[Any]) -> str | None:
    """None if every rank gave the same value, else the values by rank."""
    if all(value == values[0] for value in values):
        return None
    listed = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
    return f"{what} must be the same on every rank; got {listed}"
