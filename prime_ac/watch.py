"""What a configuration did on its first step, said once: silence means the policy did as asked.

``checkpoint_blocks`` gives every block of one configuration the same :class:`Watch`. The first
forward with gradients of each block runs under :class:`MeasuringKeepMode`, which also records
the storages the block creates and which of them autograd saves (:class:`Ledger`): what no AC
would hold for the block, the figure the audit measures by running no AC. Every forward tells
the watch which operators it dispatched. Once each block ran its first forward, the watch
reports:

- targets that matched no call in any block, naming what the blocks dispatched instead where it
  is close (``aten::mm`` named, ``aten::addmm`` called); ``strict=True`` raises instead. Said
  once per process and target set (a second model with the same targets says nothing), and at
  debug level for a name whose namespace no module of this process registered (an optional
  backend not imported: FastVideo's list names several);
- a list of which no target matched any call (a trainer's list included): the blocks keep only
  the mandatory set, as ``mode="full"`` does, said once per process and list;
- blocks whose kept results reach what no AC holds for them (:func:`worse`: at least
  :data:`REPORTED_BYTES` kept): checkpointing them this way costs memory and compute both, so
  they run without checkpointing from then on (logged once per block), or, with
  ``skip_worse=False``, keep checkpointing with a warning. Each rank judges by its own bytes,
  so in a job of several ranks a block whose recompute replays a collective keeps checkpointing
  (with a warning saying why): ranks that judged it differently would replay different
  collectives in backward and hang.

Later forwards pay nothing for this: they run the plain :class:`~prime_ac.modes.KeepMode`.
"""

from __future__ import annotations

import difflib
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from prime_ac import _compat
from prime_ac.actions import Action
from prime_ac.modes import KeepMode
from prime_ac.targets import Target, TargetSet, operator_key, registered_operators

__all__ = ["REPORTED_BYTES", "Ledger", "MeasuringKeepMode", "Watch", "worse"]

logger = logging.getLogger("prime_ac")

# What this process was told already, by kind and target set: a report says something a user can
# act on once, not once per model built with the same settings.
_SAID: set[Any] = set()


def say_once(key: Any) -> bool:
    """True the first time ``key`` is seen in this process (then the caller logs its report)."""
    if key in _SAID:
        return False
    _SAID.add(key)
    return True


def unloaded_namespaces(targets: Any) -> set[str]:
    """The namespaces of ``targets`` (strings) in which no operator is registered in this
    process: a backend that was not imported (reported at debug level: it may never be)."""
    registered = {name.split("::", 1)[0] for name in registered_operators()}
    namespaces = set()
    for t in targets:
        try:
            namespaces.add(Target.parse(str(t)).namespace)
        except ValueError:  # a tag or scoped target: no namespace of its own
            continue
    return {ns for ns in namespaces if ns not in registered and ns != "higher_order"}


# Namespaces whose operators communicate with other ranks: a recompute that replays one must
# replay it on every rank.
COMMUNICATION_NAMESPACES = frozenset(
    {
        "_c10d_functional",
        "c10d",
        "c10d_functional",
        "prime_rl_collectives",
        "prime_rl_ring",
        "deepep",
    }
)


def _several_ranks() -> bool:
    distributed = torch.distributed
    return (
        distributed.is_available()
        and distributed.is_initialized()
        and (distributed.get_world_size() > 1)
    )


# Operators a target may name where the block dispatches a sibling: a matmul as mm, addmm or bmm
# by whether it has a bias or a batch; attention as the kernel of the device it runs on.
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear"}


def _family(namespace: str, op: str | None) -> str | None:
    """The family of an operator, whose members stand for each other on some model or device
    (lists name every member on purpose): matmuls (``mm``, ``addmm``, ``_grouped_mm``, a GEMM
    library's ops), attention kernels (each device's SDPA kernel, flash, flex, varlen) and
    convolutions."""
    if op is None:
        return None
    if op in _MATMULS or op.endswith("_mm") or "gemm" in op:
        return "matmul"
    if "attention" in op or "attn" in op:
        return "attention"
    if "convolution" in op:
        return "convolution"
    return None


