"""Wrapping transformer blocks in non-reentrant checkpoint regions, in place.

A wrapped block keeps its identity: prime_ac swaps the instance's class for a subclass whose
``forward`` runs the original one under ``torch.utils.checkpoint`` (the same technique FSDP2's
``fully_shard`` uses). No module is inserted, so state-dict keys and every parameter, buffer and
module name seen from the root stay exactly as they were, and optimizer, FSDP and checkpoint
loading code needs no name-stripping.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from prime_ac.budget import BlockPlan, apply_budget
from prime_ac.config import ACConfig
from prime_ac.policy import OperatorPolicy, context_fn, make_policy
from prime_ac.targets import TargetSet

__all__ = ["BlockSelector", "checkpoint_blocks", "find_blocks", "unwrap_blocks"]

logger = logging.getLogger("prime_ac")

BlockSelector = str | Sequence[str] | Callable[[str, nn.Module], bool] | None
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_reported: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class _BlockCheckpoint:
    name: str
    policy: OperatorPolicy
    context_fn: Callable[[], Any]
    preserve_rng_state: bool
    original_class: type
    plan: BlockPlan | None = None  # set by targets="auto"


class _CheckpointedBlock(nn.Module):
    """Mixin placed in front of a block's own class; see the module docstring."""

    _prime_ac: _BlockCheckpoint

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._prime_ac
        if state.plan is not None and torch.compiler.is_compiling():
            raise RuntimeError(
                f'prime_ac: {state.name} uses a targets="auto" plan, which is keyed on the '
                "operator calls of an eager forward and is not guarded by torch.compile (blocks "
                "sharing code would share one plan). Run these blocks eagerly, or compile with "
                "explicit targets (and torch._functorch.config.activation_memory_budget)."
            )
        return checkpoint(
            super().forward,
            *args,
            use_reentrant=False,
            context_fn=state.context_fn,
            preserve_rng_state=state.preserve_rng_state,
            **kwargs,
        )


_wrapped_classes: dict[type, type] = {}


def _wrapped_class(cls: type) -> type:
    if cls not in _wrapped_classes:
        _wrapped_classes[cls] = type(f"Checkpointed{cls.__name__}", (_CheckpointedBlock, cls), {})
    return _wrapped_classes[cls]


def _is_wrapped(module: nn.Module) -> bool:
    return isinstance(module, _CheckpointedBlock)


def _block_class(module: nn.Module) -> type:
    return module._prime_ac.original_class if _is_wrapped(module) else type(module)


def _wrap(block: nn.Module, state: _BlockCheckpoint) -> None:
    if not _is_wrapped(block):
        block.__class__ = _wrapped_class(type(block))
    block._prime_ac = state


def _unwrap(block: nn.Module) -> None:
    state = block._prime_ac
    if type(block) is not _wrapped_classes.get(state.original_class):
        raise RuntimeError(
            f"cannot unwrap {state.name}: its class was changed after checkpoint_blocks "
            f"(now {type(block).__name__}, e.g. by fully_shard). Unwrap before applying such "
            "wrappers, or rebuild the model."
        )
    block.__class__ = state.original_class
    del block._prime_ac


def _is_block_stack(module: nn.Module) -> bool:
    """Two or more non-leaf children of one class in a ModuleList/ModuleDict/Sequential."""
    if not isinstance(module, _CONTAINERS) or len(module) < 2:
        return False
    children = list(module.children())
    first = _block_class(children[0])
    return all(
        _block_class(child) is first and next(child.children(), None) is not None
        for child in children
    )


def _containers(model: nn.Module) -> list[str]:
    return [
        f"{name or '<root>'} ({type(m).__name__} of {len(m)})"
        for name, m in model.named_modules()
        if isinstance(m, _CONTAINERS)
    ]


def _walk(module: nn.Module, prefix: str, take: Callable[[str, nn.Module], bool]):
    """Pre-order walk that yields modules ``take`` accepts and does not descend into them."""
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if take(path, child):
            yield path, child
        else:
            yield from _walk(child, path, take)


