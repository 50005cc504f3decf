"""Wrapping transformer blocks in non-reentrant checkpoint regions, in place, and finding them.

A wrapped block keeps its identity: prime_ac swaps the instance's class for a subclass whose
``forward`` runs the original one under ``torch.utils.checkpoint`` (the same technique FSDP2's
``fully_shard`` uses). No module is inserted, so state-dict keys and every parameter, buffer and
module name seen from the root stay exactly as they were, and optimizer, FSDP and checkpoint
loading code needs no name-stripping.

The settings live on the block (:class:`BlockCheckpoint`), so re-configuring a block is a change
of that state, never of its class: this keeps working after another wrapper (``fully_shard``)
has swapped the class again, and a block that stops being checkpointed there simply runs its own
forward.

These are the primitives; :func:`prime_ac.checkpoint_blocks` decides what to wrap.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from prime_ac.policy import OperatorPolicy
from prime_ac.scopes import untrack

__all__ = [
    "BlockCheckpoint",
    "BlockSelector",
    "can_restore_class",
    "changes_undone_on_error",
    "checkpoint_state",
    "checkpointing_disabled",
    "find_blocks",
    "unwrap_block",
    "unwrap_blocks",
    "wrap_block",
    "wrapped_blocks",
]

BlockSelector = str | Sequence[str] | Callable[[str, nn.Module], bool] | None
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_STATE = "_prime_ac"  # the attribute holding a wrapped block's BlockCheckpoint


@dataclass(frozen=True)
class BlockCheckpoint:
    """How one wrapped block is checkpointed; stored on the block itself.

    ``active=False`` makes the block run its own forward with no checkpoint (a block prime_ac
    can no longer restore to its class, and the audit's no-AC baseline). ``plan`` is the
    :class:`prime_ac.budget.BlockPlan` of a ``targets="auto"`` block.
    """

    name: str
    policy: OperatorPolicy
    context_fn: Callable[[], Any]
    preserve_rng_state: bool = True
    plan: Any = None
    active: bool = True
    original_class: type | None = None  # filled in by wrap_block


def _call(forward: Callable[..., Any], kwargs: dict, *args: Any) -> Any:
    return forward(*args, **kwargs)


class _CheckpointedBlock(nn.Module):
    """Mixin placed in front of a block's own class; see the module docstring."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state: BlockCheckpoint = getattr(self, _STATE)
        if not state.active:
            return super().forward(*args, **kwargs)
        if state.plan is not None and torch.compiler.is_compiling():
            raise RuntimeError(
                f'prime_ac: {state.name} uses a targets="auto" plan, which is keyed on the '
                "operator calls of an eager forward and is not guarded by torch.compile (blocks "
                "sharing code would share one plan). Run these blocks eagerly, or compile with "
                "explicit targets (and torch._functorch.config.activation_memory_budget)."
            )
        if torch.is_grad_enabled():
            kwargs = _without_empty_kv_cache(state.name, kwargs)
        # kwargs travel as one value, so none of the block's own keyword arguments (use_reentrant=,
        # context_fn=, debug=, ...) can be taken for checkpoint's. Positional tensors travel as
        # checkpoint's own inputs, which it saves through the saved-tensor hooks in effect
        # (save_on_cpu offloads them); tensors inside kwargs are held by reference.
        return checkpoint(
            _call,
            super().forward,
            kwargs,
            *args,
            use_reentrant=False,
            context_fn=state.context_fn,
            preserve_rng_state=state.preserve_rng_state,
        )


# The keyword names under which transformers passes a layer its KV / state cache: ``cache`` (5.2x)
# and the older names its own GradientCheckpointingLayer checks.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")


def _without_empty_kv_cache(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The block's kwargs with an empty KV cache left out, or ValueError for a filled one.

    A cache the forward fills would be filled again by the recompute (entries appended twice,
    positions shifted). An empty one (``get_seq_length() == 0``: a training call of a model left at
    ``use_cache=True``) carries nothing the block reads, so the block runs without it, as
    transformers' own gradient checkpointing does by turning the cache off; block 0 is always
    checkpointed, so the length never counts a checkpointed block's own entries. A cache that
    already holds entries (a prefix) would be read, so it is refused. Tensors and tuples are read,
    never filled, so they pass.
    """
    for key in _CACHE_KWARGS:
        cache = kwargs.get(key)
        if cache is None or isinstance(cache, (torch.Tensor, tuple)):
            continue
        length = getattr(cache, "get_seq_length", None)
        if callable(length) and length() == 0:
            warnings.warn(
                f"prime_ac: checkpointed block {name!r} runs without its empty {key} "
                f"({type(cache).__name__}) in training, as transformers' gradient checkpointing "
                "does; pass use_cache=False to the model to silence this",
                stacklevel=3,
            )
            kwargs = {**kwargs, key: None}
            continue
        raise ValueError(
            f"prime_ac: checkpointed block {name!r} got {key}={type(cache).__name__} with "
            "gradients enabled, and it is not an empty cache (get_seq_length() == 0) that the "
            "block could run without. The forward fills this cache and the recompute in backward "
            "would fill it again. Train with use_cache=False (model(..., use_cache=False) or "
            "model.config.use_cache = False), or call the model under torch.no_grad() for "
            "generation."
        )
    return kwargs


# One wrapper class per block class, created once and reused so that blocks of one class share
# a class (isinstance, torch.compile's guards, pickling by reference): a cache, not a registry.
_wrapper_classes: dict[type, type] = {}


def _wrapper_class(cls: type) -> type:
    if cls not in _wrapper_classes:
        _wrapper_classes[cls] = type(f"Checkpointed{cls.__name__}", (_CheckpointedBlock, cls), {})
    return _wrapper_classes[cls]


def checkpoint_state(module: nn.Module) -> BlockCheckpoint | None:
    """The settings of a block that prime_ac checkpoints, or None if it is not checkpointed."""
    state = getattr(module, _STATE, None) if isinstance(module, _CheckpointedBlock) else None
    return state if state is not None and state.active else None


def wrapped_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` of every checkpointed block of ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if checkpoint_state(m) is not None]


def wrap_block(block: nn.Module, state: BlockCheckpoint) -> None:
    """Checkpoint ``block`` with ``state``; a block already wrapped only gets the new state."""
    if isinstance(block, _CheckpointedBlock):
        original = getattr(block, _STATE).original_class
    else:
        original = type(block)
        block.__class__ = _wrapper_class(original)
    setattr(block, _STATE, dataclasses.replace(state, original_class=original))


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
    before = [(m, type(m), m.__dict__.get(_STATE)) for m in model.modules()]
    try:
        yield
    except BaseException:
        for module, cls, state in before:
            module.__class__ = cls
            if state is None:
                module.__dict__.pop(_STATE, None)
            else:
                setattr(module, _STATE, state)
        raise


# --- discovery --------------------------------------------------------------------------------


def _is_stack(module: nn.Module) -> bool:
    """A ModuleList/ModuleDict/Sequential whose children all have submodules of their own.

    The children may be of different classes (dense then MoE layers, attention and Mamba
    layers of a hybrid); one child is enough (a one-layer model).
    """
    children = list(module.children()) if isinstance(module, _CONTAINERS) else []
    return bool(children) and all(_submodules(c) >= 1 for c in children)


def _submodules(module: nn.Module, limit: int = 2) -> int:
    """How many submodules ``module`` holds, counting up to ``limit``."""
    count = 0
    for _ in module.modules():
        count += 1
        if count > limit:
            break
    return count - 1


def _walk(
    module: nn.Module,
    prefix: str,
    take: Callable[[str, nn.Module], bool],
    seen: set[int] | None = None,
) -> Iterator[tuple[str, nn.Module]]:
    """Pre-order walk that yields the modules ``take`` accepts and never descends into them.

    A module reachable by several paths (a layer shared between blocks) is visited once, under
    its first path, as ``named_modules`` does.
    """
    seen = set() if seen is None else seen
    for name, child in module.named_children():
        if id(child) in seen:
            continue
        seen.add(id(child))
        path = f"{prefix}.{name}" if prefix else name
        if take(path, child):
            yield path, child
        else:
            yield from _walk(child, path, take, seen)


def _named_children(container: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    return [((f"{path}.{n}" if path else n), c) for n, c in container.named_children()]


def _containers(model: nn.Module) -> str:
    seen = [
        f"{name or '<root>'} ({type(m).__name__} of {len(m)})"
        for name, m in model.named_modules()
        if isinstance(m, _CONTAINERS)
    ]
    return ", ".join(seen) or "none"


def find_blocks(
    model: nn.Module, blocks: BlockSelector = None
) -> list[list[tuple[str, nn.Module]]]:
    """The block groups ``checkpoint_blocks`` would wrap, as ``[[(qualified_name, block)]]``.

    Each group is one container (``freq`` counts indices within it); a predicate gives one
    group. ``blocks=None`` discovers the stacks: the outermost ModuleList / ModuleDict /
    Sequential containers whose children all have submodules (docs/checkpointing.md,
    "Discovery"). Raises ValueError when the selection is empty.

    Example::

        prime_ac.find_blocks(model)                    # [[('model.layers.0', ...), ...]]
        prime_ac.find_blocks(flux, ["transformer_blocks", "single_transformer_blocks"])
    """
    if blocks is None:
        return _discover(model)
    if callable(blocks) and not isinstance(blocks, str):
        group = list(_walk(model, "", blocks))
        if not group:
            raise ValueError(
                f"blocks={blocks!r} accepted no module of {type(model).__name__}: the predicate "
                "is called as predicate(qualified_name, module) on every submodule. To stop "
                "checkpointing, call prime_ac.unwrap_blocks(model)."
            )
        return [group]
    if isinstance(blocks, str):
        paths = [blocks]
    elif isinstance(blocks, Iterable) and not isinstance(blocks, nn.Module):
        paths = list(blocks)
    else:
        raise TypeError(
            f"blocks={blocks!r} must be None (discover), a dotted path such as 'model.layers', "
            "a list of paths, or a predicate (name, module) -> bool"
        )
    if not paths:
        raise ValueError(
            "blocks=[] selects no block. Omit blocks= to discover them, name containers "
            "(blocks=['model.layers']), or call prime_ac.unwrap_blocks(model) to stop "
            "checkpointing."
        )
    return [_container_group(model, path) for path in paths]


def _discover(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The rule of docs/checkpointing.md, "Discovery"."""
    if _is_stack(model):
        return [_named_children(model, "")]
    stacks = list(_walk(model, "", lambda _, m: _is_stack(m)))
    if not stacks:
        raise ValueError(
            f"checkpoint_blocks found no stack of blocks in {type(model).__name__}: no "
            "ModuleList, ModuleDict or Sequential whose children all have submodules. "
            f"Containers seen: {_containers(model)}. Pass blocks= to say where they are, e.g. "
            "blocks='model.layers', blocks=['double_blocks', 'single_blocks'], or "
            "blocks=lambda name, module: isinstance(module, MyBlock)."
        )
    # a stack whose blocks all live inside other stacks' blocks holds shared layers (Zamba2's
    # shared attention, registered once more on its own): those blocks are the real ones
    inside = {
        id(m)
        for _, stack in stacks
        for block in stack.children()
        for m in block.modules()
        if m is not block
    }
    stacks = [
        (path, stack)
        for path, stack in stacks
        if not all(id(block) in inside for block in stack.children())
    ]
    # a list of one-layer wrappers (HiDream's caption projections) is no stack of blocks when
    # real blocks, holding several layers each, exist elsewhere
    blocks = [(p, s) for p, s in stacks if all(_submodules(c) >= 2 for c in s.children())]
    stacks = blocks or stacks
    # Stacks inside two or more children of one container that is not a stack itself (blocks
    # mixed with an embedding in one Sequential): those children may be the blocks, and the
    # stacks their expert lists. Undecidable from structure alone.
    owners: dict[str, set[str]] = {}
    for path, _ in stacks:
        parts = path.split(".")
        for depth in range(len(parts) - 1, -1, -1):  # the stack's ancestors, nearest first
            parent = ".".join(parts[:depth])
            if isinstance(model.get_submodule(parent), _CONTAINERS):
                owners.setdefault(parent, set()).add(".".join(parts[: depth + 1]))
                break
    ambiguous = {parent: names for parent, names in owners.items() if len(names) > 1}
    if ambiguous:
        parent, names = next(iter(ambiguous.items()))
        container = model.get_submodule(parent)
        raise ValueError(
            f"checkpoint_blocks cannot tell which modules are the blocks of "
            f"{type(model).__name__}: {parent or '<root>'} ({type(container).__name__}) is not "
            f"a stack (some of its children are leaf modules), and its children {sorted(names)} "
            f"each hold a stack of their own ({', '.join(p for p, _ in stacks)}). Pass blocks=: "
            f"the children themselves, e.g. blocks=lambda name, module: isinstance(module, "
            f"{type(model.get_submodule(min(names))).__name__}), or the inner stacks by path."
        )
    return [_named_children(stack, path) for path, stack in stacks]


def _container_group(model: nn.Module, path: Any) -> list[tuple[str, nn.Module]]:
    if not isinstance(path, str):
        raise TypeError(
            f"blocks= entries must be dotted paths (str), got {path!r}; for a test on the "
            "modules pass a predicate, blocks=lambda name, module: ..."
        )
    try:
        container = model.get_submodule(path)
    except AttributeError:
        raise ValueError(
            f"blocks={path!r} does not exist in {type(model).__name__}. Containers seen: "
            f"{_containers(model)}."
        ) from None
    if not isinstance(container, _CONTAINERS):
        raise ValueError(
            f"blocks={path!r} is a {type(container).__name__}, not a ModuleList, ModuleDict "
            "or Sequential of blocks. Name the container that holds the blocks, or pass "
            "blocks=lambda name, module: ... to pick the block modules themselves."
        )
    group = _named_children(container, path)
    if not group:
        raise ValueError(f"blocks={path!r} is an empty {type(container).__name__}: no block.")
    return group
