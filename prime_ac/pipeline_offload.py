"""Activation offloading between a pipeline stage's forward and backward (prime-rl's
``PipelineActivationOffloadConfig``, for its Async1F1B / DualPipeV schedules).

A pipeline stage holds each in-flight micro-batch's activations from its forward to its backward,
most of that time idle. What the stage holds for backward, under block checkpointing, is what was
passed into the stage and into each block: forward pre-hooks on the stage's modules and its
``layers`` / ``engrams`` blocks collect those tensors (storages of at least ``min_bytes``, no
parameters, not the stage's outputs, which are being sent) while :meth:`forward` is entered for a
micro-batch ``(stage, micro_batch)``. :meth:`swap_out` copies each storage to host memory and
empties it in place (``storage.resize_(0)``), so every tensor on it keeps its identity: autograd's
saved tensors, the stage's cached inputs and receive buffers need no change. :meth:`prefetch`
refills the storages ``prefetch_ahead`` schedule operations before the micro-batch's backward and
:meth:`wait` makes the compute stream wait for them. On CUDA the copies run on two side streams
into pinned host buffers, pooled by size so later steps allocate none; on CPU they are made at
once (the tests' stand-in). ``host_cap`` bounds the host bytes held: a storage that does not fit
stays on the device (counted in ``ledger.overflowed``).

``target="fp8"`` keeps the activations on the device, compressed: a bf16 tensor becomes FP8 e4m3
values with one fp32 scale (amax / 448) per 128 consecutive values, 0.53x its bytes. It is lossy
(each value within 1/16 of itself, plus 2**-9 of its group's scale), so it is never the default.

:func:`offload_plan` picks, from a rank's operations in schedule order, the micro-batches whose
backward is more than ``prefetch_ahead`` operations after their forward on an offloading stage,
and where to prefetch each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from prime_ac.offload import Ledger

__all__ = ["PipelineActivationOffload", "PipelineOffloadConfig", "offload_plan"]

Key = tuple[int, int]  # (stage, micro-batch)
Op = tuple[str, int, int]  # ("F" | "B", stage, micro-batch)

_FP8_GROUP = 128
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_TARGETS = ("host", "fp8")


@dataclass(frozen=True)
class PipelineOffloadConfig:
    """prime-rl's ``PipelineActivationOffloadConfig`` with its meaning: ``min_bytes`` (64 MiB) the
    smallest storage moved, ``prefetch_ahead`` (2) how many schedule operations before a
    micro-batch's backward its activations start coming back (micro-batches whose backward
    follows sooner stay), ``stages`` the stages that offload (None: all), ``target`` "host" or
    the lossy "fp8". prime_ac's own: ``host_cap`` (bytes of host memory held at most; None: no
    bound) and ``pin_memory``."""

    min_bytes: int = 64 * 2**20
    prefetch_ahead: int = 2
    stages: tuple[int, ...] | None = None
    target: str = "host"
    host_cap: int | None = None
    pin_memory: bool = True

    def __post_init__(self) -> None:
        for name, low in (("min_bytes", 1), ("prefetch_ahead", 1), ("host_cap", 0)):
            value = getattr(self, name)
            if value is None and name == "host_cap":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"pp_activation_offload.{name}={value!r} must be an integer >= {low}"
                    + (" (or None: no bound)" if name == "host_cap" else "")
                )
        if self.stages is not None:
            if isinstance(self.stages, (str, bytes)) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.stages
            ):
                raise ValueError(
                    f"pp_activation_offload.stages={self.stages!r} must be a list of stage "
                    "indices (ints >= 0), or None for every stage"
                )
            object.__setattr__(self, "stages", tuple(self.stages))
        if self.target not in _TARGETS:
            raise ValueError(
                f"pp_activation_offload.target={self.target!r} must be 'host' (pinned host "
                "memory) or 'fp8' (lossy: FP8 e4m3 on the device, one scale per 128 values)"
            )
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"pp_activation_offload.pin_memory={self.pin_memory!r} must be a bool")

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> PipelineOffloadConfig:
        """prime-rl's ``[trainer.model.pp_activation_offload]`` table (unknown keys raise)."""
        if not isinstance(table, Mapping):
            raise ValueError(
                f"pp_activation_offload={table!r} must be a table of {sorted(PIPELINE_KEYS)}"
            )
        unknown = sorted(set(table) - set(PIPELINE_KEYS))
        if unknown:
            raise ValueError(
                f"unknown pp_activation_offload key(s) {unknown}: accepted keys are "
                f"{sorted(PIPELINE_KEYS)}"
            )
        return cls(**table)


PIPELINE_KEYS = ("min_bytes", "prefetch_ahead", "stages", "target", "host_cap", "pin_memory")


