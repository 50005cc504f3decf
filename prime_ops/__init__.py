"""Checkpoint-visible PyTorch custom ops for large-model training.

``import prime_ops`` registers every op of every namespace (schema, fake, autograd) whatever is
installed; kernel libraries are imported on the first real call. prime_ops never imports prime_ac.
"""

from prime_ops.backends import BackendUnavailable
from prime_ops import attn, collectives, deepep, fp8, moe, quack  # noqa: E402  (registers the ops)

__all__ = ["BackendUnavailable", "attn", "collectives", "deepep", "fp8", "moe", "quack"]
