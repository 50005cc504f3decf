"""``context_fn``: what ``torch.utils.checkpoint.checkpoint(..., context_fn=...)`` takes.

In eager mode a region runs its forward and its recompute under prime_ac's two dispatch modes
(:mod:`prime_ac.modes`), which share one store of kept results (:mod:`prime_ac.store`). Under
``torch.compile`` the checkpoint is traced once and the partitioner reads each node's policy tag;
there the contexts are torch's own selective-checkpoint modes tagging what the eager modes
decide (:mod:`prime_ac.compiled`), so compiled and eager decisions are the same and nothing runs
per operator.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from prime_ac import _compat
from prime_ac.compiled import compiled_plan, plan_contexts
from prime_ac.modes import KeepMode, ReplayMode, Rules
from prime_ac.policy import MODES, Mode, OperatorPolicy, make_policy, target_list
from prime_ac.scopes import parse_target
from prime_ac.store import KeptOutputMutatedError, RegionStore, ReplayMismatchError
from prime_ac.watch import MeasuringKeepMode, Watch

__all__ = [
    "KeptOutputMutatedError",
    "Recipe",
    "block_context_fn",
    "ReplayMismatchError",
    "checkpoint_contexts",
    "context_fn",
    "portable",
    "region_contexts",
    "with_recipe",
]

logger = logging.getLogger("prime_ac")


def region_contexts(rules: Rules, name: str) -> tuple[Any, Any]:
    """The (forward, recompute) contexts of one checkpointed call applying ``rules``."""
    if _compat.is_tracing():
        if rules.plan:
            raise _plan_under_compile(name)
        policy = rules.policy
        if isinstance(policy, OperatorPolicy):  # tags as eager decides: prime_ac.compiled
            return plan_contexts(compiled_plan(policy, owner=name).compile_handle)
        return create_selective_checkpoint_contexts(policy)
    store = RegionStore(name)
    watched = rules.watch is not None and rules.watch.measures(rules.block)
    keep = (MeasuringKeepMode if watched else KeepMode)(store, rules)
    return keep, ReplayMode(store, rules)


def _plan_under_compile(name: str) -> RuntimeError:
    return RuntimeError(
        f"prime_ac: {name} keeps the calls of a budget plan through a context_fn made for eager "
        "regions, which torch.compile guards by its code alone (regions with other plans would "
        "share its graph). Blocks of checkpoint_blocks(targets='auto') compile with their plan; "
        "for a region of your own, pass prime_ac.compiled.compiled_plan_context_fn(plan) under "
        "compile, or run this region eagerly."
    )


class Recipe:
    """How to make a block's ``context_fn`` again: ``factory(*args)``.

    A context function is a closure (torch.compile takes a function as a checkpoint's
    ``context_fn``, not an object), which neither pickles nor deep-copies: a copy would run the
    original's policy and offloader. The factories below attach their recipe to what they make
    (:func:`with_recipe`); a block's settings travel as the recipe (:func:`portable`), which
    pickles and copies as ``factory(*args)``, so the copy makes its own from copied arguments.
    """

    __slots__ = ("args", "factory")

    def __init__(self, factory: Callable[..., Any], args: tuple):
        self.factory, self.args = factory, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.factory, self.args)


_RECIPE = "_prime_ac_recipe"


def with_recipe(fn: Any, factory: Callable[..., Any], *args: Any) -> Any:
    """``fn``, made by ``factory(*args)``, carrying that recipe (a context function among the
    arguments travels as its own recipe)."""
    if not torch.compiler.is_compiling():  # dynamo sets no attribute on what it traces
        setattr(fn, _RECIPE, Recipe(factory, tuple(portable(a) for a in args)))
    return fn


def portable(context_fn: Any) -> Any:
    """What a copy of ``context_fn`` is made from: its recipe where it has one, else itself."""
    return getattr(context_fn, _RECIPE, context_fn) if callable(context_fn) else context_fn


def block_context_fn(
    policy: Any, block: str, watch: Watch | None = None, plan: Any = None
) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` of one block of a ``checkpoint_blocks`` configuration, reporting its
    first step to ``watch`` (:mod:`prime_ac.watch`); ``plan`` as for :class:`Rules`. A copy
    reports nothing (its recipe has no watch)."""
    fn = checkpoint_contexts(Rules(policy, plan, watch, block), f"block {block!r}")
    return with_recipe(fn, block_context_fn, policy, block, None, plan)


