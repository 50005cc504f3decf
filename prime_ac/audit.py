"""``prime_ac.audit``: what the policy in effect keeps, what it replays, and what that costs.

The audit runs one training step through the wrapped blocks with recording versions of
prime_ac's own checkpoint modes, so every number comes from the policy really in effect: the
decision is read from the checkpoint cache itself (kept or marked for replay), kept bytes are the
cached outputs, and replays are the operators the recompute actually re-executes.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from prime_ac import _compat
from prime_ac._compat import tree_leaves
from prime_ac.actions import Action
from prime_ac.compiled import compiled_blocks, compiled_readings, eager_forwards
from prime_ac.diagnostics import inputs_seen, unseen_bytes
from prime_ac.measure import (
    grads_preserved,
    operator_flops,
    track_step_by_block,
    track_step_by_device,
)
from prime_ac.modes import ReplayMode, written_tensors
from prime_ac.planner import group_names, grouped
from prime_ac.scopes import ScopeTracker
from prime_ac.store import RegionStore
from prime_ac.targets import TargetSet, operator_key
from prime_ac.watch import MeasuringKeepMode, worse
from prime_ac.wrapping import (
    BlockCheckpoint,
    checkpoint_state,
    checkpointing_disabled,
    wrap_block,
    wrapped_blocks,
)

__all__ = ["AuditReport", "CallRecord", "OpRecord", "audit", "op_name"]

LossFn = Callable[[nn.Module], torch.Tensor]


def op_name(op: Any) -> str:
    """The target string naming exactly this overload (``aten::mm.default``)."""
    ns, name, overload = operator_key(op)
    return f"{ns}::{name}" + (f".{overload}" if overload else "")


def _bytes(out: Any) -> int:
    return sum(
        t.untyped_storage().nbytes()
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.device.type != "meta"
    )


@dataclass
class CallRecord:
    """One operator call in one block's forward: the unit the budget planner chooses over."""

    op: Any
    index: int  # how many calls of this overload came before it in the block's forward
    decision: str  # "kept", "replayed", "mandatory" or "offloaded" (held on the host)
    bytes: int  # of its outputs
    flops: int
    replayed: bool = False  # re-executed by the recompute (it stops once backward has its inputs)
    scope: str = ""  # submodule path relative to the block ("" for the block's own code)

    def target(self) -> str:
        """The scoped target naming this call's operator in its submodule."""
        return f"{self.scope}/{op_name(self.op)}" if self.scope else op_name(self.op)


@dataclass
class OpRecord:
    block: str
    op: str
    decision: str
    calls: int = 0
    kept_bytes: int = 0
    replays: int = 0
    replayed_flops: int = 0
    offloaded_bytes: int = 0  # decision "offloaded": held on the host, not the device


