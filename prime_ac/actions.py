"""What a checkpointed region does with an operator overload.

:class:`Action` is the one vocabulary the policy, the two checkpoint modes, the audit and the
budget planner share.
"""

from __future__ import annotations

import enum

import torch

from prime_ac import _compat

__all__ = ["IGNORED_OPS", "Action"]

# FSDP2 runs its hooks under record_function; a recompute can emit a different number of these
# markers than the forward did. They carry no data: both modes let them through uncounted.
_PROFILER_OPS = frozenset(
    {
        torch.ops.profiler._record_function_enter.default,
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    }
)
IGNORED_OPS = _compat.SAC_IGNORED_OPS | _PROFILER_OPS


class Action(enum.IntEnum):
    """What a region does with every call of one operator overload.

    The values carry no order: code compares members by identity.
    """

    IGNORE = 0  # let through uncounted (detach, profiler markers)
    REPLAY = 1  # run again in the recompute
    KEEP = 2  # a target: kept (selective mode)
    MANDATORY = 3  # kept in every mode: its effect must happen once
    HOST_SYNC = 4  # kept when the call copies a device tensor into host memory
    SCOPED = 5  # kept where the call's module scope or tag says so (prime_ac.scopes)
    PLANNED = 6  # kept at the call indices a budget plan chose (prime_ac.budget)
    ASK = 7  # a policy callable decides per call
    KEEP_WRITTEN = 8  # a target that returns nothing and writes its arguments (QuACK's out= GEMMs):
    # kept are the tensors it wrote; the recompute copies them into its own arguments

    def label(self, kept: bool) -> str:
        """How reports (audit, budget plans) name a call of this action: ``"mandatory"``,
        ``"kept"`` or ``"replayed"``."""
        if not kept:
            return "replayed"
        return "mandatory" if self is Action.MANDATORY or self is Action.HOST_SYNC else "kept"
