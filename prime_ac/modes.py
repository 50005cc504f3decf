"""The two dispatch modes of an eager checkpointed region: one keeps, one replays.

``torch.utils.checkpoint.checkpoint(fn, use_reentrant=False, context_fn=...)`` runs the forward
under the first context ``context_fn`` returns and the recompute under the second. prime_ac's are
:class:`KeepMode` and :class:`ReplayMode`, two dispatch modes sharing one
:class:`prime_ac.store.RegionStore`, written for the fewest Python steps per operator (what
torch's own SAC modes do in a policy call, a pytree map and a counter per operator, these do in
one dictionary lookup for the operators they replay):

- The :class:`~prime_ac.actions.Action` for an operator overload is decided once per region
  (:class:`Rules`). Replayed operators are neither counted nor stored: the recompute derives
  the same action and just runs them.
- Operators that write an argument copy the kept results they would overwrite first (copy on
  write, :mod:`prime_ac.store`); nothing is copied while nothing is kept. A kept target that
  returns nothing (an out= GEMM) keeps the tensors it wrote, and its recompute call copies
  them into its own arguments instead of computing them.
- A region that kept nothing recomputes with no mode at all, exactly as plain checkpointing.
- Higher-order operators (flex_attention, invoke_subgraph, ...) reach the modes through the
  redirect torch registers for its own SAC modes (:func:`prime_ac._compat.redirect_hops`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from prime_ac import _compat
from prime_ac.actions import IGNORED_OPS, Action
from prime_ac.policy import OperatorPolicy, reads_device_into_host
from prime_ac.store import RegionStore, input_shapes

__all__ = ["KeepMode", "ReplayMode", "Rules", "written_tensors"]

_IGNORE, _REPLAY, _KEEP_WRITTEN = Action.IGNORE, Action.REPLAY, Action.KEEP_WRITTEN
_INDUCTOR_COMPILED_CODE = _compat.INDUCTOR_COMPILED_CODE
_PER_CALL = frozenset({Action.PLANNED, Action.SCOPED, Action.ASK})
_set_eval_frame = _compat.set_eval_frame
_SAVES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)


class Rules:
    """The :class:`Action` of each operator overload under one policy, decided on first sight.

    ``plan`` maps an operator to the call indices a budget plan keeps (:mod:`prime_ac.budget`).
    ``writes`` holds, for each overload that writes an argument, which ones. ``watch`` (a
    :class:`prime_ac.watch.Watch`) learns each overload the first time it is decided, and
    ``block`` is the name it knows this region by.
    """

    def __init__(
        self,
        policy: Any,
        plan: Mapping[Any, frozenset[int]] | None = None,
        watch: Any = None,
        block: str | None = None,
    ):
        self.policy = policy
        self.plan = dict(plan or {})
        self.actions: dict[Any, Action] = {}
        self.writes: dict[Any, tuple[tuple[int, str], ...] | None] = {}
        self.watch, self.block = watch, block
        # call indices of kept operators the first step found no backward reads (neither they
        # nor a view of them saved: a frozen LoRA base's GEMM), replayed from then on
        # (prime_ac.watch.Watch drops them)
        self.dropped: dict[Any, set[int]] = {}
        self._classify = policy.classify if isinstance(policy, OperatorPolicy) else None

    def action(self, op: Any) -> Action:
        action = self.actions.get(op)
        if action is None:
            action = self.actions[op] = self._decide(op)
            if self.watch is not None and action is not _IGNORE:
                self.watch.saw(op)
        return action

    def _decide(self, op: Any) -> Action:
        if op in IGNORED_OPS:
            return _IGNORE
        written = _compat.written_arguments(op)
        if written != ():
            self.writes[op] = written
        if self._classify is None:  # a policy callable: asked for every call but of views and
            # in-place ops, which replay (a view kept apart from its base would miss writes to
            # the recomputed base; an in-place op must write again)
            return _REPLAY if _compat.returns_alias(op) else Action.ASK
        action = self._classify(op)
        if action is _REPLAY and op in self.plan and written == ():
            return Action.PLANNED
        return action


class _RegionMode(_compat.DispatchMode):
    def __init__(self, store: RegionStore, rules: Rules):
        super().__init__()
        self.store, self.rules = store, rules
        self._actions = rules.actions

    def __enter__(self):
        _compat.redirect_hops(type(self))
        return super().__enter__()


class KeepMode(_RegionMode):
    """The forward: runs every operator and keeps what the rules keep."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        prior = _set_eval_frame(None)  # no dynamo inside the handler (see _compat.DispatchMode)
        try:
            action = self._actions.get(func)
            if action is None:
                action = self.rules.action(func)
            kwargs = kwargs or {}
            store = self.store
            if store.held and func in self.rules.writes:
                store.copy_before_write(written_tensors(self.rules.writes[func], args, kwargs))
            out = func(*args, **kwargs)
            if action is _REPLAY or action is _IGNORE:
                return out
            if action is Action.HOST_SYNC and not reads_device_into_host(func, args, kwargs):
                return out
            key = func if func is not _INDUCTOR_COMPILED_CODE else _compat.storage_key(func, args)
            calls = store.forward_calls
            index = calls.get(key, 0)
            calls[key] = index + 1
            if action in _PER_CALL and not self._keeps_call(action, func, index, args, kwargs, out):
                return out
            dropped = self.rules.dropped
            if dropped and index in dropped.get(key, ()):
                return out
            if action is _KEEP_WRITTEN:  # it returns nothing: what it wrote is its result
                kept = tuple(written_tensors(self.rules.writes[func], args, kwargs))
                store.keep(key, index, kept, input_shapes(args, kwargs))
                return out
            store.keep(key, index, out, input_shapes(args, kwargs))
            return out
        finally:
            _set_eval_frame(prior)

    def _keeps_call(self, action: Action, func, index: int, args, kwargs, out) -> bool:
        """For actions decided per call: whether this call is kept."""
        if action is Action.PLANNED:
            return index in self.rules.plan[func]
        if action is Action.SCOPED:
            return self.rules.policy.scoped.keeps_here(func, args)
        ctx = _compat.sac_context(out)  # Action.ASK
        return self.rules.policy(ctx, func, *args, **kwargs) in _SAVES

    def __exit__(self, *exc: Any):
        self.store.forward_done()
        return super().__exit__(*exc)


