"""prime_ac.diagnostics on CUDA: real out-of-memory errors and labels in memory snapshots.

- an allocation that cannot fit, inside a checkpointed block's forward, logs one report of what
  each block holds and propagates;
- one outside every block (after the forward, as a backward's own kernel would) is reported by
  the caching allocator's out-of-memory observer, once;
- within ``prime_ac.labelled_allocations()`` the kept results' allocations, and the buffers
  offloaded results come back into, carry ``prime_ac kept ...`` / ``prime_ac offloaded ...``
  labels in ``torch.cuda.memory._snapshot()``'s traces.

The CPU suite (tests/test_ac_diagnostics.py) checks the report's content byte for byte.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch import nn

import prime_ac

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DIM, TOKENS = 256, 512
TOO_MUCH = 1 << 50  # bytes: no device has a PiB


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.huge = False

    def forward(self, x):
        h = self.up(x).sin()
        if self.huge:
            torch.empty(TOO_MUCH, dtype=torch.uint8, device=x.device)
        return x + self.down(h).sin()


class Stack(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.stages = nn.ModuleList(Block() for _ in range(n))  # names no other test uses

    def forward(self, x):
        for layer in self.stages:
            x = layer(x)
        return x.square().sum()


def _model(**kwargs):
    torch.manual_seed(0)
    model = Stack().cuda()
    prime_ac.checkpoint_blocks(model, mode="selective", blocks="stages", **kwargs)
    return model, torch.randn(TOKENS, DIM, device="cuda")


def _errors(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "prime_ac" and r.levelno >= 40]


def test_an_oom_in_a_blocks_forward_is_reported_once(caplog):
    model, x = _model()
    model(x).backward()  # a first step (the observer is attached by then too)
    gc.collect()  # no call of an earlier test's graph is alive: the report lists them all
    model.stages[2].huge = True
    with caplog.at_level(logging.ERROR, logger="prime_ac"), pytest.raises(torch.OutOfMemoryError):
        model(x)
    errors = _errors(caplog)
    assert len(errors) == 1, errors
    assert "OutOfMemoryError" in errors[0]
    assert "x2 stages.0-1" in errors[0] and "stages.2" in errors[0]
    model.stages[2].huge = False
    torch.cuda.empty_cache()


def test_an_oom_outside_the_blocks_is_reported_by_the_allocator(caplog):
    gc.collect()
    model, x = _model()
    loss = model(x)
    with caplog.at_level(logging.ERROR, logger="prime_ac"), pytest.raises(torch.OutOfMemoryError):
        torch.empty(TOO_MUCH, dtype=torch.uint8, device="cuda")
    errors = _errors(caplog)
    assert len(errors) == 1, errors
    assert "CUDA out of memory" in errors[0] and "x4 stages.0-3" in errors[0]
    loss.backward()
    torch.cuda.empty_cache()


def _labels(step):
    if not hasattr(torch._C, "_cuda_setMemoryMetadata"):
        pytest.skip("this torch cannot label CUDA allocations (no _cuda_setMemoryMetadata)")
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        with prime_ac.labelled_allocations():
            step()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    # each allocation's label (its "user_metadata"; read as any string value of the entry)
    return [
        next((v for v in entry.values() if isinstance(v, str) and v.startswith("prime_ac")), "")
        for trace in snapshot["device_traces"]
        for entry in trace
        if entry.get("action") == "alloc"
    ]


def test_kept_results_carry_labels_in_the_snapshot():
    model, x = _model()
    labels = _labels(lambda: model(x).backward())
    for i in range(4):
        assert any(m.startswith(f"prime_ac kept block 'stages.{i}' aten::") for m in labels), i
    assert sum(m.startswith("prime_ac") for m in labels) < len(labels)  # the rest unlabelled


def test_offloaded_results_carry_labels_in_the_snapshot():
    model, x = _model(offload=["aten::sin"])
    model(x).backward()  # the first step sizes the host buffer
    labels = _labels(lambda: model(x).backward())
    for i in range(4):
        assert any(m == f"prime_ac offloaded block 'stages.{i}'" for m in labels), i
