"""Keep, offload or replay each operator call under a peak-memory budget.

A budget fraction (:mod:`prime_ac.budget`) bounds saved bytes; what a step runs out of is its
peak. This planner takes the profiled step as :class:`Call` records per :class:`BlockProfile`
and chooses per call:

- ``keep``: held on the device from its forward to its block's backward;
- ``offload``: copied to host memory on a side stream after the call, dropped from the device
  once the copy completes (at the latest at the end of the next block's forward, where the
  runtime waits for it), brought back one block ahead of its block's backward;
- ``replay``: run again in the recompute.

:func:`simulate` walks the step's program points (every call of every block's forward, every
block's backward) and returns the device bytes held at each, the host bytes, and the time the
plan costs (replayed compute plus copy time no compute hides). The held bytes are bounded the
same way whatever the copy bandwidth turns out to be, so a plan made on a wrong bandwidth still
meets its budget; the bandwidth moves only the time.

:func:`plan` is a greedy over a fixed order of upgrades (replay -> offload, then replay ->
keep, then offload -> keep; each pass by replay time saved per byte): an upgrade is taken when
the step still fits the budget and the host cap and gets faster (offload -> keep: no slower). Since the order does not depend on the budget and
no upgrade lowers any point's bytes, a smaller budget never gives a larger peak. Mandatory,
random and collective calls are kept or offloaded, never replayed; views and parameters are
never offloaded.

The helpers every report shares sit here too, at the bottom of prime_ac's layers:
:func:`parse_bytes`, :func:`format_bytes`, and :func:`grouped` / :func:`group_names`, which
merge identical neighbouring blocks into one row ("x4 layers.0-3").
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_BANDWIDTH",
    "BlockProfile",
    "Call",
    "Plan",
    "Simulation",
    "exhaustive",
    "plan",
    "simulate",
]

# Host <-> device bytes per second assumed where nothing was measured: 12 GB/s, about what a
# PCIe 4.0 x16 link sustains for pinned copies (on CUDA prime_ac.measure.copy_bandwidth times it).
DEFAULT_BANDWIDTH = 12e9

KEEP, OFFLOAD, REPLAY = "keep", "offload", "replay"
_KINDS = ("plain", "mandatory", "view", "param")


def _check_count(argument: str, value: object, what: str = "bytes") -> None:
    """Raise unless ``value`` is an int >= 0, naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        error = TypeError if not isinstance(value, (int, float)) else ValueError
        raise error(f"{argument}={value!r} must be an int >= 0 ({what})")


