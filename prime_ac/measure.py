"""Deterministic measurements of one training step: memory held for backward, replayed work.

Counting beats timing on shared machines: bytes held between forward and backward, operators
dispatched during backward and their FLOPs are exact and repeatable. A checkpointed step's
backward runs the same backward operators as the unwrapped step plus its recomputed forward
operators, so differences against the unwrapped step are the replayed work.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from prime_ac._compat import (
    FSDP_ALL_GATHER_COPY_IN,
    OpOverload,
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    tree_leaves,
)
from prime_ac.actions import IGNORED_OPS

__all__ = [
    "CallTimer",
    "OpCounter",
    "PeakTracker",
    "StepStats",
    "StorageTracker",
    "copy_bandwidth",
    "grads_preserved",
    "measure_peak",
    "measure_step",
    "operator_flops",
    "rng_states_counted",
    "storages",
    "track_step",
    "track_step_by_block",
    "track_step_by_device",
]


def _grouped_mm_flops(func, args, kwargs, out) -> int:
    """``_grouped_mm`` / ``_scaled_grouped_mm``: 2 FLOPs per multiply-add of every group.

    Groups run along M (2D ``a`` [M_total, K] with 3D ``b`` [G, K, N]), along a batch (both 3D),
    or along K (both 2D: ``a`` [M, K_total], ``b`` [K_total, N], out [G, M, N]). Counted from
    shapes, as torch's formulas are: rows past the last offset (padding) count too.
    """
    a, b = args[0], args[1]
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out.numel() * a.shape[-1]


def _attention_flops(func, args, kwargs, out) -> int:
    """CPU flash attention: ``q @ k^T`` and ``p @ v`` per batch and query head.

    torch has no formula for the CPU kernel; its CUDA flash formula asserts equal query and key
    head counts before torch 2.10, which grouped-query attention does not have.
    """
    q, k, v = args[:3]  # [B, H, S, D]; k and v may have fewer heads
    batch, heads, s_q, d_qk = q.shape
    return 2 * batch * heads * s_q * k.shape[-2] * (d_qk + v.shape[-1])


# For operators torch.utils.flop_counter has no formula for (it would count 0 FLOPs), keyed by
# overload packet or higher-order operator; torch's own formula wins where a release has one.
_FORMULAS = {
    torch.ops.aten._grouped_mm: _grouped_mm_flops,
    torch.ops.aten._scaled_grouped_mm: _grouped_mm_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    torch.ops.higher_order.flex_attention: _attention_flops,  # torch < 2.10 has no formula
}


def operator_flops(func, args, kwargs, out) -> int:
    """FLOPs of one operator call: torch.utils.flop_counter's formula, else prime_ac's own
    (grouped GEMMs, CPU flash attention, flex_attention on older torch); 0 when neither has one.
    Higher-order operators are looked up by the operator itself."""
    # imported here: torch.utils.flop_counter imports triton when it is installed
    from torch.utils.flop_counter import flop_registry

    packet = getattr(func, "_overloadpacket", func)
    formula = flop_registry.get(packet)
    if formula is not None:
        return formula(*args, **(kwargs or {}), out_val=out)
    own = _FORMULAS.get(packet)
    return 0 if own is None else own(func, args, kwargs or {}, out)


def storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``tensor``'s data on this process.

    A wrapper subclass such as a DTensor has no storage of its own (asking raises "invalid
    python storage"): its local tensors are asked instead, so a sharded tensor counts its shard.
    Meta tensors hold no memory.
    """
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        return [s for t in inner if isinstance(t, torch.Tensor) for s in storages(t)]
    if tensor.device.type == "meta":
        return []
    return [tensor.untyped_storage()]


def _lives_at(table: dict[int, weakref.ref], ptr: int) -> bool:
    """Whether the storage recorded at address ``ptr`` is still alive there."""
    ref = table.get(ptr)
    storage = ref() if ref is not None else None
    return storage is not None and storage.data_ptr() == ptr


