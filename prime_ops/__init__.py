"""Checkpoint-visible PyTorch custom ops for large-model training.

``import prime_ops`` registers every op of every namespace (schema, fake, autograd) whatever is
installed; kernel libraries are imported on the first real call. prime_ops never imports prime_ac.
"""

from prime_ops import attn, collectives, deepep, expert_parallel, fp8, moe, mxfp8, native, quack
from prime_ops.backends import BackendUnavailable

__all__ = [
    "BackendUnavailable",
    "attn",
    "collectives",
    "deepep",
    "expert_parallel",
    "fp8",
    "moe",
    "mxfp8",
    "native",
    "quack",
]
