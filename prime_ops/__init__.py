"""Checkpoint-visible PyTorch custom ops for large-model training.

``import prime_ops`` registers every op of every namespace (schema, fake, autograd) whatever is
installed; kernel libraries are imported on the first real call. prime_ops never imports prime_ac.
"""

from importlib.metadata import distributions as _distributions

from prime_ops import (
    attn,
    collectives,
    deepep,
    deepep_prime_rl,
    expert_parallel,
    fp8,
    moe,
    mxfp8,
    native,
    quack,
)
from prime_ops.backends import BackendUnavailable

# The installed distribution's version; "0+unknown" (never a real release) without metadata.
__version__ = next((d.version for d in _distributions(name="prime-ops")), "0+unknown")

__all__ = [
    "BackendUnavailable",
    "attn",
    "collectives",
    "deepep",
    "deepep_prime_rl",
    "expert_parallel",
    "fp8",
    "moe",
    "mxfp8",
    "native",
    "quack",
]