def offload_plan(
    run_ops: Sequence[Op], stages: Iterable[int] | None, prefetch_ahead: int
) -> tuple[set[Key], dict[int, list[Key]]]:
    """For a rank's operations in schedule order: the ``(stage, micro_batch)`` forwards to
    offload (their backward more than ``prefetch_ahead`` operations later, on a stage of
    ``stages``; None: every stage) and, per operation index, the micro-batches to prefetch
    right before it (``prefetch_ahead`` operations ahead of their backward)."""
    allowed = None if stages is None else set(stages)
    position = {op: i for i, op in enumerate(run_ops)}
    offloaded: set[Key] = set()
    prefetch_at: dict[int, list[Key]] = {}
    for (kind, stage, mb), i in position.items():
        if kind != "F" or (allowed is not None and stage not in allowed):
            continue
        backward = position.get(("B", stage, mb))
        if backward is not None and backward - i > prefetch_ahead:
            offloaded.add((stage, mb))
            prefetch_at.setdefault(backward - prefetch_ahead, []).append((stage, mb))
    return offloaded, prefetch_at


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over ``storage``, with a version counter of its own (writing through
    it does not look like an in-place write of the tensors autograd saved)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _compressible(t: torch.Tensor) -> bool:
    return (
        t.dtype == torch.bfloat16
        and t.is_contiguous()
        and t.dim() > 0
        and t.shape[-1] % _FP8_GROUP == 0
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def quantize_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 values of a contiguous bf16 tensor and one fp32 scale (amax / 448) per 128
    consecutive values, computed where ``t`` is."""
    groups = t.detach().reshape(-1, _FP8_GROUP).float()
    scale = groups.abs().amax(dim=1).clamp(min=1e-12) / _FP8_MAX
    q = (groups / scale[:, None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(-1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``q * scale`` into ``out`` (bf16) through an alias of its storage, so the
    tensors autograd saved see no in-place write."""
    values = (q.reshape(-1, _FP8_GROUP).float() * scale[:, None]).to(torch.bfloat16)
    alias = torch.empty(0, dtype=out.dtype, device=out.device)
    alias.set_(out.untyped_storage(), 0, out.shape, out.stride())
    alias.copy_(values.reshape(out.shape))


class _Collecting:
    def __init__(self, owner: PipelineActivationOffload, key: Key):
        self.owner, self.key = owner, key

    def __enter__(self) -> None:
        self.owner._collecting = self.key

    def __exit__(self, *exc: Any) -> None:
        self.owner._collecting = None


class PipelineActivationOffload:
    """prime-rl's ``PipelineActivationOffloader`` on prime_ac's offload engine: the schedule
    enters :meth:`forward` around a micro-batch's forward, calls :meth:`swap_out` right after
    it, :meth:`prefetch` where :func:`offload_plan` says and :meth:`wait` right before the
    backward. ``model_parts`` are the stage modules this rank holds.

    ``ledger.host`` counts the host bytes held (``peak_host`` the most), ``ledger.device`` the
    bytes of FP8 copies held on the device (``target="fp8"``), ``ledger.offloaded`` the
    storages moved and ``ledger.overflowed`` those ``host_cap`` left in place;
    ``buffer_allocations`` the host buffers allocated (the pool serves the rest).
    """

    def __init__(
        self, model_parts: Iterable[nn.Module], config: PipelineOffloadConfig | None = None
    ):
        self.config = PipelineOffloadConfig() if config is None else config
        self.ledger = Ledger()
        self.buffer_allocations = 0
        self._collecting: Key | None = None
        self._candidates: dict[Key, dict[int, torch.Tensor]] = {}
        # per offloaded micro-batch: (storage, host buffer, nbytes) / (tensor, fp8 values, scales)
        self._host: dict[Key, list[tuple[torch.UntypedStorage, torch.Tensor, int]]] = {}
        self._fp8: dict[Key, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._returned: dict[Key, tuple[Any, list[torch.Tensor], list[torch.Tensor]]] = {}
        self._pool: dict[tuple[int, bool], list[tuple[torch.Tensor, Any]]] = {}
        self._streams: Any = None
        self._handles = []
        for part in model_parts:
            for module in (part, *_blocks(part)):
                self._handles.append(
                    module.register_forward_pre_hook(self._collect, with_kwargs=True)
                )

    def plan(self, run_ops: Sequence[Op]) -> tuple[set[Key], dict[int, list[Key]]]:
        """:func:`offload_plan` with this configuration's stages and ``prefetch_ahead``."""
        return offload_plan(run_ops, self.config.stages, self.config.prefetch_ahead)

    def close(self) -> None:
        """Remove the hooks (the model then runs as if never offloaded)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --- forward ------------------------------------------------------------------------------

    def _collect(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._collecting is None:  # a recompute in backward, or a forward not offloaded
            return
        found = self._candidates.setdefault(self._collecting, {})
        for t in tree_flatten((args, kwargs))[0]:
            if (
                isinstance(t, torch.Tensor)
                and not isinstance(t, nn.Parameter)
                and t.layout == torch.strided
                and t.device.type in ("cpu", "cuda")
                and t.untyped_storage().nbytes() >= self.config.min_bytes
            ):
                found.setdefault(t.untyped_storage().data_ptr(), t)

    def forward(self, key: Key) -> contextlib.AbstractContextManager:
        """The context of micro-batch ``key``'s forward: what is passed into the stage and its
        blocks is collected."""
        return _Collecting(self, key)

    def swap_out(self, key: Key, output: Any) -> None:
        """Move micro-batch ``key``'s collected storages off the device, emptying them in place
        (its outputs, still being sent, stay)."""
        candidates = self._candidates.pop(key, {})
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor):
                candidates.pop(t.untyped_storage().data_ptr(), None)
        if key in self._host or key in self._fp8:
            raise RuntimeError(f"micro-batch {key} is offloaded already: wait({key}) first")
        if self.config.target == "fp8":
            self._fp8[key] = [self._compress(t) for t in candidates.values() if _compressible(t)]
            return
        cap = self.config.host_cap
        pairs = []
        for t in candidates.values():
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0:  # emptied already (offloaded under another key)
                continue
            if cap is not None and self.ledger.host + nbytes > cap:
                self.ledger.overflowed += 1
                continue
            flat = _bytes(storage)
            host = self._buffer(nbytes, flat.device)
            if flat.is_cuda:
                d2h = self._stream(0)
                d2h.wait_stream(torch.cuda.current_stream(flat.device))
                with torch.cuda.stream(d2h):
                    host.copy_(flat, non_blocking=True)
                flat.record_stream(d2h)  # the allocator reuses the memory after the copy only
            else:
                host.copy_(flat)
            storage.resize_(0)
            pairs.append((storage, host, nbytes))
            self.ledger.offloaded += 1
            self.ledger.add(host=nbytes)
        self._host[key] = pairs

    def _compress(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, scale = quantize_fp8(t)
        t.untyped_storage().resize_(0)
        self.ledger.offloaded += 1
        self.ledger.add(device=q.numel() + 4 * scale.numel())
        return t, q, scale

    # --- backward -----------------------------------------------------------------------------

    def prefetch(self, key: Key) -> None:
        """Start refilling micro-batch ``key``'s storages (CUDA: on the inbound side stream)."""
        compressed = self._fp8.pop(key, None)
        if compressed is not None:  # on the compute stream: back before anything reads it
            for t, q, scale in compressed:
                t.untyped_storage().resize_(t.numel() * t.element_size())
                dequantize_fp8(q, scale, t)
                self.ledger.add(device=-(q.numel() + 4 * scale.numel()))
            return
        pairs = self._host.pop(key, None)
        if pairs is None:
            return
        flats, hosts = [], []
        cuda = any(storage.device.type == "cuda" for storage, _, _ in pairs)
        h2d = self._stream(1) if cuda else None
        if cuda:  # the host copies must be complete before they are read back
            h2d.wait_stream(self._stream(0))
        # CUDA: the storages are allocated from the copy stream's pool, not the compute stream's
        with torch.cuda.stream(h2d) if cuda else contextlib.nullcontext():
            for storage, host, nbytes in pairs:
                storage.resize_(nbytes)
                flat = _bytes(storage)
                flat.copy_(host, non_blocking=cuda)
                flats.append(flat)
                hosts.append(host)
        event = h2d.record_event() if cuda else None
        self._returned[key] = (event, flats, hosts)
        self.ledger.add(host=-sum(nbytes for _, _, nbytes in pairs))

    def wait(self, key: Key) -> None:
        """Right before micro-batch ``key``'s backward: its storages are back (prefetched now if
        the schedule did not)."""
        if key in self._host or key in self._fp8:
            self.prefetch(key)
        returned = self._returned.pop(key, None)
        if returned is None:
            return
        event, flats, hosts = returned
        if event is not None:
            compute = torch.cuda.current_stream(flats[0].device)
            compute.wait_event(event)
            for flat in flats:  # freed after the backward that reads it, not before
                flat.record_stream(compute)
        for host in hosts:  # reused by an outbound copy queued after this inbound one
            self._pool.setdefault((host.numel(), host.is_pinned()), []).append((host, event))

    def pending(self) -> list[Key]:
        """The micro-batches whose activations are off the device now."""
        return sorted({*self._host, *self._fp8})

    # --- host buffers -------------------------------------------------------------------------

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        pinned = device.type == "cuda" and self.config.pin_memory
        free = self._pool.get((nbytes, pinned))
        if free:
            host, event = free.pop()
            if event is not None:  # its inbound copy must be done before it is written again
                self._stream(0).wait_event(event)
            return host
        self.buffer_allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def _stream(self, index: int) -> Any:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())  # outbound, inbound
        return self._streams[index]


def _blocks(part: nn.Module) -> Iterator[nn.Module]:
    """The stage's ``layers`` and ``engrams`` blocks (prime-rl's), on the part or on its
    language model (``part.model``, ``part.language_model``, ``part.model.language_model``)."""
    seen: set[int] = set()
    for holder in (
        part,
        getattr(part, "model", None),
        getattr(part, "language_model", None),
        getattr(getattr(part, "model", None), "language_model", None),
    ):
        if not isinstance(holder, nn.Module):
            continue
        for name in ("layers", "engrams"):
            container = getattr(holder, name, None)
            if isinstance(container, nn.Module) and id(container) not in seen:
                seen.add(id(container))
                yield from container.children()
