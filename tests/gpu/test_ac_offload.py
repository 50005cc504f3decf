"""prime_ac's offload action on CUDA (prime_ac.offload): streams, the pinned buffer, peaks.

The CPU suite checks decisions, gradients and the ledger with host copies made at once; here
the copies run on a side stream into one pinned buffer. Races are provoked by putting
``torch.cuda._sleep`` on the copy stream ahead of every copy: a missing wait shows as wrong
gradients. Times are printed, never asserted.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
from torch import nn

import prime_ac
from prime_ac.budget import budget_context_fn
from prime_ac.offload import Offloader, SavedInputOffload
from prime_ac.wrapping import checkpoint_state, wrap_block

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DIM, TOKENS, LAYERS = 1024, 4096, 6
SLEEP_CYCLES = 20_000_000  # about 10 ms at H200 clocks: longer than a block's compute


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        h = self.up(x)
        h = nn.functional.gelu(h)
        h.mul_(0.5)  # an in-place write to a result a plan may keep
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().square().mean()


class SlowCopies(Offloader):
    """Every copy waits behind a sleep on the copy stream."""

    def _copy_out(self, kept, leaves, nbytes):
        with torch.cuda.stream(self._side_stream(leaves[0].device)):
            torch.cuda._sleep(SLEEP_CYCLES)
        return super()._copy_out(kept, leaves, nbytes)

    def _copy_in(self, entry):
        if entry.back is None and entry.host:
            with torch.cuda.stream(self._side_stream(torch.device("cuda"))):
                torch.cuda._sleep(SLEEP_CYCLES)
        return super()._copy_in(entry)


@pytest.fixture(scope="module")
def setup():
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = Model().cuda().bfloat16()
    x = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    reference(x).backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters()}
    yield model, x, expected
    torch.use_deterministic_algorithms(False)


def _offload_everything(model, x, offloader):
    """Each block keeps its matmul results by offloading them all."""
    prime_ac.checkpoint_blocks(model, mode="full")
    report = prime_ac.audit(model, lambda m: m(x))
    for name in report.blocks:
        block = model.get_submodule(name)
        state = checkpoint_state(block)
        calls = frozenset((c.op, c.index) for c in report.calls[name] if c.flops > 0)
        fn = budget_context_fn(state.policy, frozenset(), f"block {name!r}", calls, offloader)
        wrap_block(block, dataclasses.replace(state, context_fn=fn))


@pytest.mark.parametrize("offloader_class", [Offloader, SlowCopies])
def test_offloaded_gradients_bitwise_with_slow_copy_streams(setup, offloader_class):
    model, x, expected = setup
    model = copy.deepcopy(model)
    offloader = offloader_class(2**31)
    _offload_everything(model, x, offloader)
    for _ in range(3):
        model.zero_grad()
        model(x).backward()
        torch.cuda.synchronize()
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, expected[n]), n
    assert offloader.ledger.offloaded > 0
    assert offloader.ledger.host == 0 and offloader.ledger.device == 0
    # one pinned buffer, allocated once for all three steps
    assert offloader.buffer_allocations == 1 and offloader.buffer.is_pinned()


def test_max_inflight_bounds_the_copies(setup):
    model, x, expected = setup
    model = copy.deepcopy(model)
    offloader = SlowCopies(2**31, max_inflight=1)
    _offload_everything(model, x, offloader)
    model(x).backward()
    largest = TOKENS * 4 * DIM * 2  # the up projection's bf16 output
    assert 0 < offloader.ledger.peak_device <= largest
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, expected[n]), n


def _step_ms(model, x, steps=3):
    model.zero_grad()
    model(x).backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        model(x).backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def test_predicted_and_measured_peak_and_step_times(setup):
    model, x, _ = setup
    results = {}
    for name, kwargs in {
        "full": {"mode": "full"},
        "selective": {"mode": "selective"},
        "peak 1GiB": {
            "mode": "selective",
            "targets": "auto",
            "budget": "1GiB",
            "profile": lambda mm: mm(x),
        },
    }.items():
        m = copy.deepcopy(model)
        prime_ac.checkpoint_blocks(m, **kwargs)
        plans = [layer._prime_ac.plan for layer in m.layers]
        peak = plans[0].peak if plans[0] is not None else None
        results[name] = (_step_ms(m, x), peak)
        if peak is not None:
            assert peak.measured is not None and peak.measured > 0
            print(f"{name}: predicted {peak.simulation.peak:,} B, measured {peak.measured:,} B")
    for name, (ms, _) in results.items():
        print(f"{name}: {ms:.2f} ms per step")


def test_named_offload_sizes_its_buffer_on_the_first_step(setup):
    """offload=[...] has no plan: the first step keeps the named results on the device and
    counts them; the second allocates the pinned buffer once and offloads them."""
    model, x, expected = setup
    m = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(m, mode="full", offload=["aten::addmm", "aten::mm"])
    offloader = checkpoint_state(m.layers[0]).policy.offloader
    m(x).backward()
    assert offloader.buffer is None and offloader.sized > 0 and offloader.ledger.offloaded == 0
    for _ in range(2):
        m.zero_grad(set_to_none=True)
        m(x).backward()
        grads = {n: p.grad for n, p in m.named_parameters()}
        assert all(torch.equal(grads[n], expected[n]) for n in expected)
    assert offloader.buffer_allocations == 1 and offloader.capacity == offloader.sized
    assert offloader.ledger.offloaded > 0 and offloader.ledger.host == 0


def test_measured_replay_times_and_copy_bandwidth(setup):
    """On CUDA the planner times each profiled call with CUDA events and the host link once
    per process; the plan's copy times use that bandwidth (less its error margin)."""
    from prime_ac.measure import CallTimer, copy_bandwidth
    from prime_ac.wrapping import wrapped_blocks

    model, x, _ = setup
    device = x.device
    first = copy_bandwidth(device)
    assert first is not None and first > 1e9  # bytes/s: a pinned copy is GB/s
    hits = copy_bandwidth.cache_info().hits
    assert copy_bandwidth(device) == first and copy_bandwidth.cache_info().hits == hits + 1
    m = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(m, mode="full")
    timer = CallTimer(wrapped_blocks(m))
    with timer:
        report = prime_ac.audit(m, lambda mm: mm(x))
    seconds = timer.seconds()
    matmuls = [(n, c.op, c.index) for n in report.blocks for c in report.calls[n] if c.flops]
    assert matmuls and all(seconds[k] > 0 for k in matmuls)
    m = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(
        m, mode="selective", targets="auto", budget="1GiB", profile=lambda mm: mm(x)
    )
    peak = m.layers[0]._prime_ac.plan.peak
    assert peak.bandwidth == pytest.approx(first * 0.7)
    print(f"copy bandwidth {first / 1e9:.1f} GB/s; slowest matmul {max(seconds.values()):.2e} s")


