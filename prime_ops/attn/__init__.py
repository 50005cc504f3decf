"""The ``prime_rl_attn`` namespace: varlen attention per backend and ring attention.

``varlen_attention(..., backend="sdpa"|"fa2"|"fa3"|"fa4")`` and
``ring_attention(..., group=..., backend=...)`` are the entry points; importing this module
registers every op (schema, fake, autograd) without importing any kernel library.
``sparse_mla(..., backend="reference"|"triton"|"flashmla")`` is DeepSeek sparse attention,
registered as ``prime_rl::sparse_mla`` (the name prime-rl's target lists use).
Importing it also registers prime-rl's all-gather context parallel ``prime_rl_ring::attention``
(:mod:`prime_ops.attn.prime_rl_ring`; ``ring_shard`` gives its per-rank arguments).
"""

from prime_ops.attn.mla import sparse_mla
from prime_ops.attn.prime_rl_ring import RingShard, ring_shard
from prime_ops.attn.ring import ring_attention
from prime_ops.attn.varlen import BACKENDS, varlen_attention

__all__ = [
    "BACKENDS",
    "RingShard",
    "ring_attention",
    "ring_shard",
    "sparse_mla",
    "varlen_attention",
]