@dataclass
class AuditReport:
    """One step's account of a checkpoint policy. ``str()`` is a table; ``to_json()`` JSON."""

    mode: str
    targets: list[str]
    blocks: list[str]
    ops: list[OpRecord]
    unmatched_targets: list[str]
    held_bytes: int  # alive between forward and backward, whole model
    held_bytes_no_ac: int
    forward_flops: int
    replayed_flops: int
    replayed_ops: int
    calls: dict[str, list[CallRecord]] = field(default_factory=dict, repr=False)
    # ``held_bytes`` split per device ("cuda:0", "cpu"): saved-tensor offloading moves bytes
    # from the accelerator to the host; kept outputs of selective regions stay where they were
    held_bytes_by_device: dict[str, int] = field(default_factory=dict)
    held_bytes_no_ac_by_device: dict[str, int] = field(default_factory=dict)
    # per block: bytes of the kept results (each storage once), and what the block holds for
    # backward without checkpointing (the storages its forward created alive when backward
    # starts, measured by the no-AC step)
    block_held_bytes: dict[str, int] = field(default_factory=dict)
    block_held_bytes_no_ac: dict[str, int] = field(default_factory=dict)
    # blocks that run without checkpointing since their first step held at least what no AC
    # holds for them (checkpoint_blocks' skip_worse): block -> the bytes that step measured
    blocks_bypassed: dict[str, str] = field(default_factory=dict)
    # blocks whose parameters got gradients while none of their forwards ran with gradients
    # enabled: something else (Reformer's reversible layers) recomputes them in backward, so
    # checkpointing them saves nothing (the same bytes in every mode)
    blocks_saving_nothing: list[str] = field(default_factory=list)
    # a peak budget (budget="24GiB"): (budget, predicted peak, measured peak or None) in bytes
    peak: tuple[int, int, int | None] | None = None
    # per block: the bytes of its tensor inputs (what its checkpoint saves to recompute from),
    # and of the kept results its budget plan offloads to host memory (among block_held_bytes)
    block_input_bytes: dict[str, int] = field(default_factory=dict)
    block_offloaded_bytes: dict[str, int] = field(default_factory=dict)
    # per block: the bytes autograd saved outside the blocks before its forward (an input
    # projection's, the embedding's): what the step holds beside the blocks there
    outside_bytes_before: dict[str, int] = field(default_factory=dict)
    # per compiled block: where its rows come from (its eager forward, with the policy or plan
    # that tags its compiled graph) and whether the graph's tags agree call for call
    # (prime_ac.compiled.compiled_readings)
    compiled_blocks: dict[str, str] = field(default_factory=dict)

    def blocks_worse_than_no_ac(self) -> list[str]:
        """Blocks whose kept results reach what no AC would hold for them, by the first step's
        rule (:func:`prime_ac.watch.worse`: at least ``REPORTED_BYTES`` kept): checkpointing
        them this way costs memory and compute both."""
        return [
            block
            for block, kept in self.block_held_bytes.items()
            if worse(kept, self.block_held_bytes_no_ac.get(block, 0))
        ]

    def block_kept_bytes(self) -> dict[str, int]:
        kept: dict[str, int] = defaultdict(int)
        for record in self.ops:
            kept[record.block] += record.kept_bytes
        return {block: kept[block] for block in self.blocks}

    def call_table(self, block: str | None = None) -> str:
        """One line per operator call of ``block`` (the first one by default), in forward order.

        The first column is a scoped target naming the call's operator in its submodule: copy it
        into ``targets`` to keep that call (``"!"`` in front to force its replay). ``#`` is the
        call's index among the block's calls of that operator.
        """
        block = self.blocks[0] if block is None else block
        if block not in self.calls:
            raise ValueError(f"block={block!r} is not an audited block: one of {self.blocks}")
        calls = self.calls[block]
        width = max([len(c.target()) for c in calls] + [len("scoped target")])
        lines = [
            f"{'scoped target':<{width}} {'#':>3} {'decision':<10} {'bytes':>11} {'replayed':>8} "
            f"{'FLOPs':>12}"
        ]
        for c in calls:
            lines.append(
                f"{c.target():<{width}} {c.index:>3} {c.decision:<10} {_mib(c.bytes):>11} "
                f"{'yes' if c.replayed else 'no':>8} {c.flops:>12}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        data = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "calls"
        }
        data["ops"] = [dataclasses.asdict(r) for r in self.ops]
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def to_html(self, path: str, measured_peak: int | None = None) -> None:
        """Write the step's memory as one self-contained HTML file (:mod:`prime_ac.report_html`);
        ``measured_peak`` in bytes where one was measured beside the audit."""
        from prime_ac.report_html import write

        write(self, path, measured_peak=measured_peak)

    def __str__(self) -> str:
        per_op: dict[tuple[str, str], OpRecord] = {}
        for r in self.ops:
            total = per_op.setdefault((r.op, r.decision), OpRecord("*", r.op, r.decision))
            total.calls += r.calls
            total.kept_bytes += r.kept_bytes
            total.replays += r.replays
            total.replayed_flops += r.replayed_flops
            total.offloaded_bytes += r.offloaded_bytes
        rows = sorted(per_op.values(), key=lambda r: (-r.kept_bytes, -r.replayed_flops, r.op))
        header = f"{'operator':<58} {'decision':<10} {'calls':>6} {'kept':>11} {'replays':>8} {'replayed FLOPs':>15}"
        lines = [
            f"prime_ac audit: mode={self.mode}, {len(self.blocks)} checkpointed blocks "
            f"({', '.join(self.blocks)})",
            header,
            "-" * len(header),
        ]
        for r in rows:
            lines.append(
                f"{r.op:<58} {r.decision:<10} {r.calls:>6} {_mib(r.kept_bytes):>11} "
                f"{r.replays:>8} {r.replayed_flops / 1e6:>10.2f} MFLOP"
            )
        lines += ["", f"{'block':<24} {'kept':>11} {'replays':>8} {'replayed FLOPs':>15}"]
        rows = []
        for block in self.blocks:
            records = [r for r in self.ops if r.block == block]
            row = (
                sum(r.kept_bytes for r in records),
                sum(r.replays for r in records),
                sum(r.replayed_flops for r in records),
            )
            rows.append((block, row, row))
        for names, (kept, replays, flops) in grouped(rows):  # "x4 layers.0-3": equal rows
            lines.append(
                f"{group_names(names):<24} {_mib(kept):>11} {replays:>8} {flops / 1e6:>10.2f} MFLOP"
                + (" each" if len(names) > 1 else "")
            )
        lines += [
            "",
            f"held for backward: {_mib(self.held_bytes)} of {_mib(self.held_bytes_no_ac)} without "
            f"AC ({self.held_bytes / max(self.held_bytes_no_ac, 1):.1%})",
            "held per device: "
            + (
                ", ".join(
                    f"{device} {_mib(self.held_bytes_by_device.get(device, 0))} of "
                    f"{_mib(self.held_bytes_no_ac_by_device.get(device, 0))}"
                    for device in sorted(
                        {*self.held_bytes_by_device, *self.held_bytes_no_ac_by_device}
                    )
                )
                or "none"
            ),
            f"offloaded: {sum(r.calls for r in self.ops if r.decision == 'offloaded')} operator "
            f"calls, {_mib(sum(r.offloaded_bytes for r in self.ops))} held on the host instead "
            "of the device",
            f"replayed: {self.replayed_ops} operator calls, {self.replayed_flops / 1e6:.2f} MFLOP "
            f"({self.replayed_flops / max(self.forward_flops, 1):.1%} of one forward)",
            "targets that matched nothing: " + (", ".join(self.unmatched_targets) or "none"),
            "blocks holding at least what no AC holds for them: "
            + (", ".join(self.blocks_worse_than_no_ac()) or "none"),
            "blocks run without checkpointing since their first step held at least what no AC "
            "holds: " + (", ".join(self.blocks_bypassed) or "none"),
            "blocks whose checkpointing saves nothing (they run without gradients, and backward "
            "recomputes them itself, as reversible layers do): "
            + (", ".join(self.blocks_saving_nothing) or "none"),
        ]
        for name, reading in self.compiled_blocks.items():
            lines.append(f"compiled block {name}: {reading}")
        if self.peak is not None:
            budget, predicted, measured = self.peak
            lines.append(
                f"peak activation memory: budget {_mib(budget)}, predicted {_mib(predicted)}, "
                f"measured {'not yet' if measured is None else _mib(measured)}"
            )
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