def _check_amount(argument: str, value: object, what: str = "seconds", positive: bool = False):
    """Raise unless ``value`` is a finite real number >= 0 (> 0 with ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{argument}={value!r} must be a number ({what})")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{argument}={value!r} must be a finite number {bound} ({what})")


@dataclass(frozen=True)
class Call:
    """One operator call of a block's forward.

    ``seconds`` is its compute time (measured where the profile ran on a device, else its
    FLOPs over a stated rate); ``kind`` is ``"plain"``, ``"mandatory"`` (also random and
    collective calls: never replayed), ``"view"`` or ``"param"`` (never offloaded).
    """

    op: str
    index: int
    bytes: int
    seconds: float
    kind: str = "plain"

    def __post_init__(self) -> None:
        if not isinstance(self.op, str):
            raise TypeError(f"Call op={self.op!r} must be the operator's name, e.g. 'aten::mm'")
        _check_count("Call index", self.index)
        _check_count("Call bytes", self.bytes)
        _check_amount("Call seconds", self.seconds)
        if self.kind not in _KINDS:
            raise ValueError(f"Call kind={self.kind!r} must be one of {list(_KINDS)}")

    def choices(self) -> tuple[str, ...]:
        if self.kind == "mandatory":
            return (OFFLOAD, KEEP)
        if self.kind in ("view", "param"):
            return (REPLAY, KEEP)
        return (REPLAY, OFFLOAD, KEEP)


@dataclass(frozen=True)
class BlockProfile:
    """One checkpointed block: its calls in forward order, its input's bytes (always held) and,
    where the profiled step measured it, ``saved_bytes``: what autograd saves for the block
    without checkpointing, which its recompute rebuilds (the kept results handed back among it).

    ``forward_extra`` and ``backward_extra`` are bytes its forward's and its backward's points
    hold beyond what :func:`simulate` counts from its calls (what the step holds outside the
    blocks, saved RNG states, temporaries, gradients in flight), and ``after_bytes`` what the
    step holds after its forward outside any block until its backward (the logits and the loss
    after the last block): :func:`prime_ac.budget.profiles` measures them on the profiled step.
    """

    name: str
    calls: tuple[Call, ...]
    input_bytes: int = 0
    saved_bytes: int | None = None
    forward_extra: int = 0
    backward_extra: int = 0
    after_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"BlockProfile name={self.name!r} must be the block's name (a str)")
        if isinstance(self.calls, (str, bytes)) or not all(
            isinstance(c, Call) for c in self.calls
        ):
            raise TypeError(
                f"BlockProfile calls={self.calls!r:.120} must be prime_ac.planner.Call records "
                "in forward order"
            )
        object.__setattr__(self, "calls", tuple(self.calls))
        _check_count("BlockProfile input_bytes", self.input_bytes)
        for extra in ("forward_extra", "backward_extra", "after_bytes"):
            _check_count(f"BlockProfile {extra}", getattr(self, extra))
        if self.saved_bytes is not None:
            _check_count("BlockProfile saved_bytes", self.saved_bytes)

    @property
    def forward_seconds(self) -> float:
        return sum(c.seconds for c in self.calls)

    def structure(self) -> tuple:
        """All the planner reads of the block but its name, times and measured extras: blocks
        alike in it are identical to the planner, and :func:`plan` gives them one plan."""
        return (
            tuple((c.op, c.index, c.bytes, c.kind) for c in self.calls),
            self.input_bytes,
            self.saved_bytes,
        )

    def working_bytes(self, held: int = 0) -> int:
        """What its backward holds once the recompute ran, ``held`` being the bytes of its kept
        and offloaded results: what autograd saves for it, or all its results unmeasured."""
        if self.saved_bytes is None:
            return sum(c.bytes for c in self.calls if c.kind != "param")
        return max(self.saved_bytes, held)


@dataclass
class Simulation:
    """What a plan does to one step: ``points`` are ``(label, device bytes)`` in program order."""

    points: list[tuple[str, int]]
    host_bytes: int
    replay_seconds: float
    exposed_copy_seconds: float
    # per block: seconds its copies (out in forward, back before backward) were not hidden
    exposed_by_block: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return max((b for _, b in self.points), default=0)

    @property
    def cost(self) -> float:
        """Seconds the plan adds to a step without checkpointing."""
        return self.replay_seconds + self.exposed_copy_seconds


def simulate(
    blocks: Sequence[BlockProfile],
    decisions: Sequence[Sequence[str]],
    bandwidth: float = DEFAULT_BANDWIDTH,
) -> Simulation:
    """Device bytes at every program point of one step under ``decisions[block][call]``.

    Forward of block ``i``, after call ``j``: the inputs of blocks ``0..i``, what blocks before
    it keep, block ``i-1``'s offloaded results (their copies may still run; the runtime waits
    for them at the end of block ``i``), block ``i``'s kept and offloaded results so far, and
    call ``j``'s result. Backward of block ``i``: the inputs of blocks ``0..i``, what blocks
    before it keep, block ``i-1``'s offloaded results (prefetched during it) and all of block
    ``i``'s working set (:meth:`BlockProfile.working_bytes`). Each point adds its block's
    measured ``forward_extra`` or ``backward_extra``; a block with ``after_bytes`` has one more
    point after its forward: what the forward left (inputs, kept and offloaded results) plus
    those bytes.

    Copies run in order on one stream at ``bandwidth`` bytes/s; a block's outbound copies hide
    behind the next block's forward, its inbound copies behind the backward of the block after
    it (taken as twice its forward plus its replays); what does not fit is exposed.
    """
    n = len(blocks)
    kept = [0] * n
    out = [0] * n
    for i, (block, chosen) in enumerate(zip(blocks, decisions, strict=True)):
        for call, d in zip(block.calls, chosen, strict=True):
            if d == KEEP:
                kept[i] += call.bytes
            elif d == OFFLOAD:
                out[i] += call.bytes
    inputs = [b.input_bytes for b in blocks]
    points: list[tuple[str, int]] = []
    held_before = 0  # inputs of earlier blocks and what they keep
    for i, (block, chosen) in enumerate(zip(blocks, decisions, strict=True)):
        base = held_before + inputs[i] + (out[i - 1] if i else 0)
        running = 0
        for call, d in zip(block.calls, chosen, strict=True):
            here = base + running + call.bytes + block.forward_extra
            if d != REPLAY:
                running += call.bytes
            points.append((f"{block.name} forward {call.op}#{call.index}", here))
        held_before += inputs[i] + kept[i]
        if block.after_bytes:
            points.append((f"after {block.name}", held_before + out[i] + block.after_bytes))
    for i in reversed(range(n)):
        held_before -= inputs[i] + kept[i]
        working = blocks[i].working_bytes(kept[i] + out[i])
        here = held_before + inputs[i] + working + (out[i - 1] if i else 0)
        points.append((f"{blocks[i].name} backward", here + blocks[i].backward_extra))
    replay = sum(
        c.seconds
        for b, chosen in zip(blocks, decisions, strict=True)
        for c, d in zip(b.calls, chosen, strict=True)
        if d == REPLAY
    )
    exposed: dict[str, float] = {}
    for i, block in enumerate(blocks):
        if not out[i]:
            continue
        copy = out[i] / bandwidth
        # out: hidden behind the rest of this forward's calls after each copy starts, roughly
        # half of it, and the next block's forward
        window_out = block.forward_seconds / 2 + (blocks[i + 1].forward_seconds if i + 1 < n else 0)
        after = blocks[i + 1] if i + 1 < n else None
        window_in = (
            2 * after.forward_seconds
            + sum(
                c.seconds for c, d in zip(after.calls, decisions[i + 1], strict=True) if d == REPLAY
            )
            if after is not None
            else 0.0
        )
        exposed[block.name] = max(0.0, copy - window_out) + max(0.0, copy - window_in)
    return Simulation(points, sum(out), replay, sum(exposed.values()), exposed)


@dataclass
class Plan:
    """The planner's choice: ``decisions[block name][call index in the block]``."""

    blocks: list[BlockProfile]
    decisions: list[list[str]]
    budget: int
    host_cap: int
    bandwidth: float  # what copy times were planned at (the estimate less its error margin)
    simulation: Simulation
    fits: bool  # False: even the least memory the rules allow exceeds the budget
    measured: int | None = None  # the peak a step with this plan held (prime_ac.budget)
    # calibration (prime_ac.budget): the first plan, whose measured peak was over the budget or
    # well under its prediction, and the budget this one was then planned for instead
    tightened_from: Plan | None = None
    planned_for: int | None = None
    # the simulator's nodes the planning evaluated (prefix-tree updates): its cost, counted
    evaluations: int = 0

    def chosen(self, block: str, decision: str) -> list[tuple[str, int]]:
        """``(op, index)`` of the calls of ``block`` with this decision."""
        i = next(k for k, b in enumerate(self.blocks) if b.name == block)
        return [
            (c.op, c.index)
            for c, d in zip(self.blocks[i].calls, self.decisions[i], strict=True)
            if d == decision
        ]

    def table(self) -> str:
        """Per block and call: the decision, the bytes, and the block's exposed copy time."""
        sim = self.simulation
        rows = [f"{'block':<20} {'operator':<34} {'decision':<8} {'bytes':>14}"]
        same = [  # neighbouring blocks of equal calls, decisions and copy time: one group
            (
                block.name,
                (
                    [(c.op, c.index, c.bytes) for c in block.calls],
                    chosen,
                    sim.exposed_by_block.get(block.name, 0.0),
                ),
                (block, chosen),
            )
            for block, chosen in zip(self.blocks, self.decisions, strict=True)
        ]
        for names, (block, chosen) in grouped(same):
            name = group_names(names)  # "x4 layers.0-3"
            for call, d in zip(block.calls, chosen, strict=True):
                rows.append(
                    f"{name:<20} {call.op + '#' + str(call.index):<34} {d:<8} {call.bytes:>14,}"
                )
            rows.append(
                f"{name:<20} {'(exposed copy time)':<34} {'':<8} "
                f"{sim.exposed_by_block.get(block.name, 0.0) * 1e3:>11.3f} ms"
                + (" each" if len(names) > 1 else "")
            )
        rows.append(
            f"predicted peak {format_bytes(sim.peak)} (budget {format_bytes(self.budget)}), host "
            f"{format_bytes(sim.host_bytes)}, replay {sim.replay_seconds * 1e3:.2f} ms, exposed "
            f"copies {sim.exposed_copy_seconds * 1e3:.2f} ms"
            + ("" if self.fits else "; the budget cannot be met: this is the least memory")
        )
        first = self.tightened_from
        if first is not None:
            how = (
                "over the budget"
                if (first.measured or 0) > first.budget
                else "under its prediction"
            )
            rows.append(
                f"first plan measured {format_bytes(first.measured or 0)} ({how}): planned again "
                f"for {format_bytes(self.planned_for or self.budget)}"
            )
        if self.measured is not None:
            rows.append(f"measured peak {format_bytes(self.measured)}")
        return "\n".join(rows)


