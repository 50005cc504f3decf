"""The per-operator save/replay policy: which operators a checkpointed block keeps.

The contexts that apply it during a checkpointed forward and recompute are in
:mod:`prime_ac.contexts`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy

from prime_ac._compat import own_code_getter, returns_alias, returns_nothing, schema_is_mutable
from prime_ac import tables
from prime_ac.actions import Action
from prime_ac.scopes import ScopeRules, split_targets
from prime_ac.targets import (
    DEFAULT_TARGETS,
    HOST_SYNC_TARGETS,
    LEVEL_TARGETS,
    MANDATORY_TARGETS,
    RELEASE_DEPENDENT_OPERATORS,
    REPLAYED_BY_MODE,
    TargetSet,
    operator_key,
    registered_operators,
    translate_composites,
)

__all__ = ["MODES", "OperatorPolicy", "make_policy", "reads_device_into_host", "target_list"]

Mode = Literal["full", "full_moe", "projections", "attention", "matmul", "selective"]
MODES: tuple[str, ...] = ("full", "full_moe", "projections", "attention", "matmul", "selective")
"""prime-rl's modes, from keeping least to most: ``full`` keeps only the mandatory operators;
``full_moe`` also replays the FP8 Mega MoE (:data:`prime_ac.targets.REPLAYED_BY_MODE`);
``projections``, ``attention`` and ``matmul`` keep fixed sets
(:data:`prime_ac.targets.LEVEL_TARGETS`); ``selective`` keeps ``targets``."""
_KEEPS_NOTHING = ("full", "full_moe")

_SAVE = CheckpointPolicy.MUST_SAVE
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
_HOST_SYNC_OPS = frozenset(tuple(t.split("::")) for t in HOST_SYNC_TARGETS)
_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default


class OperatorPolicy:
    """``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy`` for selective checkpointing.

    The decision for an operator overload is computed once and cached, so the policy costs a
    dictionary lookup per op in eager mode. Mandatory operators are MUST_SAVE in every mode;
    targets are MUST_SAVE in the modes that keep targets unless their schema mutates an argument
    (a cached result would skip the write on recompute); everything else is PREFER_RECOMPUTE, views
    (``view``, ``t``, ``split``: results that alias an argument) included, so that in the recompute
    a view shares its base's storage as it did in the forward. A
    target that returns nothing and writes its arguments (an out= GEMM) is KEEP_WRITTEN: prime_ac's
    eager regions keep what it wrote; torch's SAC (compiled regions) recomputes it.
    """

    def __init__(
        self,
        mode: Mode,
        targets: TargetSet,
        mandatory: TargetSet,
        scoped: ScopeRules | None = None,
    ):
        self.mode = mode
        self.targets = targets
        self.mandatory = mandatory
        self.scoped = scoped  # scoped, forced-replay and tag targets, if any
        self._decisions: dict[Any, Action] = {}
        # A function returning this policy, with a code object of its own: dynamo guards it by
        # its code, so a compiled region's context_fn holding it (prime_ac.contexts) compiles one
        # graph per policy. dynamo cannot make a function while it traces: a policy built in a
        # compiled function has none.
        self.compile_handle = None if torch.compiler.is_compiling() else own_code_getter(self)

    def classify(self, op: Any) -> Action:
        """MANDATORY, KEEP, SCOPED, HOST_SYNC or REPLAY (:class:`prime_ac.actions.Action`): what
        a region does with every call of ``op``. HOST_SYNC depends on each call's devices,
        SCOPED on its module scope or tag."""
        decision = self._decisions.get(op)
        if decision is None:
            decision = self._decisions[op] = self._decide(op)
        return decision

    def _decide(self, op: Any) -> Action:
        if returns_alias(op):  # a view, kept apart from its base, would miss writes to the
            return Action.REPLAY  # recomputed base (replayed, it costs no FLOP); add_ must write
        key = operator_key(op)
        if self.mandatory.matches(key):
            return Action.MANDATORY
        if self.mode not in _KEEPS_NOTHING:
            if not schema_is_mutable(op):
                if self.scoped is not None and self.scoped.involves(key):
                    return Action.SCOPED
                if self.targets.matches(key):
                    return Action.KEEP
            elif returns_nothing(op) and self.targets.matches(key):
                return Action.KEEP_WRITTEN  # an out= op: what it wrote is its result
        if key[:2] in _HOST_SYNC_OPS:
            return Action.HOST_SYNC
        return Action.REPLAY

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        action = self._decisions.get(op)
        if action is None:
            action = self.classify(op)
        if action is Action.REPLAY or action is Action.KEEP_WRITTEN:
            return _RECOMPUTE  # torch's SAC caches the (empty) return and would skip the write
        if action is Action.HOST_SYNC:
            return _SAVE if reads_device_into_host(op, args, kwargs) else _RECOMPUTE
        if action is Action.SCOPED:
            return _SAVE if self.scoped.keeps_now(op, args) else _RECOMPUTE
        return _SAVE

    def __reduce__(self) -> tuple[Any, ...]:
        # decisions are keyed by operator objects, which do not pickle: a copy starts afresh
        # (and blocks sharing a policy share its copy, so compiled blocks still share a graph)
        return (OperatorPolicy, (self.mode, self.targets, self.mandatory, self.scoped))

    def __repr__(self) -> str:
        return (
            f"OperatorPolicy(mode={self.mode!r}, "
            f"targets={[*self.targets, *(self.scoped or ())]!r}, "
            f"mandatory={list(self.mandatory)!r})"
        )


def reads_device_into_host(op: Any, args: tuple, kwargs: dict) -> bool:
    """True for ``_to_copy(device_tensor, device=cpu)`` and ``_local_scalar_dense(device_tensor)``."""
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or source.device.type == "cpu":
        return False
    if op is _LOCAL_SCALAR_DENSE:
        return True
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


def target_list(argument: str, value: Any) -> list[Any]:
    """``value`` as a list (each string is validated later), or an error naming ``argument``."""
    if isinstance(value, str):
        raise ValueError(
            f"{argument} must be a list of strings, got the string {value!r}: write [{value!r}]"
        )
    try:
        return list(value)
    except TypeError:
        raise TypeError(
            f"{argument}={value!r} is not a list of targets: pass strings such as "
            f"{argument}=['aten::mm', 'flash_attn'] (docs/checkpointing.md, 'Targets')"
        ) from None


def make_policy(
    mode: Mode = "selective",
    targets: Iterable[str] | None = None,
    mandatory: Iterable[str] | None = (),
) -> OperatorPolicy:
    """Build the policy callable for ``create_selective_checkpoint_contexts``.

    ``targets=None`` keeps :data:`DEFAULT_TARGETS` (selective mode); a list replaces them; ``[]``
    keeps only the mandatory set. ``mandatory`` adds to :data:`MANDATORY_TARGETS`; it cannot
    remove from it. ``full`` keeps only the mandatory set, ``full_moe`` that set less the FP8
    Mega MoE; ``projections``, ``attention`` and ``matmul`` keep prime-rl's fixed sets
    (:data:`prime_ac.targets.LEVEL_TARGETS`) and take no ``targets`` (see :data:`MODES`). Scoped,
    forced-replay and tag targets (``"attention/aten::mm"``, ``"!feed_forward/aten::mm"``,
    ``"tag:attn_out"``) are decided per call (:mod:`prime_ac.scopes`).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a checkpoint mode: use one of {list(MODES)}")
    if mode in LEVEL_TARGETS:
        if targets is not None:
            raise ValueError(
                f"mode={mode!r} keeps a fixed set (prime_ac.targets.LEVEL_TARGETS[{mode!r}]) and "
                f"takes no targets, got targets={targets!r}: drop them, or use mode='selective' "
                "to keep a list of your own"
            )
        targets = LEVEL_TARGETS[mode]
    named = [] if targets is None else target_list("targets", targets)
    targets = DEFAULT_TARGETS if targets is None else named
    mandatory = () if mandatory is None else target_list("mandatory", mandatory)
    refuse_typos(
        TargetSet(split_targets(translate_composites(tables.user_named(named)))[0]).problems()
        + TargetSet(tables.user_named(mandatory)).problems(mandatory=True)
    )
    plain, scoped = split_targets(translate_composites(targets))
    target_set = TargetSet(plain)
    replayed = REPLAYED_BY_MODE.get(mode, ())
    base = [t for t in MANDATORY_TARGETS if t not in replayed]
    mandatory_set = TargetSet((*base, *TargetSet(mandatory)))
    rules = ScopeRules(scoped, target_set) if scoped and mode == "selective" else None
    return OperatorPolicy(mode, target_set, mandatory_set, rules)


