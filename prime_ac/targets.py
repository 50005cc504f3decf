"""Operator targets: the string grammar, the default and mandatory sets, and matching.

prime_ac knows operators only by name, so a trainer can name ops of libraries that are not
installed or not yet imported. Accepted forms:

- ``ns``: every operator of a namespace (``"prime_rl_collectives"``)
- ``ns::op``: every overload of one operator (``"aten::mm"`` also matches ``aten::mm.out``)
- ``ns::op.overload``: one overload (``"aten::mm.default"``)
- higher-order operators live in namespace ``higher_order`` (``"higher_order::flex_attention"``)
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from prime_ac import _compat

__all__ = [
    "DEFAULT_TARGETS",
    "HOST_SYNC_TARGETS",
    "LEVEL_TARGETS",
    "MANDATORY_TARGETS",
    "RELEASE_DEPENDENT_OPERATORS",
    "QUACK_GEMMS",
    "REPLAYED_BY_MODE",
    "Target",
    "TargetSet",
    "operator_key",
    "registered_operators",
    "translate_composites",
]

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_TARGET = re.compile(rf"(?P<ns>{_IDENT})(?:::(?P<op>{_IDENT})(?:\.(?P<overload>{_IDENT}))?)?")
_FORMS = (
    "'ns', 'ns::op' or 'ns::op.overload' (e.g. 'prime_rl_attn', 'aten::mm', 'aten::mm.default')"
)

# The lists carry prime-rl's (src/prime_rl/trainer/activation_checkpointing.py, the newest version
# in the index: the one defining REPLAYABLE_EXPERT_OPERATIONS and get_layer_modes), torchtitan's
# and FastVideo's, by name; where prime_ac differs, docs/checkpointing.md ("Lists") gives the
# measurement. prime-rl's model kernels (DeepSeek V4 attention and RoPE, indexers, mega MoE) stay
# prime-rl's: the lists name them, prime_ops need not implement them.
_SDPA = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_fused_attention_overrideable",
)
_ATTENTION = (
    *_SDPA,
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "flash_attn",
    "flash_attn_3",
    "prime_rl_attn",
    "prime_rl_ring",
    "prime_rl::sparse_mla",
    "prime_rl::dsv4_sparse_attn",
    "prime_rl::dsv41_sparse_attn",
    "prime_rl::dsv41_sparse_attn_rope",
    "prime_kernels::indexed_attention_forward",
    "higher_order::flex_attention",
)
# QuACK's own registered GEMMs (quack-kernels 0.6.5, quack/gemm_interface.py and the epilogue
# GEMMs' quack/gemm_runtime/torch_op.py): the functional ones and the out= ones, which return
# nothing and write their outputs (kept with what they wrote: prime_ac.actions.Action.KEEP_WRITTEN).
# QuACK's other ops are replayed; docs/backends.md ("QuACK's other ops") says why for each.
QUACK_GEMMS: tuple[str, ...] = (
    "quack::gemm",
    "quack::gemm_add",
    "quack::gemm_out",
    "quack::gemm_add_out",
    "quack::gemm_add_inplace",
    "quack::gemm_act_out",
    "quack::gemm_dact_out",
    "quack::gemm_gated_out",
    "quack::gemm_dgated_out",
    "quack::gemm_quant_out",
    "quack::gemm_symmetric_out",
    "quack::gemm_rms_out",
    "quack::gemm_norm_act_out",
    "quack::gemm_norm_gated_out",
    "quack::gemm_epi",
    "quack::gemm_epi_f",
)
# torch's own operators that some supported torch releases lack (2.9 has no ``_v2`` scaled GEMMs,
# which torch 2.13's ``F.scaled_mm`` dispatches): a list naming them is right on every release,
# so where they are missing they are reported as unregistered, never refused as typos.
RELEASE_DEPENDENT_OPERATORS = frozenset({"aten::_scaled_mm_v2", "aten::_scaled_grouped_mm_v2"})

_MATMUL = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::convolution",
    "aten::_grouped_mm",
    "aten::_scaled_mm",
    "aten::_scaled_mm_v2",
    "aten::_scaled_grouped_mm",
    "aten::_scaled_grouped_mm_v2",
    "prime_rl::fp8_blockwise_mm",
    "prime_rl::fp8_gate_up_mm",
    "prime_rl::grouped_fp8_gemm",
    "prime_rl::grouped_linear",
    "prime_rl::dsv4_linear_rope",
    "quack::prime_linear",
    "quack::prime_grouped_linear",
    *QUACK_GEMMS,
)
# prime-rl keeps the whole _c10d_functional namespace. prime_ac keeps its reductions, all-to-alls
# and broadcast, not its all-gathers (nor wait_tensor, whose result is the all-gather's): inside a
# block an all-gather is FSDP's parameter gather (SimpleFSDP, compiled FSDP2), and keeping it
# holds every checkpointed block's unsharded weights (docs/checkpointing.md, "Lists"). Its
# in-place forms (all_reduce_, broadcast_, *_out) replay: a cached result would skip the write,
# and every rank recomputes the same blocks, so the replayed collective stays matched.
_COMMUNICATION = (
    "prime_rl_collectives",
    "_c10d_functional::all_to_all_single",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::reduce_scatter_tensor_coalesced",
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_reduce_coalesced",
    "_c10d_functional::broadcast",
)

# Compiled regions inside an eager block (torchtitan's compiled flex attention runs as one):
# compute-dense kernels, kept as torchtitan's own save list keeps them.
_COMPILED = ("higher_order::inductor_compiled_code",)

DEFAULT_TARGETS: tuple[str, ...] = _ATTENTION + _MATMUL + _COMMUNICATION + _COMPILED
"""What ``mode="selective"`` keeps when ``targets`` is None: attention, matrix products,
communication and compiled regions. Elementwise ops, norms, reshapes and RoPE replay."""

# prime-rl's levels between "full" and "selective", each keeping more than the one before.
_PROJECTIONS = (
    *_COMMUNICATION,
    *(t for t in _MATMUL if t not in ("aten::convolution", "prime_rl::dsv4_linear_rope")),
    "prime_kernels::mhc_gates_forward",
)
_LEVEL_ATTENTION = (
    *_PROJECTIONS,
    *(t for t in _ATTENTION if t != "prime_rl::dsv41_sparse_attn_rope"),
    "prime_kernels::mhc_projection_forward",
    "prime_kernels::mhc_update_projection_forward",
)
LEVEL_TARGETS: dict[str, tuple[str, ...]] = {
    "projections": _PROJECTIONS,
    "attention": _LEVEL_ATTENTION,
    "matmul": (
        *_LEVEL_ATTENTION,
        "prime_rl::dsv41_sparse_attn_rope",
        "prime_rl::dsv4_linear_rope",
        "prime_rl::dsv4_q_norm_rope",
    ),
}
"""What prime-rl's modes ``projections``, ``attention`` and ``matmul`` keep beside the mandatory
set: the projection GEMMs and the collectives, but not the attention query's projection (fused
with RoPE in prime-rl's DeepSeek models: ``dsv4_linear_rope``); then also the attention outputs
and the mHC collapses; then also the query, so the recompute runs no matmul. Where the query is
a plain GEMM (every model without those fused kernels), ``projections`` keeps it already."""

# CompositeImplicitAutograd operators decompose before any dispatch mode sees them: a target
# naming one names what it dispatches on CPU and CUDA instead (trainers' lists name them:
# torchtitan's names aten::linear).
COMPOSITE_TRANSLATIONS: dict[str, tuple[str, ...]] = {
    "aten::linear": ("aten::addmm", "aten::mm", "aten::bmm"),
    "aten::matmul": ("aten::mm", "aten::bmm"),
    "aten::scaled_dot_product_attention": _SDPA,
    "aten::_scaled_dot_product_attention_math": _SDPA,
    # prime-rl's fused kernels run in place of the named one: naming it keeps them too
    "prime_rl::fp8_blockwise_mm": ("prime_rl::fp8_blockwise_mm", "prime_rl::fp8_gate_up_mm"),
    "prime_rl::dsv41_sparse_attn": (
        "prime_rl::dsv41_sparse_attn",
        "prime_rl::dsv41_sparse_attn_rope",
    ),
}


def translate_composites(targets: Iterable[str]) -> list[str]:
    """``targets`` with each CompositeImplicitAutograd name in :data:`COMPOSITE_TRANSLATIONS`
    replaced by the operators it dispatches (``aten::linear`` -> addmm, mm and bmm; the SDPA
    front and its math path -> the fused SDPA kernels, each device's), and each prime-rl kernel
    with a fused variant joined by it (as prime-rl's ``FUSED_OPERATIONS``)."""
    translated: list[str] = []
    for target in targets:
        name = target.split(".")[0] if isinstance(target, str) else target
        for replacement in COMPOSITE_TRANSLATIONS.get(name, (target,)):
            if replacement not in translated:
                translated.append(replacement)
    return translated


MANDATORY_TARGETS: tuple[str, ...] = (
    "deepep",
    "aten::topk",
    "prime_rl::record_moe_routing_statistics",
    "prime_rl::fp8_indexer",
    "prime_rl::dsv41_index_topk",
    "prime_rl::deepep_moe",
    "prime_rl::mega_moe",
    "prime_rl::mega_moe_fp8",
    "prime_kernels::dsv41_index_topk",
    "prime_kernels::select_indexed_blocks",
    "prime_rl_collectives::all_to_all_single_async",
    "_c10d_functional::isend",
    "_c10d_functional::irecv",
    "_c10d_functional::batch_p2p_ops",
)
"""Kept in every mode, whatever ``targets`` says: non-replayable communication (DeepEP and the
MoE kernels that run it: ``deepep_moe``, ``mega_moe``, ``mega_moe_fp8``; the async all-to-all,
whose output is only complete after the ``sync_all_to_all`` that follows it, which a recompute
stopping early never reaches; point-to-point sends and receives, whose peer, another pipeline
stage, does not recompute this block and posts no matching operation), routing and sparse
selection (top-k and the indexers must pick the same experts and blocks in the recompute) and
telemetry (must count once). The names are prime-rl's; its kernels register them."""

REPLAYED_BY_MODE: dict[str, tuple[str, ...]] = {"full_moe": ("prime_rl::mega_moe_fp8",)}
"""Mandatory operators a mode replays: prime-rl's ``full_moe`` recomputes the FP8 Mega MoE
(dispatch, expert GEMMs and combine; every expert-parallel rank checkpoints the same layers in
the same order, so its collectives stay matched) instead of keeping its pools."""

HOST_SYNC_TARGETS: tuple[str, ...] = ("aten::_to_copy", "aten::_local_scalar_dense")
"""Kept in every mode when they read a non-CPU tensor into host memory (a device-to-host copy,
``.item()``): a replay would sync the host a second time and could see different metadata."""


@dataclass(frozen=True)
class Target:
    """One parsed target string."""

    namespace: str
    op: str | None = None
    overload: str | None = None

    @classmethod
    def parse(cls, text: Any) -> Target:
        if not isinstance(text, str):
            raise ValueError(
                f"target {text!r} is a {type(text).__name__}, expected a string: {_FORMS}"
            )
        match = _TARGET.fullmatch(text)
        if match is None or (match["overload"] is not None and match["ns"] == "higher_order"):
            raise ValueError(f"invalid operator target {text!r}: expected {_FORMS}")
        return cls(match["ns"], match["op"], match["overload"])

    def __str__(self) -> str:
        text = self.namespace
        if self.op is not None:
            text += f"::{self.op}"
        if self.overload is not None:
            text += f".{self.overload}"
        return text

    def problem(self, registered: set[str] | None = None, *, mandatory: bool = False) -> str | None:
        """Why no dispatch mode can see this target now, or None if it can.

        Unregistered names are legal (backends register late), so this is for reporting only.
        ``registered`` is the set of ``ns::op`` names (see :func:`registered_operators`), when
        the caller already has it. ``mandatory`` targets are cached even when they mutate (so
        their effect happens once).
        """
        if registered is None:
            registered = registered_operators()
        if self.namespace == "higher_order":
            if self.op is None or hasattr(torch.ops.higher_order, self.op):
                return None
            return "names no registered higher-order operator"
        if self.op is None:
            prefix = f"{self.namespace}::"
            if any(name.startswith(prefix) for name in registered):
                return None
            return "names a namespace with no registered operator"
        qualified = f"{self.namespace}::{self.op}"
        packet = getattr(getattr(torch.ops, self.namespace), self.op, None)
        # the dispatcher lists ``ns::op`` for a .default overload, ``ns::op.name`` for the others
        dispatched = [
            name
            for name in (packet.overloads() if packet is not None else ())
            if (qualified if name == "default" else f"{qualified}.{name}") in registered
        ]
        if not dispatched:
            return "names no registered operator"
        if self.overload is not None:
            if self.overload not in dispatched:
                return f"names no registered overload (known: {', '.join(dispatched)})"
            dispatched = [self.overload]
        keepable = [
            overload
            for overload in (getattr(packet, name) for name in dispatched)
            if mandatory
            or not _compat.schema_is_mutable(overload)
            or _compat.returns_nothing(overload)  # an out= op: kept with what it wrote
        ]
        if not keepable:
            return (
                "only mutates its arguments and returns them: a cached result would skip the "
                "write, so it is never kept"
            )
        if all(_compat.is_composite_implicit(op) for op in keepable):
            return (
                "is CompositeImplicitAutograd: it decomposes before any dispatch mode sees it, "
                "so target the operators it decomposes into instead"
            )
        return None


def registered_operators() -> set[str]:
    """Every registered operator overload as the dispatcher names it.

    ``ns::op`` is a ``.default`` overload and ``ns::op.name`` any other, so an operator with no
    ``.default`` (``aten::mul``: ``.Tensor``, ``.Scalar``) never appears under its bare name.
    """
    return _compat.dispatch_op_names()


def operator_key(op: Any) -> tuple[str, str, str | None]:
    """``(namespace, op, overload)`` of an OpOverload or a higher-order operator."""
    if isinstance(op, _compat.OpOverload):
        return _compat.operator_parts(op)
    return op.namespace, op.name(), None


class TargetSet:
    """A parsed, validated set of targets with constant-time matching."""

    def __init__(self, targets: Iterable[str]):
        if isinstance(targets, str):
            raise ValueError(
                f"targets must be a list of strings, got the string {targets!r}: "
                f"write [{targets!r}]"
            )
        self.targets: tuple[Target, ...] = tuple(Target.parse(t) for t in targets)
        self._namespaces = {t.namespace for t in self.targets if t.op is None}
        self._ops = {(t.namespace, t.op) for t in self.targets if t.op and t.overload is None}
        self._overloads = {(t.namespace, t.op, t.overload) for t in self.targets if t.overload}

    def matches(self, key: tuple[str, str, str | None]) -> bool:
        return key[0] in self._namespaces or key[:2] in self._ops or key in self._overloads

    def problems(self, *, mandatory: bool = False) -> list[tuple[str, str]]:
        """``(target, reason)`` for each target the policy can never keep as things stand."""
        registered = registered_operators()
        return [
            (str(t), reason)
            for t in self.targets
            if (reason := t.problem(registered, mandatory=mandatory)) is not None
        ]

    def __iter__(self):
        return iter(str(t) for t in self.targets)

    def __len__(self) -> int:
        return len(self.targets)