def _least(blocks: Sequence[BlockProfile], host_cap: int) -> list[list[str]]:
    """The least device memory the rules allow: replay what may replay, offload mandatory calls
    while the host cap lasts, keep the rest."""
    host = 0
    decisions = []
    for block in blocks:
        chosen = []
        for call in block.calls:
            if call.kind != "mandatory":
                chosen.append(REPLAY)
            elif call.bytes and host + call.bytes <= host_cap:
                chosen.append(OFFLOAD)
                host += call.bytes
            else:
                chosen.append(KEEP)
        decisions.append(chosen)
    return decisions


def plan(
    blocks: Sequence[BlockProfile],
    budget: int,
    *,
    bandwidth: float = DEFAULT_BANDWIDTH,
    host_cap: int | None = None,
    bandwidth_error: float = 0.3,
) -> Plan:
    """Choose keep / offload / replay per call so the step's peak stays within ``budget`` bytes.

    ``host_cap`` bounds the host bytes (default: unbounded). Copy times are planned at
    ``bandwidth * (1 - bandwidth_error)``: a bandwidth estimate up to 30% too high still gives
    a plan whose copies cost no more than predicted (the peak does not depend on it).
    Example::

        p = plan([BlockProfile("layers.0", (Call("aten::mm", 0, 2**20, 1e-4),))], 2**21)
        p.decisions  # [['keep']]
    """
    if isinstance(blocks, (str, bytes)) or not all(isinstance(b, BlockProfile) for b in blocks):
        raise TypeError(
            f"blocks={blocks!r:.120} must be prime_ac.planner.BlockProfile records, one per block "
            "in forward order (prime_ac.budget.profiles makes them from an audit)"
        )
    _check_count("budget", budget, "bytes (prime_ac.planner.parse_bytes reads '24GiB')")
    _check_amount("bandwidth", bandwidth, "bytes per second", positive=True)
    if host_cap is not None:
        _check_count("host_cap", host_cap, "bytes, or None for no cap")
    _check_amount("bandwidth_error", bandwidth_error, "a share")
    if not 0 <= bandwidth_error < 1:
        raise ValueError(f"bandwidth_error={bandwidth_error!r} must lie in [0, 1)")
    blocks = list(blocks)
    bandwidth *= 1 - bandwidth_error
    cap = math.inf if host_cap is None else host_cap
    least = _least(blocks, int(min(cap, 2**62)))
    # identical blocks that start alike form one class and take every upgrade together; the
    # last block apart (no forward follows it to hide its copies)
    classes: dict[tuple, list[int]] = {}
    for i, block in enumerate(blocks):
        key = (block.structure(), tuple(least[i]), i == len(blocks) - 1)
        classes.setdefault(key, []).append(i)
    step = _Step(blocks, least, list(classes.values()), bandwidth)
    fits = step.peak <= budget
    calls = [blocks[members[0]].calls for members in step.classes]
    order = sorted(
        ((c, j) for c in range(len(calls)) for j in range(len(calls[c]))),
        key=lambda cj: -step.seconds(*cj) / max(calls[cj[0]][cj[1]].bytes, 1),
    )
    # no upgrade lowers any point's bytes: a step over the budget at the least stays over it
    for old, new in ((REPLAY, OFFLOAD), (REPLAY, KEEP), (OFFLOAD, KEEP)) if fits else ():
        for c, j in order:
            if step.decided[c][j] == old and new in calls[c][j].choices():
                step.upgrade(c, j, new, budget, cap)
    decisions = [list(step.decided[step.of[i]]) for i in range(len(blocks))]
    sim = simulate(blocks, decisions, bandwidth)
    chosen = Plan(blocks, decisions, budget, host_cap or 0, bandwidth, sim, fits)
    chosen.evaluations = step.work()
    return chosen


