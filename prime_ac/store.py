"""The kept results of one checkpointed region, shared by its forward and recompute modes.

Kept results are stored per ``(operator, call index)``, counting only the calls of operators
that can be kept, with the shapes of the call's tensor inputs. The recompute takes them back in
the same order; a call that does not fit what the forward kept (one call too many, or inputs of
other shapes) raises :class:`ReplayMismatchError` before a wrong tensor reaches the block.

Copy on write: when an operator writes in place to a storage that holds a kept result (views
included), the kept result is replaced by a copy taken just before the write, so the recompute
receives the value the forward saw; kept results sharing that storage get views of one copy, so
they stay one storage in the recompute. A kept result modified where no mode sees it (after the
block returned) cannot be recovered and raises :class:`KeptOutputMutatedError` in the backward.

Saved-tensor hooks (``checkpoint_blocks(..., respect_saved_tensors_hooks=True)``): the
``saved_tensors_hooks`` in effect around the region's forward pack every kept result when the
forward ends (after the last copy on write) and unpack them when the recompute starts; while
one packs, :func:`saved_tensor_kind` says what it is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointError

from prime_ac import _compat

__all__ = [
    "CHECKPOINT_INPUT",
    "KEPT",
    "KEPT_CALL",
    "KeptOutputMutatedError",
    "KeptResult",
    "RegionStore",
    "ReplayMismatchError",
    "packed_as",
    "respecting_saved_tensors_hooks",
    "saved_tensor_kind",
]

CHECKPOINT_INPUT = "checkpoint_input"  # a block's positional tensor input, saved by checkpoint
KEPT = "kept"  # an operator result the policy keeps
KEPT_CALL = "kept_call"  # the output of a call wrapped in prime_ac.keep

# ``hooks``: the (pack, unpack) a region being entered now respects; ``kind``: what is packed now
_local = threading.local()


def saved_tensor_kind() -> str | None:
    """While a saved-tensor pack hook runs for prime_ac, what it packs: ``"checkpoint_input"``
    (a checkpointed block's input), ``"kept"`` (an operator result the policy keeps) or
    ``"kept_call"`` (the output of a :func:`prime_ac.keep` call or of a torch_remat region a
    ``"region:"`` target keeps, or a tensor its backward saves); None for any other tensor
    autograd saves. Kept results reach the hooks only with
    ``checkpoint_blocks(..., respect_saved_tensors_hooks=True)``.

    Example::

        def pack(t):
            kind = prime_ac.saved_tensor_kind()  # "kept", "checkpoint_input", ... or None
            return t.to("cpu") if kind == "kept" else t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.to(device)):
            model(x).sum().backward()
    """
    return getattr(_local, "kind", None)


def packed_as(kind: str, pack: Any) -> Any:
    def tagged(t: torch.Tensor) -> Any:
        prior, _local.kind = getattr(_local, "kind", None), kind
        try:
            return pack(t)
        finally:
            _local.kind = prior

    return tagged


@contextmanager
def respecting_saved_tensors_hooks() -> Iterator[None]:
    """Around one checkpointed call: the stores made inside pack their kept results with the
    saved-tensor hooks in effect here, and the call's inputs are packed tagged
    :data:`CHECKPOINT_INPUT` (torch's checkpoint saves them before its own hooks shadow these)."""
    hooks = _compat.top_saved_tensors_hooks()
    if hooks is None:
        yield
        return
    prior, _local.hooks = getattr(_local, "hooks", None), hooks
    try:
        with torch.autograd.graph.saved_tensors_hooks(
            packed_as(CHECKPOINT_INPUT, hooks[0]), hooks[1]
        ):
            yield
    finally:
        _local.hooks = prior


class _Packed:
    """A kept tensor as a saved-tensor pack hook returned it, and the storage it came from."""

    __slots__ = ("storage", "value")

    def __init__(self, value: Any, storage: int | None):
        self.value, self.storage = value, storage


class ReplayMismatchError(CheckpointError):
    """The recompute of a checkpointed block would receive the wrong kept results."""


class KeptOutputMutatedError(CheckpointError):
    """A kept result was modified in place where prime_ac could not copy it first."""


class KeptResult:
    """One kept call: its detached output and what the recompute checks it against.

    ``tensors`` are the output's tensor leaves, ``spec`` rebuilds the output from its leaves
    (None: one tensor; ``tuple``: a tuple of tensors; else a pytree spec), ``versions`` are the
    leaves' version counters when kept (None for a non-tensor leaf), and ``inputs`` the shapes of
    the call's tensor arguments.
    """

    __slots__ = ("inputs", "spec", "tensors", "versions")

    def __init__(self, out: Any, inputs: tuple):
        self.inputs = inputs
        if isinstance(out, torch.Tensor):
            t = _compat.detach(out)
            self.tensors, self.spec, self.versions = [t], None, [t._version]
            return
        if type(out) is tuple and all(isinstance(x, torch.Tensor) for x in out):
            leaves, self.spec = out, tuple  # most multi-output operators: no tree spec
        else:
            leaves, self.spec = _compat.tree_flatten(out)
        self.tensors = [_compat.detach(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        self.versions = [
            _compat.version(x) if isinstance(x, torch.Tensor) else None for x in self.tensors
        ]

    def value(self) -> Any:
        if self.spec is None:
            return self.tensors[0]
        if self.spec is tuple:
            return tuple(self.tensors)
        return _compat.tree_unflatten(self.tensors, self.spec)

    def mutated(self) -> bool:
        if self.spec is None:
            return self.tensors[0]._version != self.versions[0]
        return any(
            seen is not None and _compat.version(t) != seen
            for t, seen in zip(self.tensors, self.versions, strict=True)
        )


_CONSUMED = object()  # a kept result already handed to a recompute


def input_shapes(args: tuple, kwargs: dict) -> list:
    """The shapes of a call's top-level tensor arguments: what a replayed call must match."""
    shapes = [a.shape for a in args if isinstance(a, torch.Tensor)]
    if kwargs:
        shapes += [v.shape for v in kwargs.values() if isinstance(v, torch.Tensor)]
    return shapes


class RegionStore:
    """The kept results of one region, keyed by operator and call index.

    ``forward_calls`` counts, per operator that can be kept, its calls in the forward; ``held``
    maps a storage to the kept results living in it (for copy on write). ``stored`` / ``hits``
    count results kept and handed back; ``copies`` / ``copied_bytes`` the copies on write.
    """

    __slots__ = (
        "__weakref__",
        "copied_bytes",
        "copies",
        "entries",
        "forward_calls",
        "held",
        "hits",
        "hooks",
        "name",
        "offload_calls",
        "offload_ops",
        "offloader",
        "replay_calls",
        "stored",
    )

    def __init__(self, name: str):
        self.name = name
        self.entries: dict[Any, dict[int, Any]] = {}
        self.forward_calls: dict[Any, int] = {}
        self.replay_calls: dict[Any, int] = {}
        self.held: dict[int, list[tuple[Any, int]]] = {}
        self.stored = self.hits = self.copies = self.copied_bytes = 0
        # offload (prime_ac.offload): the (operator, call index) whose kept results go to host
        # memory, or a test of the operator whose every kept call does (offload=[...]), and the
        # model's offloader moving them
        self.offloader: Any = None
        self.offload_calls: frozenset = frozenset()
        self.offload_ops: Any = None
        self.hooks = getattr(_local, "hooks", None)  # see respecting_saved_tensors_hooks

    def keeps(self) -> bool:
        """Whether the forward kept anything (else the recompute runs with no mode at all)."""
        return self.stored > 0

    def kept_ops(self) -> set[Any]:
        return set(self.entries)

    def handed_back(self, op: Any) -> int:
        """How many kept results of ``op`` the recompute received (and so did not rerun)."""
        return sum(entry is _CONSUMED for entry in self.entries.get(op, {}).values())

    # --- forward ------------------------------------------------------------------------------

    def keep(self, op: Any, index: int, out: Any, inputs: list) -> None:
        kept = KeptResult(out, inputs)
        entries = self.entries.get(op)
        if entries is None:
            entries = self.entries[op] = {}
        entries[index] = kept
        self.stored += 1
        if self.offloader is not None and (
            (op, index) in self.offload_calls
            or (self.offload_ops is not None and self.offload_ops(op))
        ):
            self.offloader.offload(self, kept)  # False: it stays kept (host buffer full)
        for t in kept.tensors:
            if isinstance(t, torch.Tensor):
                self._hold(t, op, index)

    def _hold(self, t: torch.Tensor, op: Any, index: int) -> None:
        sid = _compat.storage_id(t)
        if sid is not None:
            held = self.held.get(sid)
            if held is None:
                self.held[sid] = [(op, index)]
            else:
                held.append((op, index))

    def copy_before_write(self, tensors: Iterable[torch.Tensor]) -> None:
        """Replace every kept result sharing a storage with ``tensors`` by a copy of it.

        Kept results sharing one storage get views of one copy, so that in the recompute a write
        through one of them reaches the others, as it did in the forward."""
        for t in tensors:
            sid = _compat.storage_id(t)
            places = [
                (op, index, i)
                for op, index in dict.fromkeys(self.held.pop(sid, ()))
                for i, leaf in enumerate(self.entries[op][index].tensors)
                if isinstance(leaf, torch.Tensor) and _compat.storage_id(leaf) == sid
            ]
            leaves = [self.entries[op][index].tensors[i] for op, index, i in places]
            if not leaves:
                continue
            copies = [self._copy(leaves[0])] if len(leaves) == 1 else self._copy_shared(leaves)
            for (op, index, i), copy in zip(places, copies, strict=True):
                kept = self.entries[op][index]
                kept.tensors[i], kept.versions[i] = copy, _compat.version(copy)
                self._hold(copy, op, index)

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        copy = t.clone()
        if copy.stride() != t.stride():  # overlapping or gapped layout: copy the whole storage
            storage = t.untyped_storage()
            copy = torch.empty(0, dtype=t.dtype, device=t.device)
            copy.set_(storage.clone(), t.storage_offset(), t.size(), t.stride())
        self.copies += 1
        self.copied_bytes += copy.untyped_storage().nbytes()
        return copy

    def _copy_shared(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of one copy of the bytes ``leaves`` (tensors of one storage) span."""
        align = max(leaf.element_size() for leaf in leaves)
        spans = [_byte_span(leaf) for leaf in leaves]
        start = min(first for first, _ in spans) // align * align
        end = max(last for _, last in spans)
        source = torch.empty(0, dtype=torch.uint8, device=leaves[0].device)
        source.set_(leaves[0].untyped_storage(), start, (end - start,), (1,))
        storage = source.clone().untyped_storage()
        self.copies += 1
        self.copied_bytes += end - start
        views = []
        for leaf in leaves:
            offset = (leaf.storage_offset() * leaf.element_size() - start) // leaf.element_size()
            view = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
            views.append(view.set_(storage, offset, leaf.size(), leaf.stride()))
        return views

    def forward_done(self) -> None:
        self.held = {}  # only writes inside the forward are copied
        if self.offloader is not None:
            self.offloader.forward_done(self)
        if self.hooks is not None:
            self._pack(self.hooks[0])

    def _pack(self, pack: Any) -> None:
        for op, entries in self.entries.items():
            packs = packed_as(KEPT_CALL if getattr(op, "kept_call", False) else KEPT, pack)
            for kept in entries.values():
                tensors = kept.tensors
                for i, t in enumerate(tensors):
                    if isinstance(t, torch.Tensor):
                        tensors[i] = _Packed(packs(t), _compat.storage_id(t))

    def _unpack(self, unpack: Any) -> None:
        """Each kept tensor back; one in a storage other than the one packed is a copy, which
        no later write to the original reaches (its version is its own)."""
        for entries in self.entries.values():
            for kept in entries.values():
                if kept is _CONSUMED:
                    continue
                for i, t in enumerate(kept.tensors):
                    if isinstance(t, _Packed):
                        value = kept.tensors[i] = unpack(t.value)
                        if _compat.storage_id(value) != t.storage:
                            kept.versions[i] = _compat.version(value)

    # --- recompute ----------------------------------------------------------------------------

    def start_recompute(self) -> None:
        # a second backward finds consumed entries, not shifted indices
        self.replay_calls = {}
        if self.hooks is not None:
            self._unpack(self.hooks[1])
        if self.offloader is not None:
            self.offloader.bring_back(self)

    def take(self, op: Any, args: tuple, kwargs: dict) -> Any:
        """The kept result for this recompute call of ``op``, or NotImplemented when the call
        runs; raises when the call does not fit what the forward kept."""
        kept = self.entries.get(op)
        if kept is None:  # this operator kept nothing here: an extra call changes nothing
            return NotImplemented
        index = self.replay_calls.get(op, 0)
        self.replay_calls[op] = index + 1
        entry = kept.get(index)
        if entry is None:
            if index < self.forward_calls.get(op, 0):  # a call the forward left to replay
                return NotImplemented
            ran = self.forward_calls[op]
            raise self._mismatch(op, index, f"but its forward called it {ran} time(s)")
        if entry is _CONSUMED:
            raise CheckpointError(
                f"prime_ac: backward ran a second time through {self.name}, whose kept results "
                "were handed to the first backward. Selective checkpointing allows one backward "
                "per forward (as torch's own does); use mode='full' with no kept operators, or "
                "run the forward again."
            )
        if input_shapes(args, kwargs) != entry.inputs:  # an extra call, before the kept ones
            raise self._mismatch(
                op,
                index,
                f"with inputs of shapes {_shapes(input_shapes(args, kwargs))}, but that call "
                f"had inputs of shapes {_shapes(entry.inputs)} in the forward",
            )
        if entry.mutated():
            raise KeptOutputMutatedError(
                f"prime_ac: {self.name} keeps the result of {op} (call #{index + 1}) for its "
                "backward, and that result was modified in place after the block's forward "
                "returned (or by code no dispatch mode sees), so the value the backward needs is "
                "gone. Clone the block's output before writing to it in place "
                f"(out = out.clone()), or leave {op} out of the targets (mandatory operators "
                "cannot be left out)."
            )
        kept[index] = _CONSUMED
        self.hits += 1
        return entry.tensors[0] if entry.spec is None else entry.value()

    def _mismatch(self, op: Any, index: int, detail: str) -> ReplayMismatchError:
        return ReplayMismatchError(
            f"prime_ac: the recompute of {self.name} called {op} a {_ordinal(index + 1)} time "
            f"{detail}, and the forward kept its results: the recompute would receive the wrong "
            "ones. The block must call this operator the same way in forward and "
            "recompute. Common causes: state filled during the forward that the recompute sees "
            "again, such as a KV cache (Hugging Face models called with use_cache=True in "
            "training append to it again in the recompute: pass use_cache=False), buffers "
            "created lazily on the first forward (create them before the first checkpointed "
            "forward), and data-dependent control flow or global state that changed between "
            "forward and backward."
        )


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The first and one past the last byte of its storage that ``t`` can address."""
    first = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return first, first
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.size(), t.stride(), strict=True))
    return first, first + extent * t.element_size()


def _shapes(shapes: tuple) -> str:
    return ", ".join(str(list(s)) for s in shapes) or "none"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
