"""Finding the blocks to checkpoint: a path, a list of paths or a predicate, or discovery of the
stacks of blocks (without helper stacks of per-token MLPs, and refusing models that declare
they do not support gradient checkpointing). The rule is docs/checkpointing.md, "Discovery".
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch import nn

__all__ = ["BlockSelector", "find_blocks"]

logger = logging.getLogger("prime_ac")

BlockSelector = str | Sequence[str] | Callable[[str, nn.Module], bool] | None
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


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