class _Prefix:
    """The most, over positions ``p``, of ``value[p]`` plus the ``weight``s before ``p``, kept
    under point updates in O(log n): a tree of (weight sum, most) per range. A step's peak is
    this over its blocks (weights: what each keeps for later), and a block's forward is this
    over its calls (weights: what each leaves held), so an upgrade is checked by updating a
    few leaves instead of simulating the step again. ``work`` counts the nodes evaluated."""

    def __init__(self, weights: Sequence[int], values: Sequence[float]):
        self.size = 1 << max(len(values) - 1, 0).bit_length()
        self.sum = [0] * (2 * self.size)
        self.most = [-math.inf] * (2 * self.size)
        self.sum[self.size : self.size + len(weights)] = weights
        self.most[self.size : self.size + len(values)] = values
        for k in range(self.size - 1, 0, -1):
            self.sum[k] = self.sum[2 * k] + self.sum[2 * k + 1]
            self.most[k] = max(self.most[2 * k], self.sum[2 * k] + self.most[2 * k + 1])
        self.work = self.size

    @property
    def top(self) -> float:
        return self.most[1]

    def set(self, p: int, weight: int, value: float) -> None:
        sums, most = self.sum, self.most
        k = self.size + p
        sums[k], most[k] = weight, value
        work = 0
        while k > 1:
            k >>= 1
            left = k << 1
            total = sums[left] + sums[left + 1]
            top = sums[left] + most[left + 1]
            if most[left] > top:
                top = most[left]
            work += 1
            if total == sums[k] and top == most[k]:
                break  # the ranges above are unchanged
            sums[k], most[k] = total, top
        self.work += work


