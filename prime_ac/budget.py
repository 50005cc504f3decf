"""``targets="auto"``: keep what saves the most replay under a memory budget.

From one profiled step in full mode, every operator call that the recompute re-executed is an
item: keeping it costs the bytes of its outputs (held from forward to backward) and saves its
FLOPs (not replayed in backward). Calls the recompute never reaches (it stops once backward has
what it needs) save nothing and are never chosen. Mandatory operators are kept regardless and
their bytes are charged first. A block has one more choice: no checkpoint at all, which holds
what autograd saves for it (measured on the same step) and replays nothing; so no block is
planned to hold more than no AC for it while replaying something.

Per block, the exact Pareto frontier of (bytes, FLOPs saved) is computed by dynamic programming.
A ``{block: bytes}`` mapping picks the best point of each block's frontier within its bytes. A
fraction is of the whole model's activation memory without AC: the blocks' frontiers are
combined, and the combination saving the most FLOPs within the fraction's bytes, less what the
model holds whatever the blocks keep (their inputs, activations outside the blocks), is chosen.

Bytes (an int, or a string with a unit such as ``"24GiB"``) are the step's peak activation
memory: every call becomes a :class:`prime_ac.planner.Call` (its bytes; its replay time, timed
on CUDA, else FLOPs over ``FLOP_RATE``) and the peak planner chooses keep, offload or replay per
call (:mod:`prime_ac.planner`); the offloaded results of all blocks share one
:class:`prime_ac.offload.Offloader`.

Chosen calls are identified as the same operator overload at the same position in the block's
forward (the way checkpoint replay itself is keyed). Because the solution is exact, a larger
budget never replays more (estimated) FLOPs, and any rule that keeps calls within the same
bytes - such as "every other matmul" - is a feasible point the planner can only match or beat.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from prime_ac import planner, ranks
from prime_ac._compat import returns_alias, schema_is_mutable, tree_leaves
from prime_ac.audit import op_name, run_audit
from prime_ac.compiled import eager_forwards
from prime_ac.contexts import checkpoint_contexts, with_recipe
from prime_ac.measure import (
    CallTimer,
    PeakTracker,
    copy_bandwidth,
    grads_preserved,
    measure_peak,
    rng_states_counted,
)
from prime_ac.modes import Rules
from prime_ac.offload import Offloader
from prime_ac.policy import OperatorPolicy
from prime_ac.scopes import ScopeRules, split_targets
from prime_ac.targets import Target, TargetSet
from prime_ac.wrapping import checkpoint_state, wrap_block, wrapped_blocks

logger = logging.getLogger("prime_ac")

__all__ = [
    "FLOP_RATE",
    "BlockPlan",
    "budget_context_fn",
    "choose_calls",
    "plan_block",
    "plan_budget",
]


@dataclass(frozen=True)
class BlockPlan:
    """What the budget policy keeps in one block, with the profile's estimates."""

    block: str
    budget_bytes: int
    kept: tuple[tuple[str, int], ...]  # (operator overload, call index in the block's forward)
    kept_bytes: int  # chosen calls plus mandatory operators (no checkpoint: what autograd saves)
    replayed_flops: int  # of the calls left to replay
    # (submodule path, operator, "kept" / "replayed" / "mandatory") of every profiled call
    calls: tuple[tuple[str, str, str], ...] = field(default=(), repr=False, compare=False)
    checkpointed: bool = True  # False: the block runs without checkpointing
    # a peak budget: the calls whose kept results go to host memory, and who moves them
    offloaded: tuple[tuple[str, int], ...] = ()
    offloader: Any = field(default=None, repr=False, compare=False)
    peak: Any = field(default=None, repr=False, compare=False)  # the planner's whole-step Plan
    # the block's module.training in the profiled step (None: not recorded): dropout and batch
    # norm hold other bytes in the other mode
    training: bool | None = field(default=None, compare=False)

    def warn_mode(self, training: bool) -> None:
        """Say (once per process, by the warnings registry) that the block now runs a step with
        gradients in the other mode than the one its plan was profiled in (a validation pass
        under no_grad holds nothing for backward: nothing to say)."""
        if not torch.is_grad_enabled():
            return
        profiled, now = ("train()", "eval()") if self.training else ("eval()", "train()")
        warnings.warn(
            f"prime_ac: a targets=\"auto\" plan was profiled with the model in {profiled} and "
            f"the block now runs in {now}: dropout and batch norm hold other bytes there, so "
            "the plan's budget no longer holds. Profile in the mode you train in: call "
            f"model.{'train' if not self.training else 'eval'}() before checkpoint_blocks.",
            stacklevel=3,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # operator objects do not pickle: the calls travel by name (the offloader as a fresh
        # one, prime_ac.offload.Offloader.__reduce__)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["kept"], fields["offloaded"] = _named(self.kept), _named(self.offloaded)
        return (_restored_plan, (fields,))

    def as_targets(self) -> list[str]:
        """Scoped targets that keep exactly the calls this plan keeps, for a config file.

        ``checkpoint_blocks(model, mode="selective", targets=plan.as_targets())`` then keeps the
        same calls (the same bytes, the same replayed FLOPs) and fits in a config file.
        An operator kept in its own submodule becomes ``"<path>/<op>"``; one kept in the block's
        own code becomes ``"<op>"`` with ``"!<path>/<op>"`` for the submodules where it replays.
        Raises ValueError when the plan keeps some calls of an operator in a submodule but not
        others (targets name a submodule's calls all together).

        Example::

            plan = prime_ac.wrapping.checkpoint_state(model.layers[0]).plan
            print(plan.as_targets())  # ['attention.wq/aten::mm.default', ...]
        """
        if not self.checkpointed:
            raise ValueError(
                f"{self.block}: the plan does not checkpoint this block (no AC holds less for it "
                "than any selective choice), so it has no target list: leave the block out of "
                "checkpoint_blocks (blocks=...)"
            )
        scopes: dict[str, dict[str, set[bool]]] = defaultdict(lambda: defaultdict(set))
        for scope, op, decision in self.calls:
            if decision != "mandatory":
                scopes[op][scope].add(decision == "kept")
        targets = []
        for op, seen in scopes.items():
            kept = [scope for scope, flags in seen.items() if True in flags]
            mixed = [scope or "<block>" for scope in kept if False in seen[scope]]
            if mixed:
                raise ValueError(
                    f"{self.block}: the plan keeps some calls of {op} in {mixed} and replays "
                    "others there; a target names all of a submodule's calls, so this plan has "
                    "no target list (keep the plan, or give that code its own submodule)"
                )
            if "" in kept:
                targets.append(op)
                targets += [f"!{scope}/{op}" for scope in seen if scope not in kept]
            else:
                targets += [f"{scope}/{op}" for scope in kept]
        self._check_reproduces(targets)
        return targets

    def _check_reproduces(self, targets: list[str]) -> None:
        plain, scoped = split_targets(targets)
        rules = ScopeRules(scoped, TargetSet(plain))
        for scope, op, decision in self.calls:
            path = tuple(scope.split(".")) if scope else ()
            key = Target.parse(op)
            keeps = rules.decide((key.namespace, key.op, key.overload), path)
            if decision != "mandatory" and keeps != (decision == "kept"):
                raise ValueError(
                    f"{self.block}: no target list reproduces this plan: {targets} would "
                    f"{'keep' if keeps else 'replay'} {op} in {scope or '<block>'}, which the "
                    "plan does not"
                )


@contextlib.contextmanager
def profiled_modes(blocks: list[tuple[str, nn.Module]]) -> Iterator[dict[str, bool]]:
    """``{block name: module.training}`` as each block's first forward inside ran."""
    seen: dict[str, bool] = {}

    def note(name: str, module: nn.Module, args: Any) -> None:
        seen.setdefault(name, module.training)

    hooks = [block.register_forward_pre_hook(functools.partial(note, n)) for n, block in blocks]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def _restored_plan(fields: dict[str, Any]) -> BlockPlan:
    fields["kept"], fields["offloaded"] = _resolved(fields["kept"]), _resolved(fields["offloaded"])
    return BlockPlan(**fields)


def _frontier(items: Sequence[tuple[int, int]], capacity: int) -> dict[int, tuple[int, tuple]]:
    """``{bytes used: (FLOPs saved, chosen item indices)}`` of every Pareto-optimal choice of
    ``(bytes, flops)`` items within ``capacity`` bytes (exact dynamic programming)."""
    frontier: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
    for i, (size, flops) in enumerate(items):
        if flops <= 0 or size > capacity:
            continue
        grown = dict(frontier)
        for used, (saved, chosen) in frontier.items():
            total = used + size
            if total <= capacity and saved + flops > grown.get(total, (-1,))[0]:
                grown[total] = (saved + flops, (*chosen, i))
        frontier = _pareto(grown)
    return frontier


def _pareto(points: dict[int, tuple]) -> dict[int, tuple]:
    """Drop points that use more bytes for no more FLOPs saved."""
    kept, best = {}, -1
    for used in sorted(points):
        if points[used][0] > best:
            kept[used], best = points[used], points[used][0]
    return kept


def choose_calls(items: Sequence[tuple[int, int]], capacity: int) -> list[int]:
    """Indices of ``(bytes, flops)`` items maximising total FLOPs with total bytes <= capacity.

    Exact; among equally good choices the one using the fewest bytes wins.
    """
    frontier = _frontier(items, capacity)
    return list(frontier[max(frontier)][1])


@dataclass(frozen=True)
class _Option:
    """One way to run a block: bytes held, FLOPs not replayed, the calls kept (None: no AC)."""

    bytes: int
    saved: int
    kept: tuple[int, ...] | None


class _Block:
    """One profiled block and its Pareto-optimal options."""

    def __init__(self, name: str, calls: list[Any], no_ac_bytes: int | None, capacity: int):
        self.name, self.calls = name, calls
        self.mandatory = sum(c.bytes for c in calls if c.decision == "mandatory")
        self.candidates = [
            c for c in calls if c.replayed and c.flops > 0 and not schema_is_mutable(c.op)
        ]
        self.replayable = sum(c.flops for c in calls if c.replayed)
        frontier = _frontier([(c.bytes, c.flops) for c in self.candidates], capacity)
        options = [
            _Option(self.mandatory + used, saved, kept) for used, (saved, kept) in frontier.items()
        ]
        if no_ac_bytes is not None and self.replayable > 0:
            options.append(_Option(no_ac_bytes, self.replayable, None))
        best = _pareto({o.bytes: (o.saved, o) for o in options})
        self.options = [option for _, option in best.values()]

    def plan(self, option: _Option, budget_bytes: int, name: str | None = None) -> BlockPlan:
        """The plan of ``option`` for this block, or for ``name``, a block identical to it."""
        if option.kept is None:
            return BlockPlan(
                name or self.name, budget_bytes, (), option.bytes, 0, self._calls(set()), False
            )
        kept = [self.candidates[i] for i in option.kept]
        chosen = {(c.op, c.index) for c in kept}
        candidates = sum(c.flops for c in self.candidates)
        return BlockPlan(
            block=name or self.name,
            budget_bytes=budget_bytes,
            kept=tuple((c.op, c.index) for c in kept),
            kept_bytes=option.bytes,
            replayed_flops=candidates - sum(c.flops for c in kept),
            calls=self._calls(chosen),
        )

    def _calls(self, chosen: set) -> tuple[tuple[str, str, str], ...]:
        return tuple(
            (
                c.scope,
                op_name(c.op),
                "mandatory"
                if c.decision == "mandatory"
                else ("kept" if (c.op, c.index) in chosen else "replayed"),
            )
            for c in self.calls
        )


def plan_block(
    block: str, calls: list[Any], capacity: int, no_ac_bytes: int | None = None
) -> BlockPlan:
    """The best plan for one block's profiled calls (``prime_ac.audit.CallRecord``) within
    ``capacity`` bytes; with ``no_ac_bytes``, no checkpoint is one of the choices."""
    planned = _Block(block, calls, no_ac_bytes, capacity)
    fitting = [o for o in planned.options if o.bytes <= capacity] or planned.options[:1]
    return planned.plan(max(fitting, key=lambda o: (o.saved, -o.bytes)), capacity)


def _structure(calls: list[Any], no_ac_bytes: int | None) -> tuple:
    """What planning a block within a fraction reads of it: blocks alike in it are identical
    (a stack's layers) and are solved once."""
    return (
        tuple(
            (c.op, c.index, c.decision, c.bytes, c.flops, c.replayed, c.scope) for c in calls
        ),
        no_ac_bytes,
    )


def _plan_whole_model(
    blocks: list[tuple[str, _Block]], capacity: int
) -> dict[str, BlockPlan]:
    """Each block's option, together saving the most FLOPs within ``capacity`` bytes.
    ``blocks`` are ``(name, solved block)``; the blocks sharing one solved block (identical:
    :func:`_structure`) take the same option, so they get the same kept calls (one compiled
    graph serves them all), at the cost of a coarser fit: their option is bought for all of
    them at once."""
    classes: dict[int, list[str]] = {}
    solved = {}
    for name, block in blocks:
        classes.setdefault(id(block), []).append(name)
        solved[id(block)] = block
    combined: dict[int, tuple[int, tuple[_Option, ...]]] = {0: (0, ())}
    for key, names in classes.items():
        block, k = solved[key], len(names)
        grown: dict[int, tuple[int, tuple[_Option, ...]]] = {}
        for used, (saved, picks) in combined.items():
            for option in block.options:
                total = used + k * option.bytes
                if total <= capacity and saved + k * option.saved > grown.get(total, (-1,))[0]:
                    grown[total] = (saved + k * option.saved, (*picks, option))
        if not grown:  # the mandatory bytes alone exceed the budget: keep only those
            grown = {
                used + k * block.options[0].bytes: (saved, (*picks, block.options[0]))
                for used, (saved, picks) in combined.items()
            }
        combined = _pareto(grown)
    _, picks = combined[max(combined)]
    chosen = dict(zip(classes, picks, strict=True))
    return {
        name: block.plan(chosen[id(block)], chosen[id(block)].bytes, name)
        for name, block in blocks
    }


def budget_context_fn(
    policy: OperatorPolicy,
    kept: frozenset[tuple[Any, int]],
    name: str,
    offloaded: frozenset[tuple[Any, int]] = frozenset(),
    offloader: Offloader | None = None,
) -> Callable[[], tuple[Any, Any]]:
    """Checkpoint contexts keeping the planned calls on top of ``policy`` (full mode), and
    handing the ``offloaded`` ones (planned or mandatory) to ``offloader``.

    A planned call is named by its operator overload and its index among that overload's calls
    in the block's forward; the recompute counts the same calls, so it finds them again.
    """
    plan: dict[Any, set[int]] = defaultdict(set)
    for op, index in kept | offloaded:
        plan[op].add(index)
    contexts = checkpoint_contexts(
        Rules(policy, {op: frozenset(indices) for op, indices in plan.items()}), name
    )
    # a copy of the block (pickle, deepcopy) makes its contexts again from the calls' names
    recipe = (_named_budget_context_fn, policy, _named(kept), name, _named(offloaded), offloader)
    if offloader is None or not offloaded:
        return with_recipe(contexts, *recipe)

    def offloading_contexts() -> tuple[Any, Any]:
        forward, recompute = contexts()
        forward.store.offloader, forward.store.offload_calls = offloader, offloaded
        return forward, recompute

    return with_recipe(offloading_contexts, *recipe)


def _named(calls: Any) -> tuple[tuple[str, int], ...]:
    """``(operator, index)`` calls with the operators by name: operator objects do not pickle."""
    return tuple((op_name(op), index) for op, index in calls)


def _resolved(calls: Sequence[tuple[str, int]]) -> tuple[tuple[Any, int], ...]:
    """:func:`_named`'s calls with their operator objects again."""
    found = []
    for name, index in calls:
        namespace, _, rest = name.partition("::")
        op, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op)
        found.append((getattr(packet, overload or "default"), index))
    return tuple(found)