class Watch:
    """The first step of one configuration: operators seen, and each block's bytes."""

    def __init__(
        self,
        targets: list[str],
        blocks: list[str],
        strict: bool,
        bypass: Callable[[str, str], None] | None = None,
        listed: list[str] | None = None,
    ):
        self.targets = [Target.parse(t) for t in targets]
        # every target the selective policy keeps by name, an adapter's included: when none
        # matched a call, the blocks keep only the mandatory set
        self.listed = [Target.parse(t) for t in listed or ()]
        self.pending = set(blocks)
        self.strict = strict
        self.seen: set[Any] = set()
        self.kept: dict[str, int] = {}  # block -> bytes of its kept results
        self.bytes: dict[str, tuple[int, int]] = {}  # block -> (kept, held without AC)
        self.ledger = Ledger()
        self.replayed_communication: dict[str, str] = {}  # block -> a collective it replays
        # block -> (its first forward's store, its rules): for dropping kept results no
        # backward reads once every block ran (_drop_unread)
        self.stores: dict[str, tuple[Any, Any]] = {}
        # bypass(block, why) makes a block run without checkpointing from its next forward on;
        # None keeps checkpointing it (checkpoint_blocks(..., skip_worse=False)) and warns
        self.bypass = bypass

    def saw(self, op: Any) -> None:
        self.seen.add(op)

    def measures(self, block: str | None) -> bool:
        """Whether ``block``'s forward is a first step's: one with gradients (a validation pass
        saves nothing, so it says nothing about training) before the block reported."""
        return block in self.pending and torch.is_grad_enabled()

    def forward_done(self, block: str, kept: int) -> None:
        if not self.measures(block):
            return
        self.pending.discard(block)
        self.kept[block] = kept
        if not self.pending:
            dropped = self._drop_unread()
            no_ac = self.ledger.no_ac_bytes()
            self.bytes = {b: (k, no_ac.get(b, 0)) for b, k in self.kept.items()}
            for block in dropped:  # still no less than no AC: the verdict bypasses it
                with_ac, without_ac = self.ledger.held(block)
                if with_ac >= without_ac:
                    self.bytes[block] = (with_ac, without_ac)
            self.ledger = Ledger()  # the storages' records are no longer needed
            self._report()
            self._verdict()

    def _drop_unread(self) -> list[str]:
        """In a block that holds more than no AC would for it, drop the kept results autograd
        saved nothing of (not they, not a view of them) in any block's first forward: no
        backward reads them, so no AC would not hold them (a frozen LoRA base's GEMM, whose
        output only feeds an add). They replay from now on, in this step's recompute too, so the
        block holds only storages no AC holds as well. Only results kept because a target named
        them, and no collective (each rank judges by its own bytes: ranks dropping different
        collectives would replay different ones); mandatory, planned and per-call decisions
        stay. A block holding no more than no AC keeps what it was asked to (prime-rl's bytes).
        Returns the blocks that dropped some."""
        stores, self.stores = self.stores, {}
        dropped_bytes = dropped_calls = 0
        remaining: list[torch.Tensor] = []
        blocks: list[str] = []
        for block, (ref, rules) in stores.items():
            store = ref()
            if store is None or store.replay_calls or store.offloader is not None:
                continue
            with_ac, without_ac = self.ledger.held(block)
            if with_ac <= without_ac:  # kept as asked
                remaining += [
                    t for es in store.entries.values() for e in es.values() for t in e.tensors
                ]
                continue
            calls, nbytes, kept = self._drop_from(store, rules)
            remaining += kept
            if calls:
                dropped_calls, dropped_bytes = dropped_calls + calls, dropped_bytes + nbytes
                blocks.append(block)
            tensors = [
                t for entries in store.entries.values() for e in entries.values() for t in e.tensors
            ]
            self.kept[block] = sum(_storages(tensors).values())
        if dropped_calls:
            self.ledger.rekept(remaining)
            logger.info(
                "prime_ac: %d kept result(s), %s, were read by no backward on the first step "
                "(as a frozen base's GEMM output): they replay from now on, so no block keeps "
                "what no AC would not hold",
                dropped_calls,
                _mib(dropped_bytes),
            )
        return blocks

    def _drop_from(self, store: Any, rules: Any) -> tuple[int, int, list[torch.Tensor]]:
        """Drop ``store``'s unread kept results: (calls dropped, their bytes, the tensors kept)."""
        calls = nbytes = 0
        kept: list[torch.Tensor] = []
        for key, entries in list(store.entries.items()):
            if (
                rules.actions.get(key) not in (Action.KEEP, Action.KEEP_WRITTEN)
                or getattr(key, "namespace", None) in COMMUNICATION_NAMESPACES
            ):
                kept += [t for e in entries.values() for t in e.tensors]
                continue
            for index in list(entries):
                tensors = entries[index].tensors
                if any(self.ledger.read_by_backward(t) for t in tensors):
                    kept += tensors
                    continue
                del entries[index]
                store.stored -= 1
                rules.dropped.setdefault(key, set()).add(index)
                calls += 1
                nbytes += sum(_storages(tensors).values())
            if not entries:
                del store.entries[key]
        return calls, nbytes, kept

    def worse_than_no_ac(self) -> list[str]:
        """Blocks whose kept results reach what no AC holds for them, where that matters: at
        least :data:`REPORTED_BYTES` kept."""
        return [b for b, (kept, no_ac) in self.bytes.items() if worse(kept, no_ac)]

    def _verdict(self) -> None:
        for block in self.worse_than_no_ac():
            kept, no_ac = self.bytes[block]
            held = (
                f"block {block!r} keeps {_mib(kept)} of operator results for backward, while "
                f"without checkpointing autograd would hold {_mib(no_ac)} for it"
            )
            collective = self.replayed_communication.get(block)
            if self.bypass is not None and collective is not None and _several_ranks():
                warnings.warn(
                    f"prime_ac: checkpointed {held}, but it stays checkpointed: its recompute "
                    f"replays {collective}, and each rank judges by its own bytes, so ranks "
                    "judging differently would replay different collectives and hang. Keep the "
                    "collective (add it to targets=[...]), leave the block out (blocks=...), or "
                    "pass skip_worse=False to silence this.",
                    stacklevel=2,
                )
                continue
            if self.bypass is not None:
                logger.warning(
                    "prime_ac: checkpointed %s on the first step; it runs without checkpointing "
                    "from now on, which holds no more and replays nothing (checkpoint_blocks(..., "
                    "skip_worse=False) keeps checkpointing it)",
                    held,
                )
                self.bypass(block, held)
                continue
            warnings.warn(
                f"prime_ac: checkpointed {held}: checkpointing it this way costs memory and "
                "compute both (frozen weights need few saved tensors, a LoRA base for instance). "
                "Keep fewer operators there (targets=[...], mode='full'), plan per block with "
                "targets='auto' and a budget, leave the block out (blocks=...), or let prime_ac "
                "run it without checkpointing (skip_worse=True, the default).",
                stacklevel=2,
            )

    def _matched(self, targets: list[Target]) -> set[Target]:
        keys = [operator_key(op) for op in self.seen]
        return {t for t in targets if any(TargetSet([str(t)]).matches(k) for k in keys)}

    def unmatched(self) -> list[str]:
        """Targets that matched no call, less those whose family another target matched: a list
        naming the CUDA and CPU attention kernels, or mm and addmm, does what it says."""
        matched = self._matched(self.targets)
        families = {_family(t.namespace, t.op) for t in matched} - {None}
        return [
            str(t)
            for t in self.targets
            if t not in matched and _family(t.namespace, t.op) not in families
        ]

    def kept_nothing(self) -> bool:
        """Whether no listed target (user-named or an adapter's) matched any call."""
        return bool(self.listed) and not self._matched(self.listed)

    def _report(self) -> None:
        unmatched = self.unmatched()
        if unmatched and self.strict:
            lines = [f"{t!r}{self._instead(t)}" for t in unmatched]
            raise ValueError(
                "prime_ac: targets that matched no operator call in any checkpointed block on "
                "the first step, so they keep nothing: " + "; ".join(lines) + " (strict=True)"
            )
        unloaded = unloaded_namespaces(unmatched)
        optional = [t for t in unmatched if Target.parse(t).namespace in unloaded]
        unmatched = [t for t in unmatched if t not in optional]
        targets = tuple(sorted(str(t) for t in self.targets))
        if optional and say_once(("unmatched, not loaded", targets, tuple(optional))):
            logger.debug(
                "prime_ac: targets of namespaces no module of this process registered matched "
                "no operator call on the first step (an optional backend not imported): %s",
                ", ".join(optional),
            )
        if unmatched:
            if say_once(("unmatched", targets, tuple(unmatched))):
                logger.warning(
                    "prime_ac: targets that matched no operator call in any checkpointed block "
                    "on the first step, so they keep nothing (said once per process and target "
                    "set): " + "; ".join(f"{t!r}{self._instead(t)}" for t in unmatched)
                )
        elif self.kept_nothing():
            listed = tuple(sorted(str(t) for t in self.listed))
            if say_once(("kept nothing", listed)):
                logger.warning(
                    "prime_ac: none of the %d listed target(s) matched an operator call in any "
                    "checkpointed block on the first step, so the blocks keep only the mandatory "
                    "set (as mode='full' does) and replay the rest: name what the blocks call "
                    "(prime_ac.audit lists it), or use mode='full' (said once per process and "
                    "list): %s",
                    len(listed),
                    ", ".join(listed),
                )

    def _instead(self, target: str) -> str:
        """The operators the blocks called that could stand for ``target``: its family's
        members (``aten::mm`` for ``aten::addmm``), or, for a target of no family, a name close
        to it in its namespace; only operators a policy can keep (none that writes its input)."""
        parsed = Target.parse(target)
        if parsed.op is None:
            return ""
        called = {
            (ns, op)
            for o in self.seen
            if not _compat.schema_is_mutable(o)
            for ns, op, _ in [operator_key(o)]
            if op != parsed.op
        }
        family = _family(parsed.namespace, parsed.op)
        if family is not None:
            close = {f"{ns}::{op}" for ns, op in called if _family(ns, op) == family}
        else:
            names = [op for ns, op in called if ns == parsed.namespace and _family(ns, op) is None]
            close = {
                f"{parsed.namespace}::{op}"
                for op in difflib.get_close_matches(parsed.op, names, n=3, cutoff=0.6)
            }
        if not close:
            return ""
        return f" (the blocks called {', '.join(sorted(close))}: name that instead, or beside it)"