class SlowInputCopies(SavedInputOffload):
    """prime-rl's offloader with every copy (out and back) behind a sleep on the side stream."""

    def _side(self, device):
        stream = super()._side(device)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        return stream


@pytest.mark.parametrize("offload_class", [SavedInputOffload, SlowInputCopies])
def test_input_offload_bitwise_with_two_forwards_in_flight(setup, offload_class):
    """prime-rl's [trainer.model.ac_offloading] on full AC: two micro-batches' forwards before
    their backwards (the reward-model loop), each block input in pinned host memory; the pool
    serves every step after the first."""
    model, x, expected = setup
    model = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(model, mode="full")
    offload = offload_class(pin_memory=True, max_inflight=2)
    allocations = []
    for _ in range(3):
        model.zero_grad()
        with offload:
            first = model(x)
        with offload:
            second = model(x)
        assert all(host.is_pinned() for host, _ in offload._saved)
        (0.5 * first + 0.5 * second).backward()
        del first, second
        torch.cuda.synchronize()
        allocations.append(offload.buffer_allocations)
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, expected[n]), n
        assert offload.ledger.host == 0
    assert allocations[0] >= 2 * LAYERS and allocations[1:] == [allocations[0]] * 2
    assert offload.ledger.peak_device <= 2 * TOKENS * DIM * 2  # max_inflight bf16 inputs


def test_step_time_and_peak_against_prime_rls_offloader(setup):
    """Full AC alone and with prime-rl's offloader (this one: side stream, prefetch), and
    selective: the peak memory each step reaches and its time, printed (never asserted)."""
    model, x, _ = setup
    rows = {}
    for name, mode, offload in (
        ("full", "full", None),
        ("full + ac_offloading", "full", SavedInputOffload(pin_memory=True)),
        ("selective", "selective", None),
    ):
        m = copy.deepcopy(model)
        prime_ac.checkpoint_blocks(m, mode=mode)

        def step(m=m, offload=offload):
            with offload if offload is not None else contextlib.nullcontext():
                loss = m(x)
            loss.backward()

        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            m.zero_grad(set_to_none=False)
            step()
        end.record()
        torch.cuda.synchronize()
        rows[name] = (start.elapsed_time(end) / 3, torch.cuda.max_memory_allocated() - base)
    for name, (ms, peak) in rows.items():
        print(f"{name}: {ms:.2f} ms per step, peak {peak / 2**20:.1f} MiB above the step's start")
    assert rows["full + ac_offloading"][1] < rows["full"][1]  # the block inputs left the device
