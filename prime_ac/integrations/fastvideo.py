"""FastVideo's selective-checkpointing op list as prime_ac targets that match on CPU and GPU.

FastVideo's list (``fastvideo/train/utils/activation_checkpoint.py``) names ``aten::mm`` and the
CUDA SDPA kernels. Its DiTs' linears have biases, so they dispatch ``aten::addmm``; on a CPU,
SDPA dispatches ``aten::_scaled_dot_product_flash_attention_for_cpu``. Taken as it stands, the
list keeps nothing there and "selective" holds what full holds. :func:`targets_from_op_list`
names, beside each operator of the list, the others that do the same work: ``aten::addmm``
beside ``aten::mm``, and every fused SDPA kernel (CUDA flash, efficient, cuDNN, the CPU kernel,
the overrideable one) beside any of them. FastVideo's "replay every second mm" is not carried
over: every matrix product is kept.

Nothing here imports FastVideo.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["FASTVIDEO_OP_LIST", "targets_from_op_list"]

FASTVIDEO_OP_LIST: tuple[str, ...] = (
    "aten::mm.default",
    "aten::_scaled_dot_product_efficient_attention.default",
    "aten::_scaled_dot_product_flash_attention.default",
    "_c10d_functional::reduce_scatter_tensor.default",
)
"""FastVideo's ``_SELECTIVE_ACTIVATION_CHECKPOINTING_OPS`` (0.2.x), as target strings."""

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
    counterparts; any other operator is kept as named.

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