class _Recorder:
    def __init__(self) -> None:
        self.ops: dict[tuple[str, Any, str], OpRecord] = {}
        self.calls: dict[str, list[CallRecord]] = defaultdict(list)
        self.by_position: dict[tuple[str, Any, int], CallRecord] = {}
        self.seen: set[Any] = set()
        self.scopes = ScopeTracker()  # hooks on the blocks while recording: each call's module
        self.kept_bytes: dict[str, int] = {}  # block -> bytes of its kept results
        self.with_grad: set[str] = set()  # blocks that ran a checkpointed forward with gradients
        # block -> (offload_calls, offload_ops) of its store, where an offloader moves results
        self.offloads: dict[str, tuple[Any, Any]] = {}

    def record(self, block: str, op: Any, decision: str) -> OpRecord:
        # a budget plan can keep some calls of an overload and replay others: one row each
        key = (block, op, decision)
        if key not in self.ops:
            self.ops[key] = OpRecord(block, op_name(op), decision)
        return self.ops[key]


class _AuditKeepMode(MeasuringKeepMode):
    def __init__(self, store, rules, recorder: _Recorder, state: BlockCheckpoint):
        super().__init__(store, rules)
        self.recorder, self.state = recorder, state
        self.positions: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stored = self.store.stored
        offloader = self.store.offloader
        moved = offloader.ledger.offloaded if offloader is not None else 0
        out = super().__torch_dispatch__(func, types, args, kwargs)
        action = self.rules.action(func)
        if action is Action.IGNORE:
            return out
        index = self.positions[func]
        self.positions[func] += 1
        kept = self.store.stored != stored
        offloaded = offloader is not None and offloader.ledger.offloaded != moved
        decision = "offloaded" if offloaded else action.label(kept)
        # an out= operator returns nothing: what it wrote is its result (and what is kept)
        result = (
            written_tensors(self.rules.writes[func], args, kwargs or {})
            if action is Action.KEEP_WRITTEN
            else out
        )
        size, flops = _bytes(result), operator_flops(func, args, kwargs, out)
        self.recorder.seen.add(func)
        record = self.recorder.record(self.state.name, func, decision)
        record.calls += 1
        record.kept_bytes += size if kept and not offloaded else 0
        record.offloaded_bytes += size if offloaded else 0
        call = CallRecord(func, index, decision, size, flops, scope=self.recorder.scopes.path())
        self.recorder.calls[self.state.name].append(call)
        self.recorder.by_position[(self.state.name, func, index)] = call
        return out

    def ledger(self) -> None:  # the audit measures no AC by running it
        return None

    def measured(self) -> None:
        self.recorder.kept_bytes[self.state.name] = self.kept_bytes


