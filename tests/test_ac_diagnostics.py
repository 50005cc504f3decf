"""What the checkpointed blocks hold, said at a glance (prime_ac.diagnostics).

- an out-of-memory error raised in a block's forward or in its recompute logs one report of
  what each block holds (kept, offloaded, inputs, saves outside the blocks by node) and then
  propagates unchanged;
- the live report's numbers are the audit's: kept and offloaded bytes per block, inputs, and
  the saves outside the blocks, byte for byte where they are known exactly;
- identical neighbouring blocks are grouped ("x4 layers.0-3") in the audit's, the plan's and
  the live report's tables;
- allocation labels cost nothing and change nothing without CUDA.
"""

from __future__ import annotations

import copy
import gc
import logging
import re

import pytest
import torch
from ac_models import assert_bitwise_equal
from torch import nn

import prime_ac
from prime_ac import _compat, diagnostics, planner
from prime_ac.diagnostics import memory_report
from prime_ac.models import build_model
from prime_ac.planner import group_names


class Fails(nn.Module):
    """Raises torch.OutOfMemoryError while ``armed``: an allocation that does not fit."""

    armed = False

    def forward(self, x):
        if self.armed:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
        return x


DIM, TOKENS = 64, 64
UP, DOWN = TOKENS * 2 * DIM * 4, TOKENS * DIM * 4  # bytes of the matmuls' outputs (float32)


class Block(nn.Module):
    """Keeps both matmuls (selective): each output is read by sin's backward."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)
        self.fails = Fails()

    def forward(self, x):
        return x + self.down(self.fails(self.up(x)).sin()).sin()


class Stack(nn.Module):
    """A projection outside the blocks (it saves its input), blocks, and a square outside."""

    def __init__(self, dim: int = DIM, n: int = 4):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.stages = nn.ModuleList(Block(dim) for _ in range(n))  # names no other test uses

    def forward(self, x):
        h = self.proj(x)
        for layer in self.stages:
            h = layer(h)
        return h.pow(2).sum()


def _stack():
    torch.manual_seed(0)
    model = Stack()
    prime_ac.checkpoint_blocks(model, mode="selective", blocks="stages")
    return model


needs_saved_data = pytest.mark.skipif(
    not _compat.SAVED_TENSOR_DATA,
    reason="this torch's SavedTensor has no .data: the saves outside the blocks are not read",
)


def _oom_records(caplog):
    return [r for r in caplog.records if r.name == "prime_ac" and r.levelno == logging.ERROR]


def test_an_oom_in_a_forward_logs_what_each_block_holds_once(caplog):
    model = _stack()
    gc.collect()  # no call of an earlier test's graph is alive: the report lists them all
    model.stages[2].fails.armed = True
    x = torch.randn(TOKENS, DIM)
    with (
        caplog.at_level(logging.ERROR, logger="prime_ac"),
        pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 8.00 GiB"),
    ):
        model(x)
    records = _oom_records(caplog)
    assert len(records) == 1
    lines = records[0].getMessage().splitlines()
    assert "OutOfMemoryError" in lines[0]
    # blocks 0 and 1 ran and keep both matmuls; block 2 failed after its first one
    assert _row(lines, "x2 stages.0-1") == ["48.00 KiB", "0 B", "16.00 KiB", "1"]
    assert _row(lines, "stages.2") == ["32.00 KiB", "0 B", "16.00 KiB", "1"]
    # outside the blocks: the projection saved x, found from block 2's inputs
    if _compat.SAVED_TENSOR_DATA:
        assert _row(lines, "MmBackward0") == ["16.00 KiB"]


def test_an_oom_in_a_recompute_logs_once_and_propagates(caplog):
    model = _stack()
    loss = model(torch.randn(TOKENS, DIM))
    # the recompute of stages.1 reruns what it replays: the armed module raises there
    gc.collect()
    model.stages[1].fails.armed = True
    with caplog.at_level(logging.ERROR, logger="prime_ac"), pytest.raises(torch.OutOfMemoryError):
        loss.backward()
    records = _oom_records(caplog)
    assert len(records) == 1
    lines = records[0].getMessage().splitlines()
    # stages.2-3 ran their backward and are gone; stages.0 keeps its results, stages.1's
    # recompute was handed its up projection before it failed
    assert _row(lines, "stages.0") == ["48.00 KiB", "0 B", "16.00 KiB", "1"]
    assert _row(lines, "stages.1") == ["16.00 KiB", "0 B", "16.00 KiB", "1"]
    assert not any("stages.2" in line or "stages.3" in line for line in lines)


def _row(lines, name):
    """The columns of the report's row for ``name`` (columns are two or more spaces apart)."""
    line = next(line for line in lines if line.strip().startswith(name + "  "))
    return re.split(r"\s{2,}", line.strip().removesuffix(" each"))[1:]


def test_an_error_is_reported_once_however_often_it_is_seen(caplog):
    error = torch.OutOfMemoryError("out of memory")
    with caplog.at_level(logging.ERROR, logger="prime_ac"):
        diagnostics.out_of_memory(error, (), {})
        diagnostics.out_of_memory(error, (), {})
    assert len(_oom_records(caplog)) == 1


