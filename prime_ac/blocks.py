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
import inspect
import logging
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from prime_ac.contexts import block_context_fn, compiled_block_context_fn
from prime_ac.policy import OperatorPolicy
from prime_ac.scopes import retrack, untrack

__all__ = [
    "BlockCheckpoint",
    "BlockSelector",
    "can_restore_class",
    "changes_undone_on_error",
    "checkpoint_state",
    "checkpointing_disabled",
    "find_blocks",
    "is_checkpointed",
    "unwrap_block",
    "unwrap_blocks",
    "wrap_block",
    "wrapped_blocks",
]

logger = logging.getLogger("prime_ac")

BlockSelector = str | Sequence[str] | Callable[[str, nn.Module], bool] | None
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
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

    def __reduce__(self) -> tuple[Any, ...]:
        # context_fn closes over the policy, and the policy caches decisions keyed by operator
        # objects (which do not pickle): a copy (deepcopy, pickle) rebuilds both from the
        # settings, so a copy never reads the scope tracker of the original. A targets="auto"
        # plan's contexts (full mode: no scopes) travel as they are.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["watch"] = None  # a copy reports nothing of the original's first step
        policy = fields.pop("policy")
        if type(policy) is OperatorPolicy and self.plan is None:
            del fields["context_fn"]  # made again for the copied policy (OperatorPolicy.__reduce__)
        return (_restored_state, (policy, fields))


def _restored_state(policy: Any, fields: dict[str, Any]) -> BlockCheckpoint:
    if "context_fn" not in fields:
        fields["context_fn"] = block_context_fn(policy, fields["name"])
    return BlockCheckpoint(policy=policy, **fields)


class _Region:
    """One checkpointed call of a block: the module state its recompute must not change.

    - Buffers: a module whose buffers the forward updated in place (a version counter moved) gets
      all its buffers copied aside before the recompute and copied back after it, in ``finally``
      (torch's early stop leaves the recompute by an exception), so the update happens once, as
      without checkpointing. Per module, because torch's batch-norm kernels write the running
      statistics without moving their version counters; the module's ``num_batches_tracked``
      moves.
    - Tensor attributes a submodule reassigns in the forward (RecurrentGemma's
      ``conv1d_state`` and ``recurrent_states``): the recompute runs with the values the forward
      started from, and the attributes get back what the forward left.
    - Per-layer state passed as a cache argument (lists, tuples or dicts of tensors: xLSTM-,
      RWKV-style recurrent states) is copied before the forward; the recompute reads and writes
      that copy, never the state the model has moved on since.
    - Other list and dict arguments the forward changes in place (diffusers' Wan VAE passes
      ``feat_cache`` and ``feat_idx`` lists that each block reads, replaces entries of and
      advances): their contents (each element by reference, nested lists and dicts too) are
      remembered before the forward; the recompute runs with the contents the forward started
      from, and the containers get back what they held when the recompute began.

    Copies live from the forward (state) or the start of the recompute (buffers) until the
    recompute ends; docs/checkpointing.md, "Module state", gives what they cost.
    """

    def __init__(self, block: nn.Module, copies: dict[int | str, Any]) -> None:
        modules = _tree(block, [])
        self.buffers = [
            [b for b in m._buffers.values() if b is not None] for m in modules if m._buffers
        ]
        self.versions = [[b._version for b in buffers] for buffers in self.buffers]
        self.attributes = []
        for m in modules:
            names = _state_names.get(type(m))
            for key in _state_attribute_names(m) if names is None else names:
                value = m.__dict__.get(key, _Region)
                if value is None or isinstance(value, torch.Tensor):
                    self.attributes.append((m.__dict__, key, value))
        self.updated: list[torch.Tensor] = []
        self.moved: list[tuple[dict, str, Any, Any]] = []
        self.copies = copies
        self.recomputing = False
        self.changed: list[tuple[Any, Any]] = []  # (argument container, contents before)

    def __call__(self, forward: Callable[..., Any], kwargs: dict, *args: Any) -> Any:
        if self.recomputing:
            if self.copies:
                args = tuple(self.copies.get(i, a) for i, a in enumerate(args))
                kwargs = {k: self.copies.get(k, v) for k, v in kwargs.items()}
            return forward(*args, **kwargs)
        containers = [
            value
            for key, value in (*enumerate(args), *kwargs.items())
            if isinstance(value, (list, dict)) and key not in self.copies
        ]
        before = [_contents(c) for c in containers]
        out = forward(*args, **kwargs)
        self.changed = [
            (c, b) for c, b in zip(containers, before, strict=True) if not _same(_contents(c), b)
        ]
        return out

    def forward_done(self) -> None:
        self.updated = [
            b
            for buffers, versions in zip(self.buffers, self.versions, strict=True)
            if any(b._version != v for b, v in zip(buffers, versions, strict=True))
            for b in buffers
        ]
        self.moved = [
            (where, key, before, where.get(key))
            for where, key, before in self.attributes
            if where.get(key) is not before
        ]
        self.buffers = self.versions = self.attributes = ()

    def context_fn(self, inner: Callable[[], tuple[Any, Any]]) -> Callable[[], tuple[Any, Any]]:
        def contexts() -> tuple[Any, Any]:
            forward, recompute = inner()
            return forward, self._recompute(recompute)

        return contexts

    @contextmanager
    def _recompute(self, inner: Any) -> Iterator[None]:
        with torch.no_grad():
            saved = [b.clone() for b in self.updated]
        for where, key, before, _ in self.moved:
            where[key] = before
        now = [_contents(c) for c, _ in self.changed]
        for container, before in self.changed:
            _restore(container, before)
        self.recomputing = True
        try:
            with inner:
                yield
        finally:
            self.recomputing = False
            for where, key, _, after in self.moved:
                where[key] = after
            for (container, _), contents in zip(self.changed, now, strict=True):
                _restore(container, contents)
            with torch.no_grad():
                for buffer, value in zip(self.updated, saved, strict=True):
                    buffer.copy_(value)


