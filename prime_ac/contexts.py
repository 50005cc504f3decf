"""prime_ac's own selective-checkpoint contexts: one keeps in the forward, one replays.

``torch.utils.checkpoint.checkpoint(fn, use_reentrant=False, context_fn=...)`` runs the forward
under the first context returned by ``context_fn`` and the recompute under the second. prime_ac
writes both (instead of subclassing torch's private modes) so that they behave the same on every
torch release. In eager mode they reach operators through the dispatch key of
:mod:`prime_ac.intercept` (:class:`KeepRegion`, :class:`ReplayRegion`), so only operators that
need a decision cost Python; with a policy callable, or under a dispatch mode already active
around the forward, they are dispatch modes (:class:`KeepMode`, :class:`ReplayMode`). Either way:

- The decision for an operator overload is computed once per block and stored as a small action
  code; the per-call work is one dict lookup. Replayed operators are neither counted nor stored:
  the recompute derives the same code and just runs them.
- Kept results are stored per ``(operator, call index)``, counting only the calls of operators
  that can be kept. The recompute returns a kept result, runs a call marked for replay, and runs an
  extra call of an operator that kept nothing; an extra call of an operator that kept results
  would hand the wrong results to the recompute and raises :class:`ReplayMismatchError`. Missing
  calls are fine (the recompute stops early). A region that kept nothing recomputes with no mode
  at all, exactly as plain checkpointing.
- Copy on write: when an operator writes in place to a storage that holds a kept result (views
  included), the kept result is replaced by a copy taken just before the write, so the recompute
  receives the value the forward saw. Only writes that really hit a kept result copy anything. A
  kept result modified where no mode sees it (after the block returned) cannot be recovered and
  raises :class:`KeptOutputMutatedError` in the backward.
- Higher-order operators (flex_attention, invoke_subgraph, ...) reach the modes through the
  same redirect torch registers for its own SAC modes, and the key through a kernel of its own.

Under ``torch.compile`` the checkpoint is traced once and the partitioner reads each node's
policy tag; there the contexts are torch's own ``create_selective_checkpoint_contexts`` with the
same policy, so compiled and eager decisions are the same and nothing runs per operator.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointError,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from prime_ac import _compat, intercept
from prime_ac.policy import (
    HOST_SYNC,
    KEPT,
    MANDATORY,
    SCOPED,
    Mode,
    OperatorPolicy,
    make_policy,
    reads_device_into_host,
)
from prime_ac.targets import operator_key

__all__ = [
    "KeptOutputMutatedError",
    "RegionCache",
    "ReplayMismatchError",
    "checkpoint_contexts",
    "context_fn",
]

# FSDP2 runs its hooks under record_function; a recompute can emit a different number of these
# markers than the forward did. They carry no data: both modes let them through uncounted.
_PROFILER_OPS = frozenset(
    {
        torch.ops.profiler._record_function_enter.default,
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    }
)
IGNORED_OPS = _compat.SAC_IGNORED_OPS | _PROFILER_OPS

# Action codes, in the order the hot paths test them. Codes up to RUN just run in the forward,
# codes up to WRITE just run in the recompute.
PASS = 0  # ignored (detach, profiler markers): uncounted, never kept
RUN = 1  # replayed
WRITE = 2  # replayed, writes an argument: copy kept results it would overwrite
KEEP = 3  # kept, every call
KEEP_WRITE = 4  # kept and writes an argument (mandatory side effects)
SYNC = 5  # kept when the call reads a device tensor into host memory
PLANNED = 6  # replayed except the calls a budget plan keeps (by call index)
CALL = 7  # a user policy callable decides per call
SCOPE = 8  # kept where the call's module scope or tag says so (prime_ac.scopes)

_set_eval_frame = _compat.set_eval_frame
_PREFER_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
_SAVES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)
_CONSUMED = object()
_MISSING = object()


class ReplayMismatchError(CheckpointError):
    """The recompute of a checkpointed block would receive the wrong kept results."""


class KeptOutputMutatedError(CheckpointError):
    """A kept result was modified in place where prime_ac could not copy it first."""


class Rules:
    """The action code of each operator overload for one policy, computed once per overload.

    ``plan`` maps an operator to the call indices a budget plan keeps (``prime_ac.budget``).
    """

    def __init__(self, policy: Any, plan: Mapping[Any, frozenset[int]] | None = None):
        self.policy = policy
        self.plan = dict(plan or {})
        self.actions: dict[Any, int] = {}
        self.writes: dict[Any, tuple[tuple[int, str], ...] | None] = {}
        self._classify = policy.classify if isinstance(policy, OperatorPolicy) else None
        self._planned = {operator_key(op) for op in self.plan}
        self.table: Any = None  # the codes gates read (prime_ac.intercept), made on first use
        self._listed = 0  # registry entries already given gates
        self._coded = 0  # gated operators already coded in the table
        self._hops = -1  # size of the higher-order operator registry then

    def intercepts(self) -> bool:
        """Whether regions can use the dispatch key: the decision must follow from operator names
        (a policy callable wants every call) and the key must be free. Also adds the gates for
        operators registered since the last call and codes every gated operator in the table."""
        if self._classify is None or not intercept.available():
            return False
        entries = intercept.registry(relist=not _awaiting_recompute)
        if len(entries) != self._listed or _compat.hop_registry_size() != self._hops:
            self._hops = _compat.hop_registry_size()
            ops = [
                op
                for key, mutable in entries[self._listed :]
                if mutable or key in self._planned or self.policy.may_keep(key)
                if (op := intercept.resolve(key)) is not None and op not in IGNORED_OPS
            ]
            intercept.ensure_gates([*ops, *_compat.sac_hops()])
            self._listed = len(entries)
        gated = intercept.gated()
        if self._coded != len(gated):  # including the gates other policies added
            if self.table is None:
                self.table = intercept.new_table()
            for op in gated[self._coded :]:
                self.code(op)
            self._coded = len(gated)
        return True

    def code(self, op: Any) -> int:
        """The action code of ``op``, also written to the table (for a gate that lacked it)."""
        code = self.action(op)
        self.table.set(op._schema.name, op._schema.overload_name, code)
        return code

    def action(self, op: Any) -> int:
        code = self.actions.get(op)
        if code is None:
            code = self.actions[op] = self._decide(op)
        return code

    def _decide(self, op: Any) -> int:
        if op in IGNORED_OPS:
            return PASS
        written = _compat.written_arguments(op)
        writes = written != ()
        if writes:
            self.writes[op] = written
        if self._classify is None:
            return CALL
        decision = self._classify(op)
        if decision in (MANDATORY, KEPT):
            return KEEP_WRITE if writes else KEEP
        if decision == HOST_SYNC:
            return SYNC
        if decision == SCOPED:
            return SCOPE
        if op in self.plan and not writes:
            return PLANNED
        return WRITE if writes else RUN


class RegionCache:
    """The kept results of one checkpointed region, shared by its two modes.

    ``entries[op][index]`` is ``[value, spec, versions]``: a detached tensor, its tree spec
    (None for a single tensor, ``tuple`` for a tuple of tensors) and the version counter(s) it
    had when kept. A region on the dispatch key keeps the operators kept every call in its
    native ``store`` instead (C++, same checks); ``stored`` and ``hits`` count both.
    ``copies`` and ``copied_bytes`` count the copy-on-write copies.
    """

    __slots__ = (
        "__weakref__",
        "_hits",
        "_stored",
        "copied_bytes",
        "copies",
        "entries",
        "forward_calls",
        "held",
        "name",
        "store",
    )

    def __init__(self, name: str, store: Any = None):
        self.name = name
        self.store = store  # intercept.new_store() for a region on the key
        self.entries: dict[Any, dict[int, Any]] = {}
        self.forward_calls: dict[Any, int] = {}  # counted calls per operator in the forward
        self.held: dict[int, list[tuple[Any, int]]] = {}  # storage id -> entries holding it
        self._stored = 0  # kept results stored by the forward
        self._hits = 0  # kept results handed to the recompute
        self.copies = 0
        self.copied_bytes = 0

    @property
    def stored(self) -> int:
        """Kept results stored by the forward."""
        return self._stored + (self.store.stored if self.store is not None else 0)

    @property
    def hits(self) -> int:
        """Kept results handed to the recompute."""
        return self._hits + (self.store.hits if self.store is not None else 0)

    def keeps(self) -> bool:
        """Whether the forward kept anything (else the recompute needs no interception)."""
        return bool(self.entries) or self.stored > 0

    def kept_ops(self) -> set[Any]:
        """The operators with kept results."""
        ops = set(self.entries)
        if self.store is not None:
            ops.update(intercept.resolve_schema(*name) for name in self.store.kept_ops())
        return ops

    def keep(self, op: Any, index: int, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            value = _compat.detach(out)
            entry = [value, None, _compat.version(value)]
            self._hold(value, op, index)
        else:
            if type(out) is tuple and all(isinstance(x, torch.Tensor) for x in out):
                leaves, spec = list(out), tuple  # most multi-output operators: no tree spec
            else:
                leaves, spec = _compat.tree_flatten(out)
            leaves = [_compat.detach(x) if isinstance(x, torch.Tensor) else x for x in leaves]
            entry = [leaves, spec, [_version_or_none(x) for x in leaves]]
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    self._hold(leaf, op, index)
        self.entries.setdefault(op, {})[index] = entry
        self._stored += 1

    def handed_back(self, op: Any) -> int:
        """How many kept results of ``op`` the recompute received (and so did not rerun)."""
        return sum(entry is _CONSUMED for entry in self.entries.get(op, {}).values())

    def _hold(self, t: torch.Tensor, op: Any, index: int) -> None:
        sid = _compat.storage_id(t)
        if sid is not None:
            self.held.setdefault(sid, []).append((op, index))
            if self.store is not None:  # writes to it must reach Python
                self.store.hold(sid)

    def copy_before_write(self, tensors: Iterable[torch.Tensor]) -> None:
        """Replace every kept result sharing a storage with ``tensors`` by a copy of it."""
        for t in tensors:
            sid = _compat.storage_id(t)
            if sid is not None and self.store is not None:
                self.store.copy_before_write(sid, self._copied)
            for op, index in self.held.pop(sid, ()):
                entry = self.entries[op][index]
                if entry[1] is None:
                    entry[0] = self._copy(entry[0], op, index)
                    entry[2] = 0
                    continue
                for i, leaf in enumerate(entry[0]):
                    if isinstance(leaf, torch.Tensor) and _compat.storage_id(leaf) == sid:
                        entry[0][i] = self._copy(leaf, op, index)
                        entry[2][i] = 0

    def _copy(self, t: torch.Tensor, op: Any, index: int) -> torch.Tensor:
        copy = self._copied(t)
        self._hold(copy, op, index)
        return copy

    def _copied(self, t: torch.Tensor) -> torch.Tensor:
        """A counted copy of kept tensor ``t`` (also for the native store's kept tensors)."""
        copy = t.clone()
        if copy.stride() != t.stride():  # overlapping or gapped layout: copy the whole storage
            storage = t.untyped_storage()
            copy = torch.empty(0, dtype=t.dtype, device=t.device)
            copy.set_(storage.clone(), t.storage_offset(), t.size(), t.stride())
        self.copies += 1
        self.copied_bytes += copy.untyped_storage().nbytes()
        return copy

    def take(self, op: Any, index: int, entry: Any) -> Any:
        """The kept result for the recompute, checked against later in-place writes."""
        value, spec, versions = entry
        if spec is None:
            if _compat.version(value) != versions:
                raise self._mutated(op, index)
            return value
        for leaf, seen in zip(value, versions, strict=True):
            if seen is not None and _compat.version(leaf) != seen:
                raise self._mutated(op, index)
        return tuple(value) if spec is tuple else _compat.tree_unflatten(value, spec)

    def _mutated(self, op: Any, index: int) -> KeptOutputMutatedError:
        return KeptOutputMutatedError(
            f"prime_ac: {self.name} keeps the result of {op} (call #{index + 1}) for its "
            "backward, and that result was modified in place after the block's forward returned "
            "(or by code no dispatch mode sees), so the value the backward needs is gone. Clone "
            "the block's output before writing to it in place (out = out.clone()), or leave "
            f"{op} out of the targets (mandatory operators cannot be left out)."
        )

    def error(self, kind: str, op: Any, index: int, ran: int) -> CheckpointError:
        """The error for call ``index`` of ``op`` in the recompute (``kind`` from the native
        store; ``ran``: the forward's calls)."""
        if kind == "mutated":
            return self._mutated(op, index)
        if kind == "consumed":
            return _second_backward(self.name)
        return self.mismatch(op, index, ran)

    def mismatch(self, op: Any, index: int, ran: int | None = None) -> ReplayMismatchError:
        ran = self.forward_calls.get(op, 0) if ran is None else ran
        return ReplayMismatchError(
            f"prime_ac: the recompute of {self.name} called {op} a {_ordinal(index + 1)} time, "
            f"but its forward called it {ran} time(s) and kept the results: the recompute would "
            "receive the wrong kept results. The block must call this operator the same way in "
            "forward and recompute. Common causes: state filled during the forward that the "
            "recompute sees again, such as a KV cache (Hugging Face models called with "
            "use_cache=True in training append to it again in the recompute: pass "
            "use_cache=False), buffers created lazily on the first forward (create them before "
            "the first checkpointed forward), and data-dependent control flow or global state "
            "that changed between forward and backward."
        )


def _second_backward(name: str) -> CheckpointError:
    return CheckpointError(
        f"prime_ac: backward ran a second time through {name}, whose kept results were handed "
        "to the first backward. Selective checkpointing allows one backward per forward (as "
        "torch's own does); use mode='full' with no kept operators, or run the forward again."
    )


def _version_or_none(x: Any) -> int | None:
    return _compat.version(x) if isinstance(x, torch.Tensor) else None


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _written_tensors(written: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    if written is None:  # unknown: every tensor argument
        return [t for t in _compat.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    tensors = []
    for position, name in written:
        value = args[position] if position < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            tensors.extend(t for t in value if isinstance(t, torch.Tensor))
    return tensors


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


class _Decisions:
    """One side of a region: how a call is handled, however it arrives (a mode or the key).

    Actions up to ``limit`` just run (through ``run``); the rest go to the side's ``_dispatch``.
    """

    run = staticmethod(_call)
    limit = RUN

    def __init__(self, cache: RegionCache, rules: Rules):
        self.cache, self.rules, self.actions = cache, rules, rules.actions

    def handle(self, func: Any, args: tuple, kwargs: dict) -> Any:
        action = self.actions.get(func)
        if action is None:
            action = self.rules.action(func)
        if action <= self.limit:
            return self.run(func, args, kwargs)
        return self._dispatch(func, action, args, kwargs)


class _Keeping(_Decisions):
    """The forward: runs every operator, keeps what the rules keep."""

    def _dispatch(self, func: Any, action: int, args: tuple, kwargs: dict) -> Any:
        cache = self.cache
        if (cache.held or cache.store is not None) and func in self.rules.writes:
            cache.copy_before_write(_written_tensors(self.rules.writes[func], args, kwargs))
        out = self.run(func, args, kwargs)
        if action == WRITE:
            return out
        if action == SYNC and not reads_device_into_host(func, args, kwargs):
            return out
        index = cache.forward_calls.get(func, 0)
        cache.forward_calls[func] = index + 1
        if action == PLANNED:
            if index not in self.rules.plan[func]:
                return out
        elif action == SCOPE:
            if not self.rules.policy.scoped.keeps_here(func, args):
                return out
        elif action == CALL:
            decision = self.rules.policy(_compat.sac_context(out), func, *args, **kwargs)
            if decision not in _SAVES:
                return out
        cache.keep(func, index, out)
        return out


class _Replaying(_Decisions):
    """The recompute: hands kept results back, runs everything else."""

    limit = WRITE  # writes are copied before in the forward only

    def __init__(self, cache: RegionCache, rules: Rules):
        super().__init__(cache, rules)
        self.calls: dict[Any, int] = {}

    def _dispatch(self, func: Any, action: int, args: tuple, kwargs: dict) -> Any:
        if action == SYNC and not reads_device_into_host(func, args, kwargs):
            return self.run(func, args, kwargs)
        out = self.kept(func)
        return self.run(func, args, kwargs) if out is NotImplemented else out

    def kept(self, func: Any) -> Any:
        """The kept result for the next call of ``func``, or NotImplemented when the recompute
        runs the call; raises when the kept results and the calls no longer match."""
        cache = self.cache
        if cache.store is not None and self.actions[func] == KEEP and intercept.is_gated(func):
            return intercept.take(cache.store, func, cache.error)  # kept in C++ by its gate
        index = self.calls.get(func, 0)
        self.calls[func] = index + 1
        kept = cache.entries.get(func)
        if kept is None:  # this operator kept nothing here: an extra call changes nothing
            return NotImplemented
        entry = kept.get(index, _MISSING)
        if entry is _MISSING:
            if index < cache.forward_calls.get(func, 0):  # marked for replay
                return NotImplemented
            raise cache.mismatch(func, index)
        if entry is _CONSUMED:
            raise _second_backward(cache.name)
        kept[index] = _CONSUMED
        cache._hits += 1
        return cache.take(func, index, entry)


class _HandlingMode(_compat.DispatchMode):
    """A dispatch mode that hands every call to ``self.handle``."""

    def __enter__(self):
        _compat.redirect_hops(type(self))
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        prior = _set_eval_frame(None)  # no dynamo inside the handler (see _compat.DispatchMode)
        try:
            return self.handle(func, args, kwargs or {})
        finally:
            _set_eval_frame(prior)


class KeepMode(_Keeping, _HandlingMode):
    """The forward as a dispatch mode, which sees every operator: with a policy callable, under
    another mode, without the key, and in the audit (which records every call)."""

    def __init__(self, cache: RegionCache, rules: Rules):
        _HandlingMode.__init__(self)
        _Keeping.__init__(self, cache, rules)

    def __exit__(self, *exc: Any):
        self.cache.held = {}  # only writes inside the forward are copied
        return super().__exit__(*exc)


class ReplayMode(_Replaying, _HandlingMode):
    """The recompute as a dispatch mode."""

    record = False  # True: enter even when nothing was kept (the audit counts replays)

    def __init__(self, cache: RegionCache, rules: Rules):
        _HandlingMode.__init__(self)
        _Replaying.__init__(self, cache, rules)
        self._entered = False

    def __enter__(self):
        self.calls.clear()  # a second backward finds consumed entries, not shifted indices
        self._entered = self.cache.keeps() or self.record
        if not self._entered:  # nothing kept: recompute exactly as plain checkpointing
            return self
        return super().__enter__()

    def __exit__(self, *exc: Any):
        if self._entered:
            return super().__exit__(*exc)
        return None


# The caches of key regions that kept results and were not recomputed yet (or freed unused).
_awaiting_recompute: weakref.WeakSet[RegionCache] = weakref.WeakSet()


class _KeyRegion(_Decisions):
    """One side of a region on the dispatch key (``prime_ac.intercept``)."""

    run = staticmethod(intercept.run_below)
    recompute = False

    def _enter_key(self) -> Any:
        rules, cache = self.rules, self.cache
        return intercept.enter(
            rules.table, cache.store, self.recompute, self._handle_call, rules.code, cache.error
        )

    def _handle_call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        prior = _set_eval_frame(None)  # no dynamo inside the handler (see _compat.DispatchMode)
        try:
            return self.handle(func, args, kwargs)
        finally:
            _set_eval_frame(prior)


class KeepRegion(_KeyRegion, _Keeping):
    """The forward through the dispatch key: only the calls the rules act on reach Python, and
    operators kept every call are kept in C++ (``cache.store``)."""

    def __enter__(self) -> KeepRegion:
        self._region = self._enter_key()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._region.exit()
        self._region = None
        cache = self.cache
        cache.held = {}  # only writes inside the forward are copied
        cache.store.release_all()
        if cache.keeps():
            _awaiting_recompute.add(cache)


class ReplayRegion(_KeyRegion, _Replaying):
    """The recompute through the dispatch key.

    A dispatch mode active around the recompute (FlopCounterMode around backward) sits above the
    key and would see the kept operators as if they ran: a shield mode then takes every call
    before any other mode does and hands it to this region.
    """

    recompute = True

    def __enter__(self) -> ReplayRegion:
        self.calls.clear()
        self._region = self._shield = None
        if not self.cache.keeps():  # nothing kept: recompute exactly as plain checkpointing
            return self
        self._region = self._enter_key()
        if _compat.dispatch_mode_active():
            self._shield = _Shield(self).__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._shield is not None:
            self._shield.__exit__(*exc)
        if self._region is not None:
            self._region.exit()
        self._region = self._shield = None
        _awaiting_recompute.discard(self.cache)


class _Shield(_HandlingMode):
    def __init__(self, region: ReplayRegion):
        super().__init__()
        self.handle = region.handle


def _must_recompute(policy: OperatorPolicy, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    # Eager replays every operator it does not keep; MUST_RECOMPUTE makes the partitioner do the
    # same (with PREFER_RECOMPUTE, torch 2.9's min-cut partitioner saves some instead).
    decision = policy(ctx, op, *args, **kwargs)
    return CheckpointPolicy.MUST_RECOMPUTE if decision is _PREFER_RECOMPUTE else decision


def checkpoint_contexts(rules: Rules, name: str) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` applying ``rules`` (one :class:`RegionCache` per region).

    Under torch.compile it returns torch's own contexts with the same policy (see the module
    docstring). In eager mode a region intercepts through the dispatch key when it can, and
    uses dispatch modes when a mode is already active around the forward or the policy is a
    callable.
    """

    compiled_policy = rules.policy
    if isinstance(rules.policy, OperatorPolicy):
        compiled_policy = functools.partial(_must_recompute, rules.policy)

    def contexts() -> tuple[Any, Any]:
        if _compat.is_tracing():
            return create_selective_checkpoint_contexts(compiled_policy)
        if not _compat.dispatch_mode_active() and rules.intercepts():
            cache = RegionCache(name, intercept.new_store())
            return KeepRegion(cache, rules), ReplayRegion(cache, rules)
        cache = RegionCache(name)
        return KeepMode(cache, rules), ReplayMode(cache, rules)

    return contexts


def context_fn(
    mode: Mode = "selective",
    targets: Iterable[str] | None = None,
    mandatory: Iterable[str] = (),
    *,
    policy: OperatorPolicy | Callable[..., Any] | None = None,
    name: str = "<checkpointed region>",
) -> Callable[[], tuple[Any, Any]]:
    """What ``torch.utils.checkpoint.checkpoint(..., context_fn=...)`` takes.

    For trainers that wrap regions themselves. ``policy`` is an :class:`OperatorPolicy` (built
    from ``mode``/``targets``/``mandatory`` when None) or any torch SAC policy callable
    ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``, called once per forward operator call.
    ``name`` appears in errors.

    Example::

        from torch.utils.checkpoint import checkpoint
        out = checkpoint(block, x, use_reentrant=False, context_fn=prime_ac.context_fn("selective"))
    """
    policy = make_policy(mode, targets, mandatory) if policy is None else policy
    if not callable(policy):
        raise TypeError(
            f"policy={policy!r} is not callable: pass prime_ac.make_policy(...) or a function "
            "(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy"
        )
    return checkpoint_contexts(Rules(policy), name)