@needs_saved_data
def test_the_live_report_is_the_audits_and_empties_after_backward():
    model = build_model("dense")
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    prime_ac.checkpoint_blocks(model, mode="selective")
    report = prime_ac.audit(model, lambda m: m.loss(tokens))
    loss = model.loss(tokens)
    live = memory_report(model, loss)
    assert [b.block for b in live.blocks] == report.blocks
    for name in report.blocks:
        assert live.block(name).kept == report.block_held_bytes[name] > 0
        assert live.block(name).inputs == report.block_input_bytes[name] > 0
        assert live.block(name).offloaded == report.block_offloaded_bytes[name] == 0
    # what the step holds: the blocks' kept results and inputs, and the saves outside them,
    # within the loss's own graph bookkeeping (the target ids NLL saves, 2 x 64 int64)
    outside = sum(live.outside.values())
    held = live.kept + live.inputs + outside
    assert report.held_bytes <= held <= report.held_bytes + 2 * 64 * 8
    loss.backward()
    assert memory_report(model).blocks == []


def test_offloaded_results_are_reported_apart_from_kept_ones():
    model = build_model("dense")
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    attention = "aten::_scaled_dot_product_flash_attention_for_cpu"
    prime_ac.checkpoint_blocks(model, mode="selective", offload=[attention])
    model.loss(tokens).backward()  # the first step sizes the offload
    report = prime_ac.audit(model, lambda m: m.loss(tokens))
    loss = model.loss(tokens)
    live = memory_report(model)
    for name in report.blocks:
        row = live.block(name)
        assert row.offloaded == report.block_offloaded_bytes[name] > 0
        assert row.kept + row.offloaded == report.block_held_bytes[name]
    loss.backward()


@needs_saved_data
def test_outside_saves_are_counted_by_node_and_byte():
    model = _stack()
    x = torch.randn(TOKENS, DIM)
    loss = model(x)
    live = memory_report(model, loss)
    # proj saved x; pow saved the last block's output; the parameters are the model's
    assert live.outside == {"MmBackward0": x.nbytes, "PowBackward0": DOWN}
    assert live.inputs == 4 * DOWN  # each block's input, once
    assert [b.kept for b in live.blocks] == [UP + DOWN] * 4
    loss.backward()
    # the audit finds the projection's save before every block, and holds what the live
    # report holds but x, which the audit's step did not create
    report = prime_ac.audit(model, lambda m: m(x))
    assert report.outside_bytes_before == {f"stages.{i}": x.nbytes for i in range(4)}
    assert report.held_bytes == live.kept + live.inputs + sum(live.outside.values()) - x.nbytes


def test_identical_blocks_are_grouped():
    assert group_names(["layers.0", "layers.1", "layers.2", "layers.3"]) == "x4 layers.0-3"
    assert group_names(["layers.0", "layers.2"]) == "x2 layers.0, layers.2"
    assert group_names(["layers.5"]) == "layers.5"
    model = build_model("dense")
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    prime_ac.checkpoint_blocks(model, mode="selective")
    report = prime_ac.audit(model, lambda m: m.loss(tokens))
    table = str(report)
    assert "x4 layers.0-3" in table and "\nlayers.1 " not in table
    calls = (planner.Call("aten::mm", 0, 2**20, 1e-4), planner.Call("aten::sin", 0, 2**20, 1e-6))
    blocks = [planner.BlockProfile(f"layers.{i}", calls, 2**20) for i in range(4)]
    rows = planner.plan(blocks, 2**40).table().splitlines()
    assert [row.split()[:2] for row in rows[1:-1]] == [
        ["x4", "layers.0-3"]
    ] * 3  # two calls and the copy time, once for the four blocks


def test_labels_change_nothing_without_cuda():
    model = _stack()
    reference = copy.deepcopy(model)
    x = torch.randn(TOKENS, DIM)
    reference(x).backward()
    with diagnostics.labelled_allocations():
        assert diagnostics.labelling()
        model(x).backward()
    assert not diagnostics.labelling()
    assert_bitwise_equal(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in reference.named_parameters()},
    )


def test_labels_name_the_kept_and_offloaded_calls(monkeypatch):
    """What CUDA's allocator would be told, recorded where no CUDA is."""
    told = []
    monkeypatch.setattr(
        diagnostics._compat, "set_allocation_label", lambda t: told.append(t) or True
    )
    torch.manual_seed(0)
    model = Stack()
    prime_ac.checkpoint_blocks(model, mode="selective", blocks="stages", offload=["aten::sin"])
    x = torch.randn(TOKENS, DIM)
    model(x).backward()  # outside the context: nothing is told
    assert told == []
    with diagnostics.labelled_allocations():
        model(x).backward()
    labels = told[0::2]
    assert told[1::2] == [""] * len(labels)  # each label is cleared after its call
    for i in range(4):
        block = f"block 'stages.{i}'"
        # both matmuls kept, both sines kept (and offloaded), nothing replayed is labelled
        assert labels.count(f"prime_ac kept {block} aten::mm.default") == 2
        assert labels.count(f"prime_ac kept {block} aten::sin.default") == 2
        # its two offloaded sines come back under the label (when prefetched, and again
        # when its own recompute starts, where nothing is left to copy)
        assert labels.count(f"prime_ac offloaded {block}") >= 2
    assert len([label for label in labels if " kept " in label]) == 4 * 4