class _Nested:
    """A list or dict inside an argument's contents, with its own contents."""

    __slots__ = ("container", "contents")

    def __init__(self, container: Any) -> None:
        self.container, self.contents = container, _contents(container)


def _contents(value: list | dict) -> list | dict:
    """What a list or dict holds, each element by reference and nested lists and dicts as
    :class:`_Nested`: enough to tell a change in place and to undo it."""
    if isinstance(value, list):
        return [_Nested(v) if isinstance(v, (list, dict)) else v for v in value]
    return {k: _Nested(v) if isinstance(v, (list, dict)) else v for k, v in value.items()}


def _same(a: list | dict, b: list | dict) -> bool:
    if type(a) is not type(b) or len(a) != len(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_element(a[k], b[k]) for k in a)
    return all(_same_element(x, y) for x, y in zip(a, b, strict=True))


def _same_element(a: Any, b: Any) -> bool:
    if isinstance(a, _Nested) and isinstance(b, _Nested):
        return a.container is b.container and _same(a.contents, b.contents)
    return a is b


def _restore(container: list | dict, contents: list | dict) -> None:
    """Put ``contents`` (from :func:`_contents`) back into ``container``, in place."""
    values = contents if isinstance(contents, list) else contents.values()
    for value in values:
        if isinstance(value, _Nested):
            _restore(value.container, value.contents)

    def plain(v: Any) -> Any:
        return v.container if isinstance(v, _Nested) else v

    if isinstance(container, list):
        container[:] = [plain(v) for v in contents]
    else:
        container.clear()
        container.update({k: plain(v) for k, v in contents.items()})


def _tree(module: nn.Module, out: list[nn.Module]) -> list[nn.Module]:
    """``module`` and its submodules (``modules()`` at a quarter of its cost: no names)."""
    out.append(module)
    for child in module._modules.values():
        if child is not None:
            _tree(child, out)
    return out


_MODULE_ATTRIBUTES = frozenset(nn.Module().__dict__)


# Per module class: the plain attributes that its first instance seen held as a tensor or None
# (state its forward may reassign, set in __init__), less nn.Module's own. Found once per
# class, so a call looks at a few names instead of every attribute of every submodule.
_state_names: dict[type, tuple[str, ...]] = {}


def _state_attribute_names(module: nn.Module) -> tuple[str, ...]:
    names = _state_names[type(module)] = tuple(
        key
        for key in module.__dict__.keys() - _MODULE_ATTRIBUTES
        if module.__dict__[key] is None or isinstance(module.__dict__[key], torch.Tensor)
    )
    return names