class _AuditReplayMode(ReplayMode):
    record = True  # enter even when nothing was kept, to count the replays

    def __init__(self, store, rules, recorder: _Recorder, state: BlockCheckpoint):
        super().__init__(store, rules)
        self.recorder, self.state = recorder, state
        self.positions: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        hits = self.store.hits
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.rules.action(func) is Action.IGNORE:
            return out
        index = self.positions[func]
        self.positions[func] += 1
        call = self.recorder.by_position.get((self.state.name, func, index))
        if self.store.hits == hits and call is not None:  # re-executed, not handed back
            call.replayed = True
            record = self.recorder.record(self.state.name, func, "replayed")
            record.replays += 1
            record.replayed_flops += operator_flops(func, args, kwargs, out)
        return out


def _checkpointed_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks = wrapped_blocks(model)
    if not blocks:
        raise ValueError(
            "audit found no checkpointed block: call prime_ac.checkpoint_blocks(model, ...) first"
        )
    shadowed = [name for name, block in blocks if "forward" in block.__dict__]
    if shadowed:  # an instance forward (torchtitan's remat wrapper) runs instead of prime_ac's
        raise ValueError(
            f"audit: {shadowed} have an instance attribute forward set after "
            "checkpoint_blocks (torchtitan's block.forward = remat.checkpoint(...)?), which runs "
            "instead of prime_ac's checkpoint: there is no prime_ac policy to audit there. "
            "del block.forward (prime_ac's runs again), or let checkpoint_blocks come after "
            "torchtitan's AC (it takes the remat wrapper over)"
        )
    return blocks


