"""The wrapping state of a checkpointed block: its settings, wrapping and unwrapping it in
place, and the guard that makes a re-configuration all or nothing.

A wrapped block keeps its identity: prime_ac swaps the instance's class for a subclass whose
``forward`` runs the original one under ``torch.utils.checkpoint`` (the same technique FSDP2's
``fully_shard`` uses; :func:`prime_ac.region.run_region` runs it). No module is inserted, so
state-dict keys and every parameter, buffer and module name seen from the root stay exactly as
they were, and optimizer, FSDP and checkpoint loading code needs no name-stripping.

The settings live on the block (:class:`BlockCheckpoint`), so re-configuring a block is a change
of that state, never of its class: this keeps working after another wrapper (``fully_shard``)
has swapped the class again, and a block that stops being checkpointed there simply runs its own
forward.

These are the primitives; :mod:`prime_ac.discovery` finds the blocks and
:func:`prime_ac.checkpoint_blocks` decides what to wrap.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from prime_ac.compiled import compiled_plan, offload_ready, watched
from prime_ac.contexts import block_context_fn, portable
from prime_ac.policy import OperatorPolicy
from prime_ac.region import cache_positions, run_region
from prime_ac.remat import is_remat_checkpoint
from prime_ac.scopes import retrack, untrack

__all__ = [
    "BlockCheckpoint",
    "can_restore_class",
    "changes_undone_on_error",
    "checkpoint_state",
    "checkpointing_disabled",
    "is_checkpointed",
    "own_class",
    "unwrap_block",
    "unwrap_blocks",
    "wrap_block",
    "wrapped_blocks",
]

_STATE = "_prime_ac"  # the attribute holding a wrapped block's BlockCheckpoint


@dataclass(frozen=True)
class BlockCheckpoint:
    """How one wrapped block is checkpointed; stored on the block itself.

    ``active=False`` makes the block run its own forward with no checkpoint (a block prime_ac
    can no longer restore to its class, and the audit's no-AC baseline). ``plan`` is the
    :class:`prime_ac.budget.BlockPlan` of a ``targets="auto"`` block. ``early_stop`` and
    ``determinism_check`` go to ``torch.utils.checkpoint.checkpoint``; None leaves torch's
    defaults (``True``, ``"default"``).
    """

    name: str
    policy: OperatorPolicy
    context_fn: Callable[[], Any]
    preserve_rng_state: bool = True
    plan: Any = None
    active: bool = True
    original_class: type | None = None  # filled in by wrap_block
    early_stop: bool | None = None
    determinism_check: str | None = None
    # the first step's prime_ac.watch.Watch of this block's configuration (its bytes, once
    # every block ran), and why the block runs without checkpointing since then ("" while it
    # is checkpointed): its first step held at least what no AC holds for it
    watch: Any = dataclasses.field(default=None, compare=False, repr=False)
    bypassed: str = ""
    # ambient saved_tensors_hooks pack the kept results too (checkpoint_blocks' option)
    respect_saved_tensors_hooks: bool = False
    # the instance ``forward`` (a torch_remat checkpoint) prime_ac took over, put back by
    # unwrap_block; a copy of the block drops it (it calls the original block)
    shadowed_forward: Any = dataclasses.field(default=None, compare=False, repr=False)
    # the plan as a compiled region applies it (prime_ac.compiled.CompiledPlan), made by
    # wrap_block: blocks with equal plans share one, and one compiled graph
    compiled: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __reduce__(self) -> tuple[Any, ...]:
        # context_fn closes over the policy, and the policy caches decisions keyed by operator
        # objects (which do not pickle): a copy (deepcopy, pickle) rebuilds both from the
        # settings, so a copy never reads the scope tracker of the original. A targets="auto"
        # plan's or an offloading policy's contexts travel as their recipe
        # (prime_ac.contexts.Recipe): the copy's are made from its own plan and offloader.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["watch"] = None  # a copy reports nothing of the original's first step
        fields["shadowed_forward"] = None
        fields["compiled"] = None  # made again by wrap_block for the copy's policy
        policy = fields.pop("policy")
        if type(policy) is OperatorPolicy and self.plan is None:
            del fields["context_fn"]  # made again for the copied policy (OperatorPolicy.__reduce__)
        else:
            fields["context_fn"] = portable(self.context_fn)
        return (_restored_state, (policy, fields))


def _restored_state(policy: Any, fields: dict[str, Any]) -> BlockCheckpoint:
    if "context_fn" not in fields:
        fields["context_fn"] = block_context_fn(policy, fields["name"])
    return BlockCheckpoint(policy=policy, **fields)


class _CheckpointedBlock(nn.Module):
    """Mixin placed in front of a block's own class; see the module docstring."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state: BlockCheckpoint = getattr(self, _STATE)
        if state.plan is not None and getattr(state.plan, "training", None) not in (
            None,
            self.training,
        ):
            state.plan.warn_mode(self.training)  # profiled in eval(), trained in train()
        if (
            not state.active
            or state.bypassed
            or (state.plan is not None and not state.plan.checkpointed)
        ):  # a budget plan, or the first step's bytes (prime_ac.watch), may leave a block plain
            return super().forward(*args, **kwargs)
        return run_region(self, state, super().forward, args, kwargs)

    def __reduce_ex__(self, protocol: int) -> Any:
        # The wrapper class is made at run time and cannot be found by name: a pickled (or
        # deep-copied) block names its own class, and unpickling makes the wrapper again.
        if not can_restore_class(self):  # another wrapper swapped the class since: its rules
            return super().__reduce_ex__(protocol)
        return (_rewrapped, (getattr(self, _STATE).original_class,), self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        state = getattr(self, _STATE)
        retrack(self, state.policy if state.active else None)  # copied scope hooks: made afresh


def _rewrapped(original: type) -> nn.Module:
    return object.__new__(_wrapper_class(original))


# One wrapper class per block class, created once and reused so that blocks of one class share
# a class (isinstance, torch.compile's guards): a cache, not a registry. Pickles name the
# block's own class (``_CheckpointedBlock.__reduce_ex__``), never the wrapper.
_wrapper_classes: dict[type, type] = {}


def _wrapper_class(cls: type) -> type:
    if cls not in _wrapper_classes:
        _wrapper_classes[cls] = type(f"Checkpointed{cls.__name__}", (_CheckpointedBlock, cls), {})
    return _wrapper_classes[cls]


def own_class(block: nn.Module) -> type:
    """The class ``block`` has when prime_ac does not wrap it."""
    state = getattr(block, _STATE, None) if isinstance(block, _CheckpointedBlock) else None
    return type(block) if state is None else state.original_class


def checkpoint_state(module: nn.Module) -> BlockCheckpoint | None:
    """The settings of a block that prime_ac checkpoints, or None if it is not checkpointed."""
    state = getattr(module, _STATE, None) if isinstance(module, _CheckpointedBlock) else None
    return state if state is not None and state.active else None


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` runs as a checkpointed block: one prime_ac checkpoints (and has not
    stood down after a first step that held at least what no AC holds), or torch's
    ``CheckpointWrapper``, or torch_remat's checkpoint set as the instance's ``forward`` (as
    torchtitan sets it); an instance ``forward`` of any other kind, which prime_ac's class
    cannot reach, answers False.

    The question trainers ask with ``isinstance(module, CheckpointWrapper)`` (FastVideo does),
    which a prime_ac block answers False: it keeps its class's name and its state-dict keys.

    Example::

        prime_ac.checkpoint_blocks(model)
        assert all(prime_ac.is_checkpointed(block) for block in model.layers)
    """
    shadow = module.__dict__.get("forward")
    if shadow is not None:  # runs instead of any class's forward, prime_ac's included
        return is_remat_checkpoint(shadow)
    state = checkpoint_state(module)
    if state is not None:
        return not state.bypassed
    wrapper = sys.modules.get(_CHECKPOINT_WRAPPER)  # never imported: no module can be one
    return wrapper is not None and isinstance(module, wrapper.CheckpointWrapper)


_CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"


def wrapped_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` of every checkpointed block of ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if checkpoint_state(m) is not None]


def wrap_block(block: nn.Module, state: BlockCheckpoint) -> None:
    """Checkpoint ``block`` with ``state``; a block already wrapped only gets the new state."""
    if isinstance(block, _CheckpointedBlock):
        previous = getattr(block, _STATE)
        original = previous.original_class
        if state.shadowed_forward is None:  # a re-configuration still owes the taken-over one
            state = dataclasses.replace(state, shadowed_forward=previous.shadowed_forward)
    else:
        original = type(block)
        block.__class__ = _wrapper_class(original)
    cache_positions(original)
    compiled = None
    if state.plan is not None and state.plan.checkpointed:
        compiled = compiled_plan(
            state.policy,
            state.plan.kept,
            state.plan.offloaded,
            f"block {state.name!r}",
            block=original,
        )
    if state.watch is not None:  # a compiled block traced before its first step warns
        watched(state.policy, state.watch)
    offload_ready(state.policy, state.plan)
    setattr(block, _STATE, dataclasses.replace(state, original_class=original, compiled=compiled))


def can_restore_class(block: nn.Module) -> bool:
    """Whether ``block``'s class is still the one prime_ac gave it (not swapped since)."""
    state = getattr(block, _STATE, None)
    return state is not None and type(block) is _wrapper_classes.get(state.original_class)


def unwrap_block(block: nn.Module) -> None:
    """Stop checkpointing ``block``.

    Its class is restored; if another wrapper swapped the class since (``fully_shard``'s
    ``FSDPCheckpointed<X>``), prime_ac cannot restore it without undoing that wrapper, so the
    block keeps the class and runs its own forward with no checkpoint. Scope hooks (scoped
    targets) go either way.
    """
    if not isinstance(block, _CheckpointedBlock):
        return
    untrack(block)
    shadowed = getattr(block, _STATE).shadowed_forward
    if shadowed is not None:  # the torch_remat checkpoint prime_ac took over
        block.forward = shadowed
    if can_restore_class(block):
        block.__class__ = getattr(block, _STATE).original_class
        delattr(block, _STATE)
    else:
        setattr(block, _STATE, dataclasses.replace(getattr(block, _STATE), active=False))


def unwrap_blocks(model: nn.Module) -> list[str]:
    """Stop checkpointing every block of ``model``; returns their qualified names.

    Blocks get their own class back, except where another wrapper has swapped it since (see
    :func:`unwrap_block`): those run their own forward, unchanged otherwise.

    Example::

        prime_ac.checkpoint_blocks(model, mode="full")
        prime_ac.unwrap_blocks(model)  # ['layers.0', 'layers.1', ...]
    """
    blocks = wrapped_blocks(model)
    for _, block in blocks:
        unwrap_block(block)
    return [name for name, _ in blocks]


@contextmanager
def checkpointing_disabled(model: nn.Module) -> Iterator[None]:
    """Within the context, every checkpointed block of ``model`` runs without checkpointing.

    Nothing is unwrapped and no class changes, so it works under other wrappers (FSDP2); this is
    how the audit measures the no-AC baseline of a model it must not restructure.
    """
    states = [(block, checkpoint_state(block)) for _, block in wrapped_blocks(model)]
    for block, state in states:
        setattr(block, _STATE, dataclasses.replace(state, active=False))
    try:
        yield
    finally:
        for block, state in states:
            setattr(block, _STATE, state)


@contextmanager
def changes_undone_on_error(model: nn.Module) -> Iterator[None]:
    """If the body raises, every module of ``model`` gets back the class and checkpoint settings
    it had on entry, so a failed re-configuration leaves the model exactly as it was."""
    before = [
        (m, type(m), m.__dict__.get(_STATE), m.__dict__.get("forward")) for m in model.modules()
    ]
    try:
        yield
    except BaseException:
        for module, cls, state, forward in before:
            module.__class__ = cls
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward
            if state is None:
                module.__dict__.pop(_STATE, None)
            else:
                setattr(module, _STATE, state)
        raise