class _CheckpointedBlock(nn.Module):
    """Mixin placed in front of a block's own class; see the module docstring."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state: BlockCheckpoint = getattr(self, _STATE)
        if (
            not state.active
            or state.bypassed
            or (state.plan is not None and not state.plan.checkpointed)
        ):  # a budget plan, or the first step's bytes (prime_ac.watch), may leave a block plain
            return super().forward(*args, **kwargs)
        if state.plan is not None and torch.compiler.is_compiling():
            raise RuntimeError(
                f'prime_ac: {state.name} uses a targets="auto" plan, which is keyed on the '
                "operator calls of an eager forward and is not guarded by torch.compile (blocks "
                "sharing code would share one plan). Run these blocks eagerly, or compile with "
                "explicit targets (and torch._functorch.config.activation_memory_budget)."
            )
        options = {}
        if state.early_stop is not None:
            options["early_stop"] = state.early_stop
        if state.determinism_check is not None:
            options["determinism_check"] = state.determinism_check
        # kwargs travel as one value, so none of the block's own keyword arguments (use_reentrant=,
        # context_fn=, debug=, ...) can be taken for checkpoint's. Positional tensors travel as
        # checkpoint's own inputs, which it saves through the saved-tensor hooks in effect
        # (save_on_cpu offloads them); tensors inside kwargs are held by reference.
        if not torch.is_grad_enabled():
            return checkpoint(
                _call,
                super().forward,
                kwargs,
                *args,
                use_reentrant=False,
                context_fn=state.context_fn,
                preserve_rng_state=state.preserve_rng_state,
                **options,
            )
        args, kwargs, copies = _without_cache(state, args, kwargs)
        if torch.compiler.is_compiling():  # compiled code applies buffer writes once anyway
            region, context_fn = _call, compiled_block_context_fn(state.policy)
        else:
            region = _Region(self, copies)
            context_fn = region.context_fn(state.context_fn)
        out = checkpoint(
            region,
            super().forward,
            kwargs,
            *args,
            use_reentrant=False,
            context_fn=context_fn,
            preserve_rng_state=state.preserve_rng_state,
            **options,
        )
        if region is not _call:
            region.forward_done()
        return out

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


def _call(forward: Callable[..., Any], kwargs: dict, *args: Any) -> Any:
    return forward(*args, **kwargs)


# The names under which transformers and recurrent models pass a layer its KV / state cache:
# ``cache`` (5.2x), the older names its own GradientCheckpointingLayer checks, and ``state``
# (xLSTM, RWKV: per-layer recurrent state).
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params", "state")


# Per block class, filled when a block is wrapped (eagerly), so that a compiled forward only
# reads it: torch.compile traces a dict lookup, where it warns about a functools.cache wrapper.
_cache_positions_of: dict[type, tuple[tuple[int, str], ...]] = {}


def _cache_positions(cls: type) -> tuple[tuple[int, str], ...]:
    """``(index, name)`` of the positional parameters of ``cls.forward`` named as a cache."""
    positions = _cache_positions_of.get(cls)
    if positions is None:
        positions = _cache_positions_of[cls] = _find_cache_positions(cls)
    return positions


def _find_cache_positions(cls: type) -> tuple[tuple[int, str], ...]:
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]  # self
    except (TypeError, ValueError):
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(
        (i, p.name)
        for i, p in enumerate(parameters)
        if p.kind in positional and p.name in _CACHE_NAMES
    )


def _is_cache_object(value: Any) -> bool:
    return callable(getattr(type(value), "get_seq_length", None))


def _without_cache(
    state: BlockCheckpoint, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any], dict[int | str, Any]]:
    """The block's arguments with an empty cache left out, plus copies of the per-layer states
    its recompute must read; ValueError for a filled cache. The block's name is read only for a
    message: torch 2.9's dynamo guards a string passed on, which would compile one graph per
    block.

    A cache is recognised by keyword, by position (the block's ``forward`` names the parameter
    as one of ``_CACHE_NAMES``: RecurrentGemma passes ``cache`` positionally), or by type (an
    object with ``get_seq_length``: any transformers ``Cache``, wherever it is passed).

    A cache object the forward fills would be filled again by the recompute (entries appended
    twice, positions shifted). An empty one (``get_seq_length() == 0``: a training call of a model
    left at ``use_cache=True``) carries nothing the block reads, so the block runs without it, as
    transformers' own gradient checkpointing does by turning the cache off; block 0 is always
    checkpointed, so the length never counts a checkpointed block's own entries. A cache that
    already holds entries (a prefix) would be read, so it is refused. Lists, tuples and dicts of
    tensors under a cache name are per-layer states: the recompute gets a copy of them as they
    were before the forward (see :class:`_Region`).
    """
    named = dict(_cache_positions(state.original_class))
    found: list[tuple[int | str, str, Any]] = [
        (key, key, kwargs[key]) for key in _CACHE_NAMES if kwargs.get(key) is not None
    ]
    found += [
        (i, named.get(i, f"argument {i}"), value)
        for i, value in enumerate(args)
        if value is not None and (i in named or _is_cache_object(value))
    ]
    copies: dict[int | str, Any] = {}
    for where, key, cache in found:
        if isinstance(cache, torch.Tensor):
            continue
        if not _is_cache_object(cache):
            if isinstance(cache, (list, tuple, dict)):
                copies[where] = tree_map_only(torch.Tensor, _copy, cache)
            continue
        if cache.get_seq_length() == 0:
            warnings.warn(
                f"prime_ac: checkpointed block {state.name!r} runs without its empty {key} "
                f"({type(cache).__name__}) in training, as transformers' gradient checkpointing "
                "does; pass use_cache=False to the model to silence this",
                stacklevel=4,
            )
            if isinstance(where, int):
                args = (*args[:where], None, *args[where + 1 :])
            else:
                kwargs = {**kwargs, key: None}
            continue
        raise ValueError(
            f"prime_ac: checkpointed block {state.name!r} got {key}={type(cache).__name__} with "
            "gradients enabled, and it is not an empty cache (get_seq_length() == 0) that the "
            "block could run without. The forward fills this cache and the recompute in backward "
            "would fill it again. Train with use_cache=False (model(..., use_cache=False) or "
            "model.config.use_cache = False), or call the model under torch.no_grad() for "
            "generation."
        )
    return args, kwargs, copies


def _copy(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.detach().clone()


# One wrapper class per block class, created once and reused so that blocks of one class share
# a class (isinstance, torch.compile's guards): a cache, not a registry. Pickles name the
# block's own class (``_CheckpointedBlock.__reduce_ex__``), never the wrapper.
_wrapper_classes: dict[type, type] = {}


def _wrapper_class(cls: type) -> type:
    if cls not in _wrapper_classes:
        _wrapper_classes[cls] = type(f"Checkpointed{cls.__name__}", (_CheckpointedBlock, cls), {})
    return _wrapper_classes[cls]


def checkpoint_state(module: nn.Module) -> BlockCheckpoint | None:
    """The settings of a block that prime_ac checkpoints, or None if it is not checkpointed."""
    state = getattr(module, _STATE, None) if isinstance(module, _CheckpointedBlock) else None
    return state if state is not None and state.active else None


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` runs as a checkpointed block: one prime_ac checkpoints (and has not
    stood down after a first step that held at least what no AC holds), or torch's
    ``CheckpointWrapper``.

    The question trainers ask with ``isinstance(module, CheckpointWrapper)`` (FastVideo does),
    which a prime_ac block answers False: it keeps its class's name and its state-dict keys.

    Example::

        prime_ac.checkpoint_blocks(model)
        assert all(prime_ac.is_checkpointed(block) for block in model.layers)
    """
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
        original = getattr(block, _STATE).original_class
    else:
        original = type(block)
        block.__class__ = _wrapper_class(original)
    _cache_positions(original)
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
    Sequential containers whose children all have submodules, without helper stacks of
    per-token MLPs beside stacks of blocks that hold attention, a mixer or a convolution
    (docs/checkpointing.md, "Discovery"; the stacks left out are logged at INFO). Raises
    ValueError when the selection is empty.

    Example::

        prime_ac.find_blocks(model)                    # [[('model.layers.0', ...), ...]]
        prime_ac.find_blocks(flux, ["transformer_blocks", "single_transformer_blocks"])
    """
    if blocks is None:
        return _discover(model)
    if isinstance(blocks, nn.Module):
        raise TypeError(
            f"blocks= takes where the blocks are, not a module: got {type(blocks).__name__}. "
            "Pass the container's path (blocks='model.layers'), a list of paths, or a predicate "
            "(blocks=lambda name, module: module is my_block)"
        )
    if callable(blocks) and not isinstance(blocks, str):
        _check_predicate(blocks)
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


def _check_predicate(predicate: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(predicate)
    except (TypeError, ValueError):  # a builtin without a signature: called as given
        return
    try:
        signature.bind("name", None)
    except TypeError:
        raise TypeError(
            f"blocks={predicate!r} must take two arguments, (qualified_name, module), and "
            f"takes {signature}: write blocks=lambda name, module: ..."
        ) from None


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
    stacks = _without_helper_stacks(blocks or stacks)
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
    # a block shared by two stacks (one layer registered in an encoder and a decoder list) is
    # one block, under its first path, as named_modules() names it
    taken: set[int] = set()
    groups = []
    for path, stack in stacks:
        group = [(n, b) for n, b in _named_children(stack, path) if id(b) not in taken]
        taken.update(id(b) for _, b in group)
        if group:
            groups.append(group)
    _refuse_unsupported(model, groups)
    return groups


# The flags by which diffusers (``_supports_gradient_checkpointing``) and transformers
# (``supports_gradient_checkpointing``) models say whether their blocks can be checkpointed, and
# the library base classes whose False is only the default for models that never said.
_SUPPORT_FLAGS = ("_supports_gradient_checkpointing", "supports_gradient_checkpointing")
_LIBRARY_BASES = frozenset({"ModelMixin", "PreTrainedModel"})


def _declares_unsupported(module: nn.Module) -> str | None:
    """The flag ``module``'s own class sets to False, or None: diffusers' AutoencoderKLWan
    passes its blocks caches they change in place, and says so."""
    for flag in _SUPPORT_FLAGS:
        owner = next((c for c in type(module).__mro__ if flag in c.__dict__), None)
        declared_off = owner is not None and owner.__dict__[flag] is False
        if declared_off and owner.__name__ not in _LIBRARY_BASES:
            return f"{owner.__name__}.{flag} = False"
    return None


def _refuse_unsupported(model: nn.Module, groups: list[list[tuple[str, nn.Module]]]) -> None:
    names = [name for group in groups for name, _ in group]
    for path, module in model.named_modules():
        flag = _declares_unsupported(module)
        inside = [n for n in names if not path or n.startswith(path + ".")]
        if flag is not None and inside:
            containers = list(dict.fromkeys(n.rpartition(".")[0] for n in inside))
            raise ValueError(
                f"checkpoint_blocks: {path or '<root>'} ({type(module).__name__}) declares that "
                f"it does not support gradient checkpointing ({flag}), so discovery does not "
                f"wrap its blocks ({', '.join(inside[:3])}{', ...' * (len(inside) > 3)}). If "
                f"you know them to be safe, name them: blocks={containers!r} (prime_ac restores "
                "list and dict arguments a block changes in place for the recompute)."
            )


# Class names of modules that mix tokens (attention, state-space and recurrent mixers,
# convolutions); torch's own such modules are recognised by type.
_MIXER_NAMES = re.compile(r"attention|attn|mixer|mamba|conv|ssm|lstm|rnn|recurren|retention", re.I)
_MIXER_TYPES = (nn.MultiheadAttention, nn.modules.conv._ConvNd, nn.RNNBase)


def _mixes_tokens(block: nn.Module) -> bool:
    """Whether ``block`` holds attention, a mixer, a recurrence or a convolution."""
    return any(
        isinstance(m, _MIXER_TYPES) or _MIXER_NAMES.search(type(m).__name__)
        for m in block.modules()
    )


def _parameters(block: nn.Module) -> int:
    return sum(p.numel() for p in block.parameters())


def _without_helper_stacks(stacks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The stacks without helper stacks: stacks none of whose blocks mixes tokens (per-token
    MLPs: Chroma's guidance approximator, Qwen3-VL's deepstack mergers), beside stacks whose
    blocks do, unless their largest block is as large as the largest of those."""
    mixing = [s for _, s in stacks if any(_mixes_tokens(c) for c in s.children())]
    if not mixing:
        return stacks
    largest = max(_parameters(c) for s in mixing for c in s.children())
    kept = []
    for path, stack in stacks:
        if any(s is stack for s in mixing) or max(map(_parameters, stack.children())) >= largest:
            kept.append((path, stack))
        else:
            logger.info(
                "prime_ac discovery: %s is not a stack of blocks: no block of it holds "
                "attention, a mixer or a convolution, and each is smaller than the largest "
                "block of the other stacks (%d parameters); pass blocks= to checkpoint it",
                path,
                largest,
            )
    return kept


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
