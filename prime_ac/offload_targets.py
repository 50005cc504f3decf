"""``offload=[...]``: operators the user names, whose results go to host memory.

A named operator's calls are kept (one the mode would replay is kept too) and every kept call of
it is handed to one :class:`prime_ac.offload.Offloader` shared by the configuration's blocks,
which sizes its host buffer from the first step (no plan says how much goes out). Views and
operators that write an argument are never offloaded (their results share a storage that
dropping would not free, or must be written again): they stay as the mode decides. Parameters
and tensors that need grad stay on the device (the offloader refuses them). Mandatory, random
and collective operators may be named: they stay kept either way, never replayed.

Compiled blocks tag the same calls ``MUST_CPU_OFFLOAD`` and torch's compile-side offload moves
them (:mod:`prime_ac.compiled`; torch 2.13+, a clear error on older torch); on the CPU they stay
where they are, with a warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prime_ac._compat import returns_alias, schema_is_mutable
from prime_ac.actions import Action
from prime_ac.contexts import with_recipe
from prime_ac.offload import Offloader
from prime_ac.policy import OperatorPolicy
from prime_ac.scopes import ScopeRules
from prime_ac.targets import TargetSet, operator_key, translate_composites

__all__ = ["OffloadPolicy", "offload_policies", "offloading_context_fn", "with_offload"]


class OffloadPolicy(OperatorPolicy):
    """An :class:`OperatorPolicy` that also keeps the ``offload`` operators, whose kept results
    :attr:`offloader` moves to host memory (its ``ledger`` counts the bytes)."""

    def __init__(
        self,
        mode: Any,
        targets: TargetSet,
        mandatory: TargetSet,
        scoped: ScopeRules | None,
        offload: TargetSet,
        offloader: Offloader,
    ):
        super().__init__(mode, targets, mandatory, scoped)
        self.offload, self.offloader = offload, offloader
        self._offloads: dict[Any, bool] = {}

    def _decide(self, op: Any) -> Action:
        action = super()._decide(op)
        return Action.KEEP if action is Action.REPLAY and self.offloads(op) else action

    def offloads(self, op: Any) -> bool:
        """Whether the kept calls of ``op`` (a store's key) go to host memory."""
        answer = self._offloads.get(op)
        if answer is None:
            answer = self._offloads[op] = (
                not isinstance(op, tuple)  # compiled code, keyed by its storages
                and not returns_alias(op)
                and not schema_is_mutable(op)
                and self.offload.matches(operator_key(op))
            )
        return answer

    def __reduce__(self) -> tuple[Any, ...]:
        # the offloader copies as a fresh one (Offloader.__reduce__), once for all the policies
        # and context functions sharing it
        args = (self.mode, self.targets, self.mandatory, self.scoped, self.offload, self.offloader)
        return (OffloadPolicy, args)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, offload={list(self.offload)!r})"


def with_offload(policy: OperatorPolicy, offload: TargetSet, offloader: Offloader) -> Any:
    """``policy`` keeping and offloading the ``offload`` operators too."""
    return OffloadPolicy(
        policy.mode, policy.targets, policy.mandatory, policy.scoped, offload, offloader
    )


def offloading_context_fn(
    context_fn: Callable[[], tuple[Any, Any]], policy: Any
) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` whose regions hand ``policy``'s offloaded calls to its offloader (an
    :class:`OffloadPolicy`; any other policy: ``context_fn`` itself)."""
    if not isinstance(policy, OffloadPolicy):
        return context_fn

    def contexts() -> tuple[Any, Any]:
        forward, recompute = context_fn()
        store = getattr(forward, "store", None)  # None: a compiled region (torch's contexts)
        if store is not None:
            store.offloader, store.offload_ops = policy.offloader, policy.offloads
        return forward, recompute

    return with_recipe(contexts, offloading_context_fn, context_fn, policy)


def offload_policies(policies: dict[str, Any], offload: Any) -> dict[str, Any]:
    """Each mode's policy also offloading the ``offload`` names (None: unchanged), all of them
    sharing one offloader."""
    if offload is None:
        return policies
    targets, offloader = TargetSet(translate_composites(offload)), Offloader(None)
    return {mode: with_offload(p, targets, offloader) for mode, p in policies.items()}
