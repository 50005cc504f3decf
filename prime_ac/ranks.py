"""Planning a budget across ranks: the ranks of a group agree on one plan, or all raise.

A peak plan (:mod:`prime_ac.budget`) runs collectives: every rank of ``group`` must run the
same ones, in the same order, with tensors of the same size, or the next one aborts or hangs.
So planning, with any kind of budget, starts with :func:`check`: one all-gather of a fixed-size
row per rank (whether its profile raised, its budget kind, its blocks and operator calls as
counts and hashes, its peak budget and copy bandwidth), after which every rank knows what every
other brought. Ranks that
differ all raise :class:`RanksError`, naming the ranks and the difference; a rank whose
profile raised re-raises its own error (:func:`failures_reported` sends its row) and the
others raise naming it, instead of waiting for it in the next collective.

Past the check the ranks plan on agreed values only: the group's smallest budget and
bandwidth, each call's largest bytes and time (:func:`agree`), each measured peak's largest
(:func:`most`). The planner is deterministic, so every rank makes the same plans, takes the
same calibration branch and so runs the same number of collectives.

``group`` is a ``torch.distributed`` process group (None: every rank; a group of one rank or
no ``torch.distributed``: no collective) or False: this rank plans alone, without any
exchange. Ranks whose blocks differ (pipeline stages) plan per stage with a group per stage
from ``dist.new_group``. A rank of the group that never plans cannot be detected by the
others (it sends nothing): every rank of the group must plan. :func:`resolve` turns the
user's ``group`` into the one the other functions take, where None means no exchange.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prime_ac.planner import BlockProfile, Call, format_bytes

logger = logging.getLogger("prime_ac")

__all__ = ["RanksError", "agree", "check", "failures_reported", "most", "resolve"]

KINDS = ("peak", "fraction", "per-block")
_DESCRIBED = {
    "peak": "a peak in bytes (an int or '24GiB')",
    "fraction": "a fraction of the no-AC memory (a float)",
    "per-block": "bytes per block (a mapping)",
}
# a row: failed, kind, blocks, hash of the block names, calls, hash of the calls, budget,
# bandwidth (bytes/s), host cap (_NONE: not measured, no cap)
_WIDTH = 9
_NONE = 2**62
_FIX = (
    "pass group= (a torch.distributed process group of the ranks that run the same blocks, such "
    "as each pipeline stage's from dist.new_group) so each group plans together, or group=False "
    "to plan on each rank alone"
)


class RanksError(RuntimeError):
    """The ranks planning together cannot agree: their blocks or budget kinds differ, or a
    rank's profile or measured step raised. Raised on every rank of the group (a failing rank
    raises its own error)."""


def resolve(group: Any) -> Any:
    """The process group that plans together, or None where this rank plans alone (``group``
    False or of one rank, or no ``torch.distributed`` process group)."""
    if group is False:
        return None
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    # dist.new_group returns this sentinel, not a group, to the ranks it leaves out
    if initialized and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"group=: rank {dist.get_rank()} is not a member of the group it passed; pass the "
            "group this rank belongs to (such as its pipeline stage's)"
        )
    if group is not None and not (initialized and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"group={group!r}: pass a torch.distributed process group (the ranks that plan "
            "together), None for every rank, or False to plan on this rank alone"
        )
    if not initialized:
        return None
    group = dist.group.WORLD if group is None else group
    return group if dist.get_world_size(group) > 1 else None


def _device(group: Any) -> Any:
    """Where the group's collectives take tensors: the CPU for gloo, else the accelerator."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _gather(group: Any, row: Sequence[int]) -> list[list[int]]:
    """Every group member's ``row`` (one all-gather), in group rank order."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(list(row), dtype=torch.int64, device=_device(group))
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [r.tolist() for r in rows]


def _ranks(group: Any, members: Sequence[int]) -> str:
    import torch.distributed as dist

    ranks = [dist.get_global_rank(group, m) for m in members]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _raise_for_failures(group: Any, rows: list[list[int]], doing: str) -> None:
    failed = [m for m, row in enumerate(rows) if row[0]]
    if failed:
        raise RanksError(
            f"prime_ac: {_ranks(group, failed)} raised while {doing} (the error is in that "
            "rank's output); the ranks planning together stop here instead of waiting"
        )


def _digest(parts: Sequence[str]) -> int:
    """A hash stable across processes (``hash()`` of a str is salted per process)."""
    blob = hashlib.blake2b("\0".join(parts).encode(), digest_size=7).digest()
    return int.from_bytes(blob, "little")


def check(
    group: Any,
    kind: str,
    blocks: Sequence[tuple[str, Sequence[str]]],
    budget: int = 0,
    bandwidth: float | None = None,
    host_cap: int | None = None,
) -> tuple[int, float | None, int | None]:
    """Check that every rank of ``group`` plans the same ``blocks`` (``(name, operators of its
    calls in order)``) with the same ``kind`` of budget, in one all-gather; raise
    :class:`RanksError` on every rank where they differ or a rank failed. Returns the budget,
    bandwidth and host cap the group plans with: the smallest over its ranks (None: none
    measured, no cap; as given without a group)."""
    if group is None:
        return budget, bandwidth, host_cap
    calls = [op for _, ops in blocks for op in ops]
    mine = [
        0,
        KINDS.index(kind),
        len(blocks),
        _digest([name for name, _ in blocks]),
        len(calls),
        _digest([f"{name}:{','.join(ops)}" for name, ops in blocks]),
        min(budget, _NONE - 1),
        _NONE if bandwidth is None else int(bandwidth),
        _NONE if host_cap is None else min(host_cap, _NONE - 1),
    ]
    rows = _gather(group, mine)
    _raise_for_failures(group, rows, "profiling the step to plan")

    def differ(field: slice, what: str, describe: Callable[[tuple, int], str]) -> None:
        seen: dict[tuple, list[int]] = {}
        for m, row in enumerate(rows):
            seen.setdefault(tuple(row[field]), []).append(m)
        if len(seen) > 1:
            told = "; ".join(
                f"{_ranks(group, ms)}: {describe(key, i)}"
                for i, (key, ms) in enumerate(seen.items())
            )
            names = ", ".join(name for name, _ in blocks[:4]) + (", ..." if len(blocks) > 4 else "")
            raise RanksError(
                f"prime_ac: the ranks planning together must {what}, and they differ ({told}; "
                f"this rank's blocks: {names or 'none'}). Every rank of the group plans one step "
                f"together; {_FIX}"
            )

    differ(slice(1, 2), "pass the same kind of budget", lambda k, _: _DESCRIBED[KINDS[k[0]]])
    differ(slice(2, 3), "checkpoint as many blocks", lambda k, _: f"{k[0]} blocks")
    differ(slice(3, 4), "checkpoint blocks of the same names", lambda _, i: f"names #{i + 1}")
    differ(
        slice(4, 6),
        "run the same operator calls in each block (control flow that depends on the data "
        "changes them)",
        lambda k, i: f"{k[0]} calls (sequence #{i + 1})",
    )
    least, link, cap = (min(row[k] for row in rows) for k in (6, 7, 8))
    agreed = (("budget", 6, budget, least), ("host_cap", 8, host_cap, cap))
    for argument, k, given, smallest in agreed:
        if given is not None and smallest < given:
            logger.warning(
                "prime_ac: %s=%s on this rank; the ranks planning together plan with their "
                "smallest, %s (%s), so they run one plan (pass group= to plan apart)",
                argument,
                format_bytes(given),
                format_bytes(smallest),
                _ranks(group, [m for m, row in enumerate(rows) if row[k] == smallest]),
            )
    return least, None if link == _NONE else float(link), None if cap == _NONE else cap


def most(group: Any, value: int) -> int:
    """``value``'s largest over the ranks of ``group`` (one all-gather), raising
    :class:`RanksError` where a rank failed (:func:`failures_reported`)."""
    if group is None:
        return value
    rows = _gather(group, [0, value])
    _raise_for_failures(group, rows, "measuring a plan's peak")
    return max(row[1] for row in rows)


@contextlib.contextmanager
def failures_reported(group: Any, then: Callable = check) -> Iterator[None]:
    """Where the body raises on this rank, send the group a failed row of the exchange the
    others are in (``then``: :func:`check` or :func:`most`) and re-raise: the others raise
    :class:`RanksError` naming this rank instead of waiting for it."""
    try:
        yield
    except Exception:
        if group is not None:
            width = _WIDTH if then is check else 2
            _gather(group, [1] + [0] * (width - 1))
        raise


def agree(blocks: list[BlockProfile], group: Any = None) -> list[BlockProfile]:
    """The same profile on every rank of ``group`` (checked alike by :func:`check`): each call's
    bytes and seconds, and each block's measured bytes (input, saved, extras: every field but
    its name and calls), become their largest over the ranks (one all-reduce), so every rank
    plans alike. Without a group, as is."""
    if group is None:
        return blocks
    import torch
    import torch.distributed as dist

    measured = [f.name for f in dataclasses.fields(BlockProfile) if f.name not in ("name", "calls")]
    values = []
    for b in blocks:
        values += [float(c.bytes) for c in b.calls] + [c.seconds for c in b.calls]
        # None (not measured) as -1: the largest is -1 only where no rank measured it
        values += [-1.0 if getattr(b, f) is None else float(getattr(b, f)) for f in measured]
    tensor = torch.tensor(values, dtype=torch.float64, device=_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    largest = iter(tensor.cpu().tolist())
    agreed = []
    for b in blocks:
        sizes = [int(next(largest)) for _ in b.calls]
        times = [next(largest) for _ in b.calls]
        calls = [
            Call(c.op, c.index, size, time, c.kind)
            for c, size, time in zip(b.calls, sizes, times, strict=True)
        ]
        fields = {f: next(largest) for f in measured}
        fields = {f: None if v < 0 else int(v) for f, v in fields.items()}
        agreed.append(dataclasses.replace(b, calls=tuple(calls), **fields))
    return agreed