def checkpoint_contexts(rules: Rules, name: str) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` applying ``rules``, one store per checkpointed call.

    A function object, which torch.compile takes as a constant when it traces a ``checkpoint``
    given it (torch 2.9 refuses a ``functools.partial`` holding ``rules``); built inside a
    compiled function, a partial of the policy's handle (:func:`_traced_context_fn`).
    """
    if torch.compiler.is_compiling():
        if rules.plan:
            raise _plan_under_compile(name)
        return _traced_context_fn(rules.policy)

    def contexts() -> tuple[Any, Any]:
        return region_contexts(rules, name)

    return contexts


def context_fn(
    mode: Mode = "selective",
    targets: Iterable[str] | None = None,
    mandatory: Iterable[str] | None = (),
    *,
    policy: OperatorPolicy | Callable[..., Any] | None = None,
    name: str = "<checkpointed region>",
) -> Callable[[], tuple[Any, Any]]:
    """What ``torch.utils.checkpoint.checkpoint(..., context_fn=...)`` takes.

    For trainers that wrap regions themselves. ``policy`` is an :class:`OperatorPolicy` (built
    from ``mode``/``targets``/``mandatory`` when None) or any torch SAC policy callable
    ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``, called once per forward operator call
    (views and in-place operators excepted: they always replay, see :mod:`prime_ac.policy`).
    ``name`` appears in errors. It may be called inside a compiled function (with a policy built
    outside it). ``targets`` with a mode other than ``"selective"`` are unused, as in prime-rl's
    ``get_checkpoint_context_fn`` (logged once per setting).

    Example::

        import prime_ac, torch
        from torch.utils.checkpoint import checkpoint

        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        x = torch.randn(4, 8, requires_grad=True)
        out = checkpoint(block, x, use_reentrant=False, context_fn=prime_ac.context_fn("selective"))
        out.sum().backward()
    """
    if policy is not None:
        if not callable(policy):
            raise TypeError(
                f"policy={policy!r} is not callable: pass prime_ac.make_policy(...) or a function "
                "(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy"
            )
        return checkpoint_contexts(Rules(policy), name)
    targets = None if targets is None else tuple(target_list("targets", targets))
    if targets is not None and mode != "selective" and mode in MODES:
        targets = _unused_targets(mode, targets)
    mandatory = () if mandatory is None else tuple(target_list("mandatory", mandatory))
    if not torch.compiler.is_compiling():
        _rules_for(mode, targets, mandatory)  # bad settings raise here, not in the forward
    # Only constants in the partial: torch.compile traces a context_fn built inside a compiled
    # function, and takes a checkpoint's context_fn only as a Python constant.
    return functools.partial(_named_contexts, mode, targets, mandatory, name)


@functools.cache
def _unused_targets(mode: str, targets: tuple) -> None:
    """None for ``targets`` given with a mode that keeps none, as prime-rl's
    ``get_checkpoint_context_fn`` takes and ignores them; logged once per setting."""
    for target in targets:
        parse_target(target)  # a typo is an error even where the list is unused
    logger.info(
        "prime_ac: context_fn(%r, targets=%r): mode %r keeps no targets, so they are unused "
        "(prime-rl ignores them too); they apply with mode='selective'",
        mode,
        list(targets),
        mode,
    )
    return None


def _traced_context_fn(policy: Any) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` built inside a compiled function: dynamo passes a checkpoint neither a
    function defined in the code it traces nor a partial holding an object made there (Rules),
    and torch 2.9 no partial holding an :class:`OperatorPolicy`. A policy built outside comes
    through its ``compile_handle`` (see :func:`compiled_block_context_fn`); any other policy
    goes in the partial itself (a plain function is a constant to dynamo)."""
    handle = getattr(policy, "compile_handle", None)
    if handle is not None:
        return functools.partial(_handle_contexts, handle)
    return functools.partial(policy_contexts, policy)


def compiled_block_context_fn(policy: OperatorPolicy) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` of a checkpointed block in a compiled forward.

    dynamo guards a checkpoint's ``context_fn`` by its code only, so a block's own context_fn
    (one function per block) would let a block of another configuration reuse the graph
    compiled for the first. This partial holds the policy's ``compile_handle``, a function with
    a code object of its own (:func:`prime_ac._compat.own_code_getter`): blocks sharing a
    configuration share a graph, another configuration recompiles. A policy built inside a
    compiled function has no handle and goes in the partial, which dynamo guards by the policy's
    identity (torch 2.10+; torch 2.9 cannot trace building a policy).
    """
    return _traced_context_fn(policy)


def _handle_contexts(handle: Callable[[], Any]) -> tuple[Any, Any]:
    return policy_contexts(handle())


def policy_contexts(policy: Any) -> tuple[Any, Any]:
    """The (forward, recompute) contexts of a compiled region applying ``policy``."""
    return region_contexts(Rules(policy), "a compiled checkpointed region")


@functools.cache
def _rules_for(mode: str, targets: tuple | None, mandatory: tuple) -> Rules:
    """One :class:`Rules` per setting, shared by the regions of every context_fn with it (the
    rules are a pure function of the setting; sharing them decides each overload once)."""
    return Rules(make_policy(mode, targets, mandatory))


def _named_contexts(mode: str, targets: tuple | None, mandatory: tuple, name: str):
    return region_contexts(_rules_for(mode, targets, mandatory), name)