def _named_budget_context_fn(
    policy: OperatorPolicy,
    kept: Sequence[tuple[str, int]],
    name: str,
    offloaded: Sequence[tuple[str, int]],
    offloader: Offloader | None,
) -> Callable[[], tuple[Any, Any]]:
    return budget_context_fn(
        policy, frozenset(_resolved(kept)), name, frozenset(_resolved(offloaded)), offloader
    )


def plan_budget(
    model: nn.Module,
    profile: Callable[[nn.Module], torch.Tensor],
    budget: Any,
    group: Any = None,
    host_cap: Any = None,
) -> dict[str, BlockPlan]:
    """Profile one step of the full-mode-wrapped ``model`` and plan each checkpointed block,
    together with the ranks of ``group`` (:mod:`prime_ac.ranks`).

    A peak budget's offloads hold at most ``host_cap`` bytes on the host (an int or a string
    such as ``"64GiB"``; None: no cap). On CPU, where host and device are one memory, an
    offload frees nothing, so none is planned unless ``host_cap`` is given. The audit's
    full-mode step is measured phase by phase (:class:`StepMemory`) for the planner, in place
    of its no-AC step (not run for a peak budget).

    Returns ``{block name: plan}``; the model is left as it was (the caller applies the plans).
    """
    group = ranks.resolve(group)
    device = next((p.device for p in model.parameters()), None)
    # a peak budget on CUDA: each call's replay time as measured, and the host link's bandwidth
    peak = not isinstance(budget, (float, Mapping))  # bytes: an int or "24GiB"
    kind = "peak" if peak else "fraction" if isinstance(budget, float) else "per-block"
    cap = None if host_cap is None else planner.parse_bytes(host_cap, "host_cap")
    one_memory = device is None or device.type == "cpu"
    if peak and cap is None and one_memory:
        cap = 0
    timer = None
    blocks = wrapped_blocks(model)
    with ranks.failures_reported(group):
        if peak and device is not None and device.type == "cuda":
            timer = CallTimer(blocks)
        phases = _phases_measured(blocks, profile, one_memory) if peak and blocks else None
        with timer or contextlib.nullcontext(), phases or contextlib.nullcontext() as measured:
            tracker, profiled = measured or (None, profile)
            with tracker or contextlib.nullcontext():
                # a peak plan reads no no-AC baseline: the phases stand in for it
                report = run_audit(model, profiled, baseline=not peak)
        link = copy_bandwidth(device) if peak else None
    limit = planner.parse_bytes(budget) if peak else 0
    calls = {name: report.calls.get(name, []) for name in report.blocks}
    structure = [(name, [op_name(c.op) for c in calls[name]]) for name in report.blocks]
    limit, link, cap = ranks.check(group, kind, structure, limit, link, cap)
    no_ac = report.block_held_bytes_no_ac
    if peak:
        measured = timer.seconds() if timer is not None else {}
        memory = tracker.memory() if tracker.started else None
        return _calibrated(model, profile, report, limit, measured, link, group, cap, memory)
    if isinstance(budget, float):
        held = {
            name: sum(c.bytes for c in calls[name] if c.decision == "mandatory")
            for name in report.blocks
        }
        # what the full-mode model holds whatever its blocks keep beyond the mandatory set
        base = report.held_bytes - sum(held.values())
        capacity = max(int(budget * report.held_bytes_no_ac) - base, 0)
        solved: dict[tuple, _Block] = {}
        for name in report.blocks:
            key = _structure(calls[name], no_ac.get(name))
            if key not in solved:
                solved[key] = _Block(name, calls[name], no_ac.get(name), capacity)
        blocks = [(n, solved[_structure(calls[n], no_ac.get(n))]) for n in report.blocks]
        return _plan_whole_model(blocks, capacity)
    return {
        name: plan_block(name, calls[name], budget[name], no_ac.get(name)) for name in report.blocks
    }


