"""Process groups for the communicating ops, and the checked mode that keeps bad calls from hanging.

A collective whose ranks disagree (split sizes, shapes, dtypes, the packed layout of a ring) does
not fail cleanly: gloo aborts the process or returns uninitialised rows, NCCL hangs, and an
error raised on one rank before communicating leaves its peers waiting in the collective. So:

- Default mode: every check that needs no communication runs on each rank before anything is
  sent, and an error raised there says that the other ranks may be waiting (and how to turn on
  checked mode).
- Checked mode (``checked=True`` on a front, or ``PRIME_OPS_CHECK_COLLECTIVES=1``): the front
  first gathers a small fingerprint of every rank's call (the rank's own validation result,
  splits, shapes, dtypes, a digest of ``cu_seqlens``, flags) with one ``all_gather_object``,
  and every rank raises the same ``ValueError`` if any rank's call is invalid or the calls do
  not fit together, before the real collective starts. It costs one small collective and a host
  sync per call (measured in ``benchmarks/collectives_overhead.py``); it runs in eager mode and
  is skipped while compiling.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from prime_ops._compat import resolve_process_group

__all__ = [
    "CHECK_ENV",
    "agree",
    "checked_mode",
    "peers_may_wait",
    "rank_local",
    "resolve",
    "resolve_name",
    "same_on_every_rank",
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


def agree(
    op: str,
    group: dist.ProcessGroup,
    describe: Callable[[], Any],
    compare: Callable[[Sequence[Any]], str | None],
) -> None:
    """Checked mode: raise the same ValueError on every rank unless every call fits.

    ``describe()`` runs this rank's own checks (raising ValueError) and returns its fingerprint,
    a small picklable value; ``compare(fingerprints)`` gets every rank's, in group rank order,
    and returns what does not fit, or None. Runs one ``all_gather_object`` on ``group``.
    """
    try:
        error, fingerprint = None, describe()
    except ValueError as exc:
        error, fingerprint = str(exc), None
    table: list[Any] = [None] * group.size()
    dist.all_gather_object(table, (error, fingerprint), group=group)
    suffix = f"Every rank raises this error ({CHECK_ENV} / checked=True); nothing was sent."
    for rank, (error, _) in enumerate(table):
        if error is not None:
            raise ValueError(f"{op}: rank {rank} of the group rejected its call: {error}. {suffix}")
    problem = compare([fingerprint for _, fingerprint in table])
    if problem is not None:
        raise ValueError(f"{op}: the ranks' calls do not fit together: {problem}. {suffix}")


def same_on_every_rank(what: str, values: Sequence[Any]) -> str | None:
    """A ``compare`` helper: None if every rank gave the same value, else the differences."""
    if all(value == values[0] for value in values):
        return None
    listed = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
    return f"{what} must be the same on every rank; got {listed}"
