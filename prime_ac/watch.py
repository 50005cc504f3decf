"""What a configuration did on its first step, said once: silence means the policy did as asked.

``checkpoint_blocks`` gives every block of one configuration the same :class:`Watch`. The first
forward of each block runs under :class:`MeasuringKeepMode`, which also measures what autograd
would hold for the block without checkpointing (the tensors it saves that the block created);
every forward tells the watch which operators it dispatched. Once each block ran its first
forward, the watch reports:

- targets that matched no call in any block, naming what the blocks dispatched instead where it
  is close (``aten::mm`` named, ``aten::addmm`` called); ``strict=True`` raises instead;
- blocks whose kept results exceed what no AC holds for them: selective checkpointing there
  costs memory and compute both (the audit, which measures no AC by running it, lists the
  blocks that reach it).

Later forwards pay nothing for this: they run the plain :class:`~prime_ac.modes.KeepMode`.
"""

from __future__ import annotations

import difflib
import logging
import warnings
import weakref
from typing import Any

import torch

from prime_ac import _compat
from prime_ac.modes import KeepMode
from prime_ac.targets import Target, TargetSet, operator_key

__all__ = ["MeasuringKeepMode", "Watch"]

logger = logging.getLogger("prime_ac")

# Operators a target may name where the block dispatches a sibling: a matmul as mm, addmm or bmm
# by whether it has a bias or a batch; attention as the kernel of the device it runs on.
_MATMULS = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "linear",
    "_grouped_mm",
    "_scaled_mm",
}


def _family(target: Target) -> str | None:
    """The family of operators ``target`` belongs to, where lists name every member on purpose
    (each device's attention kernel, mm beside addmm)."""
    if target.op in _MATMULS:
        return "matmul"
    if target.op is not None and "scaled_dot_product" in target.op:
        return "attention"
    return None


class Watch:
    """The first step of one configuration: operators seen, and each block's bytes."""

    def __init__(self, targets: list[str], blocks: list[str], strict: bool):
        self.targets = [Target.parse(t) for t in targets]
        self.pending = set(blocks)
        self.strict = strict
        self.seen: set[Any] = set()
        self.bytes: dict[str, tuple[int, int]] = {}  # block -> (kept, held without AC)

    def saw(self, op: Any) -> None:
        self.seen.add(op)

    def measures(self, block: str | None) -> bool:
        return block in self.pending

    def forward_done(self, block: str, kept: int, no_ac: int) -> None:
        if block not in self.pending:
            return
        self.pending.discard(block)
        self.bytes[block] = (kept, no_ac)
        if not self.pending:
            self._report()

    def unmatched(self) -> list[str]:
        """Targets that matched no call, less those whose family another target matched: a list
        naming the CUDA and CPU attention kernels, or mm and addmm, does what it says."""
        keys = [operator_key(op) for op in self.seen]
        matched = {t for t in self.targets if any(TargetSet([str(t)]).matches(k) for k in keys)}
        families = {_family(t) for t in matched} - {None}
        return [str(t) for t in self.targets if t not in matched and _family(t) not in families]

    def _report(self) -> None:
        unmatched = self.unmatched()
        if unmatched:
            lines = [f"{t!r}{self._instead(t)}" for t in unmatched]
            message = (
                "prime_ac: targets that matched no operator call in any checkpointed block on "
                "the first step, so they keep nothing: " + "; ".join(lines)
            )
            if self.strict:
                raise ValueError(message + " (strict=True)")
            logger.warning(message)
        for block, (kept, no_ac) in self.bytes.items():
            if kept > no_ac:
                warnings.warn(
                    f"prime_ac: checkpointed block {block!r} keeps {_mib(kept)} of operator "
                    f"results for backward, while without checkpointing autograd would hold "
                    f"{_mib(no_ac)} for it: checkpointing it this way costs memory and compute "
                    "both (frozen weights need few saved tensors, a LoRA base for instance). "
                    "Keep fewer operators there (targets=[...], mode='full'), plan per block "
                    "with targets='auto' and a budget, or leave the block out (blocks=...).",
                    stacklevel=2,
                )

    def _instead(self, target: str) -> str:
        parsed = Target.parse(target)
        if parsed.op is None:
            return ""
        called = sorted(
            {
                f"{ns}::{op}"
                for ns, op, _ in (operator_key(o) for o in self.seen)
                if ns == parsed.namespace and op != parsed.op
            }
        )
        names = [name.split("::")[1] for name in called]
        close = set(difflib.get_close_matches(parsed.op, names, n=3, cutoff=0.6))
        if parsed.op in _MATMULS:
            close |= {n for n in names if n in _MATMULS}
        if not close:
            return ""
        instead = ", ".join(f"{parsed.namespace}::{n}" for n in sorted(close))
        return f" (the blocks called {instead}: name that instead, or beside it)"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _storages(tensors: Any) -> dict[int, int]:
    found = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            sid = _compat.storage_id(t)
            if sid is not None:
                found[sid] = t.untyped_storage().nbytes()
    return found


class MeasuringKeepMode(KeepMode):
    """A watched block's first forward: :class:`KeepMode`, plus what no AC would hold for it.

    Without AC a block holds, when its forward returns, the tensors autograd saved and the other
    tensors its forward created that are still alive (its output), as the audit's no-AC step
    counts them. torch's checkpoint has installed its saved-tensor hooks when this mode enters;
    a pair on top records each tensor autograd saves and hands it on to checkpoint's own hooks, so
    the checkpoint behaves exactly as without the measurement.
    """

    def __enter__(self):
        self._created: dict[int, weakref.ref] = {}
        self._saved: dict[int, int] = {}
        pack, unpack = _compat.top_saved_tensors_hooks() or (_detached, _same)

        def recording_pack(t: torch.Tensor) -> Any:
            self._saved.update(_storages([t]))
            return pack(t)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(recording_pack, unpack)
        self._hooks.__enter__()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # storages this call created: a view (of a parameter, say) shares its input's
        inputs = _storages(args)
        for leaf in _compat.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                sid = _compat.storage_id(leaf)
                if sid is not None and sid not in inputs:
                    self._created[sid] = weakref.ref(leaf)
        return out

    def __exit__(self, *exc: Any):
        try:
            result = super().__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)
        if exc[0] is None:
            kept = _storages(
                t
                for entries in self.store.entries.values()
                for e in entries.values()
                for t in e.tensors
            )
            self.kept_bytes = sum(kept.values())
            live = _storages(ref() for ref in self._created.values())
            held = {sid: n for sid, n in self._saved.items() if sid in self._created}
            held.update((sid, n) for sid, n in live.items() if sid not in kept)
            self.no_ac_bytes = sum(held.values())
            self.measured()
        return result

    def measured(self) -> None:
        """Called with ``kept_bytes`` and ``no_ac_bytes`` set, after a forward that returned."""
        self.rules.watch.forward_done(self.rules.block, self.kept_bytes, self.no_ac_bytes)


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
