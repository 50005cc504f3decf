"""FastVideo's selective-checkpointing op list as prime_ac targets that match on CPU and GPU.

FastVideo's main branch (``fastvideo/train/utils/activation_checkpoint.py`` @ 1728326dd9d8)
keeps the CUDA SDPA kernels (flash, efficient, cuDNN) and its own ``fastvideo::`` /
``fastvideo_kernel::`` attention ops, no matrix product and no collective (keeping FSDP's
parameter all-gather would hold every block's unsharded weights). On a CPU, SDPA dispatches
``aten::_scaled_dot_product_flash_attention_for_cpu``, so the list as it stands keeps nothing
there. :func:`targets_from_op_list` names, beside each SDPA kernel of a list, every other fused
SDPA kernel (CUDA flash, efficient, cuDNN, the CPU kernel, the overrideable one), and beside a
matrix product (older lists named ``aten::mm``) its biased twin ``aten::addmm``.

FastVideo's ``ops`` mode wraps blocks with ``preserve_rng_state=False``: its blocks draw no
random numbers that must replay; pass the same to :func:`prime_ac.checkpoint_blocks` to match it.
:func:`apply_activation_checkpointing` is FastVideo's entry point of the same name on prime_ac:
its three types, its block lists, and its op list read when it is called.

Nothing here imports FastVideo.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from prime_ac import checkpoint_blocks
from prime_ac.tables import supplied

__all__ = [
    "FASTVIDEO_BLOCK_LISTS",
    "FASTVIDEO_OP_LIST",
    "apply_activation_checkpointing",
    "targets_from_op_list",
]

FASTVIDEO_BLOCK_LISTS: tuple[str, ...] = (
    "blocks",
    "double_blocks",
    "single_blocks",
    "transformer_blocks",
    "temporal_transformer_blocks",
    "transformer_double_blocks",
    "transformer_single_blocks",
    "text_transformer_blocks",
    "visual_transformer_blocks",
)
"""The attributes FastVideo main's ``_TRANSFORMER_BLOCK_NAMES`` looks for on a transformer."""

FASTVIDEO_OP_LIST: tuple[str, ...] = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "fastvideo::_flash_attn_default_forward",
    "fastvideo::_flash_attn_cute_forward",
    "fastvideo::_flash_attn_cute_varlen_forward",
    "fastvideo::_flash_attn_cute_fp4_forward",
    "fastvideo::_flash_attn_no_pad_forward",
    "fastvideo::_flash_attn_varlen_qk_no_pad_forward",
    "fastvideo_kernel::block_sparse_attn_sm90",
    "fastvideo_kernel::block_sparse_attn_sm100a",
    "fastvideo_kernel::block_sparse_attn_triton",
)
"""FastVideo main's ``_SELECTIVE_ACTIVATION_CHECKPOINTING_OP_NAMES`` (@ 1728326dd9d8), as
target strings. Its ``fastvideo::`` ops register when their backend module is imported; until
then prime_ac mentions them at debug level only (a run need not load every backend)."""

_SDPA = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_fused_attention_overrideable",
)
_SAME_WORK = {
    "aten::mm": ("aten::mm", "aten::addmm"),
    "aten::addmm": ("aten::mm", "aten::addmm"),
    # the math kernel is CompositeImplicitAutograd (never dispatched): the fused kernels do its work
    "aten::_scaled_dot_product_attention_math": _SDPA,
    **{kernel: _SDPA for kernel in _SDPA},
}


