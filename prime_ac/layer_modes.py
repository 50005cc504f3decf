"""Each layer's mode: prime-rl's ``layer_modes`` and ``freq`` read per block, and one policy per
mode the blocks use. :func:`get_layer_modes` is public for trainers that keep their own wrapping
loop; :func:`prime_ac.checkpoint_blocks` reads it for every group of blocks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prime_ac.config import ACConfig
from prime_ac.policy import make_policy

__all__ = ["get_layer_modes", "layer_policies"]


def get_layer_modes(
    config: ACConfig,
    layer_names: Sequence[str],
    num_layers: int | None = None,
    parts: Sequence[str | None] | None = None,
) -> list[str]:
    """The mode of each layer this rank holds under ``config``, ``"none"`` for an unchecked one.

    prime-rl's ``get_layer_modes``, for a trainer that keeps its own wrapping loop: with
    ``layer_modes``, each layer's entry, found by the layer's index in the full model (pipeline
    stages keep those: ``model.layers.7`` reads entry 7); otherwise ``config.mode`` for every
    ``freq``-th name in ``layer_names`` (this rank's layers, in order) and ``"none"`` for the
    rest. The index is the part of the names that tells the layers apart, so blocks that are
    parts of layers (``layers.3.mlp``, ``layers.3.0``) read their layer's entry. ``num_layers``,
    when given, is the full model's layer count that ``layer_modes`` must match.

    ``parts``, prime-rl's fourth argument, is the half each layer keeps where a pipeline stage
    boundary cuts it (``"attention"`` or ``"moe"``, else None): it picks that half's mode from a
    pair entry (``["full", "selective"]``). Without ``layer_modes`` it is unused, as in prime-rl.
    """
    names = list(layer_names)
    if config.layer_modes is None:
        return [config.mode if i % config.freq == 0 else "none" for i in range(len(names))]
    halves = _parts(parts, len(names))
    count = len(config.layer_modes)
    if num_layers is not None and num_layers != count:
        raise ValueError(
            f"layer_modes has {count} entries and the model {num_layers} decoder layers: give "
            "one entry per layer of the full model"
        )
    modes = []
    for name, index, part in zip(names, _layer_indices(names), halves, strict=True):
        if index >= count:
            raise ValueError(
                f"layer_modes has {count} entries, one per decoder layer of the full model by "
                f"index, and block {name!r} is layer {index}: give one entry per layer"
            )
        mode = config.layer_modes[index]
        if not isinstance(mode, str):
            if part is None:
                raise ValueError(
                    f"layer_modes[{index}]={list(mode)!r} gives layer {index} a mode per half "
                    "(attention, moe), which prime-rl applies where a pipeline stage boundary "
                    f"cuts the layer; {name!r} is one whole block here: give it one mode, or "
                    "pass parts= naming the half this stage holds"
                )
            mode = mode[0] if part == "attention" else mode[1]
        modes.append(mode)
    return modes


def _parts(parts: Sequence[str | None] | None, count: int) -> list[str | None]:
    """prime-rl's ``parts``: one of "attention", "moe" or None per layer name."""
    if not parts:  # prime-rl's `parts or [None] * len(layer_names)`
        return [None] * count
    halves = list(parts)
    if len(halves) != count or any(p not in ("attention", "moe", None) for p in halves):
        raise ValueError(
            f"parts={halves!r} must give each of the {count} layer names the half a pipeline "
            "stage boundary leaves it ('attention' or 'moe'), or None for a whole layer"
        )
    return halves


def _layer_indices(names: list[str]) -> list[int]:
    """Each name's layer index: the one numeric part of the names whose values differ between
    them (``layers.{0..3}.0`` -> 0..3), the last part for a single name with one number."""
    parts = [name.split(".") for name in names]
    shapes = {len(p) for p in parts}
    numeric = (
        [i for i in range(len(parts[0])) if all(p[i].isdigit() for p in parts)]
        if len(shapes) == 1
        else []
    )
    telling = [i for i in numeric if len({p[i] for p in parts}) == len(parts)]
    if len(telling) == 1:
        return [int(p[telling[0]]) for p in parts]
    shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
    if not numeric:
        why = "no numeric part that all of them share, as model.layers.N has"
    elif not telling:
        why = "no numeric part that differs between each of them"
    else:
        why = "several numeric parts that could be the layer's index"
    raise ValueError(
        f"layer_modes finds each block's entry by its layer index, and the blocks ({shown}) "
        f"have {why}: select whole decoder layers (blocks named model.layers.N) or give the "
        "blocks their modes with mode= and freq="
    )


def layer_policies(
    config: ACConfig, modes: dict[str, str], mandatory: Iterable[str], policy: Any
) -> dict[str, Any]:
    """One policy per mode the blocks use (``policy`` for ``config.mode`` itself)."""
    policies = {config.mode: policy}
    for mode in sorted(set(modes.values()) - set(policies)):
        targets = config.targets if mode == "selective" else None
        policies[mode] = make_policy(mode, targets, mandatory)
    return policies