@contextmanager
def _recording(blocks: list[tuple[str, nn.Module]], recorder: _Recorder) -> Iterator[None]:
    states = [(block, checkpoint_state(block)) for _, block in blocks]
    for block, state in states:
        wrap_block(
            block, dataclasses.replace(state, context_fn=_recording_contexts(state, recorder))
        )
    try:
        yield
    finally:
        for block, state in states:
            wrap_block(block, state)


def _recording_contexts(state: BlockCheckpoint, recorder: _Recorder):
    inner = state.context_fn

    def contexts():
        if torch.is_grad_enabled():
            recorder.with_grad.add(state.name)
        keep, _ = inner()  # the rules in effect, exactly as the block would use them
        if keep.store.offloader is not None:  # what it offloads (budget plan, offload=[...])
            recorder.offloads[state.name] = (keep.store.offload_calls, keep.store.offload_ops)
        store = RegionStore(f"block {state.name!r}")
        # and the offload in effect: offloaded results go to the host as in training
        for name in ("offloader", "offload_calls", "offload_ops"):
            setattr(store, name, getattr(keep.store, name))
        return (
            _AuditKeepMode(store, keep.rules, recorder, state),
            _AuditReplayMode(store, keep.rules, recorder, state),
        )

    return contexts


def _checked_loss(loss_fn: LossFn) -> LossFn:
    def checked(model: nn.Module) -> torch.Tensor:
        loss = loss_fn(model)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            shown = (
                f"a tensor of shape {tuple(loss.shape)} with requires_grad={loss.requires_grad}"
                if isinstance(loss, torch.Tensor)
                else f"{type(loss).__name__} {loss!r:.80}"
            )
            raise TypeError(
                f"audit(model, loss_fn): loss_fn must return the loss of one forward, a "
                f"one-element tensor that requires grad, to run backward on; it returned {shown}. "
                "Reduce it (loss.sum() / loss.mean()) and compute it with gradients enabled."
            )
        return loss

    return checked


def audit(model: nn.Module, loss_fn: LossFn) -> AuditReport:
    """Run one training step (``loss_fn(model).backward()``) and report the policy in effect.

    The model must already be wrapped by :func:`prime_ac.checkpoint_blocks`. The step runs twice
    (once with checkpointing disabled in place, for the no-AC baseline; nothing is unwrapped,
    so it works on a model sharded by FSDP2 after or before wrapping); parameter gradients are restored
    afterwards, other side effects of the step (optimizer-free buffers, counters) are not.

    Example::

        prime_ac.checkpoint_blocks(model, mode="selective")
        report = prime_ac.audit(model, lambda m: m.loss(batch))
        print(report)                 # a table; report.to_json() for tools
    """
    return run_audit(model, loss_fn)


