"""Planning a budget across ranks (prime_ac.ranks): ranks agree where they should and only there.

On 2 and 4 gloo ranks, the odd ranks differ from the even ones in each case: their block count,
their operator calls, their kind of budget, their peak budget (close to the others'), a profile
or a measured step that raises. Every rank must end the case with the same exception type (or
its own error, where its profile raised) or the same plan, having run the same number of
collectives; no case waits for a timeout (the group's is short, so a regression fails fast).
Pipeline stages plan per stage with ``dist.new_group``; ``group=False`` plans alone.
"""

from __future__ import annotations

import gc
import logging
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import prime_ac
import prime_ac.budget as budget_module
from prime_ac.planner import BlockProfile, Call
from prime_ac.ranks import RanksError, agree, check, resolve
from prime_ac.wrapping import is_checkpointed
from tests.dist_utils import run_distributed

DIM = 16


class Block(nn.Module):
    def __init__(self, extra: bool = False):
        super().__init__()
        self.up, self.down, self.extra = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM), extra

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x))
        if self.extra:  # control flow that adds a call (data-dependent in a real model)
            h = torch.tanh(h)
        return x + self.down(h)


class Stack(nn.Module):
    def __init__(self, blocks: int = 2, extra: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(extra) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


class Collectives:
    """Counts the collectives prime_ac runs (all-gathers and all-reduces) on this rank."""

    def __init__(self):
        self.count = 0
        self._originals = {}
        for name in ("all_gather", "all_reduce"):
            original = getattr(dist, name)
            self._originals[name] = original

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def restore(self):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def _plan(rank, budget, blocks=2, extra=False, group=None, profile=None):
    """Plan a Stack on this rank (a batch of its own size); returns the model and the number of
    collectives the planning ran, or the exception and that number."""
    model = Stack(blocks, extra)
    x = torch.randn(4 + rank, 8, DIM)
    counter = Collectives()
    try:
        prime_ac.checkpoint_blocks(
            model,
            mode="selective",
            targets="auto",
            budget=budget,
            profile=profile or (lambda m: m(x)),
            group=group,
        )
        return model, counter.count
    except Exception as error:  # what each rank raised is compared across the ranks below
        assert not any(is_checkpointed(m) for m in model.modules())  # left as it was
        return error, counter.count
    finally:
        counter.restore()


def _everyone(value, group=None):
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _expect_ranks_error(outcome, *words):
    error, count = outcome
    assert isinstance(error, RanksError), error
    for word in words:
        assert word in str(error), (word, str(error))
    return count


def _plan_of(model):
    peak = model.layers[0]._prime_ac.plan.peak
    return peak.budget, peak.measured, peak.planned_for, peak.decisions


def _cases(rank, world_size):
    odd = rank % 2 == 1
    evens = "rank 0" if world_size == 2 else "ranks 0, 2"
    odds = "rank 1" if world_size == 2 else "ranks 1, 3"
    last = world_size - 1
    counts = {}

    # the profile: each call's largest bytes and time, each block's largest measured bytes
    mm = Call("aten::mm", 0, 100 * (rank + 1), 0.1 * (rank + 1))
    profile = [
        BlockProfile("a", (mm,), 5 * (rank + 1), 60 * (rank + 1), forward_extra=7 * rank),
        BlockProfile("b", (mm,), after_bytes=3 * (rank + 1)),
    ]
    agreed = agree(profile, resolve(None))
    assert agreed[0].calls[0].bytes == 100 * world_size
    assert agreed[0].calls[0].seconds == pytest.approx(0.1 * world_size)
    assert agreed[0].saved_bytes == 60 * world_size and agreed[1].saved_bytes is None
    assert agreed[0].input_bytes == 5 * world_size and agreed[1].input_bytes == 0
    assert agreed[0].forward_extra == 7 * last and agreed[1].after_bytes == 3 * world_size
    # the smallest budget, bandwidth and host cap (None: not measured, no cap)
    structure = [("layers.0", ["aten::mm.default"])]
    given = (2**20 * (world_size - rank), 1e9 + rank, None if odd else 2**30 * (rank + 1))
    assert check(resolve(None), "peak", structure, *given) == (2**20, 1e9, 2**30)

    # different block counts (what pipeline stages have)
    outcome = _plan(rank, "1MiB", blocks=2 + odd)
    counts["blocks"] = _expect_ranks_error(
        outcome, "as many blocks", f"{evens}: 2 blocks", f"{odds}: 3 blocks", "group="
    )
    # different operator calls in the same blocks: one more per block on the odd ranks
    outcome = _plan(rank, "1MiB", extra=odd)
    counts["calls"] = _expect_ranks_error(outcome, "operator calls", "group=")
    told = dict(re.findall(r"(ranks? [\d, ]+): (\d+) calls", str(outcome[0])))
    assert int(told[odds]) == int(told[evens]) + 2, told
    # a peak budget on one rank, a fraction on the other
    outcome = _plan(rank, 0.5 if odd else "1MiB")
    counts["kinds"] = _expect_ranks_error(
        outcome, "kind of budget", "a fraction", "a peak", "group="
    )
    # a rank planning per block while the other plans a peak: detected by the same exchange
    outcome = _plan(rank, {"layers.0": 2**20, "layers.1": 2**20} if odd else "1MiB")
    counts["per-block"] = _expect_ranks_error(
        outcome, "kind of budget", "bytes per block", "group="
    )

    # a profile that raises on the last rank: it raises its own error, the others name it
    def failing(model, x=torch.randn(4, 8, DIM)):
        if rank == last:
            raise ValueError("the last rank's batch is bad")
        return model(x)

    error, counts["profile raised"] = _plan(rank, "1MiB", profile=failing)
    if rank == last:
        assert isinstance(error, ValueError) and "batch is bad" in str(error)
    else:
        _expect_ranks_error((error, 0), f"rank {last} raised while profiling")
    # ... and one whose step with the plan (the calibration's measurement) raises
    def out_of_memory(*args):
        raise MemoryError("no room for the planned step")

    measure_peak = budget_module.measure_peak
    if rank == last:
        budget_module.measure_peak = out_of_memory
    try:
        error, counts["measure raised"] = _plan(rank, "1MiB")
    finally:
        budget_module.measure_peak = measure_peak
    if rank == last:
        assert isinstance(error, MemoryError)
    else:
        _expect_ranks_error((error, 0), f"rank {last} raised while measuring")

    # budgets close together: one plan, for the smallest, on every rank, one number of collectives
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("prime_ac").addHandler(handler)
    try:
        budget = 72 * 2**10 + (2**10 if odd else 0)
        model, counts["close budgets"] = _plan(rank, budget)
    finally:
        logging.getLogger("prime_ac").removeHandler(handler)
    plans = _everyone(_plan_of(model))
    assert all(p == plans[0] for p in plans), plans
    assert plans[0][0] == 72 * 2**10 and plans[0][1] <= 72 * 2**10  # fits, on every rank
    told = [m for m in logs if "plan with their smallest, 72.00 KiB" in m]
    assert bool(told) == odd and all(evens in m for m in told), logs
    model(torch.randn(4 + rank, 8, DIM)).backward()  # the planned model trains

    # every case ran the same collectives on every rank
    everyone = _everyone(counts)
    assert all(c == everyone[0] for c in everyone), everyone
    assert counts["blocks"] == counts["kinds"] == 1  # the check only
    # the check, the profile, the measured peak (planned again: the profile, maybe the peak)
    assert counts["close budgets"] in (3, 4, 5), counts


def _stages(rank, world_size):
    """Pipeline stages: the first half of the ranks run 2 blocks, the second half 3; each stage
    plans in its own group (on 2 ranks: a group of one rank each, which plans alone)."""
    half = world_size // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world_size)))]
    stage = rank // half
    error, count = _plan(rank, 40 * 2**10, blocks=2 + stage, group=groups[1 - stage])
    assert isinstance(error, ValueError) and count == 0  # before any collective
    assert f"group=: rank {rank} is not a member" in str(error), error
    model, count = _plan(rank, 40 * 2**10, blocks=2 + stage, group=groups[stage])
    assert not isinstance(model, Exception), model
    plans = _everyone(_plan_of(model), groups[stage])
    assert all(p == plans[0] for p in plans), plans
    counts = _everyone(count)
    assert counts[:half] == [counts[0]] * half and counts[half:] == [counts[-1]] * half
    assert (counts[0] > 0) == (half > 1)  # a group of one rank exchanges nothing
    # without a group the stages disagree, and every rank says so
    outcome = _plan(rank, 40 * 2**10, blocks=2 + stage)
    first = "rank 0" if half == 1 else "ranks 0, 1"
    _expect_ranks_error(outcome, f"{first}: 2 blocks", "group=")
    # group=False: each rank plans alone, with no collective
    model, count = _plan(rank, 40 * 2**10, blocks=2 + stage, group=False)
    assert is_checkpointed(model.layers[0]) and count == 0


def _both(rank, world_size):
    # the audit collects garbage three times a step: with torch's modules preloaded that scans
    # a large heap (about 0.3 s each); frozen, it scans only what the cases create
    gc.freeze()
    _cases(rank, world_size)
    _stages(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_plan_together_or_all_raise(world_size):
    # a short group timeout: a case that regresses into a hang fails in seconds
    run_distributed(_both, world_size, timeout=60)


def test_group_is_checked_before_any_collective():
    assert resolve(False) is None and resolve(None) is None  # no process group: plan alone
    with pytest.raises(TypeError, match=r"group='stage0'.*process group"):
        resolve("stage0")
    with pytest.raises(ValueError, match=r'group= .*only with targets="auto"'):
        prime_ac.checkpoint_blocks(Stack(), mode="full", group=False)
    blocks = [BlockProfile("a", (Call("aten::mm", 0, 1, 1.0),))]
    assert agree(blocks, None) is blocks


def test_the_planner_knows_nothing_of_ranks():
    source = (Path(__file__).parents[1] / "prime_ac" / "planner.py").read_text()
    assert "torch.distributed" not in source and "import torch" not in source
