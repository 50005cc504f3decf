"""Offload: the third action beside keep and replay, a kept result held in host memory.

A region's store (:class:`prime_ac.store.RegionStore`) hands a kept result to the
:class:`Offloader` when the plan offloads that call. On CUDA its tensors are copied into one
pinned host buffer on a side stream after the operator, the device tensors are dropped once the
copy's event completes (and at the latest when the next block's forward ends, which waits for
them), and they are copied back ahead of the block's recompute: when a block's recompute
starts, the block before it (the next to recompute) is prefetched, up to ``prefetch_bytes``.

The hazards the field reports, and what is done about each:

- stream races (NaN gradients): the copy stream waits for the compute stream before reading;
  the compute stream waits for every copy in flight before a write to a kept storage (copy on
  write) and for a result's inbound copy before the recompute uses it; a device tensor is held
  until its outbound copy is done, so the allocator cannot hand its memory out under the copy;
- pinned-allocation stalls (``cudaHostAlloc`` per tensor): one buffer, allocated once at the
  size the plan asks for, never grown; a result that does not fit stays kept on the device
  (``overflowed`` counts them) rather than waiting for room;
- host memory running out: the buffer is capped at ``host_cap`` bytes.

On CPU the "host" copy is a separate CPU tensor made at once, and :class:`Ledger` counts the
device bytes (kept results still in the store) and host bytes apart, so the tests check the
accounting and the gradients where no GPU exists.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from prime_ac import diagnostics

__all__ = ["Ledger", "Offloader", "SavedInputOffload"]

logger = logging.getLogger("prime_ac")


@dataclass
class Ledger:
    """Bytes of offloaded results: still on the device (copy in flight), on the host, and the
    most each reached."""

    device: int = 0
    host: int = 0
    peak_device: int = 0
    peak_host: int = 0
    offloaded: int = 0  # results offloaded
    overflowed: int = 0  # results that stayed kept because the host buffer was full

    def add(self, device: int = 0, host: int = 0) -> None:
        self.device += device
        self.host += host
        self.peak_device = max(self.peak_device, self.device)
        self.peak_host = max(self.peak_host, self.host)


def _offloadable(t: Any) -> bool:
    """A tensor that owns its whole storage, densely in some order of its dimensions (attention
    returns a transposed layout): views (and tensors of a larger base) are never offloaded,
    since dropping them frees nothing; nor are parameters and tensors that need grad."""
    return (
        isinstance(t, torch.Tensor)
        and not isinstance(t, torch.nn.Parameter)
        and not t.requires_grad
        and _dense(t)
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and t.device.type in ("cpu", "cuda")
    )


def _dense(t: torch.Tensor) -> bool:
    """No gaps and no overlap: contiguous once its dimensions are ordered by stride."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(order).is_contiguous()


_ALIGN = 64  # bytes: each slice of the pinned buffer starts at a multiple of this


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


class _Entry:
    """One offloaded result: the store entry, its host tensors and the events of its copies."""

    __slots__ = ("back", "device", "host", "kept", "nbytes", "out_event")

    def __init__(self, kept: Any, host: list, device: list, nbytes: int, event: Any):
        self.kept, self.host, self.device, self.nbytes = kept, host, device, nbytes
        self.out_event, self.back = event, None


