"""Compiled blocks: the keep / offload / replay decisions of an eager region, as graph tags.

Under ``torch.compile`` a checkpointed block is traced once and torch's partitioner reads each
node's tag (``node.meta["recompute"]``); the tags come from a selective-checkpoint policy that
torch calls once per operator call while it traces, in the order the eager forward makes them.
:class:`CompiledPlan` is that policy for one block configuration: the block's
:class:`~prime_ac.policy.OperatorPolicy` (mandatory, targets, scoped targets, named offload)
plus a plan's calls, keyed as eager keys them (operator overload, index among that overload's
calls in the block's forward). Kept calls are tagged ``MUST_SAVE``, everything else
``MUST_RECOMPUTE`` (eager replays it), offloaded calls ``MUST_CPU_OFFLOAD``.

Guards: dynamo guards a checkpoint's ``context_fn`` by its code, so the context function holds
the plan's ``compile_handle`` (a function with a code object of its own,
:func:`prime_ac._compat.own_code_getter`). There is one :class:`CompiledPlan` per distinct
content (policy, kept and offloaded calls): blocks whose plans are equal share it and one
graph; a block with another plan fails the guard and compiles its own, so a block never runs
another block's decisions. dynamo compiles at most ``torch._dynamo.config.recompile_limit``
graphs per code object, and every wrapped block runs one forward: the plan that reaches the
limit warns (:func:`_count_traced`).

Offload: torch's partitioner neither saves nor offloads on ``MUST_CPU_OFFLOAD`` by itself (it
treats the tag as no tag; torch 2.13-2.14). Its offload pass
(``torch._functorch._activation_offloading``) moves the saved values whose node carries
``meta["should_offload"]`` to pinned host memory after their last forward use and back before
their first backward use (views, getitems, non-contiguous values and graph outputs excepted),
on a side stream with prefetch when its flags say so. The forward mode here
(:class:`_TaggingMode`) turns each offload tag into ``MUST_SAVE`` plus ``should_offload`` when
the region's trace ends, and :func:`prime_ac._compat.enable_compiled_offload` turns torch's
flags on (they act only on nodes marked so, which only prime_ac marks). Values on the CPU stay
where they are (there is no host to move them to; eager offload makes a copy in the same
memory), with a warning once per plan. A torch without compile-side offload (2.9) raises at
the first compiled call that would offload.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from prime_ac import _compat

__all__ = [
    "CompiledPlan",
    "compiled_blocks",
    "compiled_offload_supported",
    "compiled_plan",
    "compiled_plan_context_fn",
    "compiled_readings",
    "eager_forwards",
    "offload_ready",
    "watched",
]

_SAVE = CheckpointPolicy.MUST_SAVE
_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
_SAVES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)
# torch 2.13+ (None before: no compile-side offload)
_OFFLOAD = getattr(CheckpointPolicy, "MUST_CPU_OFFLOAD", None)


def compiled_offload_supported() -> bool:
    """Whether this torch can offload saved values of a compiled graph (2.13+)."""
    return _OFFLOAD is not None and _compat.COMPILED_OFFLOAD


class CompiledPlan:
    """The decisions of one block configuration for compiled regions (see the module doc).

    ``traced`` holds the last traced region's decisions, ``(operator, index, decision)`` per
    call, decision one of ``"kept"``, ``"offloaded"``, ``"replayed"``: what the compiled graph
    was tagged with.
    """

    def __init__(
        self,
        policy: Any,
        kept: frozenset[tuple[Any, int]],
        offloaded: frozenset[tuple[Any, int]],
        owner: str,
        block: type | None = None,
    ):
        self.policy, self.kept, self.offloaded, self.owner = policy, kept, offloaded, owner
        self.block = block
        self.planned = {op for op, _ in kept | offloaded}
        self.traced: list[tuple[Any, int, str]] = []
        self.warned_cpu = False
        self.compile_handle = _compat.own_code_getter(self)

    def decide(self, op: Any, index: int, ctx: Any, args: tuple, kwargs: dict) -> str:
        """``"kept"``, ``"offloaded"`` or ``"replayed"`` for call ``index`` of ``op``."""
        if op in self.planned and not _planned_never(op):  # as eager: views, writes replay
            if (op, index) in self.offloaded:
                return "offloaded"
            if (op, index) in self.kept:
                return "kept"
        policy = self.policy
        if policy(ctx, op, *args, **kwargs) not in _SAVES:
            return "replayed"
        offloads = getattr(policy, "offloads", None)  # prime_ac.offload_targets.OffloadPolicy
        return "offloaded" if offloads is not None and offloads(op) else "kept"

    def tagger(self) -> Callable[..., CheckpointPolicy]:
        """A fresh policy for one traced region: it counts each overload's calls from 0."""
        counts: dict[Any, int] = defaultdict(int)
        decisions: list[tuple[Any, int, str]] = []
        self.traced = decisions

        def tag(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            index = counts[op]
            counts[op] = index + 1
            decision = self.decide(op, index, ctx, args, kwargs)
            decisions.append((op, index, decision))
            if decision == "replayed":
                return _RECOMPUTE
            if decision == "kept":
                return _SAVE
            if not compiled_offload_supported():
                raise RuntimeError(_no_compiled_offload(self.owner, op))
            return _OFFLOAD

        return tag

    def __repr__(self) -> str:
        return f"CompiledPlan({self.owner}: {len(self.kept)} kept, {len(self.offloaded)} offloaded)"


def _planned_never(op: Any) -> bool:
    return _compat.returns_alias(op) or _compat.schema_is_mutable(op)


def _no_compiled_offload(owner: str, op: Any) -> str:
    return (
        f"prime_ac: {owner} offloads {op} in a compiled block, and torch {torch.__version__} "
        "has no compile-side offload (CheckpointPolicy.MUST_CPU_OFFLOAD and "
        "torch._functorch._activation_offloading: torch 2.13+). Nothing would reach the host. "
        "Either run these blocks eagerly (do not compile them; offload works there), drop "
        "offload= (or plan with a budget that needs none: a fraction or {block: bytes}), or "
        "upgrade torch to 2.13 or later."
    )


# One CompiledPlan per distinct content, shared by the blocks whose decisions are equal (and so
# their compiled graph); dropped with the last block holding it.
_plans: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def compiled_plan(
    policy: Any,
    kept: Iterable[tuple[Any, int]] = (),
    offloaded: Iterable[tuple[Any, int]] = (),
    owner: str = "a checkpointed block",
    block: type | None = None,
) -> CompiledPlan:
    """The :class:`CompiledPlan` of this content, made once. ``block``: the class of the wrapped
    blocks applying it (plans of other classes stay apart, so each one's ``traced`` is its own;
    counted against dynamo's recompile limit, :func:`_count_traced`)."""
    key = (policy, frozenset(kept), frozenset(offloaded), block)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = CompiledPlan(policy, key[1], key[2], owner, block)
    return plan


def offload_ready(policy: Any, plan: Any) -> None:
    """Before a block with offload compiles: torch's compile-side offload on (its ops
    registered, its flags read when AOTAutograd keys its cache, so a cached graph with offload
    nodes is found under the flags it was made with)."""
    named = getattr(policy, "offload", None)  # prime_ac.offload_targets.OffloadPolicy
    planned = plan is not None and plan.offloaded
    if (named or planned) and compiled_offload_supported():
        _compat.enable_compiled_offload()


def compiled_plan_context_fn(plan: CompiledPlan) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` of a compiled region applying ``plan``: a partial of its handle, which
    dynamo guards by its own code object (one graph per distinct plan)."""
    return functools.partial(plan_contexts, plan.compile_handle)


def plan_contexts(handle: Callable[[], CompiledPlan]) -> tuple[Any, Any]:
    """The (forward, recompute) contexts of one traced region applying ``handle()``."""
    plan = handle()
    _count_traced(plan)
    scoped = getattr(plan.policy, "scoped", None)
    if scoped is None or not scoped.needs_region:  # region targets refuse compile: no advice
        _warn_unwatched(plan.policy)
    forward, recompute = create_selective_checkpoint_contexts(plan.tagger())
    forward.__class__ = _TaggingMode  # the same mode and storage (whose layout torch changes)
    forward.plan = plan
    return forward, recompute


class _TaggingMode(_compat.CachingSACMode):
    """torch's forward SAC mode; on leaving, the nodes it tagged ``MUST_CPU_OFFLOAD`` become
    saved values marked for torch's offload pass (values on the CPU: saved in place). Made by
    giving the mode ``create_selective_checkpoint_contexts`` returns this class: it adds no
    state, and the mode's constructor and storage differ across torch releases. Higher-order
    operators (flex_attention, invoke_subgraph) find their rule by the mode's exact class, so
    the redirect torch registers for its own mode is registered for this one too."""

    def __enter__(self) -> Any:
        _compat.redirect_hops(type(self))
        proxy = _compat.proxy_mode()
        self._graph = proxy.tracer.graph if proxy is not None else None
        self._start = len(self._graph.nodes) if self._graph is not None else 0
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        out = super().__exit__(*exc)
        if self._graph is not None and _OFFLOAD is not None:
            _mark_offloads(list(self._graph.nodes)[self._start :], self.plan)
        return out


def _mark_offloads(nodes: list[Any], plan: CompiledPlan) -> None:
    marked = on_cpu = 0
    for node in nodes:
        if node.meta.get("recompute") is not _OFFLOAD:
            continue
        node.meta["recompute"] = _SAVE
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            node.meta["should_offload"] = True
            marked += 1
        else:
            on_cpu += 1
    if marked:
        _compat.enable_compiled_offload()
    if on_cpu and not plan.warned_cpu:  # once per plan
        plan.warned_cpu = True
        warnings.warn(
            f"prime_ac: {plan.owner} offloads results that are on the CPU in a compiled block: "
            "they stay saved where they are (torch's compile-side offload moves device memory "
            "to the host; eager offload on the CPU makes a copy in the same memory). Bytes held "
            "are the same as keeping them.",
            stacklevel=2,
        )


# Distinct plans traced for checkpointed blocks. Every wrapped block runs one forward (the
# wrapper class's, prime_ac.wrapping), one code object to dynamo, which compiles at most
# recompile_limit graphs for it and runs the blocks past that eagerly.
_traced: weakref.WeakSet = weakref.WeakSet()


def _count_traced(plan: CompiledPlan) -> None:
    if plan.block is None or plan in _traced:
        return
    _traced.add(plan)
    limit = _compat.recompile_limit()
    if limit is not None and len(_traced) == limit:
        warnings.warn(
            f"prime_ac: {limit} distinct block plans compiled, which is "
            f"torch._dynamo.config.recompile_limit: dynamo compiles one graph per plan for the "
            "checkpointed blocks' forward, and runs blocks with yet another plan eagerly "
            "(their plan still applies, uncompiled; with fullgraph=True dynamo raises instead). "
            "Raise torch._dynamo.config.recompile_limit to at least the number of distinct "
            "plans, or plan so that identical blocks get equal plans.",
            stacklevel=2,
        )


def compiled_blocks(model: Any, blocks: list[tuple[str, Any]]) -> list[str]:
    """The checkpointed ``blocks`` that run compiled: compiled themselves, inside a compiled
    module, or all of them when ``model`` is compiled."""
    if _compat.is_compiled_module(model):
        return [name for name, _ in blocks]
    compiled = [name for name, m in model.named_modules() if _compat.is_compiled_module(m)]
    return [
        name
        for name, _ in blocks
        if any(name == c or name.startswith(f"{c}.") or not c for c in compiled)
    ]


@contextlib.contextmanager
def eager_forwards(compiled: bool) -> Iterator[None]:
    """Compiled frames run their eager code (``torch.compiler.set_stance("force_eager")``):
    what the audit measures with its dispatch modes, which dynamo does not trace through."""
    if not compiled:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def compiled_readings(
    names: list[str], states: dict[str, Any], calls: dict[str, list[Any]]
) -> dict[str, str]:
    """Per compiled block, where its audit rows come from and whether its compiled graph's tags
    (the last trace of its plan, :attr:`CompiledPlan.traced`) agree with them call for call."""
    readings = {}
    for name in names:
        plan = states[name].compiled
        if plan is None:
            readings[name] = (
                "eager forward with the policy that tags its compiled graph, call for call"
            )
            continue
        if not plan.traced:
            readings[name] = (
                "eager forward with its plan; its compiled graph is not traced yet (run one "
                "compiled step before the audit to compare)"
            )
            continue
        traced = {(op, i): d != "replayed" for op, i, d in plan.traced}
        differ = [
            f"{c.op}#{c.index} compiled {'saves' if traced[(c.op, c.index)] else 'replays'}"
            for c in calls.get(name, [])
            if (c.op, c.index) in traced
            and traced[(c.op, c.index)] != (c.decision != "replayed")
        ]
        unseen = sum(1 for c in calls.get(name, []) if (c.op, c.index) not in traced)
        if differ or unseen:
            readings[name] = (
                f"compiled graph saved differently from its eager forward at {len(differ)} "
                f"calls ({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}); "
                f"{unseen} eager calls not seen in its trace"
            )
        else:
            readings[name] = "compiled graph tagged as its eager forward, call for call"
    return readings


# The first-step watch of each policy's configuration (prime_ac.watch), set by wrap_block: it
# measures eager regions only, so a compiled block traced before its first eager step warns.
_watches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_warned_watches: weakref.WeakSet = weakref.WeakSet()


def watched(policy: Any, watch: Any) -> None:
    """Note that blocks applying ``policy`` report their first step to ``watch``."""
    try:
        _watches[policy] = weakref.ref(watch)
    except TypeError:  # a policy that takes no weak reference (a plain function): no watch
        pass


def _warn_unwatched(policy: Any) -> None:
    ref = _watches.get(policy) if _is_weakrefable(policy) else None
    watch = ref() if ref is not None else None
    if watch is None or not watch.pending or watch in _warned_watches:
        return
    _warned_watches.add(watch)
    warnings.warn(
        f"prime_ac: checkpointed blocks compiled before their first step "
        f"({', '.join(sorted(watch.pending)[:4])}{', ...' if len(watch.pending) > 4 else ''}) "
        "take no part in the first step's report, skip_worse and the drop of kept results no "
        "backward reads (prime_ac.watch measures eager regions; a compiled graph saves only "
        "what its backward reads anyway). Run one step before compiling the blocks for them, "
        "or prime_ac.audit(model, loss_fn) for the table.",
        stacklevel=2,
    )


def _is_weakrefable(value: Any) -> bool:
    try:
        weakref.ref(value)
    except TypeError:
        return False
    return True