# Replay time of a call whose time was not measured: its FLOPs at this rate (1e12 FLOP/s, a
# stated guess between a CPU core's and a GPU's; only the ratio to the copy bandwidth matters).
FLOP_RATE = 1e12


def profiles(
    report: Any,
    seconds: Mapping[tuple, float] | None = None,
    group: Any = None,
    memory: StepMemory | None = None,
) -> list[planner.BlockProfile]:
    """The audit's profiled calls as the peak planner's blocks, agreed with the ranks of
    ``group`` (resolved: :func:`prime_ac.ranks.agree`).

    A call's replay time is ``seconds[(block, op, index)]`` where it was measured
    (:class:`prime_ac.measure.CallTimer`, on CUDA), else its FLOPs at ``FLOP_RATE``. What
    autograd saved for each block without checkpointing (the audit's no-AC step; for a peak
    plan, what the block's recompute left alive, from ``memory``) is its recompute's working set.

    What the step holds beyond the blocks' results (their inputs, the embeddings, the logits
    and the loss, saved RNG states, temporaries and gradients in flight) comes from ``memory``,
    the profiled step's phases (:func:`plan_budget` measures them): each phase's measured most
    less what the simulator counts for the profiled plan becomes that phase's extra bytes, so
    the logits count after the last block's forward, not in every block. Without ``memory``,
    what the full-mode step held beyond the mandatory results is spread over the blocks'
    inputs, which misses the loss's own peak.
    """
    mandatory = sum(
        c.bytes
        for name in report.blocks
        for c in report.calls.get(name, [])
        if c.decision == "mandatory"
    )
    base = max(report.held_bytes - mandatory, 0) // max(len(report.blocks), 1)
    blocks = []
    for name in report.blocks:
        calls = []
        for c in report.calls.get(name, []):
            if c.decision == "mandatory":
                kind = "mandatory"
            elif returns_alias(c.op) or schema_is_mutable(c.op):
                kind = "view"
            else:
                kind = "plain"
            # a call the recompute never reaches saves nothing when kept
            timed = (seconds or {}).get((name, c.op, c.index))
            time = c.flops / FLOP_RATE if timed is None else timed
            time = time if c.replayed and kind != "view" else 0.0
            size = 0 if kind == "view" else c.bytes  # a view or an in-place write: no new bytes
            calls.append(planner.Call(op_name(c.op), c.index, size, time, kind))
        saved = report.block_held_bytes_no_ac.get(name)
        blocks.append(planner.BlockProfile(name, tuple(calls), 0 if memory else base, saved))
    return ranks.agree(blocks if memory is None else _with_extras(blocks, memory), group)