class StorageTracker(TorchDispatchMode):
    """Records every storage that operators create while active.

    ``held_bytes()`` is then the size of those still alive: what the forward left behind for the
    backward, autograd's saved tensors and SAC's cache alike (both hold the storages).
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref] = {}
        self._preexisting: dict[int, weakref.ref] = {}
        self.owner: str | None = None  # who creates the storages now (see track_step_by_block)
        self._owners: dict[int, str | None] = {}

    def exclude(self, tensors) -> None:
        """Storages that existed before (parameters, inputs) are never counted, views included."""
        self._preexisting.update(
            (s.data_ptr(), weakref.ref(s)) for t in tensors for s in storages(t)
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(func, OpOverload) and func.name() == FSDP_ALL_GATHER_COPY_IN:
            # FSDP2's all-gather buffer: scratch that a finished collective may still hold
            self.forget(out)
            self.exclude(out)
            return out
        for leaf in tree_leaves(out):
            for storage in storages(leaf) if isinstance(leaf, torch.Tensor) else ():
                ptr = storage.data_ptr()
                # An address is reused once its storage dies or is resized away (FSDP frees its
                # gathered parameters so): track the storage living there now.
                if not _lives_at(self._preexisting, ptr) and not _lives_at(self._storages, ptr):
                    self._storages[ptr] = weakref.ref(storage)
                    self._owners[ptr] = self.owner
        return out

    def forget(self, tensors) -> None:
        """Stop counting the storages of ``tensors`` (the loss; parameters FSDP gathered)."""
        for t in tensors:
            for storage in storages(t):
                self._storages.pop(storage.data_ptr(), None)

    def held_bytes(self) -> int:
        return sum(self.held_bytes_by_device().values())

    def held_bytes_by_device(self) -> dict[str, int]:
        """Held bytes per device (``"cuda:0"``, ``"cpu"``): activation offloading moves bytes
        from the accelerator to the host, which one total would hide. Storages a saved-tensor
        hook creates (``save_on_cpu``'s host copies) count where they live; data a hook moves
        out of torch storages (to disk, to a foreign buffer) no longer counts. Empty storages
        hold nothing and name no device: torch 2.9's checkpoint (not 2.13's) makes a 0-element
        tensor per checkpointed call (``_NoopSaveInputs``'s output), which must not add a
        ``"cpu": 0``."""
        held: dict[str, int] = {}
        for storage in self._alive().values():
            device = str(storage.device)
            held[device] = held.get(device, 0) + storage.nbytes()
        return dict(sorted(held.items()))

    def held_bytes_by_owner(self, collect: bool = True) -> dict[str | None, int]:
        """Held bytes per owner: the storages created while ``owner`` was set to it.
        ``collect=False`` right after another reading, which collected the garbage (a full
        collection walks every Python object: 0.3 s once torch._dynamo is imported)."""
        held: dict[str | None, int] = {}
        for ptr, storage in self._alive(collect).items():
            owner = self._owners.get(ptr)
            held[owner] = held.get(owner, 0) + storage.nbytes()
        return held

    def _alive(self, collect: bool = True) -> dict[int, torch.UntypedStorage]:
        if collect:  # storages only a reference cycle holds are garbage, not held
            gc.collect()
        alive = {}
        for ptr, ref in self._storages.items():
            storage = ref()
            if storage is not None and storage.nbytes() > 0:
                alive[ptr] = storage
        return alive


class OpCounter(TorchDispatchMode):
    """Counts dispatched operator overloads and their FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.counts[func] += 1
        self.flops += operator_flops(func, args, kwargs, out)
        return out


@dataclass
class StepStats:
    loss: float
    held_bytes: int  # storages created in forward and alive at backward start (loss excluded)
    forward_flops: int
    backward_flops: int  # includes recompute under checkpointing
    backward_ops: Counter = field(repr=False)
    wall_s: float
    grads: dict[str, torch.Tensor] = field(repr=False)


def track_step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> tuple[int, int]:
    """Run one step; return (bytes held when backward starts, FLOPs of the forward).

    :func:`track_step_by_device` splits the held bytes per device.
    """
    held, flops = track_step_by_device(model, loss_fn)
    return sum(held.values()), flops


def track_step_by_device(
    model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]
) -> tuple[dict[str, int], int]:
    """Run one step; return (bytes held when backward starts per device, FLOPs of the forward).

    Held bytes are the storages the forward created that are still alive once it returns, the
    loss itself excluded: what the model keeps for backward, under any checkpoint policy.
    Parameters never count, whether they existed before (sharded or not) or were gathered during
    the forward (FSDP2 modules not resharded after it), nor do FSDP2's all-gather buffers.
    """
    tracker, counter = StorageTracker(), OpCounter()
    tracker.exclude([*model.parameters(), *model.buffers()])
    with tracker, counter:
        loss = loss_fn(model)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"loss_fn must return the loss tensor to run backward on, got {type(loss).__name__}"
        )
    tracker.forget([loss, *model.parameters(), *model.buffers()])
    held = tracker.held_bytes_by_device()
    loss.backward()
    return held, counter.flops