class ReplayMode(_RegionMode):
    """The recompute: hands kept results back and runs everything else."""

    record = False  # True: enter even when nothing was kept (the audit counts replays)

    def __init__(self, store: RegionStore, rules: Rules):
        super().__init__(store, rules)
        self._entered = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        prior = _set_eval_frame(None)
        try:
            action = self._actions.get(func)
            if action is None:
                action = self.rules.action(func)
            kwargs = kwargs or {}
            if action is _REPLAY or action is _IGNORE:
                return func(*args, **kwargs)
            if action is Action.HOST_SYNC and not reads_device_into_host(func, args, kwargs):
                return func(*args, **kwargs)
            key = func if func is not _INDUCTOR_COMPILED_CODE else _compat.storage_key(func, args)
            out = self.store.take(key, args, kwargs)
            if out is NotImplemented:
                return func(*args, **kwargs)
            if action is _KEEP_WRITTEN:  # write what the forward wrote instead of computing it
                written = written_tensors(self.rules.writes[func], args, kwargs)
                for tensor, value in zip(written, out, strict=True):
                    tensor.copy_(value)
                return None
            return out
        finally:
            _set_eval_frame(prior)

    def __enter__(self):
        self.store.start_recompute()
        self._entered = self.store.keeps() or self.record
        if not self._entered:  # nothing kept: recompute exactly as plain checkpointing
            return self
        return super().__enter__()

    def __exit__(self, *exc: Any):
        if self._entered:
            return super().__exit__(*exc)
        return None


def written_tensors(written: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call writes (``written`` as :attr:`Rules.writes` holds it): what an out=
    operator that returns nothing produces."""
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