# Namespaces torch fills when it loads: a name there that names no operator never will.
_TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional"})


def refuse_typos(problems: list[tuple[str, str]]) -> None:
    """Raise for the ``(target, reason)`` problems (:meth:`TargetSet.problems`) of names in
    torch's own namespaces that name no operator (``aten::mmm``: a typo, never a late backend),
    with the registered names closest to each. Shared by every entry that takes targets."""
    typos = [
        (target, reason)
        for target, reason in problems
        if reason.startswith("names no registered")
        and target.split("::")[0].split("/")[-1] in _TORCH_NAMESPACES
        and target.split("/")[-1].split(".")[0] not in RELEASE_DEPENDENT_OPERATORS
    ]
    if typos:
        raise ValueError(
            "targets naming no operator in a namespace torch loads with itself, so they never "
            "will: "
            + "; ".join(f"{target!r} {reason}{_close(target, reason)}" for target, reason in typos)
            + ". Fix the name (ns::op or ns::op.overload)."
        )


def _close(target: str, reason: str) -> str:
    """`` (did you mean ...?)`` naming registered operators close to ``target``'s (a wrong
    overload's reason lists the known overloads already)."""
    if "overload" in reason:
        return ""
    namespace, _, rest = target.split("/")[-1].partition("::")
    op = rest.split(".")[0]
    prefix = f"{namespace}::"
    names = {n[len(prefix) :].split(".")[0] for n in registered_operators() if n.startswith(prefix)}
    close = difflib.get_close_matches(op, sorted(names), n=3, cutoff=0.75)
    return f" (did you mean {', '.join(f'{namespace}::{c}' for c in close)}?)" if close else ""