def find_blocks(
    model: nn.Module, blocks: BlockSelector = None
) -> list[list[tuple[str, nn.Module]]]:
    """The block groups ``checkpoint_blocks`` would wrap, as ``[[(qualified_name, block)]]``.

    Each group is one container (``freq`` counts indices within it); a predicate gives one group.
    """
    if callable(blocks) and not isinstance(blocks, str):
        return [list(_walk(model, "", blocks))]
    if blocks is None:
        if _is_block_stack(model):
            return [list(_named_children(model, ""))]
        stacks = list(_walk(model, "", lambda _, m: _is_block_stack(m)))
        if not stacks:
            raise ValueError(
                f"checkpoint_blocks found no stack of repeated blocks in {type(model).__name__}. "
                f"Containers seen: {', '.join(_containers(model)) or 'none'}. Pass blocks= to say "
                "where they are, e.g. blocks='model.layers', blocks=['double_blocks', "
                "'single_blocks'], or blocks=lambda name, module: isinstance(module, MyBlock)."
            )
        return [list(_named_children(stack, path)) for path, stack in stacks]
    paths = [blocks] if isinstance(blocks, str) else list(blocks)
    groups = []
    for path in paths:
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
                f"{', '.join(_containers(model)) or 'none'}."
            ) from None
        if not isinstance(container, _CONTAINERS):
            raise ValueError(
                f"blocks={path!r} is a {type(container).__name__}, not a ModuleList, ModuleDict "
                "or Sequential of blocks. Name the container that holds the blocks, or pass "
                "blocks=lambda name, module: ... to pick the block modules themselves."
            )
        groups.append(list(_named_children(container, path)))
    return groups


def _named_children(container: nn.Module, path: str) -> Iterable[tuple[str, nn.Module]]:
    for name, child in container.named_children():
        yield (f"{path}.{name}" if path else name), child


def checkpoint_blocks(
    model: nn.Module,
    *,
    mode: str = "full",
    freq: int = 1,
    targets: Iterable[str] | str | None = None,
    blocks: BlockSelector = None,
    mandatory: Iterable[str] = (),
    preserve_rng_state: bool = True,
    strict: bool = False,
    config: ACConfig | None = None,
    budget: int | float | Mapping[str, int] | None = None,
    profile: Callable[[nn.Module], Any] | None = None,
) -> list[str]:
    """Wrap each selected block of ``model`` in its own non-reentrant checkpoint region.

    Works in place and returns the wrapped blocks' qualified names. ``freq=k`` wraps blocks whose
    index in their container is a multiple of k. Applying it again replaces the settings (blocks
    no longer selected are unwrapped); wrappers never nest. ``config`` (an :class:`ACConfig`)
    supplies mode, freq and targets. Targets that no dispatch mode can see are logged once, or
    raise ValueError with ``strict=True``.

    ``targets="auto"`` keeps, per block, the operator calls that save the most replayed FLOPs
    within ``budget`` (bytes per block, a float fraction of the no-AC activation memory, or a
    ``{block name: bytes}`` mapping),
    measured on one step ``profile(model)`` that returns a loss (see :mod:`prime_ac.budget`).

    Example::

        import prime_ac
        wrapped = prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::mm"])
    """
    if config is None:  # validates, with the same errors as a config file gets
        config = ACConfig(mode=mode, freq=freq, targets=targets, budget=budget)
    mode, freq, targets = config.mode, config.freq, config.targets
    auto = targets == "auto"
    if auto and profile is None:
        raise ValueError(
            'targets="auto" needs profile=: a function that runs one forward of the model and '
            "returns the loss, e.g. profile=lambda model: model.loss(batch)"
        )
    if auto:
        mode, targets = "full", None  # profile with nothing but the mandatory set kept
    policy = make_policy(mode, targets, mandatory)
    named = TargetSet(targets or () if mode == "selective" else ())
    _report(named.problems() + TargetSet(mandatory).problems(mandatory=True), strict)

    selected: dict[int, str] = {}
    for group in find_blocks(model, blocks):
        for index, (name, block) in enumerate(group):
            if index % freq == 0:
                selected[id(block)] = name
                _wrap(
                    block,
                    _BlockCheckpoint(
                        name=name,
                        policy=policy,
                        context_fn=context_fn(policy=policy, name=f"block {name!r}"),
                        preserve_rng_state=preserve_rng_state,
                        original_class=_block_class(block),
                    ),
                )
    for module in model.modules():
        if _is_wrapped(module) and id(module) not in selected:
            _unwrap(module)
    if auto:
        apply_budget(model, profile, config.budget)
    return list(selected.values())


def unwrap_blocks(model: nn.Module) -> list[str]:
    """Restore every block ``checkpoint_blocks`` wrapped; returns their qualified names."""
    names = []
    for name, module in model.named_modules():
        if _is_wrapped(module):
            _unwrap(module)
            names.append(name)
    return names


def _report(problems: list[tuple[str, str]], strict: bool) -> None:
    """Log (once per process) or raise for user-named targets the policy can never keep."""
    if strict and problems:
        raise ValueError(
            "targets that no dispatch mode can see (strict=True): "
            + "; ".join(f"{target!r} {reason}" for target, reason in problems)
        )
    for target, reason in problems:
        if (target, reason) not in _reported:
            _reported.add((target, reason))
            logger.warning("prime_ac target %r %s; it matches nothing for now", target, reason)
