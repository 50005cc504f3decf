"""Running one checkpointed call of a block: what its recompute must read and must not change.

:func:`run_region` is the body of a wrapped block's ``forward`` (:mod:`prime_ac.wrapping` owns
the wrapping): it calls ``torch.utils.checkpoint.checkpoint`` around the block's own forward,
leaves an empty KV cache out and hands the recompute copies of per-layer states (the caches
recognised by name, position or type), and, through :class:`_Region`, gives the recompute the
buffers, tensor attributes and list / dict arguments as the forward found them.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from prime_ac import diagnostics
from prime_ac._compat import CHECKPOINT_RESPECTS_HOOKS
from prime_ac.compiled import compiled_plan_context_fn
from prime_ac.contexts import compiled_block_context_fn
from prime_ac.store import respecting_saved_tensors_hooks

__all__ = ["cache_positions", "run_region"]


def run_region(
    block: nn.Module, state: Any, forward: Callable[..., Any], args: tuple, kwargs: dict
) -> Any:
    """Run ``forward`` (the block's own) under checkpoint with the settings of ``state``, a
    :class:`prime_ac.wrapping.BlockCheckpoint` whose block is checkpointed."""
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
            forward,
            kwargs,
            *args,
            use_reentrant=False,
            context_fn=state.context_fn,
            preserve_rng_state=state.preserve_rng_state,
            **options,
        )
    args, kwargs, copies = _without_cache(state, args, kwargs)
    if torch.compiler.is_compiling():  # compiled code applies buffer writes once anyway
        region = _call
        if state.compiled is not None:  # a plan: tagged per call, guarded per distinct plan
            context_fn = compiled_plan_context_fn(state.compiled)
        else:
            context_fn = compiled_block_context_fn(state.policy)
        if CHECKPOINT_RESPECTS_HOOKS:  # torch 2.14+: said explicitly, no FutureWarning
            options["respect_saved_tensors_hooks"] = state.respect_saved_tensors_hooks
    else:
        region = _Region(block, copies, state.name)
        context_fn = region.context_fn(state.context_fn)
    respect = state.respect_saved_tensors_hooks and region is not _call
    with respecting_saved_tensors_hooks() if respect else nullcontext():
        out = checkpoint(
            region,
            forward,
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

    def __init__(self, block: nn.Module, copies: dict[int | str, Any], name: str) -> None:
        self.held = diagnostics.track(block, name)  # what the call holds (memory_report)
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
        diagnostics.calls.depth += 1
        try:
            return self._run(forward, kwargs, args)
        except torch.OutOfMemoryError as error:  # what the blocks hold, logged once per error
            diagnostics.out_of_memory(error, args, kwargs)
            raise
        finally:
            diagnostics.calls.depth -= 1

    def _run(self, forward: Callable[..., Any], kwargs: dict, args: tuple) -> Any:
        if self.recomputing:
            if self.copies:
                args = tuple(self.copies.get(i, a) for i, a in enumerate(args))
                kwargs = {k: self.copies.get(k, v) for k, v in kwargs.items()}
            return forward(*args, **kwargs)
        self.held.forward(args, kwargs)
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
            store = getattr(forward, "store", None)
            if store is not None:
                self.held.store = weakref.ref(store)
                if diagnostics.labelling():
                    diagnostics.label_keeps(forward)
            return forward, _EachEntry(lambda: self._recompute(recompute))

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


class _EachEntry:
    """A context manager made anew on each entry: torch enters a region's recompute context once
    per backward through it, twice where ``retain_graph=True`` keeps the graph for another."""

    __slots__ = ("_entered", "_make")

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make, self._entered = make, []

    def __enter__(self) -> Any:
        context = self._make()
        value = context.__enter__()
        self._entered.append(context)
        return value

    def __exit__(self, *exc: Any) -> Any:
        return self._entered.pop().__exit__(*exc)


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


def _call(forward: Callable[..., Any], kwargs: dict, *args: Any) -> Any:
    return forward(*args, **kwargs)


# The names under which transformers and recurrent models pass a layer its KV / state cache:
# ``cache`` (5.2x), the older names its own GradientCheckpointingLayer checks, and ``state``
# (xLSTM, RWKV: per-layer recurrent state).
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params", "state")


# Per block class, filled when a block is wrapped (eagerly), so that a compiled forward only
# reads it: torch.compile traces a dict lookup, where it warns about a functools.cache wrapper.
_cache_positions_of: dict[type, tuple[tuple[int, str], ...]] = {}


def cache_positions(cls: type) -> tuple[tuple[int, str], ...]:
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
    state: Any, args: tuple, kwargs: dict[str, Any]
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
    named = dict(cache_positions(state.original_class))
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
                stacklevel=5,
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