# Below this many kept bytes a block is never reported nor bypassed: its kept results (a
# block's own 24-byte output, a test model's few KiB) cost nothing worth a word, whatever the
# ratio to no AC. Blocks of models worth checkpointing hold MiBs to GiBs.
REPORTED_BYTES = 2**20


def worse(kept: int, no_ac: int) -> bool:
    """Whether a block keeping ``kept`` bytes, where no AC holds ``no_ac`` for it, is better off
    without checkpointing: it holds at least as much and replays, and it keeps at least
    :data:`REPORTED_BYTES`. The first step and the audit both judge by this."""
    return kept >= REPORTED_BYTES and kept >= no_ac


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


class _Created:
    """One storage a watched block created on the first step."""

    __slots__ = ("block", "ref", "nbytes", "saved", "kept")

    def __init__(self, block: str, storage: torch.UntypedStorage):
        self.block, self.ref, self.nbytes = block, weakref.ref(storage), storage.nbytes()
        self.saved = self.kept = False

    def alive(self) -> bool:
        return self.ref() is not None


class Ledger:
    """The storages the watched blocks created on the first step, and which autograd saved.

    What no AC holds for a block is what the audit's no-AC step counts: the storages the block's
    forward created that are alive when backward starts. Here, in the checkpointed step, that is
    each storage autograd saved inside any watched block's first forward (the block's own saves
    and the next block's saves of its output), plus each storage still alive when the last
    watched block returns that no checkpoint store holds (the model's output, state kept on
    modules, tensors the code around the blocks saved). A storage kept only as a later block's
    checkpointed input counts too: the figure errs high, so that it never makes a block look
    worse than no AC. Storages are told apart by their address while alive, so a storage freed
    and its address reused (the checkpointed forward frees what it does not keep) counts twice,
    as in no AC, where both stay alive.
    """

    def __init__(self) -> None:
        self.created: list[_Created] = []
        self._at: dict[int, _Created] = {}  # storage address -> the storage living there now

    def _live(self, t: torch.Tensor) -> _Created | None:
        entry = self._at.get(_compat.storage_id(t))
        return entry if entry is not None and entry.alive() else None

    def outputs(self, block: str, args: Any, out: Any) -> None:
        """Record the storages an operator call created (a view shares its input's)."""
        inputs = _storages(_compat.tree_leaves(args))
        for leaf in _compat.tree_leaves(out):
            if not isinstance(leaf, torch.Tensor) or _compat.storage_id(leaf) in inputs:
                continue
            sid = _compat.storage_id(leaf)
            if sid is None or self._live(leaf) is not None:
                continue
            storage = leaf.untyped_storage()
            if storage.nbytes() > 0 and leaf.device.type != "meta":
                entry = self._at[sid] = _Created(block, storage)
                self.created.append(entry)

    def saved(self, t: torch.Tensor) -> None:
        entry = self._live(t)
        if entry is not None:
            entry.saved = True

    def kept(self, tensors: Any) -> None:
        for t in tensors:
            entry = self._live(t) if isinstance(t, torch.Tensor) else None
            if entry is not None:
                entry.kept = True

    def held(self, block: str) -> tuple[int, int]:
        """What ``block``'s storages hold now (its kept results, its output), and what they
        would hold without AC (what autograd saved, and what is alive but not kept)."""
        with_ac = without_ac = 0
        for entry in self.created:
            if entry.block != block:
                continue
            alive = entry.alive()
            with_ac += entry.nbytes if alive else 0
            without_ac += entry.nbytes if entry.saved or (alive and not entry.kept) else 0
        return with_ac, without_ac

    def read_by_backward(self, t: Any) -> bool:
        """Whether autograd saved ``t``'s storage (or a view of it) in a watched forward; True
        for a storage the ledger does not know (not created by a watched block: kept as is)."""
        if not isinstance(t, torch.Tensor):
            return False
        entry = self._live(t)
        return entry is None or entry.saved

    def rekept(self, tensors: Any) -> None:
        """The storages still kept, after some kept results were dropped."""
        for entry in self.created:
            entry.kept = False
        self.kept(tensors)

    def no_ac_bytes(self) -> dict[str, int]:
        """Per block, what no AC would hold for it; call once every watched block returned."""
        held: dict[str, int] = {}
        for entry in self.created:
            if entry.saved or (entry.alive() and not entry.kept):
                held[entry.block] = held.get(entry.block, 0) + entry.nbytes
        return held


