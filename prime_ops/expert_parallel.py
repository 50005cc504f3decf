"""Reference expert-parallel (EP) MoE built from the ``prime_rl_collectives`` ops.

Experts are sharded over an EP process group: rank r owns experts ``[r * L, (r + 1) * L)``
with ``L = num_experts // group.size()``. :func:`dispatch` sends each routed token row to the rank
owning its expert with one variable-split all-to-all; :func:`combine` sends expert outputs back
along the same path. Both are plain compositions of registered ops, so autograd, torch.compile
and ``prime_ac`` see every communication as one named operator.

This is the readable reference (a Python loop over local experts), meant for tests and as the
shape of a trainer's own dispatcher, not a tuned kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from prime_ops import native
from prime_ops.collectives import all_to_all_single, all_to_all_single_equal
from prime_ops.moe import record_moe_routing_statistics
from prime_ops.mxfp8 import mxfp8_all_to_all_single

__all__ = ["DispatchPlan", "ExpertParallelMoE", "combine", "dispatch"]


@dataclass(frozen=True)
class DispatchPlan:
    """What :func:`combine` needs to send expert outputs back to where their tokens came from."""

    input_splits: torch.Tensor  # rows this rank sent to each rank
    output_splits: torch.Tensor  # rows this rank received from each rank
    order: torch.Tensor  # received row -> position in local-expert order
    group: dist.ProcessGroup | None
    mxfp8: bool = False  # rows travel as MXFP8 (prime_ops.mxfp8) in both directions


def dispatch(
    tokens: torch.Tensor,
    counts: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    mxfp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Send routed token rows to the ranks that own their experts.

    ``tokens`` holds one row per (token, expert) assignment, sorted by global expert id;
    ``counts[e]`` is how many rows go to expert e. Returns the rows this rank's experts must
    process, grouped by local expert; the number of rows per local expert; and the plan for
    :func:`combine`. ``group=None`` means every expert is local (no communication).
    ``mxfp8=True`` sends the rows (here and in :func:`combine`) as MXFP8, about half the bytes
    of bf16; gradients travel back in full precision.
    """
    world = 1 if group is None else group.size()
    if counts.dim() != 1 or counts.numel() % world != 0:
        raise ValueError(
            f"counts must be 1-D with one entry per expert, a multiple of the group size "
            f"{world}; got shape {tuple(counts.shape)}"
        )
    if group is None:
        everything = torch.tensor([tokens.shape[0]])
        plan = DispatchPlan(everything, everything, torch.arange(tokens.shape[0]), None)
        return tokens, counts, plan
    local = counts.numel() // world
    # recv_counts[s * local + e]: rows rank s sends to this rank's local expert e.
    recv_counts = all_to_all_single_equal(counts, group)
    input_splits = counts.view(world, local).sum(1)
    output_splits = recv_counts.view(world, local).sum(1)
    send = mxfp8_all_to_all_single if mxfp8 else all_to_all_single
    received = send(tokens, output_splits, input_splits, group)
    # Received rows are ordered (source rank, local expert); regroup them by local expert.
    expert_of_row = torch.arange(local, device=counts.device).repeat(world)
    expert_of_row = expert_of_row.repeat_interleave(recv_counts)
    order = torch.argsort(expert_of_row, stable=True)
    plan = DispatchPlan(input_splits, output_splits, order, group, mxfp8)
    return received[order], recv_counts.view(world, local).sum(0), plan


def combine(expert_output: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Inverse of :func:`dispatch`: rows come back in the order they were sent."""
    if plan.group is None:
        return expert_output
    received = torch.empty_like(expert_output).index_copy(0, plan.order, expert_output)
    send = mxfp8_all_to_all_single if plan.mxfp8 else all_to_all_single
    return send(received, plan.input_splits, plan.output_splits, plan.group)


class ExpertParallelMoE(nn.Module):
    """Top-k token-choice MoE with SwiGLU experts sharded over ``ep_group``.

    Softmax router in fp32, ``top_k`` experts per token, outputs summed with the top-k
    probabilities as weights. ``ep_group=None`` keeps every expert on this process, which is
    also the single-process reference of the sharded layer. Per-expert token counts and the
    summed top-k probability accumulate in the ``tokens_per_expert`` and
    ``routing_confidence_sum`` buffers through ``prime_rl::record_moe_routing_statistics``
    (this rank's tokens only; all-reduce them for global statistics).
    ``mxfp8_transport=True`` moves token rows between ranks as MXFP8 (``dim`` a multiple of 32).
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        ep_group: dist.ProcessGroup | None = None,
        mxfp8_transport: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        world = 1 if ep_group is None else ep_group.size()
        if num_experts % world != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the EP group size {world}; "
                "every rank must own the same number of experts"
            )
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.ep_group = num_experts, top_k, ep_group
        self.mxfp8_transport = mxfp8_transport
        local = num_experts // world
        rank = 0 if ep_group is None else ep_group.rank()
        self.local_experts = range(rank * local, (rank + 1) * local)
        kw = {"device": device, "dtype": dtype}
        self.router = nn.Linear(dim, num_experts, bias=False, **kw)
        self.w_gate = nn.Parameter(torch.empty(local, dim, hidden_dim, **kw))
        self.w_up = nn.Parameter(torch.empty(local, dim, hidden_dim, **kw))
        self.w_down = nn.Parameter(torch.empty(local, hidden_dim, dim, **kw))
        self.register_buffer(
            "tokens_per_expert",
            torch.zeros(num_experts, device=device, dtype=torch.float32),
            persistent=False,
        )
        self.register_buffer(
            "routing_confidence_sum",
            torch.zeros((), device=device, dtype=torch.float32),
            persistent=False,
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.router.weight, std=self.router.in_features**-0.5)
        for w in (self.w_gate, self.w_up, self.w_down):  # [experts, fan_in, fan_out]
            nn.init.normal_(w, std=w.shape[1] ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        # A static-shape count (bincount's length depends on the data under torch.compile).
        flat = experts.flatten()
        counts = torch.zeros(self.num_experts, dtype=flat.dtype, device=flat.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat))
        with torch.no_grad():
            record_moe_routing_statistics(
                self.tokens_per_expert, self.routing_confidence_sum, counts, weights.sum()
            )
        # One row per (token, slot), sorted by expert so each expert's rows are contiguous:
        # one prime_rl::moe_permute / moe_unpermute each when the native kernels are built
        # (the same values; see docs/native.md), else the eager chain.
        fused = native.has_kernel("moe_permute", x.device)
        if fused:
            x_sorted, row_map, _ = native.moe_permute(x, experts, self.num_experts)
        else:
            order = torch.argsort(experts.flatten(), stable=True)
            x_sorted = x[order // self.top_k]
        rows, rows_per_expert, plan = dispatch(
            x_sorted, counts, self.ep_group, mxfp8=self.mxfp8_transport
        )
        rows = combine(self._experts(rows, rows_per_expert), plan)
        if fused:
            return native.moe_unpermute(rows, row_map, weights.to(rows.dtype)).reshape(shape)
        slots = torch.empty_like(rows).index_copy(0, order, rows).view(-1, self.top_k, shape[-1])
        out = (slots * weights.unsqueeze(-1).to(slots.dtype)).sum(1)
        return out.reshape(shape)

    def _experts(self, rows: torch.Tensor, rows_per_expert: torch.Tensor) -> torch.Tensor:
        chunks = rows.split(rows_per_expert.tolist())
        return torch.cat(
            [
                (F.silu(r @ self.w_gate[e]) * (r @ self.w_up[e])) @ self.w_down[e]
                for e, r in enumerate(chunks)
            ]
        )