@dataclass
class StepMemory:
    """The most a full-mode step held in each phase, by
    :class:`prime_ac.measure.PeakTracker`'s ledger (live storages operators created, plus
    saved RNG states on CPU): ``forward[block]`` from the end of the block before (the
    embeddings before the first) to the block's end, ``backward[block]`` from the gradient of
    the block's output to that of the block before (the first block's to the end of the step),
    ``after`` from the last block's forward to its backward (the loss and its gradient);
    ``recomputed[block]``: what the block's recompute left alive when its backward's first
    operator ran (what autograd saves for it, less its kept results)."""

    forward: dict[str, int] = field(default_factory=dict)
    backward: dict[str, int] = field(default_factory=dict)
    after: int | None = None
    recomputed: dict[str, int] = field(default_factory=dict)


def _with_extras(
    blocks: list[planner.BlockProfile], memory: StepMemory
) -> list[planner.BlockProfile]:
    """``blocks`` with each measured phase's bytes beyond what the simulator counts for the
    profiled plan (mandatory results kept, the rest replayed) as its extras; a phase the
    simulator counts above its measurement adds nothing (the prediction stays above). A block
    without a no-AC measurement takes its recompute's bytes and its kept results as what
    autograd saves for it."""
    extended, before = [], 0  # before: what the blocks before keep
    for i, block in enumerate(blocks):
        kept = sum(c.bytes for c in block.calls if c.kind == "mandatory")
        if block.saved_bytes is None and block.name in memory.recomputed:
            block = dataclasses.replace(block, saved_bytes=memory.recomputed[block.name] + kept)
        forward, running = 0, 0
        for c in block.calls:
            forward = max(forward, running + c.bytes)
            running += c.bytes if c.kind == "mandatory" else 0
        backward = block.working_bytes(kept)
        extras = {
            "forward_extra": max(memory.forward.get(block.name, 0) - before - forward, 0),
            "backward_extra": max(memory.backward.get(block.name, 0) - before - backward, 0),
        }
        before += kept
        if i == len(blocks) - 1 and memory.after is not None:
            extras["after_bytes"] = max(memory.after - before, 0)
        extended.append(dataclasses.replace(block, **extras))
    return extended


