"""What the checkpointed blocks hold right now: a live report, an out-of-memory report, labels.

Every eager checkpointed call of a block with gradients records, at no cost beyond a few Python
steps per call, the bytes of its tensor inputs and a weak reference to its store of kept
results (:class:`Held`); the record lives as long as the call's autograd graph. From these:

- :func:`memory_report` says, per block, the bytes its live calls keep on the device, have
  offloaded to the host, and hold as inputs, with no second run of the step; given the step's
  output it also walks the autograd graph for what is saved outside the blocks, by node.
- When ``torch.OutOfMemoryError`` passes through a checkpointed block's forward or recompute,
  that report is logged (logger ``"prime_ac"``, error level) once per error before the error
  propagates, the graph walked from the block's inputs. On CUDA the caching allocator's
  out-of-memory observer logs it for errors raised outside any block's code (the backward's
  own kernels, the loss).
- Inside :func:`labelled_allocations`, the CUDA allocations of the calls prime_ac keeps (and
  the buffers offloaded results come back into) carry a label naming the block and operator in
  ``torch.cuda.memory._snapshot()``'s traces; a no-op without CUDA.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from prime_ac import _compat
from prime_ac.actions import Action
from prime_ac.planner import format_bytes, group_names, grouped
from prime_ac.store import KeptResult

__all__ = [
    "BlockMemory",
    "Held",
    "MemoryReport",
    "labelled_allocations",
    "memory_report",
]

logger = logging.getLogger("prime_ac")


class Held:
    """One checkpointed call of a block while its graph lives: the block, its store of kept
    results (weakly) and the bytes of its tensor inputs (counted in its forward)."""

    __slots__ = ("__weakref__", "block", "input_bytes", "inputs", "name", "order", "store")

    def __init__(self, block: torch.nn.Module, name: str):
        self.block = weakref.ref(block)
        self.name = name
        self.order = next(_count)
        self.store: Any = None
        self.inputs: dict[int, int] = {}  # storage id -> bytes
        self.input_bytes = 0

    def forward(self, args: tuple, kwargs: dict) -> None:
        self.inputs = _input_storages(args, kwargs)
        self.input_bytes = sum(self.inputs.values())
        if _collecting is not None and self.name not in _collecting.inputs:
            _collecting.first_call(self.name, self.inputs, (args, kwargs))


# weak references to the records of live calls (a record goes when its call's graph is freed)
_live: set[weakref.ref] = set()
_count = itertools.count()


def _input_storages(args: tuple, kwargs: dict) -> dict[int, int]:
    """Storage id -> bytes of the tensors among a call's arguments and one level inside them
    (HF's ``position_embeddings=(cos, sin)``), parameters left out: a few steps per tensor, no
    pytree walk."""
    found: dict[int, int] = {}
    for group in (args, kwargs.values()):
        for value in group:
            if isinstance(value, torch.Tensor):
                _add_storage(found, value)
            elif type(value) in (tuple, list):
                for inner in value:
                    if isinstance(inner, torch.Tensor):
                        _add_storage(found, inner)
            elif type(value) is dict:
                for inner in value.values():
                    if isinstance(inner, torch.Tensor):
                        _add_storage(found, inner)
    return found


def _add_storage(found: dict[int, int], t: torch.Tensor) -> None:
    if isinstance(t, torch.nn.Parameter) or t.is_meta:
        return
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage of its own (a wrapper subclass)
        return
    found[storage._cdata] = storage.nbytes()


class Collected:
    """What each block's first checkpointed call in a step found (:func:`inputs_seen`)."""

    def __init__(self) -> None:
        self.inputs: dict[str, dict[int, int]] = {}  # block -> storage id -> bytes
        # block -> bytes autograd saved outside the blocks before the call (the graph behind
        # its inputs; storages of the blocks' inputs left out)
        self.outside_before: dict[str, int] = {}
        # each call's walk goes on from where the one before stopped: one pass over the graph
        self._seen: dict[int, int] = {}
        self._visited: dict[int, Any] = {}
        self._outside = 0

    def first_call(self, name: str, inputs: dict[int, int], args: Any) -> None:
        self.inputs[name] = inputs
        self._seen.update(inputs)
        if _compat.SAVED_TENSOR_DATA:
            by_node, _ = saved_outside(args, self._seen, self._visited)
            self._outside += sum(by_node.values())
            self.outside_before[name] = self._outside


_collecting: Collected | None = None


class _Calls(threading.local):
    depth = 0  # checkpointed calls running on this thread (forward or recompute)


calls = _Calls()
_observing = False


def track(block: torch.nn.Module, name: str) -> Held:
    """A record for one checkpointed call of ``block`` (called by the region running it)."""
    held = Held(block, name)
    _live.add(weakref.ref(held, _live.discard))
    if not _observing and torch.cuda.is_initialized():
        _observe()
    return held


@contextlib.contextmanager
def inputs_seen() -> Iterator[Collected]:
    """Within the context, the inputs of each block's first checkpointed call and what was
    saved outside the blocks before it (the audit reads them from the step it runs)."""
    global _collecting
    previous, _collecting = _collecting, Collected()
    try:
        yield _collecting
    finally:
        _collecting = previous


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    """Storage id -> bytes of ``tensors``' storages, each once."""
    found: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        sid = _compat.storage_id(t)
        if sid is not None:
            found[sid] = t.untyped_storage().nbytes()
    return found


# --- the report ---------------------------------------------------------------------------------


@dataclass
class BlockMemory:
    """What one block's live checkpointed calls hold, in bytes."""

    block: str
    kept: int = 0  # kept results on the device
    offloaded: int = 0  # kept results offloaded to host memory
    inputs: int = 0  # the calls' tensor inputs (what the checkpoint saves to recompute from)
    calls: int = 0  # live calls (more than one: forwards whose backward has not run yet)

    def row(self) -> tuple[int, int, int, int]:
        return (self.kept, self.offloaded, self.inputs, self.calls)


@dataclass
class MemoryReport:
    """What the checkpointed blocks hold now. ``str()`` is a table, identical neighbouring
    blocks on one line ("x4 layers.0-3"); ``outside`` maps an autograd node's name to the
    bytes saved outside the blocks (None: the graph was not walked)."""

    blocks: list[BlockMemory]
    outside: dict[str, int] | None = None
    note: str = ""  # where the report was taken (an error's name)
    packed: int = 0  # saves outside the blocks packed by saved-tensor hooks

    @property
    def kept(self) -> int:
        return sum(b.kept for b in self.blocks)

    @property
    def offloaded(self) -> int:
        return sum(b.offloaded for b in self.blocks)

    @property
    def inputs(self) -> int:
        return sum(b.inputs for b in self.blocks)

    def block(self, name: str) -> BlockMemory:
        for b in self.blocks:
            if b.block == name:
                return b
        raise KeyError(
            f"block={name!r} holds nothing live: one of {[b.block for b in self.blocks]}"
        )

    def __str__(self) -> str:
        head = f"{'blocks':<24} {'kept':>12} {'offloaded':>12} {'inputs':>12} {'calls':>6}"
        lines = [
            "prime_ac memory report" + (f" ({self.note})" if self.note else "") + ": "
            f"{len(self.blocks)} block(s) hold {format_bytes(self.kept)} kept, {format_bytes(self.offloaded)} "
            f"offloaded, {format_bytes(self.inputs)} inputs",
            head,
            "-" * len(head),
        ]
        for names, b in grouped([(b.block, b.row(), b) for b in self.blocks]):
            each = " each" if len(names) > 1 else ""
            lines.append(
                f"{group_names(names):<24} {format_bytes(b.kept):>12} {format_bytes(b.offloaded):>12} "
                f"{format_bytes(b.inputs):>12} {b.calls:>6}{each}"
            )
        if self.outside is None:
            lines.append(
                "saved outside the blocks: not walked (memory_report(model, outputs=loss), on a "
                "torch whose saved tensors show .data)"
            )
        else:
            total = sum(self.outside.values())
            lines.append(f"saved outside the blocks: {format_bytes(total)} by autograd node")
            for node, nbytes in sorted(self.outside.items(), key=lambda kv: (-kv[1], kv[0])):
                lines.append(f"  {node:<40} {format_bytes(nbytes):>12}")
            if self.packed:
                lines.append(f"  ({self.packed} saved tensor(s) packed by saved-tensor hooks)")
        return "\n".join(lines)


def memory_report(
    model: torch.nn.Module | None = None, outputs: Any = None, *, note: str = ""
) -> MemoryReport:
    """What the checkpointed blocks of ``model`` hold now, read from prime_ac's stores: no second
    run. ``model=None`` reports the blocks of every model (their buffers then count among the
    inputs). ``outputs`` (a tensor or tensors with a graph: the loss, the model's output) also
    has the graph behind it walked for what autograd saves outside the blocks, by node.

    Example::

        loss = model.loss(batch)
        print(prime_ac.memory_report(model, loss))  # per block: kept, offloaded, inputs
        loss.backward()
    """
    modules = None if model is None else {id(m) for m in model.modules()}
    rows: dict[str, BlockMemory] = {}
    # the model's parameters and buffers (a rotary table passed to every block) are not the
    # step's: they count nowhere
    seen = {} if model is None else _storages([*model.parameters(), *model.buffers()])
    alive = (ref() for ref in list(_live))
    for held in sorted((h for h in alive if h is not None), key=lambda h: h.order):
        block = held.block()
        if block is None or (modules is not None and id(block) not in modules):
            continue
        row = rows.get(held.name)
        if row is None:
            row = rows[held.name] = BlockMemory(held.name)
        row.calls += 1
        row.inputs += unseen_bytes(held.inputs, seen)
        store = held.store() if held.store is not None else None
        if store is not None:
            kept, offloaded = _store_bytes(store, seen)
            row.kept += kept
            row.offloaded += offloaded
    report = MemoryReport(list(rows.values()), note=note)
    if outputs is not None and _compat.SAVED_TENSOR_DATA:
        report.outside, report.packed = saved_outside(outputs, seen)
    return report


def _store_bytes(store: Any, seen: dict[int, int]) -> tuple[int, int]:
    """(kept, offloaded) bytes of the results ``store`` holds now, each storage once across
    the report (``seen``); results the recompute received are gone."""
    offloader = store.offloader
    moved = set()
    if offloader is not None:
        moved = {id(e.kept) for e in offloader._entries.get(store, ()) if e.host}
    kept = offloaded = 0
    for entries in store.entries.values():
        for entry in entries.values():
            if not isinstance(entry, KeptResult):  # handed to the recompute
                continue
            n = unseen_bytes(_storages(entry.tensors), seen)
            if id(entry) in moved:
                offloaded += n
            else:
                kept += n
    return kept, offloaded


def saved_outside(
    outputs: Any, seen: dict[int, int] | None = None, visited: dict[int, Any] | None = None
) -> tuple[dict[str, int], int]:
    """What autograd saved outside checkpointed blocks in the graph behind ``outputs``: bytes
    per node name (each storage once, none already in ``seen``), and how many saves a
    saved-tensor hook packed into something else (an offload's record). Saves inside a
    checkpoint are holders its recompute fills and are not counted; the checkpoints' own
    input saves are the blocks' inputs. Nodes in ``visited`` (filled here) are not walked."""
    seen = {} if seen is None else seen
    # the nodes themselves too: an id is unique while they live
    visited = {} if visited is None else visited
    roots = [
        t.grad_fn
        for t in _compat.tree_leaves(outputs)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    by_node: dict[str, int] = {}
    packed = 0
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        stack.extend(next_node for next_node, _ in node.next_functions)
        name = node.name()
        if name.endswith("NoopSaveInputsBackward"):  # a checkpoint's inputs: the block's
            continue
        for value in _compat.saved_tensor_values(node):
            if isinstance(value, torch.Tensor):
                if value.is_leaf and value.requires_grad:  # a parameter: the model's
                    continue
                n = unseen_bytes(_storages([value]), seen)
                if n:
                    by_node[name] = by_node.get(name, 0) + n
            elif type(value).__name__ != "_Holder":  # a checkpoint's: recomputed, not held
                packed += 1
    return by_node, packed


def unseen_bytes(storages: dict[int, int], seen: dict[int, int]) -> int:
    """The bytes of ``storages`` not in ``seen``, which then holds them: each storage counts
    once in a report (a block's input is often the block before's kept output)."""
    total = 0
    for sid, n in storages.items():
        if sid not in seen:
            seen[sid] = n
            total += n
    return total


# --- out of memory ------------------------------------------------------------------------------


def out_of_memory(error: BaseException, args: tuple, kwargs: dict) -> None:
    """Log what each block holds as ``error`` (an out-of-memory error) leaves a checkpointed
    call whose inputs are ``args``/``kwargs``; once per error."""
    if getattr(error, "_prime_ac_reported", False):
        return
    with contextlib.suppress(AttributeError):  # an error that takes no attributes: said again
        error._prime_ac_reported = True  # type: ignore[attr-defined]
    _log(type(error).__name__, (args, kwargs))


def _log(what: str, outputs: Any) -> None:
    try:
        report = memory_report(outputs=outputs, note=what)
    except Exception as exc:  # the report must never replace the error it reports
        logger.error("prime_ac: %s; the memory report failed: %r", what, exc)
        return
    logger.error(
        "prime_ac: %s in a step with checkpointed blocks; what they hold now (keep fewer "
        "targets, offload, or plan within a budget: targets='auto', budget=...):\n%s",
        what,
        report,
    )


def _observe() -> None:
    """Attach the CUDA allocator's out-of-memory observer (once per process)."""
    global _observing
    _observing = True
    _compat.attach_oom_observer(_observer)


def _observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    # inside a checkpointed call the error passes through the call, which reports it with
    # the graph behind the call's inputs; elsewhere (the backward's own kernels) it is here
    if calls.depth == 0:
        _log(
            f"CUDA out of memory on device {device} allocating {format_bytes(alloc)} "
            f"({format_bytes(device_free)} free)",
            None,
        )


# --- allocation labels --------------------------------------------------------------------------

_labelling = 0  # labelled_allocations() contexts open (any thread)


@contextlib.contextmanager
def labelled_allocations() -> Iterator[None]:
    """Within the context, the CUDA allocations of the calls prime_ac keeps carry the label
    ``prime_ac kept <block> <operator>`` and the device buffers offloaded results return into
    ``prime_ac offloaded <block>``, as ``torch.cuda.memory._snapshot()``'s traces show them
    (record them with ``torch.cuda.memory._record_memory_history()``). Outside it, and
    without CUDA, nothing is labelled and nothing is paid.

    Example::

        torch.cuda.memory._record_memory_history()
        with prime_ac.labelled_allocations():
            model.loss(batch).backward()
        snapshot = torch.cuda.memory._snapshot()
    """
    global _labelling
    _labelling += 1
    try:
        yield
    finally:
        _labelling -= 1


def labelling() -> bool:
    return _labelling > 0


@contextlib.contextmanager
def label(text: str) -> Iterator[None]:
    """Label the CUDA allocations made inside the context (where labelling is on)."""
    if not _labelling or not _compat.set_allocation_label(text):
        yield
        return
    try:
        yield
    finally:
        _compat.set_allocation_label("")


# the actions under which every call is kept (others are decided per call, after it ran)
_ALWAYS_KEPT = frozenset({Action.KEEP, Action.MANDATORY, Action.KEEP_WRITTEN, Action.HOST_SYNC})
_labelled_classes: dict[type, type] = {}


def label_keeps(mode: Any) -> None:
    """Make ``mode`` (a region's forward mode) label the allocations of the calls it may keep."""
    cls = type(mode)
    if cls not in _labelled_classes:
        _labelled_classes[cls] = type(f"Labelled{cls.__name__}", (_Labelling, cls), {})
    mode.__class__ = _labelled_classes[cls]


class _Labelling:
    """Mixin in front of a forward mode: each call whose action may keep it runs under a label
    (``prime_ac kept``, or ``prime_ac kept or replayed`` where a plan, scope or policy callable
    decides per call)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        action = self.rules.action(func)
        if action is Action.REPLAY or action is Action.IGNORE:
            return super().__torch_dispatch__(func, types, args, kwargs)
        how = "kept" if action in _ALWAYS_KEPT else "kept or replayed"
        name = str(func)  # aten.mm.default, named as targets name it: aten::mm.default
        if "::" not in name:
            name = name.replace(".", "::", 1)
        with label(f"prime_ac {how} {self.store.name} {name}"):
            return super().__torch_dispatch__(func, types, args, kwargs)