def run_audit(model: nn.Module, loss_fn: LossFn, baseline: bool = True) -> AuditReport:
    """:func:`audit`; without ``baseline`` only the step with the policy runs (the no-AC fields
    read 0): a peak budget's planner, which measures that step phase by phase instead, saves a
    whole step."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"audit(model, loss_fn): model must be a torch.nn.Module wrapped by "
            f"prime_ac.checkpoint_blocks, got {type(model).__name__} {model!r:.80}"
        )
    if not callable(loss_fn):
        raise TypeError(
            f"audit(model, loss_fn): loss_fn={loss_fn!r:.80} is not callable: pass a function "
            "that runs one forward and returns the loss, e.g. lambda m: m(batch).loss"
        )
    blocks = _checkpointed_blocks(model)
    loss_fn = _checked_loss(loss_fn)
    compiled = compiled_blocks(model, blocks)
    with grads_preserved(model), eager_forwards(bool(compiled)):
        held_none: dict[str, int] = {}
        block_none: dict[str, int] = {}
        if baseline:
            with checkpointing_disabled(model):
                held_none, block_none, forward_flops = track_step_by_block(
                    model, loss_fn, dict(blocks)
                )
        recorder = _Recorder()
        with (
            _recording(blocks, recorder),
            recorder.scopes.tracking(b for _, b in blocks),
            inputs_seen() as collected,
        ):
            held, flops = track_step_by_device(model, loss_fn)
        forward_flops = forward_flops if baseline else flops
        saving_nothing = [
            name
            for name, block in blocks
            if name not in recorder.with_grad
            and not checkpoint_state(block).bypassed
            and any(p.grad is not None for p in block.parameters())
        ]
    state = checkpoint_state(blocks[0][1])
    policy = state.policy
    mode = "auto" if state.plan is not None else policy.mode
    targets = list(policy.targets) if mode == "selective" else []
    scoped = (
        [str(t) for t in policy.scoped.targets] if mode == "selective" and policy.scoped else []
    )
    seen_keys = [operator_key(op) for op in recorder.seen]
    unmatched = [t for t in targets if not any(TargetSet([t]).matches(k) for k in seen_keys)]
    ops = list(recorder.ops.values())
    return AuditReport(
        mode=mode,
        targets=targets + scoped,
        blocks=[name for name, _ in blocks],
        ops=ops,
        unmatched_targets=unmatched,
        held_bytes=sum(held.values()),
        held_bytes_no_ac=sum(held_none.values()),
        forward_flops=forward_flops,
        replayed_flops=sum(r.replayed_flops for r in ops),
        replayed_ops=sum(r.replays for r in ops),
        calls=dict(recorder.calls),
        held_bytes_by_device=held,
        held_bytes_no_ac_by_device=held_none,
        block_held_bytes=recorder.kept_bytes,
        block_held_bytes_no_ac=block_none,
        blocks_bypassed={
            name: checkpoint_state(block).bypassed
            for name, block in blocks
            if checkpoint_state(block).bypassed
        },
        blocks_saving_nothing=saving_nothing,
        peak=_peak(state.plan),
        compiled_blocks=compiled_readings(
            compiled, {name: checkpoint_state(b) for name, b in blocks}, recorder.calls
        ),
        block_input_bytes=_input_bytes(model, blocks, collected.inputs),
        outside_bytes_before={name: collected.outside_before.get(name, 0) for name, _ in blocks},
        block_offloaded_bytes=_offloaded([name for name, _ in blocks], recorder),
    )


def _input_bytes(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], inputs: dict[str, dict[int, int]]
) -> dict[str, int]:
    """Per block, the bytes of its inputs, each storage counted at the first block taking it;
    the model's parameters and buffers (a rotary table passed to every block) count nowhere."""
    seen = {
        _compat.storage_id(t): 0
        for t in (*model.parameters(), *model.buffers())
        if _compat.storage_id(t) is not None
    }
    return {name: unseen_bytes(inputs.get(name, {}), seen) for name, _ in blocks}


def _offloaded(blocks: list[str], recorder: _Recorder) -> dict[str, int]:
    """Per block, the bytes of the kept calls its policy offloads to host memory (a budget
    plan's calls, offload=[...]'s operators); a result the host buffer has no room for stays
    on the device at run time, which the audit's own step does not see."""
    found = {}
    for name in blocks:
        calls, ops = recorder.offloads.get(name, (frozenset(), None))
        found[name] = sum(
            c.bytes
            for c in recorder.calls.get(name, [])
            if c.decision != "replayed"
            and ((c.op, c.index) in calls or (ops is not None and ops(c.op)))
        )
    return found


def _peak(plan: Any) -> tuple[int, int, int | None] | None:
    """A peak plan's budget, predicted and measured peak (prime_ac.budget.plan_peak)."""
    peak = getattr(plan, "peak", None)
    if peak is None:
        return None
    return peak.budget, peak.simulation.peak, peak.measured
