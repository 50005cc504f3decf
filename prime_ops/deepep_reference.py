"""DeepEP's normal (intranode) dispatch/combine semantics over ``torch.distributed``.

:class:`ReferenceBuffer` has the subset of ``deep_ep.Buffer``'s interface that
:class:`prime_ops.deepep.Dispatcher` calls (``get_dispatch_layout``, ``dispatch`` with or without
a cached handle, ``combine``) and the same results, computed with ``all_to_all_single`` over any
process group (gloo on CPU, nccl on GPU). ``Dispatcher(..., backend="reference")`` uses it: CPU
tests and CPU debugging runs then exercise the same layout, masking, alignment and ordering rules
as the real kernels, so a wrong formula in an adapter shows up without a GPU. The rules, as
DeepEP's legacy kernels implement them (``csrc/kernels/legacy/layout.cu``, ``intranode.cu``):

- Rank ``j`` owns experts ``[j * L, (j + 1) * L)``. A token goes to rank ``j`` once if any of its
  ``topk_idx`` is one of those experts (``is_token_in_rank``); ``-1`` selects nothing.
- Received rows are ordered by source rank, then by token index on that rank.
- Received ``topk_idx`` is the local expert index, or ``-1`` where the expert lives on another
  rank; received ``topk_weights`` are zeroed exactly where the received index is ``-1``.
- Per local expert, the received count (over all sources, one per selecting slot) is rounded up
  to a multiple of ``expert_alignment``; the received rows themselves are not padded.
- ``combine`` sums, per source token, the rows returned by every rank that received it, in rank
  order, accumulating in fp32 and rounding once to the input dtype; top-k weights are summed the
  same way, without any mask. A token no rank received combines to zeros.

Every tensor crosses the wire as raw bytes, so results are bitwise what was sent.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["ReferenceBuffer"]


class _Layout(NamedTuple):
    """The reference's dispatch handle: who got which token, and the split sizes both ways."""

    token: torch.Tensor  # source token of each sent row (rows sorted by rank, then token)
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    num_tokens: int  # rows of x on this rank (the rows combine returns)


def _exchange(
    t: torch.Tensor, send_counts: list[int], recv_counts: list[int], group
) -> torch.Tensor:
    """Variable-split all-to-all of the rows of ``t``, bytes for bytes."""
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    raw = t.contiguous().view(torch.uint8).view(t.shape[0], row_bytes)
    out = raw.new_empty(sum(recv_counts), row_bytes)
    dist.all_to_all_single(out, raw, recv_counts, send_counts, group=group)
    return out.view(t.dtype).view(out.shape[0], *t.shape[1:])


class ReferenceBuffer:
    """DeepEP's ``Buffer`` semantics on any process group; see the module docstring."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.group_size = group.size()
        self.rank = group.rank()

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        """``(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, None)``."""
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
        per_expert.index_add_(
            0, topk_idx[valid], torch.ones_like(topk_idx[valid], dtype=torch.int32)
        )
        local = num_experts // self.group_size
        rank_of_slot = torch.where(valid, topk_idx // local, -1)
        ranks = torch.arange(self.group_size, device=topk_idx.device)
        in_rank = (rank_of_slot[:, :, None] == ranks).any(dim=1)
        return in_rank.sum(0, dtype=torch.int32), None, per_expert, in_rank, None

    def dispatch(
        self,
        x: torch.Tensor,
        handle: _Layout | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        **_: Any,
    ):
        """``(recv_x, recv_topk_idx, recv_topk_weights, counts, handle, None)``.

        With ``handle`` (a cached dispatch) only ``recv_x`` is returned, the rest is None.
        """
        if handle is not None:
            recv_x = _exchange(x[handle.token], handle.send_counts, handle.recv_counts, self.group)
            return recv_x, None, None, None, None, None
        dest, token = is_token_in_rank.T.nonzero(as_tuple=True)
        send_counts = num_tokens_per_rank.to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        layout = _Layout(token, send_counts.tolist(), recv_counts.tolist(), x.shape[0])

        local = num_tokens_per_expert.numel() // self.group_size
        per_expert = num_tokens_per_expert.to(torch.int64)
        recv_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_per_expert, per_expert, group=self.group)
        counts = recv_per_expert.view(self.group_size, local).sum(0)
        counts = (counts + expert_alignment - 1) // expert_alignment * expert_alignment

        sent_idx = topk_idx[token] - dest[:, None] * local
        here = (sent_idx >= 0) & (sent_idx < local)  # -1 (no expert) lands below 0 too
        sent_idx = torch.where(here, sent_idx, -1)
        sent_weights = torch.where(here, topk_weights[token], 0.0)
        exchange = (layout.send_counts, layout.recv_counts, self.group)
        recv_x = _exchange(x[token], *exchange)
        recv_idx = _exchange(sent_idx, *exchange)
        recv_weights = _exchange(sent_weights, *exchange)
        return recv_x, recv_idx, recv_weights, counts.tolist(), layout, None

    def combine(
        self,
        x: torch.Tensor,
        handle: _Layout,
        topk_weights: torch.Tensor | None = None,
        **_: Any,
    ):
        """``(combined_x, combined_topk_weights or None, None)``."""
        back = (handle.recv_counts, handle.send_counts, self.group)
        combined = _sum_by_rank(_exchange(x, *back), handle)
        weights = None
        if topk_weights is not None:
            weights = _sum_by_rank(_exchange(topk_weights, *back), handle)
        return combined, weights, None


def _sum_by_rank(returned: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Per source token, the fp32 sum of the rows every rank returned, added in rank order."""
    total = returned.new_zeros(layout.num_tokens, *returned.shape[1:], dtype=torch.float32)
    start = 0
    for count in layout.send_counts:  # each token appears at most once per rank
        rows = slice(start, start + count)
        total[layout.token[rows]] += returned[rows].float()
        start += count
    return total.to(returned.dtype)
