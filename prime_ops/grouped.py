"""The contiguous grouped layout shared by the grouped GEMM ops (FP8 and QuACK).

Rows of ``x`` are sorted by group (expert); ``offsets`` is an int32 ``[G]`` tensor of cumulative
row ends, as ``torch._grouped_mm`` takes it.
"""

from __future__ import annotations

import torch

from prime_ops._compat import assert_async

__all__ = ["check_offsets_meta", "check_offsets_values"]


def check_offsets_meta(
    offsets: torch.Tensor, groups: int, *, name: str = "offsets", weight: str = "weight"
) -> None:
    """Dtype and shape only: safe in fakes, where values are unknown."""
    if groups == 0:
        raise ValueError(
            f"{weight} has 0 groups: a grouped GEMM needs at least one (one weight per group, "
            f"stacked on dim 0); with no tokens routed anywhere keep the groups and pass {name} "
            "of zeros"
        )
    if offsets.dtype != torch.int32 or offsets.dim() != 1 or offsets.shape[0] != groups:
        raise ValueError(
            f"{name} must be a 1-D int32 tensor of {groups} cumulative row ends (one per group "
            f"of weight), got dtype {offsets.dtype} and shape {tuple(offsets.shape)}"
        )


def check_offsets_values(offsets: torch.Tensor, rows: int, *, name: str = "offsets") -> None:
    """Offsets must be non-decreasing, non-negative and end at the row count.

    Checked on the host for CPU tensors; on CUDA the check is queued on the device
    (``torch._assert_async``), so it costs no host sync and fails at the next synchronization.
    """
    steps = torch.diff(offsets, prepend=offsets.new_zeros(1))
    ok = (steps >= 0).all() & (offsets[-1] == rows)
    if offsets.device.type != "cpu":
        assert_async(ok, f"{name} must be non-decreasing and end at the row count of x")
    elif not bool(ok):
        raise ValueError(
            f"{name} must be non-decreasing cumulative row ends that finish at the row count "
            f"of x ({rows}), got {offsets.tolist()}"
        )