class _Step:
    """One step under decisions that only ever upgrade, for :func:`plan`: what :func:`simulate`
    computes, kept incrementally. Block ``i`` contributes ``term(i)`` (its points less what
    blocks before it keep) on top of the prefix sum of the blocks' inputs and kept bytes; the
    members of a class share their decisions and so one forward tree."""

    def __init__(
        self,
        blocks: list[BlockProfile],
        least: list[list[str]],
        classes: list[list[int]],
        bandwidth: float,
    ):
        self.blocks, self.classes, self.bandwidth = blocks, classes, bandwidth
        self.of = [0] * len(blocks)
        for c, members in enumerate(classes):
            for i in members:
                self.of[i] = c
        self.decided = [list(least[members[0]]) for members in classes]
        self.forwards = []
        for members, chosen in zip(classes, self.decided, strict=True):
            calls = blocks[members[0]].calls
            left = [x.bytes if d != REPLAY else 0 for x, d in zip(calls, chosen, strict=True)]
            self.forwards.append(_Prefix(left, [x.bytes for x in calls]))
        self.kept, self.out, self.replay = [], [], []
        for block, chosen in zip(blocks, least, strict=True):
            pairs = list(zip(block.calls, chosen, strict=True))
            self.kept.append(sum(x.bytes for x, d in pairs if d == KEEP))
            self.out.append(sum(x.bytes for x, d in pairs if d == OFFLOAD))
            self.replay.append(sum(x.seconds for x, d in pairs if d == REPLAY))
        self.host = sum(self.out)
        self.forward_seconds = [b.forward_seconds for b in blocks]
        self.tree = _Prefix(
            [b.input_bytes + k for b, k in zip(blocks, self.kept, strict=True)],
            [self.term(i) for i in range(len(blocks))],
        )

    @property
    def peak(self) -> float:
        return self.tree.top if self.blocks else 0

    def work(self) -> int:
        return self.tree.work + sum(f.work for f in self.forwards)

    def seconds(self, c: int, j: int) -> float:
        """Replay time the call saves per member of its class."""
        members = self.classes[c]
        return sum(self.blocks[i].calls[j].seconds for i in members) / len(members)

    def term(self, i: int) -> float:
        """Block ``i``'s highest point less what the blocks before it hold for later."""
        block = self.blocks[i]
        before = self.out[i - 1] if i else 0
        forward = self.forwards[self.of[i]].top + block.forward_extra
        backward = block.working_bytes(self.kept[i] + self.out[i]) + block.backward_extra
        here = block.input_bytes + before + max(forward, backward)
        if block.after_bytes:
            after = block.input_bytes + self.kept[i] + self.out[i] + block.after_bytes
            here = max(here, after)
        return here

    def exposed(self, i: int) -> float:
        """Block ``i``'s copy time that no compute hides (as :func:`simulate` has it)."""
        if not self.out[i]:
            return 0.0
        copy = self.out[i] / self.bandwidth
        last = i + 1 == len(self.blocks)
        window_out = self.forward_seconds[i] / 2 + (0 if last else self.forward_seconds[i + 1])
        window_in = 0.0 if last else 2 * self.forward_seconds[i + 1] + self.replay[i + 1]
        return max(0.0, copy - window_out) + max(0.0, copy - window_in)

    def upgrade(self, c: int, j: int, new: str, budget: int, cap: float) -> bool:
        """Call ``j`` of class ``c`` becomes ``new`` in every member if the step still fits the
        budget and the host cap and gets faster (from offload: no slower); else nothing
        changes."""
        members = self.classes[c]
        old = self.decided[c][j]
        size = self.blocks[members[0]].calls[j].bytes
        offloaded = size * ((new == OFFLOAD) - (old == OFFLOAD))
        if self.host + offloaded * len(members) > cap:
            return False
        n = len(self.blocks)
        # whose copy times change: a block's own (its offloads), the one before (its copies
        # back hide behind this one's replays); whose points: its own and the next (offloads)
        timed = {i for i in members if offloaded} | {i - 1 for i in members if old == REPLAY and i}
        near = sorted({*members, *(i + 1 for i in members if offloaded and i + 1 < n)})
        saved = {i: (self.kept[i], self.out[i], self.replay[i]) for i in members}
        exposed = sum(self.exposed(k) for k in timed)
        for i in members:
            self.out[i] += offloaded
            if old == REPLAY:
                self.replay[i] -= self.blocks[i].calls[j].seconds
        after = sum(self.exposed(k) for k in timed)
        replayed = sum(self.blocks[i].calls[j].seconds for i in members) if old == REPLAY else 0.0
        # faster, or no slower where it frees the host (from offload) or saves replay that a
        # copy exposed elsewhere costs again (a tie: a later pass may end that copy); a change
        # within rounding is none
        change, rounding = after - exposed - replayed, 1e-12 * (after + exposed + replayed)
        if not (change < -rounding or (change <= rounding and (old == OFFLOAD or replayed > 0))):
            self._restore(saved)
            return False
        for i in members:
            self.kept[i] += size * ((new == KEEP) - (old == KEEP))
        forward = self.forwards[c]
        if old == REPLAY:
            forward.set(j, size, size)
        self._refresh(near)
        if self.tree.top > budget:
            if old == REPLAY:
                forward.set(j, 0, size)
            self._restore(saved)
            self._refresh(near)
            return False
        self.decided[c][j] = new
        self.host += offloaded * len(members)
        return True

    def _restore(self, saved: dict[int, tuple[int, int, float]]) -> None:
        for i, (kept, out, replay) in saved.items():
            self.kept[i], self.out[i], self.replay[i] = kept, out, replay

    def _refresh(self, near: list[int]) -> None:
        for i in near:
            self.tree.set(i, self.blocks[i].input_bytes + self.kept[i], self.term(i))


