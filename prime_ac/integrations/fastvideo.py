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

Nothing here imports FastVideo.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["FASTVIDEO_OP_LIST", "targets_from_op_list"]

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
target strings. Its ``fastvideo::`` ops register when their backend module is imported, so
prime_ac logs them once per configuration until then."""

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
    have (``"aten::mm.defualt"``) raises ValueError.

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
    return targets


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