def targets_from_op_list(ops: Iterable[Any]) -> list[str]:
    """prime_ac targets keeping what ``ops`` asks for on every device.

    ``ops`` holds target strings (``"aten::mm.default"``), ``str(op)`` spellings
    (``"aten.mm.default"``) or operator objects (``torch.ops.aten.mm.default``). Matrix products
    and SDPA kernels become their operator names without overload, with their CPU and CUDA
    counterparts; any other operator is kept as named. An overload that the operator does not
    have (``"aten::mm.defualt"``) raises ValueError. The targets are marked as a trainer's list
    (:func:`prime_ac.tables.supplied`): a name that matches nothing on one run (another device's
    kernel, a backend not loaded) is not reported; a list of which nothing matched is, once.

    Example::

        targets = targets_from_op_list(FASTVIDEO_OP_LIST)
        prime_ac.checkpoint_blocks(transformer, mode="selective", targets=targets)
    """
    if isinstance(ops, str):
        raise ValueError(f"ops={ops!r} is one string; pass a list of operators: [{ops!r}]")
    targets: list[str] = []
    for op in ops:
        name = _name(op)
        base = name.rsplit(".", 1)[0] if name.count(".") == 1 else name
        if base != name:
            _check_overload(op, base, name.rsplit(".", 1)[1])
        for target in _SAME_WORK.get(base, (name,)):
            if target not in targets:
                targets.append(target)
    return list(supplied(targets))


def _name(op: Any) -> str:
    """``ns::op[.overload]`` for a target string, a ``str(op)`` spelling or an operator."""
    if not isinstance(op, str):
        namespace = getattr(op, "namespace", None)
        if namespace == "higher_order":
            return f"higher_order::{op.name()}"
        op = str(op)
    if "::" in op:
        return op
    parts = op.split(".")
    if len(parts) not in (2, 3):
        raise ValueError(
            f"operator {op!r} is neither a target ('aten::mm.default') nor an operator's "
            "str() ('aten.mm.default')"
        )
    return f"{parts[0]}::{'.'.join(parts[1:])}"


def _check_overload(op: Any, base: str, overload: str) -> None:
    """Raise when ``base`` is a registered operator without ``overload``: a typo dropped with the
    overload would go unseen. Operators not registered yet (a backend loading later) pass."""
    namespace, _, name = base.partition("::")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return
    known = packet.overloads()
    if overload not in known:
        raise ValueError(
            f"ops names {op!r}, but {base} has no overload {overload!r} (it has "
            f"{', '.join(known)}): fix the overload, or name the operator without one ({base!r})"
        )


def apply_activation_checkpointing(
    module: nn.Module,
    checkpointing_type: Any = "full",
    n_layer: int = 1,
    *,
    op_list: Iterable[Any] | None = None,
) -> nn.Module:
    """Checkpoint ``module``'s blocks as FastVideo's function of the same name does, with prime_ac.

    ``checkpointing_type`` is FastVideo's (a string or its ``CheckpointType``): ``"full"`` checks
    every block of FastVideo's block lists (:data:`FASTVIDEO_BLOCK_LISTS`), ``"ops"`` keeps
    ``op_list`` (FastVideo's list: :data:`FASTVIDEO_OP_LIST`, read now, so a test that
    monkeypatches it is honoured), ``"block_skip"`` checks every ``n_layer``-th block. Blocks
    keep their class and names, as with :func:`prime_ac.checkpoint_blocks`; ``module`` is
    returned. A module with none of the block lists raises ValueError, as FastVideo's does.
    """
    kind = getattr(checkpointing_type, "value", checkpointing_type)
    settings = {"full": ("full", 1), "ops": ("selective", 1), "block_skip": ("full", n_layer)}
    if kind not in settings:
        raise ValueError(
            f"checkpointing_type={checkpointing_type!r} is not one of FastVideo's types: use "
            f"{', '.join(repr(k) for k in settings)}"
        )
    blocks = [name for name in FASTVIDEO_BLOCK_LISTS if getattr(module, name, None) is not None]
    if not blocks:
        raise ValueError(
            f"activation checkpointing found nothing to apply to: {type(module).__name__} has "
            f"none of FastVideo's block lists ({', '.join(FASTVIDEO_BLOCK_LISTS)}); wrap its "
            "blocks with prime_ac.checkpoint_blocks(module, blocks=...) instead"
        )
    mode, freq = settings[kind]
    targets = None
    if kind == "ops":
        targets = targets_from_op_list(FASTVIDEO_OP_LIST if op_list is None else op_list)
    checkpoint_blocks(
        module, mode=mode, freq=freq, targets=targets, blocks=blocks, preserve_rng_state=False
    )
    return module