class Offloader:
    """Moves the offloaded results of every region of one model to host memory and back.

    ``capacity`` is the host bytes the plan offloads (the pinned buffer's size on CUDA, at most
    ``host_cap``); None (named offload targets, no plan) sizes it from the first step: on CUDA
    that step's results stay on the device while their bytes are counted (``sized``), and the
    buffer is allocated once for the steps after it; on CPU nothing bounds it; ``prefetch_bytes`` bounds what is brought back ahead of a block's recompute
    (None: the whole next block); ``max_inflight`` bounds the outbound copies in flight
    (prime-rl's ``max_inflight_activations``; None: no bound). ``pin_memory=False`` uses
    pageable host memory (the copies then block the host).
    """

    def __init__(
        self,
        capacity: int,
        *,
        host_cap: int | None = None,
        prefetch_bytes: int | None = None,
        max_inflight: int | None = None,
        pin_memory: bool = True,
    ):
        for name, value in (
            ("capacity", capacity),
            ("host_cap", host_cap),
            ("prefetch_bytes", prefetch_bytes),
            ("max_inflight", max_inflight),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name}={value!r} must be an int >= 0 (or None)")
        self.host_cap = host_cap
        self.capacity = (
            capacity if host_cap is None or capacity is None else min(capacity, host_cap)
        )
        self.sized = 0  # capacity None: the bytes the first step would have offloaded (CUDA)
        self.prefetch_bytes, self.max_inflight = prefetch_bytes, max_inflight
        self.pin_memory = pin_memory
        self.ledger = Ledger()
        self.buffer: torch.Tensor | None = None  # CUDA: the one pinned buffer
        self.buffer_allocations = 0
        self._offset = 0  # bump pointer into the buffer; reset when nothing is out
        self._stream: Any = None
        self._inflight: deque[tuple[Any, _Entry]] = deque()  # (store, entry) copies not done
        self._order: list[weakref.ref] = []  # stores holding offloaded results, forward order
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __reduce__(self) -> tuple[Any, ...]:
        # host copies belong to the model (and the process) that made them: a copy (deepcopy,
        # pickle) gets an empty offloader of its own with the same settings
        settings = {
            "host_cap": self.host_cap,
            "prefetch_bytes": self.prefetch_bytes,
            "max_inflight": self.max_inflight,
            "pin_memory": self.pin_memory,
        }
        return (_fresh_offloader, (self.capacity, settings))

    # --- forward ------------------------------------------------------------------------------

    def offload(self, store: Any, kept: Any) -> bool:
        """Start moving one kept result to the host; False (it stays kept) when it cannot."""
        leaves = [t for t in kept.tensors if isinstance(t, torch.Tensor)]
        if not leaves or not all(_offloadable(t) for t in leaves):
            return False
        if len({t.untyped_storage().data_ptr() for t in leaves}) != len(leaves):
            return False  # leaves sharing a storage: copy on write keeps them one storage
        nbytes = sum(t.untyped_storage().nbytes() for t in leaves)
        cuda = leaves[0].device.type == "cuda"
        if cuda and self.capacity is None:  # the first step sizes the buffer: this stays kept
            self.sized += nbytes
            return False
        full = self.capacity is not None and self.ledger.host + nbytes > self.capacity
        if full or (cuda and not self._room(nbytes)):
            self.ledger.overflowed += 1
            return False
        if cuda:
            entry = self._copy_out(kept, leaves, nbytes)
        else:  # the "host" copy is a separate CPU tensor, made now
            host = [t.clone() for t in leaves]
            entry = _Entry(kept, host, [], nbytes, None)
            self._swap(kept, host)
        self._register(store, entry)
        self.ledger.offloaded += 1
        self.ledger.add(host=nbytes, device=nbytes if cuda else 0)
        self._poll()
        return True

    def _room(self, nbytes: int) -> bool:
        if self.buffer is None:  # with room for aligning each slice
            size = self.capacity + _ALIGN * 1024
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            self.buffer_allocations += 1
        return _aligned(self._offset) + nbytes <= self.buffer.numel()

    def _copy_out(self, kept: Any, leaves: list[torch.Tensor], nbytes: int) -> _Entry:
        stream = self._side_stream(leaves[0].device)
        stream.wait_stream(torch.cuda.current_stream(leaves[0].device))
        host = []
        with torch.cuda.stream(stream):
            for t in leaves:
                size = t.untyped_storage().nbytes()
                start = _aligned(self._offset)  # a dtype view needs an aligned byte offset
                # the same strides: a dense copy, and backward sees the layout it saved
                dest = (
                    self.buffer[start : start + size].view(t.dtype).as_strided(t.shape, t.stride())
                )
                self._offset = start + size
                dest.copy_(t, non_blocking=True)
                host.append(dest)
            event = torch.cuda.Event()
            event.record(stream)
        entry = _Entry(kept, host, leaves, nbytes, event)
        if self.max_inflight is not None:
            while len(self._inflight) >= max(self.max_inflight, 1):
                self._finish(*self._inflight.popleft(), wait=True)
        return entry

    def _register(self, store: Any, entry: _Entry) -> None:
        entries = self._entries.get(store)
        if entries is None:
            entries = self._entries[store] = []
            self._order = [r for r in self._order if r() is not None]
            self._order.append(weakref.ref(store))
            # a block whose backward never runs (its graph dropped, its forward raised, frozen)
            weakref.finalize(store, self._dropped, entries).atexit = False
        entries.append(entry)
        if entry.out_event is not None:
            self._inflight.append((store, entry))

    def _dropped(self, entries: list[_Entry]) -> None:
        """A store died with results still out: their host bytes are free (and the buffer once
        nothing else is out), so later steps offload as planned instead of overflowing."""
        for entry in entries:
            if entry.host:
                entry.host = []
                self.ledger.add(host=-entry.nbytes)
        if next(iter(self._entries.keys()), None) is None:  # live stores only
            self._offset = 0

    def _poll(self) -> None:
        """Drop the device tensors of the copies that are done."""
        while self._inflight and self._inflight[0][1].out_event.query():
            self._finish(*self._inflight.popleft(), wait=False)

    def _finish(self, store: Any, entry: _Entry, wait: bool) -> None:
        if wait:
            entry.out_event.synchronize()
        # a write the store could not see (after the block returned) between the keep and the
        # copy's end: the value the backward needs may be gone, as for a kept result
        self._swap(entry.kept, entry.host)
        entry.device = []
        self.ledger.add(device=-entry.nbytes)

    def _swap(self, kept: Any, host: list) -> None:
        """The store's entry now holds the host tensors. A device tensor written since it was
        kept (where no copy on write saw it) marks the entry mutated (version -1), so the
        recompute raises as it does for a kept result."""
        it = iter(host)
        for i, t in enumerate(kept.tensors):
            if isinstance(t, torch.Tensor):
                h = next(it)
                changed = t._version != kept.versions[i]
                kept.tensors[i] = h
                kept.versions[i] = -1 if changed else h._version

    def before_write(self) -> None:
        """The compute stream waits for every copy in flight (a write must not race a read)."""
        for _, entry in self._inflight:
            torch.cuda.current_stream(entry.device[0].device).wait_event(entry.out_event)

    def forward_done(self, store: Any) -> None:
        """A block's forward ended: the copies of the blocks before it must be done now (the
        planner's bound on held bytes)."""
        self._poll()
        while self._inflight and self._inflight[0][0] is not store:
            self._finish(*self._inflight.popleft(), wait=True)

    # --- backward -----------------------------------------------------------------------------

    def bring_back(self, store: Any) -> None:
        """Before ``store``'s recompute: its results on the device, the next block's under way."""
        if self.capacity is None and self.sized:  # the first forward is over: size the buffer
            cap = self.host_cap
            self.capacity = self.sized if cap is None else min(self.sized, cap)
        entries = self._entries.pop(store, None)
        if entries is None:
            return
        position = next((k for k, r in enumerate(self._order) if r() is store), None)
        for _, entry in list(self._inflight):
            if entry in entries:
                self._inflight.remove((store, entry))
                self._finish(store, entry, wait=True)
        for entry in entries:
            with diagnostics.label(f"prime_ac offloaded {store.name}"):
                self._copy_in(entry)
            if entry.back is not None:
                torch.cuda.current_stream(entry.back[0].device).wait_event(entry.back[1])
                self._swap_back(entry, entry.back[0])
        entries.clear()  # all back: the finalizer of _register must not hold the results
        if position is not None:
            del self._order[position]
            if position > 0:
                self._prefetch(self._order[position - 1]())
        if not self._entries:
            self._offset = 0  # the step's results are all back: the buffer is free again

    def _prefetch(self, store: Any) -> None:
        budget = self.prefetch_bytes
        for entry in self._entries.get(store, []) if store is not None else []:
            if budget is not None and entry.nbytes > budget:
                break
            with diagnostics.label(f"prime_ac offloaded {store.name}"):
                started = self._copy_in(entry)
            if started and budget is not None:
                budget -= entry.nbytes

    def _copy_in(self, entry: _Entry) -> bool:
        """Start the inbound copy (CUDA); on CPU bring the copy back now. True if it started."""
        if entry.back is not None or not entry.host:
            return False
        if entry.out_event is None:  # CPU
            self._swap_back(entry, [h.clone() for h in entry.host])
            return False
        device = torch.device("cuda", torch.cuda.current_device())
        compute = torch.cuda.current_stream(device)
        dev = [torch.empty_like(h, device=device) for h in entry.host]  # on the compute stream
        stream = self._side_stream(device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            for d, h in zip(dev, entry.host, strict=True):
                d.copy_(h, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        entry.back = (dev, event)
        return True

    def _swap_back(self, entry: _Entry, device: list) -> None:
        if not device:
            return
        kept = entry.kept
        it = iter(device)
        for i, t in enumerate(kept.tensors):
            if isinstance(t, torch.Tensor):
                d = next(it)
                kept.tensors[i] = d
                if kept.versions[i] != -1:
                    kept.versions[i] = d._version
        self.ledger.add(host=-entry.nbytes)
        entry.host, entry.back = [], None

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream


def _fresh_offloader(capacity: int | None, settings: dict[str, Any]) -> Offloader:
    return Offloader(capacity, **settings)


class _Kept:
    """A saved tensor left where it is, with the version it was saved at: autograd checks no
    version under saved-tensor hooks, so the unpack does. A tensor without a graph (metadata
    such as ``cu_seqlens``) is handed back as the same object, which code that caches by
    identity relies on (prime-rl's offloader does the same); one with a graph is held detached,
    as autograd wraps it anew on unpack anyway and holding an output saved by the node that made
    it would keep that graph alive in a cycle."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor = t if t.grad_fn is None else t.detach()
        self.version = t._version


class _Copy:
    """What the offload owns for one saved storage (every saved tensor of one forward that views
    it shares it): its host buffer (back to the pool when the graph has released each of those
    tensors), on CUDA the device storage's bytes until the outbound copy is done, and the
    storage brought back, shared by the tensors unpacked from it until each was unpacked."""

    __slots__ = (
        "back",
        "buffer",
        "device",
        "event",
        "key",
        "nbytes",
        "restored",
        "unpacked",
        "users",
    )

    def __init__(self, buffer: torch.Tensor, key: tuple, nbytes: int):
        self.buffer, self.key, self.nbytes = buffer, key, nbytes
        self.device: torch.Tensor | None = None
        self.event: Any = None
        self.back: tuple[torch.Tensor, Any] | None = None  # CUDA: an inbound copy under way
        self.restored: torch.Tensor | None = None  # the storage brought back (its bytes)
        self.unpacked = 0  # records unpacked from ``restored``
        self.users = 0  # records the graph still holds


class _Saved:
    """What autograd's graph holds in place of one offloaded saved tensor: its storage's copy
    and its place in that storage (``host`` is the tensor rebuilt on the host buffer). Dropped
    by the graph (after the backward that reads it, or when the graph is freed), it lets go of
    the copy (``weakref.finalize``)."""

    __slots__ = (
        "__weakref__",
        "copy",
        "host",
        "previous",
        "source",
        "version",
        "where",
        "witness",
    )

    def __init__(self, copy: _Copy, host: torch.Tensor, where: torch.device):
        self.copy, self.host, self.where = copy, host, where
        self.previous: weakref.ref | None = None  # the record saved before it, same entry
        self.source: weakref.ref | None = None  # the tensor saved (the same one saved again)
        self.version = 0
        self.witness: torch.Tensor | None = None

    @property
    def back(self) -> tuple[torch.Tensor, Any] | None:
        """The inbound copy of its storage under way (CUDA), if any."""
        return self.copy.back


def _placed(like: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """``like``'s dtype, place (offset), shape and strides on ``storage``: a saved view rebuilt
    on the copy of its base's storage."""
    t = torch.empty(0, dtype=like.dtype, device=storage.device)
    return t.set_(storage, like.storage_offset(), like.shape, like.stride())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _of_parameter(t: torch.Tensor) -> bool:
    """A parameter or buffer, or a view of one (``weight.t()``): the model's memory, not an
    activation; moving it would free nothing."""
    buffer = getattr(torch.nn, "Buffer", None)
    return any(
        isinstance(x, torch.nn.Parameter) or (buffer is not None and isinstance(x, buffer))
        for x in (t, t._base)
        if x is not None
    )


def _witness(t: torch.Tensor) -> torch.Tensor:
    """A tensor with no storage that shares ``t``'s version counter: it tells whether ``t`` (or
    any alias of it) was written in place, without holding ``t``'s memory. Emptying it bumps the
    shared counter once, which is undone (another saved copy of ``t`` must not see a write)."""
    witness = t.detach()
    with torch.autograd._unsafe_preserve_version_counter(t):
        witness.set_()
    return witness


def _modified(kind: str, shape: Any, now: int, saved: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{kind} {list(shape)}] is at version {now}; expected version {saved} "
        "instead. (prime_ac.SavedInputOffload checks what autograd does not check under "
        "saved-tensor hooks; without the offload, backward raises the same.)"
    )


def _host_memory_used() -> float | None:
    """The fraction of host RAM in use, as prime-rl reads it (total less available), or None
    where it cannot be read cheaply (Linux: /proc/meminfo; else os.sysconf's free pages)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        total = int(info["MemTotal"].split()[0])
        available = int(info["MemAvailable"].split()[0])
    except (OSError, KeyError, ValueError):
        try:
            total, available = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
        except (AttributeError, OSError, ValueError):
            return None
    return 1 - available / total if total > 0 else None


_HOST_MEMORY_WARNING = 0.9  # prime-rl's: warn once host RAM is over 90% used


class SavedInputOffload:
    """prime-rl's ``[trainer.model.ac_offloading]``: what autograd saves outside the
    checkpointed regions (with full AC, each block's input) goes to host memory.

    Enter it around the forward (``with offload: loss = model(batch)``). Each saved tensor
    that owns its storage is copied to the host as it is saved (CUDA: on a side stream into a
    pinned buffer, the device tensor held until its copy is done, at most ``max_inflight``
    copies in flight); backward brings it back, and starts bringing back the tensor saved
    before it in the same forward, which backward needs next. A saved view moves through its
    base's storage: one host copy per storage, however many of its views are saved, each view
    rebuilt on the storage brought back. Parameters and buffers (and their views), tensor
    subclasses and storages with fewer than ``min_bytes`` are left where they are;
    :attr:`left_bytes` counts the bytes of the storages the latest forward left.

    A host buffer belongs to the graph that saved into it until autograd drops the saved
    tensor (after the backward that reads it, or when the graph is freed); then it goes back
    to a pool that later saves of the same size take from, so steps after the first allocate
    nothing. Several forwards may be in flight before their backwards (micro-batches,
    pipeline schedules), and ``retain_graph=True`` backwards read the same host copies again.
    A saved tensor written in place after it was saved raises in backward, as without the
    offload (autograd does not check versions under saved-tensor hooks; this does). On CPU
    the host copy is a separate CPU tensor and :attr:`ledger` counts its bytes.

    CUDA stream order: the side stream waits for the compute stream before each outbound
    copy; the compute stream waits for an inbound copy before using it, and the inbound
    tensor is marked used by the side stream (``record_stream``), so its memory is not reused
    under the copy even if the graph drops it first. A pooled buffer is reused only by a copy
    on the same device's side stream, queued after every copy that read or wrote it, so a
    buffer still being copied when its graph let go is never overwritten early.
    """

    def __init__(
        self, pin_memory: bool = True, max_inflight: int | None = 5, min_bytes: int = 1024
    ):
        if max_inflight is not None and (
            isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1
        ):
            raise ValueError(
                f"max_inflight={max_inflight!r} must be an int >= 1 (or None: no bound)"
            )
        if not isinstance(pin_memory, bool):
            raise TypeError(
                f"pin_memory={pin_memory!r} must be True (pinned host buffers) or False"
            )
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(
                f"min_bytes={min_bytes!r} must be an int >= 0: saved tensors smaller than this "
                "stay where they are"
            )
        self.pin_memory, self.max_inflight, self.min_bytes = pin_memory, max_inflight, min_bytes
        self.ledger = Ledger()
        self.buffer_allocations = 0  # host buffers allocated (the pool serves the rest)
        self._pool: dict[tuple, list[torch.Tensor]] = {}  # (nbytes, pinned, device) -> free
        self._pooled = 0  # bytes in the pool
        self._lock = threading.RLock()  # a graph may be released on autograd's threads
        self._streams: dict[torch.device, Any] = {}
        self._inflight: deque[_Copy] = deque()  # CUDA: outbound copies holding a device tensor
        self._entry: list[weakref.ref] = []  # the latest entry's records, in save order
        # this forward's copies by storage (data_ptr -> copy, a tensor on it, its witness, version)
        self._storages: dict[int, tuple[_Copy, weakref.ref, torch.Tensor, int]] = {}
        self._left: set[int] = set()  # storages this forward left in place
        self.left_bytes = 0  # their bytes (parameters and buffers aside)
        self._hooks: Any = None
        self._warned = False
        self._unmoved: set[str] = set()  # device types whose saved tensors cannot move (logged)

    def __enter__(self) -> SavedInputOffload:
        if self._hooks is not None:
            raise RuntimeError(
                "SavedInputOffload is already entered: enter it once around each forward "
                "(not nested in itself)"
            )
        self._entry = []
        self._storages, self._left, self.left_bytes = {}, set(), 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is None:
            raise RuntimeError(
                "SavedInputOffload was exited without being entered: use it as "
                "`with offload: loss = model(batch)` (enter, then exit, once per forward)"
            )
        hooks.__exit__(*exc)
        self._storages, self._left = {}, set()  # storages are shared within one forward
        self._poll()

    # --- forward ------------------------------------------------------------------------------

    def _moves(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage goes to the host: a plain strided tensor (views included,
        through their base's storage) on CPU or CUDA, not a parameter or buffer nor a view of
        one, whose storage has at least ``min_bytes``."""
        return (
            type(t) is torch.Tensor  # not Parameter, nn.Buffer, DTensor, FakeTensor, ...
            and not _of_parameter(t)
            and t.layout == torch.strided
            and not t.is_nested
            and not t.is_quantized
            and t.device.type in ("cpu", "cuda")
            and t.untyped_storage().nbytes() >= self.min_bytes
        )

    def _note_left(self, t: torch.Tensor) -> None:
        """Count the bytes of a storage this forward leaves on the device (parameters and
        buffers, the model's own memory, aside)."""
        if t.layout != torch.strided or t.is_nested or _of_parameter(t):
            return
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor subclass without a storage
            return
        if storage.data_ptr() not in self._left:
            self._left.add(storage.data_ptr())
            self.left_bytes += storage.nbytes()

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._moves(t):
            if t.device.type not in ("cpu", "cuda", "meta") and t.device.type not in self._unmoved:
                self._unmoved.add(t.device.type)
                logger.warning(
                    "prime_ac: SavedInputOffload moves CUDA tensors only; what autograd saves "
                    "on %s stays there (prime-rl's [trainer.model.ac_offloading] offloads "
                    "nothing on this device). Logged once per device type.",
                    t.device.type,
                )
            self._note_left(t)
            return _Kept(t)
        last = self._entry[-1]() if self._entry else None
        if (  # the same tensor saved again at once (x * x): one host copy serves both
            last is not None
            and last.source is not None
            and last.source() is t
            and last.version == t._version
        ):
            return last
        copy = self._shared(t) or self._copy_out(t)
        host = _placed(t, copy.buffer.untyped_storage())  # the saved view, on the host copy
        record = _Saved(copy, host, t.device)
        record.version, record.witness = t._version, _witness(t)
        record.source = weakref.ref(t)
        record.previous = self._entry[-1] if self._entry else None
        with self._lock:
            copy.users += 1
        weakref.finalize(record, self._release, copy).atexit = False
        self._entry.append(weakref.ref(record))
        return record

    def _shared(self, t: torch.Tensor) -> _Copy | None:
        """The copy this forward already made of ``t``'s storage (another view of it was
        saved), if the storage was not written since: one host copy per storage. "Written" is
        what the version counter says, which autograd itself relies on: a write it cannot see
        (through ``.data`` or a raw pointer) between the two saves is not seen here either."""
        storage = t.untyped_storage()
        found = self._storages.get(storage.data_ptr())
        if found is None:
            return None
        copy, source, witness, version = found
        alive = source()
        if (
            copy.buffer is None  # the graph released it already
            or alive is None  # the memory may have been freed and handed out again
            or alive.untyped_storage().data_ptr() != storage.data_ptr()
            or alive.untyped_storage().nbytes() != storage.nbytes()
            or witness._version != version  # written since: the copy holds older values
            or t._version != version
        ):
            return None
        return copy

    def _copy_out(self, t: torch.Tensor) -> _Copy:
        """Copy all of ``t``'s storage to a host buffer (CUDA: on the side stream, the device
        storage held until the copy has read it)."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        cuda = self._streamed(t.device)
        pinned = cuda and self.pin_memory
        key = (nbytes, pinned, t.device if cuda else None)
        copy = _Copy(self._host_buffer(key), key, nbytes)
        flat = _bytes(storage)
        if cuda:
            # at most max_inflight copies in flight, this one included: wait for the oldest
            self._poll(None if self.max_inflight is None else self.max_inflight - 1)
            stream = self._side(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                copy.buffer.copy_(flat, non_blocking=True)
                copy.event = torch.cuda.Event()
                copy.event.record(stream)
            copy.device = flat  # held until the copy has read it
        else:  # the "host" copy: a separate CPU buffer, made now
            copy.buffer.copy_(flat)
        self._storages[storage.data_ptr()] = (copy, weakref.ref(t), _witness(t), t._version)
        with self._lock:
            self.ledger.offloaded += 1
            self.ledger.add(host=nbytes, device=nbytes if cuda else 0)
            if cuda:
                self._inflight.append(copy)
        return copy

    def _host_buffer(self, key: tuple) -> torch.Tensor:
        nbytes, pinned, _ = key
        with self._lock:
            free = self._pool.get(key)
            if free:
                self._pooled -= nbytes
                return free.pop()
            # a size not pooled: drop pooled buffers of other sizes rather than let the pool and
            # the live copies outgrow the most the live copies have needed (shapes that change
            # from step to step would otherwise pile up host memory)
            limit = max(self.ledger.peak_host, self.ledger.host + nbytes)
            for other, buffers in sorted(self._pool.items(), key=lambda kv: -kv[0][0]):
                while buffers and self.ledger.host + self._pooled + nbytes > limit:
                    buffers.pop()
                    self._pooled -= other[0]
                if not buffers:
                    self._pool.pop(other, None)
            self.buffer_allocations += 1
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._check_host_memory()
        return buffer

    def _check_host_memory(self) -> None:
        if self._warned:
            return
        used = _host_memory_used()
        if used is not None and used > _HOST_MEMORY_WARNING:
            self._warned = True
            logger.warning(
                "prime_ac: host memory is %.0f%% used with %.2f GiB of offloaded activations "
                "held (SavedInputOffload, prime-rl's [trainer.model.ac_offloading]); the host "
                "may run out: fewer micro-batches in flight, or less offloading, would help. "
                "Logged once.",
                100 * used,
                self.ledger.host / 2**30,
            )

    def _poll(self, bound: int | None = None) -> None:
        """Drop the device tensors whose outbound copies are done, and wait for the oldest
        while more than ``bound`` copies are in flight."""
        while True:
            with self._lock:
                if not self._inflight:
                    return
                copy = self._inflight[0]
                over = bound is not None and len(self._inflight) > bound
                if not over and not copy.event.query():
                    return
                self._inflight.popleft()
            if over:
                copy.event.synchronize()
            with self._lock:
                copy.device = None
                self.ledger.add(device=-copy.nbytes)

    def _release(self, copy: _Copy) -> None:
        """The graph dropped a record: once it dropped every record of the copy, the host
        buffer goes back to the pool."""
        with self._lock:
            copy.users -= 1
            if copy.unpacked >= copy.users:  # no record left to read the storage brought back
                copy.restored, copy.unpacked = None, 0
            if copy.users > 0:
                return
            self.ledger.add(host=-copy.nbytes)
            self._pool.setdefault(copy.key, []).append(copy.buffer)
            self._pooled += copy.nbytes
            copy.buffer = None
        self._poll()  # a device tensor its copy no longer needs goes now, not at the next save

    # --- backward -----------------------------------------------------------------------------

    def _unpack(self, record: Any) -> torch.Tensor:
        if isinstance(record, _Kept):
            t = record.tensor
            if t._version != record.version:
                raise _modified(t.type(), t.shape, t._version, record.version)
            return t
        if record.witness._version != record.version:
            w = record.witness
            raise _modified(w.type(), record.host.shape, w._version, record.version)
        value = self._bring(record)
        previous = record.previous() if record.previous is not None else None
        if previous is not None:
            self._start_back(previous)  # prefetch what backward needs next
        return value

    def _bring(self, record: _Saved) -> torch.Tensor:
        """The saved tensor on its device: rebuilt on its storage brought back, which the
        tensors saved from the same storage share (they alias as in the forward), held here
        until each of them was unpacked."""
        copy = record.copy
        if copy.device is not None:  # still held (its copy in flight): the same values
            return _placed(record.host, copy.device.untyped_storage())
        with self._lock:
            if copy.restored is None:
                if not self._streamed(record.where):
                    copy.restored = copy.buffer.clone()  # its own: the buffer outlives no graph
                else:
                    self._poll()
                    self._start_back(record)
                    (copy.restored, event), copy.back = copy.back, None
                    torch.cuda.current_stream(record.where).wait_event(event)
            value = _placed(record.host, copy.restored.untyped_storage())
            copy.unpacked += 1
            if copy.unpacked >= copy.users:  # each record has it: the graph holds it from now on
                copy.restored, copy.unpacked = None, 0
        return value

    def _start_back(self, record: _Saved) -> None:
        copy, where = record.copy, record.where
        if (
            not self._streamed(where)
            or copy.back is not None
            or copy.device is not None
            or copy.restored is not None
        ):
            return
        device = torch.empty(copy.nbytes, dtype=torch.uint8, device=where)
        stream = self._side(where)
        stream.wait_stream(torch.cuda.current_stream(where))
        with torch.cuda.stream(stream):
            device.copy_(copy.buffer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        device.record_stream(stream)  # freed before its copy is done: not reused under it
        copy.back = (device, event)

    @staticmethod
    def _streamed(device: torch.device) -> bool:
        """Copies of this device's tensors run on a side stream (CUDA); else they are made at
        once (CPU). Tests stand CPU in for CUDA through it, with stand-in streams."""
        return device.type == "cuda"

    def _side(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    @property
    def _saved(self) -> list[tuple[torch.Tensor, _Saved]]:
        """The latest entry's records still held by a graph, as (host copy, record) pairs in
        save order (tests reach the host copies through it)."""
        records = [r() for r in self._entry]
        return [(r.host, r) for r in records if r is not None]