class _PhaseTracker(PeakTracker):
    """:class:`prime_ac.measure.PeakTracker` counting from :meth:`start` (the full-mode step
    of the audit), with the most held in each ``phase`` that hooks set, and what each block's
    recompute (the operators its backward phase runs with gradients enabled) left alive."""

    def __init__(self) -> None:
        super().__init__()
        self.started = False
        self.phase: tuple[str, str | None] | None = None
        self.most: dict[tuple[str, str | None], int] = {}
        self.recomputed: dict[str, int] = {}
        self.recomputing = False
        self.phase_start = 0

    def start(self) -> None:
        self.started = True
        self.alive = self.peak = self.states = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.started:
            return func(*args, **(kwargs or {}))
        where, name = self.phase or (None, None)
        if where == "backward" and name not in self.recomputed:
            if torch.is_grad_enabled():
                self.recomputing = True
            elif self.recomputing and func is not torch.ops.aten.detach.default:
                # the block's first backward operator (the recompute detaches what it saves)
                self.recomputed[name] = max(self.held() - self.phase_start, 0)
                self.recomputing = False
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.phase is not None:
            here = self.held()
            self.most[self.phase] = max(self.most.get(self.phase, here), here)
        return out

    def memory(self) -> StepMemory:
        found = StepMemory(after=self.most.get(("after", None)), recomputed=dict(self.recomputed))
        for (where, name), most in self.most.items():
            if name is not None:
                getattr(found, where)[name] = most
        return found


