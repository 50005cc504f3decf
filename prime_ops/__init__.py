"""Checkpoint-visible PyTorch custom ops for large-model training.

``import prime_ops`` registers every op of every namespace (schema, fake, autograd) whatever is
installed; kernel libraries are imported on the first real call. prime_ops never imports prime_ac.

torch lets a second ``torch.library.custom_op`` of a name silently replace the first (the later
import wins), so a registration of one of prime_ops' ops by another module (a half-done switch
from prime-rl's own ``attn.py``, say) raises instead, naming both modules, in either import order.
"""

from importlib.metadata import distributions as _distributions

from prime_ops import _owned_ops

_before = _owned_ops.snapshot()

from prime_ops import (  # noqa: E402 -- the snapshot above must come first
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
from prime_ops.backends import BackendUnavailable  # noqa: E402

_owned_ops.claim(_before)
del _before

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