def track_step_by_block(
    model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], blocks: dict[str, nn.Module]
) -> tuple[dict[str, int], dict[str, int], int]:
    """:func:`track_step_by_device`, plus the held bytes each of ``blocks`` (by name) created.

    Run without checkpointing, a block's share is what autograd holds for it without AC: the
    storages its forward created that are alive when backward starts (its inputs excluded).
    """
    tracker, counter = StorageTracker(), OpCounter()
    tracker.exclude([*model.parameters(), *model.buffers()])
    hooks = []
    for name, block in blocks.items():
        hooks.append(block.register_forward_pre_hook(functools.partial(_own, tracker, name)))
        hooks.append(
            block.register_forward_hook(functools.partial(_disown, tracker), always_call=True)
        )
    try:
        with tracker, counter:
            loss = loss_fn(model)
    finally:
        for hook in hooks:
            hook.remove()
    tracker.forget([loss, *model.parameters(), *model.buffers()])
    held = tracker.held_bytes_by_device()
    by_owner = tracker.held_bytes_by_owner(collect=False)  # the same instant: one collection
    loss.backward()
    return held, {name: by_owner.get(name, 0) for name in blocks}, counter.flops


def _own(tracker: StorageTracker, name: str, module: nn.Module, args: Any) -> None:
    tracker.owner = name


def _disown(tracker: StorageTracker, module: nn.Module, args: Any, out: Any) -> None:
    tracker.owner = None


def measure_step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> StepStats:
    """Run ``loss_fn(model).backward()`` three times: timed, memory-tracked, counted.

    Gradients come from the timed run, which runs under no extra mode.
    """
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = loss_fn(model)
    loss.backward()
    wall = time.perf_counter() - start
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    held, forward_flops = track_step(model, loss_fn)

    model.zero_grad(set_to_none=True)
    counted = loss_fn(model)
    backward = OpCounter()
    with backward:
        counted.backward()
    model.zero_grad(set_to_none=True)
    return StepStats(
        loss=loss.item(),
        held_bytes=held,
        forward_flops=forward_flops,
        backward_flops=backward.flops,
        backward_ops=backward.counts,
        wall_s=wall,
        grads=grads,
    )


class PeakTracker(TorchDispatchMode):
    """A storage ledger: the bytes of the storages operators created that are alive, at every
    operator, and the most they reached (``peak``) less what ``host_bytes()`` says lives in
    host copies (offloaded results on CPU, :class:`prime_ac.offload.Ledger`). An output in the
    storage of one of its operator's inputs (a view, an in-place or ``out=`` write) created
    nothing: a weight's transpose in every linear layer is not new memory. ``states`` adds the
    bytes no operator creates: the RNG states checkpointed blocks save
    (:func:`rng_states_counted`)."""

    def __init__(self, host_bytes: Callable[[], int] = lambda: 0) -> None:
        super().__init__()
        self.host_bytes = host_bytes
        self.alive = self.peak = self.states = 0
        self._seen: set[int] = set()

    def held(self) -> int:
        """What the step holds now: live storages and saved RNG states, less the host copies."""
        return self.alive + self.states - self.host_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            storage._cdata
            for leaf in tree_leaves((args, kwargs))
            if isinstance(leaf, torch.Tensor)
            for storage in storages(leaf)
        }
        for leaf in tree_leaves(out):
            for storage in storages(leaf) if isinstance(leaf, torch.Tensor) else ():
                key = storage._cdata  # the StorageImpl's address (see _compat.storage_id)
                if key in self._seen or key in inputs or storage.nbytes() == 0:
                    continue
                self._seen.add(key)
                self.alive += storage.nbytes()
                weakref.finalize(storage, self._freed, key, storage.nbytes())
        self.peak = max(self.peak, self.held())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.alive -= nbytes