@contextlib.contextmanager
def _phases_measured(
    blocks: list[tuple[str, nn.Module]], profile: Callable, rng: bool
) -> Iterator[tuple[_PhaseTracker, Callable]]:
    """A :class:`_PhaseTracker` to enter around the audit, and the profile to give it: the
    tracker starts at the first step whose blocks checkpoint (the audit's full-mode step, not
    its no-AC one) and block hooks mark the phases (a gradient hook on each block's output
    marks where its backward starts). ``rng``: count the RNG states the blocks save (CPU)."""
    tracker = _PhaseTracker()
    names = [name for name, _ in blocks]
    def checkpointing() -> bool:
        return all(checkpoint_state(b) is not None for _, b in blocks)

    def measured_profile(model: nn.Module) -> Any:
        if checkpointing() and not tracker.started:
            # the weight gradients go into memory the model holds, as in measure_peak's steps
            # (the audit's caller keeps the gradients the model had)
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            tracker.start()
            tracker.phase = ("forward", names[0])
        elif not checkpointing():
            tracker.phase = None
        return profile(model)

    def backward_starts(name: str, handle: list, grad: torch.Tensor) -> None:
        handle[0].remove()
        if tracker.phase is not None:
            tracker.phase = ("backward", name)
            tracker.phase_start, tracker.recomputing = tracker.held(), False

    def forward_done(index: int, module: nn.Module, args: Any, out: Any) -> None:
        if tracker.phase is None:
            return
        following = names[index + 1] if index + 1 < len(names) else None
        tracker.phase = ("forward", following) if following else ("after", None)
        grad = next(
            (t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None
        )
        if grad is not None:
            handle: list = []
            starts = functools.partial(backward_starts, names[index], handle)
            handle.append(grad.register_hook(starts))

    hooks = [
        block.register_forward_hook(functools.partial(forward_done, i))
        for i, (_, block) in enumerate(blocks)
    ]
    try:
        saving = [b for _, b in blocks if rng and checkpoint_state(b).preserve_rng_state]
        with rng_states_counted(tracker, saving):
            yield tracker, measured_profile
    finally:
        for hook in hooks:
            hook.remove()


def plan_peak(
    report: Any,
    budget: int,
    host_cap: int | None = None,
    seconds: Mapping[tuple, float] | None = None,
    bandwidth: float | None = None,
    group: Any = None,
    memory: StepMemory | None = None,
) -> dict[str, BlockPlan]:
    """Plans for every block of ``report`` meeting a peak of ``budget`` bytes (keep / offload /
    replay per call), sharing one offloader. ``seconds`` are measured replay times (see
    :func:`profiles`); ``bandwidth`` the measured copy bandwidth (None: the stated default);
    ``group`` the (resolved) ranks planning together; ``memory`` the profiled step's phases
    (:func:`profiles`)."""
    link = {} if bandwidth is None else {"bandwidth": bandwidth}
    blocks = profiles(report, seconds, group, memory)
    peak = planner.plan(blocks, budget, host_cap=host_cap, **link)
    offloader = (
        Offloader(peak.simulation.host_bytes, host_cap=host_cap)
        if peak.simulation.host_bytes
        else None
    )
    plans = {}
    for i, name in enumerate(report.blocks):
        records = report.calls.get(name, [])
        chosen = peak.decisions[i]
        kept = tuple(
            (c.op, c.index)
            for c, d in zip(records, chosen, strict=True)
            if d == planner.KEEP and c.decision != "mandatory"
        )
        offloaded = tuple(
            (c.op, c.index) for c, d in zip(records, chosen, strict=True) if d == planner.OFFLOAD
        )
        labels = {planner.KEEP: "kept", planner.OFFLOAD: "offloaded", planner.REPLAY: "replayed"}
        plans[name] = BlockPlan(
            block=name,
            budget_bytes=budget,
            kept=kept,
            kept_bytes=sum(
                c.bytes for c, d in zip(records, chosen, strict=True) if d == planner.KEEP
            ),
            replayed_flops=sum(
                c.flops
                for c, d in zip(records, chosen, strict=True)
                if d == planner.REPLAY and c.replayed
            ),
            calls=tuple(
                (
                    c.scope,
                    op_name(c.op),
                    "mandatory" if c.decision == "mandatory" and d == planner.KEEP else labels[d],
                )
                for c, d in zip(records, chosen, strict=True)
            ),
            offloaded=offloaded,
            offloader=offloader,
            peak=peak,
        )
    return plans


# A first plan measured under its prediction by more than this share of the budget is planned
# again with the difference given back (the simulator over-counts some models' working sets).
CALIBRATION_SLACK = 0.05


def _calibrated(
    model: nn.Module,
    profile: Callable,
    report: Any,
    budget: int,
    seconds: Mapping[tuple, float] | None = None,
    bandwidth: float | None = None,
    group: Any = None,
    host_cap: int | None = None,
    memory: StepMemory | None = None,
) -> dict:
    """Plan for a peak of ``budget`` (``host_cap``, ``memory``: see :func:`plan_peak`), run one
    step with the plan and measure what it held
    (:func:`prime_ac.measure.measure_peak`), and correct the simulator once by its error
    (measured less predicted): a plan measured over the budget is replaced by one planned for
    the budget less the error; one measured under its prediction by more than
    ``CALIBRATION_SLACK`` of the budget is replaced by one planned for the budget plus the
    difference, if that one's measured peak stays within the budget. Each plan records what it
    measured (``Plan.measured``, the first as ``tightened_from``); one that could not be brought
    within the budget logs a warning.

    With the (resolved) ``group``, every input to a decision here is agreed over its ranks
    (the profile, the budget, the bandwidth, each measured peak), so every rank takes the same
    branches and runs the same collectives."""
    options = {"seconds": seconds, "bandwidth": bandwidth, "group": group, "memory": memory}
    plans = plan_peak(report, budget, host_cap, **options)
    peak = next(iter(plans.values())).peak if plans else None
    if peak is None:
        return plans
    peak.measured = _measure(model, profile, plans, group)
    error = peak.measured - peak.simulation.peak
    over = peak.measured > budget
    if (over and peak.fits) or -error > CALIBRATION_SLACK * budget:
        again = plan_peak(report, max(budget - error, 0), host_cap, **options)
        second = next(iter(again.values())).peak
        if second.decisions != peak.decisions:
            second.measured = _measure(model, profile, again, group)
            if over or second.measured <= budget:
                second.budget, second.planned_for = budget, second.budget
                second.tightened_from = peak
                plans, peak = again, second
    if peak.measured > budget:
        logger.warning(
            "prime_ac: budget=%s is not met: the plan %s holds %s at its peak (measured on the "
            "profiled step; %s). Raise the budget, or shrink the step (fewer tokens per "
            "micro-batch) or what the blocks must keep (mandatory operators).",
            planner.format_bytes(budget),
            "with the least memory the rules allow" if not peak.fits else "chosen",
            planner.format_bytes(peak.measured),
            "predicted " + planner.format_bytes(peak.simulation.peak),
        )
    return plans


def _measure(
    model: nn.Module, profile: Callable, plans: dict[str, BlockPlan], group: Any = None
) -> int:
    """The peak of one step of ``model`` with ``plans`` applied (the most over the ranks of the
    resolved ``group``; a rank whose step raises makes them all raise), the model left as it
    was."""
    states = {}
    for name, p in plans.items():
        block = model.get_submodule(name)
        state = states[name] = checkpoint_state(block)
        fn = budget_context_fn(
            state.policy, frozenset(p.kept), f"block {name!r}", frozenset(p.offloaded), p.offloader
        )
        # the plan on the state too: a compiled block applies state.compiled, made from it
        wrap_block(block, dataclasses.replace(state, context_fn=fn, plan=p))
    try:
        offloader = next((p.offloader for p in plans.values() if p.offloader is not None), None)
        host = (lambda: offloader.ledger.host) if offloader is not None else (lambda: 0)
        # the step's gradients go; those the model held (accumulated micro-batches) come back
        # torch's checkpoint saves an RNG state per block outside the dispatcher: counted on CPU
        rng = [model.get_submodule(n) for n, s in states.items() if s.preserve_rng_state]
        # on CUDA a compiled block's step is measured compiled (the allocator's peak); the CPU
        # ledger is a dispatch mode, which compiled code does not run under: eager forwards
        cpu = all(p.device.type != "cuda" for p in model.parameters())
        with (
            ranks.failures_reported(group, ranks.most),
            grads_preserved(model),
            eager_forwards(cpu),
        ):
            measured = measure_peak(model, profile, host, rng)
        return ranks.most(group, measured)  # every rank calibrates alike
    finally:
        for name, state in states.items():
            wrap_block(model.get_submodule(name), state)
