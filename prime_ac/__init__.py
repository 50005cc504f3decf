"""Operator-based selective activation checkpointing for PyTorch.

``checkpoint_blocks(model, mode="selective")`` wraps each transformer block in a non-reentrant
checkpoint region and decides per operator, by name or namespace, what to keep and what to
replay. prime_ac imports torch only: it knows operators by name, never by import.
"""

from importlib.metadata import distributions as _distributions

from prime_ac.audit import AuditReport, audit
from prime_ac.checkpoint import checkpoint_blocks
from prime_ac.config import ACConfig
from prime_ac.contexts import context_fn
from prime_ac.diagnostics import MemoryReport, labelled_allocations, memory_report
from prime_ac.discovery import find_blocks
from prime_ac.keep import keep
from prime_ac.layer_modes import get_layer_modes
from prime_ac.policy import MODES, OperatorPolicy, make_policy
from prime_ac.scopes import tag
from prime_ac.store import KeptOutputMutatedError, ReplayMismatchError, saved_tensor_kind
from prime_ac.targets import DEFAULT_TARGETS, HOST_SYNC_TARGETS, MANDATORY_TARGETS, Target
from prime_ac.wrapping import is_checkpointed, unwrap_blocks

# The installed distribution's version; "0+unknown" (never a real release) without metadata.
__version__ = next((d.version for d in _distributions(name="prime-ops")), "0+unknown")

__all__ = [
    "DEFAULT_TARGETS",
    "HOST_SYNC_TARGETS",
    "MANDATORY_TARGETS",
    "MODES",
    "ACConfig",
    "AuditReport",
    "KeptOutputMutatedError",
    "MemoryReport",
    "OperatorPolicy",
    "ReplayMismatchError",
    "Target",
    "audit",
    "checkpoint_blocks",
    "context_fn",
    "find_blocks",
    "get_layer_modes",
    "is_checkpointed",
    "labelled_allocations",
    "keep",
    "make_policy",
    "memory_report",
    "saved_tensor_kind",
    "tag",
    "unwrap_blocks",
]