@contextlib.contextmanager
def grads_preserved(model: nn.Module) -> Iterator[None]:
    """The model's parameter gradients set aside while a measuring step runs, put back after.

    Backward accumulates into an existing ``.grad`` in place, so the step starts from None
    (its numbers are the step's alone) and the gradients the model held (accumulated
    micro-batches) come back as they were, whether the step returns or raises.
    """
    saved = {p: p.grad for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    try:
        yield
    finally:
        for p, g in saved.items():
            p.grad = g


@contextlib.contextmanager
def rng_states_counted(tracker: PeakTracker, blocks: Iterable[nn.Module]) -> Iterator[None]:
    """Count in ``tracker`` the CPU RNG state torch's checkpoint saves in each forward of
    ``blocks`` (checkpointed with ``preserve_rng_state``): ``torch.get_rng_state`` makes it
    outside the dispatcher, so no operator shows it (5,056 bytes with torch's CPU generator).
    Held from the block's forward until the gradient of its input arrives, when its backward
    is done (to the end of the step where no input needs a gradient)."""
    size = torch.get_rng_state().numel()

    def release(handle: list, grad: torch.Tensor) -> None:
        tracker.states -= size
        handle[0].remove()

    def saved(module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tracker.states += size
        first = next(
            (t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad), None
        )
        if first is not None:
            handle: list = []
            handle.append(first.register_hook(functools.partial(release, handle)))

    hooks = [block.register_forward_pre_hook(saved) for block in blocks]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def measure_peak(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], torch.Tensor],
    host_bytes: Callable[[], int] = lambda: 0,
    rng_blocks: Iterable[nn.Module] = (),
) -> int:
    """The most activation memory one step ``loss_fn(model).backward()`` held at once.

    On CUDA: ``torch.cuda.max_memory_allocated`` less what was allocated before the step. On
    CPU: :class:`PeakTracker`'s storage ledger (host copies of offloaded results excluded),
    with the RNG state each of ``rng_blocks`` saves per forward (:func:`rng_states_counted`;
    the checkpointed blocks that preserve RNG states).
    A parameter without a gradient gets one of zeros first, so the weight gradients accumulate
    into memory the model holds anyway and the peak is what the activations (and the gradients
    flowing between them) add; the gradients are the step's, added to those zeros.
    """
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss_fn(model).backward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    tracker = PeakTracker(host_bytes)
    with rng_states_counted(tracker, rng_blocks), tracker:
        loss = loss_fn(model)
        loss.backward()
    return tracker.peak


class CallTimer(TorchDispatchMode):
    """The time each operator call of each block's forward took on the device where it ran:
    CUDA events around every call, read once the step is done (:meth:`seconds`).

    Calls are named as the audit names them, ``(block, operator, index among the block's calls
    of that operator)`` (operators the checkpoint modes ignore not counted); only forwards are
    timed (a block's recompute runs outside its module call). ``event`` makes the events (a
    stand-in in tests); enter it only on CUDA, where a call's time is not its FLOPs.
    """

    def __init__(self, blocks: list[tuple[str, nn.Module]], event: Callable[[], Any] | None = None):
        super().__init__()
        self.event = event or functools.partial(torch.cuda.Event, enable_timing=True)
        self.blocks = blocks
        self.block: str | None = None
        self.positions: Counter = Counter()
        self.events: dict[tuple[str, Any, int], tuple[Any, Any]] = {}
        self._hooks: list[Any] = []

    def __enter__(self):
        for name, block in self.blocks:
            self._hooks.append(block.register_forward_pre_hook(functools.partial(self._in, name)))
            self._hooks.append(block.register_forward_hook(self._out, always_call=True))
        return super().__enter__()

    def __exit__(self, *exc: Any):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return super().__exit__(*exc)

    def _in(self, name: str, module: nn.Module, args: Any) -> None:
        self.block = name
        self.positions = Counter()

    def _out(self, module: nn.Module, args: Any, out: Any) -> None:
        self.block = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.block is None or func in IGNORED_OPS:
            return func(*args, **(kwargs or {}))
        key = (self.block, func, self.positions[func])
        self.positions[func] += 1
        start, end = self.event(), self.event()
        start.record()
        out = func(*args, **(kwargs or {}))
        end.record()
        self.events.setdefault(key, (start, end))  # a second forward: the first one counts
        return out

    def seconds(self) -> dict[tuple[str, Any, int], float]:
        """Each timed call's seconds (waits for the device once)."""
        for _, end in self.events.values():
            end.synchronize()
        return {key: start.elapsed_time(end) / 1e3 for key, (start, end) in self.events.items()}


# MiB copied each way when timing the host link
_PROBE_BYTES = 64 << 20


@functools.cache
def copy_bandwidth(device: torch.device | None = None) -> float | None:
    """Bytes/s of a pinned host copy to and from ``device`` (the slower way), timed with CUDA
    events once per process and device; None off CUDA (the planner's stated default applies)."""
    if device is None or device.type != "cuda":
        return None
    host = torch.empty(_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)  # warm-up: the first copy pays for setup
    host.copy_(dev, non_blocking=True)
    times = []
    for dest, source in ((dev, host), (host, dev)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            dest.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / 3)
    return _PROBE_BYTES / max(max(times), 1e-9)