class MeasuringKeepMode(KeepMode):
    """A block's first forward: :class:`KeepMode`, plus the bytes of its kept results and, for a
    watched block, the storages it creates and autograd saves (see :class:`Ledger`).

    torch's checkpoint has installed its saved-tensor hooks when this mode enters; a pair on top
    records each tensor autograd saves and hands it on to checkpoint's own hooks, so the
    checkpoint behaves exactly as without the measurement.
    """

    def ledger(self) -> Ledger | None:
        watch = self.rules.watch
        return watch.ledger if watch is not None and watch.measures(self.rules.block) else None

    def __enter__(self):
        self._ledger = self.ledger()
        if self._ledger is not None:
            pack, unpack = _compat.top_saved_tensors_hooks() or (_detached, _same)
            record = self._ledger.saved

            def recording_pack(t: torch.Tensor) -> Any:
                record(t)
                return pack(t)

            self._hooks = torch.autograd.graph.saved_tensors_hooks(recording_pack, unpack)
            self._hooks.__enter__()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._ledger is not None:
            self._ledger.outputs(self.rules.block, (args, kwargs), out)
            if getattr(func, "namespace", None) in COMMUNICATION_NAMESPACES:
                self._note_communication(func)
        return out

    def _note_communication(self, func: Any) -> None:
        """Remember a collective this block's recompute may replay (any action that does not
        always keep it), for the verdict on several ranks."""
        action = self.rules.action(func)
        if action not in (Action.KEEP, Action.MANDATORY, Action.KEEP_WRITTEN):
            self.rules.watch.replayed_communication.setdefault(self.rules.block, str(func))

    def __exit__(self, *exc: Any):
        try:
            result = super().__exit__(*exc)
        finally:
            if self._ledger is not None:
                self._hooks.__exit__(*exc)
        if exc[0] is None:
            tensors = [
                t
                for entries in self.store.entries.values()
                for e in entries.values()
                for t in e.tensors
            ]
            self.kept_bytes = sum(_storages(tensors).values())
            if self._ledger is not None:
                self._ledger.kept(tensors)
                self.rules.watch.stores[self.rules.block] = (weakref.ref(self.store), self.rules)
            self.measured()
        return result

    def measured(self) -> None:
        """Called with ``kept_bytes`` set, after a forward that returned."""
        self.rules.watch.forward_done(self.rules.block, self.kept_bytes)


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