def exhaustive(
    blocks: Sequence[BlockProfile],
    budget: int,
    *,
    bandwidth: float = DEFAULT_BANDWIDTH,
    host_cap: int | None = None,
) -> Simulation | None:
    """The cheapest plan within the budget by trying every choice (small cases: tests)."""
    import itertools

    flat = [(i, c) for i, b in enumerate(blocks) for c in b.calls]
    best = None
    cap = math.inf if host_cap is None else host_cap
    for combo in itertools.product(*(c.choices() for _, c in flat)):
        decisions: list[list[str]] = [[] for _ in blocks]
        for (i, _), d in zip(flat, combo, strict=True):
            decisions[i].append(d)
        sim = simulate(blocks, decisions, bandwidth)
        if sim.peak <= budget and sim.host_bytes <= cap and (best is None or sim.cost < best.cost):
            best = sim
    return best


_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_AMOUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: object, argument: str = "budget") -> int:
    """Bytes from an int or a string with a unit such as ``"24GiB"``, ``"512MiB"``, ``"1.5GB"``,
    ``"4096B"`` (unit names in any case: ``"64kib"`` is ``"64KiB"``).

    A string without a unit (``"0.3"``, ``"4096"``) is refused: a budget's number alone reads
    as a fraction to some and as bytes to others. Raises ValueError naming ``argument`` and the
    accepted forms.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _AMOUNT.match(value) if isinstance(value, str) else None
    if match is not None and not match.group(2):
        number = match.group(1)
        if argument != "budget":
            forms = f"bytes with a unit ('{number}B', '24GiB')"
        elif float(number) <= 1:
            forms = (
                f"a float fraction of the no-AC activation memory ({argument}={float(number)!r}) "
                "or bytes with a unit ('24GiB', '512MiB')"
            )
        else:
            forms = (
                f"bytes with a unit ('{number}B', '24GiB') or a float fraction in [0, 1] of the "
                "no-AC activation memory"
            )
        raise ValueError(f"{argument}={value!r} is a number with no unit: write {forms}")
    if match is not None and match.group(2).upper() in _UNITS:
        amount = float(match.group(1)) * _UNITS[match.group(2).upper()]
        if math.isfinite(amount):
            return int(amount)
    raise ValueError(
        f"{argument}={value!r}: bytes are an int >= 0 or a string with a unit, such as "
        "'24GiB', '512MiB', '1.5GB' or '4096B' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, "
        "in any case)"
    )


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def grouped(rows: Sequence[tuple[str, Any, Any]]) -> list[tuple[list[str], Any]]:
    """``(name, key, value)`` rows with neighbours of equal ``key`` merged:
    ``[(names, first value), ...]`` in order."""
    groups: list[tuple[list[str], Any, Any]] = []
    for name, key, value in rows:
        if groups and groups[-1][1] == key:
            groups[-1][0].append(name)
        else:
            groups.append(([name], key, value))
    return [(names, value) for names, _, value in groups]


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def group_names(names: Sequence[str]) -> str:
    """``"x4 layers.0-3"`` for several names counting up under one prefix, ``"x2 a, b"`` for
    other groups, the name itself for one."""
    if len(names) == 1:
        return names[0]
    parts = [_NUMBERED.match(n) for n in names]
    if all(parts) and len({p.group(1) for p in parts}) == 1:
        numbers = [int(p.group(2)) for p in parts]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"x{len(names)} {parts[0].group(1)}{numbers[0]}-{numbers[-1]}"
    return f"x{len(names)} " + ", ".join(names)
