"""MoE routing telemetry as a mutating op: ``prime_rl::record_moe_routing_statistics``.

Routers accumulate how many tokens each expert received (for load-balancing bias updates and
metrics). Done with plain in-place adds, activation checkpointing replays the adds during
recompute and the counters double. As one mutating custom op the accumulation has a name that
checkpoint policies keep (``prime_ac`` lists it as mandatory in every mode), so it runs once per
forward and never in recompute. The name and schema are prime-rl's (its MoE layer module's
``record_moe_routing_statistics``, unchanged in every stored version up to the newest), so its call
``record_moe_routing_statistics(self.tokens_per_expert, self.routing_confidence_sum,
num_tokens_per_expert, routing_confidence_sum)`` under ``torch.no_grad()`` binds as it is.

The reference expert-parallel MoE layer that records these statistics lives in
:mod:`prime_ops.expert_parallel`.
"""

from __future__ import annotations

import torch

from prime_ops.devices import check_same_device

__all__ = ["record_moe_routing_statistics"]


def _check(tokens_per_expert, routing_confidence_sum, token_counts, confidence) -> None:
    check_same_device(
        "prime_rl::record_moe_routing_statistics",
        tokens_per_expert=tokens_per_expert,
        routing_confidence_sum=routing_confidence_sum,
        token_counts=token_counts,
        confidence=confidence,
    )
    if token_counts.shape != tokens_per_expert.shape:
        raise ValueError(
            f"token_counts has shape {tuple(token_counts.shape)} but tokens_per_expert has "
            f"{tuple(tokens_per_expert.shape)}; pass one count per expert"
        )
    if confidence.shape != routing_confidence_sum.shape:
        raise ValueError(
            f"confidence has shape {tuple(confidence.shape)} but routing_confidence_sum has "
            f"{tuple(routing_confidence_sum.shape)}; pass the confidence already reduced to "
            "the accumulator's shape (usually a 0-d sum over tokens)"
        )
    for name, total in (
        ("tokens_per_expert", tokens_per_expert),
        ("routing_confidence_sum", routing_confidence_sum),
    ):
        if any(
            stride == 0 and size > 1
            for stride, size in zip(total.stride(), total.shape, strict=True)
        ):
            raise ValueError(
                f"{name} is an expanded view (strides {total.stride()} for shape "
                f"{tuple(total.shape)}): several of its elements share one memory location, so "
                "an in-place add cannot accumulate into each; pass a tensor that owns its "
                f"elements (torch.zeros({', '.join(map(str, total.shape))}) or {name}.clone())"
            )
    for total, part, names in (
        (tokens_per_expert, token_counts, ("tokens_per_expert", "token_counts")),
        (routing_confidence_sum, confidence, ("routing_confidence_sum", "confidence")),
    ):
        if not torch.can_cast(part.dtype, total.dtype):
            raise TypeError(
                f"{names[1]} is {part.dtype}, which {names[0]} ({total.dtype}) cannot add in "
                f"place; make {names[0]} {torch.promote_types(part.dtype, total.dtype)}"
            )


@torch.library.custom_op(
    "prime_rl::record_moe_routing_statistics",
    mutates_args=("tokens_per_expert", "routing_confidence_sum"),
)
def record_moe_routing_statistics(
    tokens_per_expert: torch.Tensor,
    routing_confidence_sum: torch.Tensor,
    token_counts: torch.Tensor,
    confidence: torch.Tensor,
) -> None:
    """Add ``token_counts`` into ``tokens_per_expert`` and ``confidence`` into the sum, in place.

    Call it under ``torch.no_grad()`` with detached statistics: it is telemetry, not part of the
    loss, and has no autograd formula.
    """
    _check(tokens_per_expert, routing_confidence_sum, token_counts, confidence)
    tokens_per_expert.add_(token_counts)
    routing_confidence_sum.add_(confidence)


@record_moe_routing_statistics.register_fake
def _(tokens_per_expert, routing_confidence_sum, token_counts, confidence):
    _check(tokens_per_expert, routing_confidence_sum, token_counts, confidence)
