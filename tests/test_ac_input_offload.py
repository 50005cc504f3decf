"""prime-rl's activation offloading (prime_ac.offload.SavedInputOffload) on CPU: what autograd
saves around the checkpointed blocks goes to host copies and comes back; gradients equal those
of no offload bitwise, whichever way forwards and backwards interleave; the host buffers belong
to the graph that saved into them until autograd lets go, then the pool reuses them."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from ac_models import BlockStack, assert_bitwise_equal, grads
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

import prime_ac
import prime_ac.offload as offload_module
from prime_ac.offload import SavedInputOffload

DIM = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def _batch(seed: int, tokens: int = 16) -> torch.Tensor:
    # 4 x 16 x 16 fp32: 4 KiB, above the 1 KiB below which nothing moves
    return torch.randn(4, tokens, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def base():
    torch.manual_seed(0)
    return BlockStack(Block)


def _checkpointed(model: nn.Module, mode: str) -> nn.Module:
    model = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(model, mode=mode)
    return model


def _host_buffers(offload: SavedInputOffload) -> int:
    return sum(len(buffers) for buffers in offload._pool.values())


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_micro_batches_bitwise_and_the_pool_serves_later_steps(base, mode):
    batches = [_batch(seed) for seed in range(3)]
    reference = copy.deepcopy(base)
    for x in batches:
        reference(x).backward()
    model, offload = _checkpointed(base, mode), SavedInputOffload(pin_memory=False)
    allocations = []
    for x in batches:  # prime-rl's micro-batch loop: gradients accumulate
        with offload:
            loss = model(x)
        assert offload.ledger.host > 0
        loss.backward()
        assert offload.ledger.host == 0  # autograd let go: every buffer is back in the pool
        allocations.append(offload.buffer_allocations)
    assert_bitwise_equal(grads(model), grads(reference))
    # each step saves the 3 block inputs and the loss's input, all of one size
    assert offload.ledger.offloaded == 3 * 4 and offload.ledger.peak_host == 4 * 4096
    assert allocations == [4, 4, 4] and _host_buffers(offload) == 4


def test_two_forwards_before_one_backward(base):
    """The second forward must not copy into the buffers the first graph still holds (it did:
    entering the offload returned them to the pool, and the gradients came out wrong)."""
    a, b = _batch(1), _batch(2)
    reference = copy.deepcopy(base)
    (reference(a) + reference(b)).backward()
    model, offload = _checkpointed(base, "full"), SavedInputOffload(pin_memory=False)
    with offload:
        l1 = model(a)
    with offload:
        l2 = model(b)
    assert offload.ledger.host == 2 * 4 * 4096 and offload.buffer_allocations == 8
    (l1 + l2).backward()
    assert_bitwise_equal(grads(model), grads(reference))
    assert offload.ledger.host == 0 and _host_buffers(offload) == 8


def test_pipeline_order_forward_forward_backward_forward(base):
    """1F1B-like: f1 f2 b1 f3 b2 b3; f3 takes the buffers b1 released, none of f2's."""
    batches = [_batch(seed) for seed in range(3)]
    reference = copy.deepcopy(base)
    for x in batches:
        reference(x).backward()
    model, offload = _checkpointed(base, "full"), SavedInputOffload(pin_memory=False)
    losses = []
    for x in batches[:2]:
        with offload:
            losses.append(model(x))
    losses.pop(0).backward()
    assert offload.ledger.host == 4 * 4096 and _host_buffers(offload) == 4
    with offload:
        losses.append(model(batches[2]))
    assert offload.buffer_allocations == 8 and _host_buffers(offload) == 0
    for loss in losses:
        loss.backward()
    assert_bitwise_equal(grads(model), grads(reference))
    assert offload.ledger.host == 0


def _torch_checkpointed(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    for layer in model.layers:
        layer.forward = lambda x, f=layer.forward: checkpoint(f, x, use_reentrant=False)
    return model


@pytest.mark.parametrize("ac", ["none", "torch"])
def test_retain_graph_reads_the_host_copies_again(base, ac):
    x = _batch(3)
    reference = copy.deepcopy(base)
    loss = reference(x)
    loss.backward(retain_graph=True)
    loss.backward()
    model = copy.deepcopy(base) if ac == "none" else _torch_checkpointed(base)
    offload = SavedInputOffload(pin_memory=False)
    with offload:
        loss = model(x)
    loss.backward(retain_graph=True)
    assert offload.ledger.host > 0  # still the graph's
    loss.backward()
    assert_bitwise_equal(grads(model), grads(reference))
    del loss
    assert offload.ledger.host == 0


def test_retain_graph_through_prime_ac_blocks(base):
    """mode="full" recomputes each block again for the second backward (the region's recompute
    context is entered once per backward); selective, whose kept results went to the first
    backward, says so."""
    x = _batch(3)
    reference = copy.deepcopy(base)
    loss = reference(x)
    loss.backward(retain_graph=True)
    loss.backward()
    model, offload = _checkpointed(base, "full"), SavedInputOffload(pin_memory=False)
    with offload:
        loss = model(x)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_bitwise_equal(grads(model), grads(reference))
    model = _checkpointed(base, "selective")
    with offload:
        loss = model(x)
    loss.backward(retain_graph=True)
    with pytest.raises(CheckpointError, match="backward ran a second time through block"):
        loss.backward()


def test_a_graph_dropped_without_backward_returns_its_buffers(base):
    model, offload = _checkpointed(base, "full"), SavedInputOffload(pin_memory=False)
    with offload:
        loss = model(_batch(0))
    assert offload.ledger.host > 0
    del loss
    assert offload.ledger.host == 0 and _host_buffers(offload) == 4


def test_the_backward_reads_the_host_copies(base):
    model, offload = _checkpointed(base, "full"), SavedInputOffload(pin_memory=False)
    x = _batch(0)
    reference = copy.deepcopy(model)
    reference(x).backward()
    with offload:
        loss = model(x)
    for host, _ in offload._saved:
        host.add_(1.0)
    loss.backward()
    assert any(not torch.equal(grads(model)[n], g) for n, g in grads(reference).items())


def _in_place_after_save(offload, big: bool, through_alias: bool):
    x = torch.randn(32, 64 if big else 4, requires_grad=True)  # 8 KiB moves, 512 B stays
    y = x * 2
    if offload is None:
        z = y.sin()
    else:
        with offload:
            z = y.sin()  # saves y
        assert offload.ledger.offloaded == int(big)
    (y.detach() if through_alias else y).add_(1.0)
    z.sum().backward()


@pytest.mark.parametrize("big", [True, False], ids=["offloaded", "left-in-place"])
@pytest.mark.parametrize("through_alias", [False, True], ids=["direct", "alias"])
def test_an_in_place_write_after_save_raises_as_without_offload(big, through_alias):
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        _in_place_after_save(None, big, through_alias)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as offloaded:
        _in_place_after_save(SavedInputOffload(pin_memory=False), big, through_alias)
    versions = r"is at version (\d+); expected version (\d+)"
    assert plain.match(versions) and offloaded.match(versions)


def test_a_block_input_written_after_the_forward_raises_as_without_offload(base):
    for offload in (None, SavedInputOffload(pin_memory=False)):
        model, inp = _checkpointed(base, "full"), _batch(0)
        with offload if offload is not None else torch.enable_grad():
            loss = model(inp)
        inp.mul_(2.0)  # the first block's saved input
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


class _Strides(torch.autograd.Function):
    """y = a * b, recording the strides of what backward gets back."""

    seen: list = []

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        _Strides.seen.append((a.stride(), b.stride()))
        return grad * b, grad * a


def test_views_duplicates_layouts_bitwise():
    """A tensor saved twice at once has one host copy, a dense permuted layout comes back with
    its strides, a tensor with gaps moves through its whole storage and comes back with its
    strides (views: tests/compat/test_prime_rl_views_offload.py)."""

    def run(offload):
        torch.manual_seed(0)
        w = torch.randn(64, 32, requires_grad=True)
        h = w * 1.5
        with offload if offload is not None else torch.enable_grad():
            sq = h * h  # h saved twice
            v = h[:, :16].exp()  # exp saves its result, not the view
            t = torch.empty_strided((64, 32), (1, 64)).copy_(h)  # dense, column-major
            gaps = torch.empty_strided((64, 32), (40, 1)).copy_(h)  # storage with gaps
            mixed = _Strides.apply(t, gaps)
            loss = sq.sum() + v.sum() + mixed.sum()
        loss.backward()
        return w.grad

    _Strides.seen = []
    expected = run(None)
    offload = SavedInputOffload(pin_memory=False)
    got = run(offload)
    assert torch.equal(got, expected)
    assert _Strides.seen[0] == _Strides.seen[1] == ((1, 64), (40, 1))
    # h (once, for both saves), exp's result (4 KiB), t, gaps (its storage, 10 KiB)
    assert offload.ledger.offloaded == 4
    assert offload.ledger.host == 0


def test_torch_checkpoint_regions_inside_the_context_offload_their_inputs():
    """Inside a non-reentrant region its own hooks save; the region's inputs are saved
    through the offload (and a reentrant region's too)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(3))
    x = _batch(0).requires_grad_()  # a reentrant region needs an input that requires grad

    def run(reentrant, offload):
        for p in blocks.parameters():
            p.grad = None
        with offload if offload is not None else torch.enable_grad():
            h = x
            for block in blocks:
                h = checkpoint(block, h, use_reentrant=reentrant)
            loss = h.square().mean()
        loss.backward()
        return {n: p.grad for n, p in blocks.named_parameters()}

    for reentrant in (False, True):
        expected = run(reentrant, None)
        offload = SavedInputOffload(pin_memory=False)
        assert_bitwise_equal(run(reentrant, offload), expected)
        assert offload.ledger.offloaded == 4 and offload.ledger.host == 0  # 3 inputs, the loss's


def test_double_backward_bitwise():
    """create_graph=True: what the first backward brings back becomes part of the second
    graph, a tensor of its own (not the pooled buffer)."""
    torch.manual_seed(0)
    model = BlockStack(Block)
    x = _batch(0)

    def run(offload):
        model.zero_grad()
        inp = x.clone().requires_grad_()
        with offload if offload is not None else torch.enable_grad():
            loss = model(inp)
        (g,) = torch.autograd.grad(loss, inp, create_graph=True)
        with offload if offload is not None else torch.enable_grad():
            second = g.square().sum()
        second.backward()
        return grads(model)

    expected = run(None)
    offload = SavedInputOffload(pin_memory=False)
    assert_bitwise_equal(run(offload), expected)
    assert offload.ledger.offloaded > 0 and offload.ledger.host == 0


def test_the_pool_stays_bounded_when_shapes_change(base):
    model, offload = _checkpointed(base, "full"), SavedInputOffload(pin_memory=False)
    for tokens in (16, 24, 32, 16, 40):
        with offload:
            loss = model(_batch(0, tokens))
        loss.backward()
        assert offload._pooled <= offload.ledger.peak_host
    assert offload.ledger.host == 0


def test_host_memory_over_90_percent_warns_once(base, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="prime_ac")
    model = _checkpointed(base, "full")
    monkeypatch.setattr(offload_module, "_host_memory_used", lambda: 0.5)
    offload = SavedInputOffload(pin_memory=False)
    with offload:
        model(_batch(0)).backward()
    assert "host memory" not in caplog.text
    monkeypatch.setattr(offload_module, "_host_memory_used", lambda: 0.95)
    offload = SavedInputOffload(pin_memory=False)
    for tokens in (16, 32):  # two steps that allocate
        with offload:
            loss = model(_batch(0, tokens))
        loss.backward()
    warnings = [r for r in caplog.records if "host memory is 95% used" in r.getMessage()]
    assert len(warnings) == 1
    used = offload_module._host_memory_used()  # the real reading, where the host has one
    assert used is None or 0 <= used <= 1


def test_entering_twice_at_once_raises():
    offload = SavedInputOffload(pin_memory=False)
    with offload, pytest.raises(RuntimeError, match="already entered"), offload:
        pass
    with offload:  # and it can be entered again after
        pass


class _Log:
    """What the stand-in streams saw, in order."""

    def __init__(self):
        self.calls: list[tuple] = []


class _Event:
    """Done once someone waited for it, or two later events were recorded (the copy stream
    runs its work in order, behind): the bookkeeping must ask, never assume."""

    log: _Log
    clock = 0

    def __init__(self):
        self.done = False

    def record(self, stream=None):
        _Event.clock += 1
        self.stream, self.at = stream, _Event.clock
        _Event.log.calls.append(("record", stream, self))

    def query(self):
        return self.done or _Event.clock - self.at >= 2

    def synchronize(self):
        self.done = True
        _Event.log.calls.append(("synchronize", self))


class _Stream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        _Event.log.calls.append(("wait_stream", self, other))

    def wait_event(self, event):
        event.done = True  # ordered behind it, from this stream's view
        _Event.log.calls.append(("wait_event", self, event))


class _StandInCuda(SavedInputOffload):
    """CPU tensors take the CUDA path, with stand-in streams and events; each unpack of an
    offloaded tensor notes how it found its record: prefetched, device tensor still held, or
    neither (brought back now)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.found: list[str] = []

    @staticmethod
    def _streamed(device):
        return True

    def _unpack(self, record):
        if not isinstance(record, offload_module._Kept):
            held = record.copy.device is not None
            self.found.append("held" if held else "prefetched" if record.back else "now")
        return super()._unpack(record)


@pytest.fixture
def stand_in_streams(monkeypatch):
    log = _Log()
    _Event.log = log
    compute = _Stream("compute")
    current: list = [compute]

    class _Context:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            current.append(self.stream)

        def __exit__(self, *exc):
            current.pop()

    def record_stream(tensor, stream):
        log.calls.append(("record_stream", stream, tensor))

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream("side"))
    monkeypatch.setattr(torch.cuda, "stream", _Context)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream, raising=False)
    return log, compute


@pytest.mark.parametrize("max_inflight", [1, 2, None])
def test_the_stream_path_waits_bounds_and_prefetches(base, stand_in_streams, max_inflight):
    """The CUDA path's bookkeeping with stand-in streams: the side stream waits for the compute
    stream before each copy, at most max_inflight device tensors are held, an inbound copy is
    waited for before use and marked used by the side stream, and each unpack starts bringing
    back the tensor saved before it; gradients bitwise, the pool reused on later steps."""
    log, compute = stand_in_streams
    batches = [_batch(seed) for seed in range(3)]
    reference = copy.deepcopy(base)
    for x in batches[:2]:
        reference(x).backward()
    (reference(batches[2]) * 1).backward()
    model = _checkpointed(base, "full")
    offload = _StandInCuda(pin_memory=False, max_inflight=max_inflight)
    with offload:
        l1 = model(batches[0])
    with offload:  # two in flight, one backward after the other
        l2 = model(batches[1])
    bound = max_inflight if max_inflight is not None else 8
    assert len(offload._inflight) <= bound
    assert offload.ledger.peak_device <= bound * 4096
    records = [record for _, record in offload._saved]
    assert records[0].previous is None  # the chain stops where the entry starts
    assert all(b.previous() is a for a, b in zip(records[:-1], records[1:], strict=True))
    del records  # the graphs' own, not the test's
    log.calls.clear()
    l1.backward()
    l2.backward()
    with offload:
        l3 = model(batches[2])
    l3.backward()
    # backward reads the last saved first: still held, or (when its copy is done) brought back
    # now; each one after it was prefetched by the unpack before it
    assert len(offload.found) == 3 * 4
    for step in range(3):
        first, *rest = offload.found[4 * step : 4 * step + 4]
        assert first in ("held", "now") and all(f in ("held", "prefetched") for f in rest)
    assert "prefetched" in offload.found, offload.found
    assert_bitwise_equal(grads(model), grads(reference))
    assert offload.ledger.host == 0 and offload.ledger.device <= bound * 4096
    assert offload.buffer_allocations == 8  # the third step drew all 4 from the pool
    # every outbound copy: the side stream waited for the compute stream first
    records_at = [i for i, c in enumerate(log.calls) if c[0] == "record"]
    assert records_at
    for i in records_at:
        assert log.calls[i - 1][:3] == ("wait_stream", log.calls[i][1], compute)
    # every inbound tensor was marked used by the side stream, and waited for before its use
    inbound = [c[2] for c in log.calls if c[0] == "record_stream"]
    waited = {id(c[2]) for c in log.calls if c[0] == "wait_event" and c[1] is compute}
    events = [c[2] for c in log.calls if c[0] == "record"]
    assert inbound and len(inbound) <= len(events)
    assert all(e.query() for e in events)
    assert len(waited) >= len(inbound) - 2  # all but what no backward read (prefetched last)


def test_tensors_on_other_accelerators_stay_and_say_so(caplog):
    """Only CUDA tensors move (the host side is pinned CPU memory): a saved tensor on another
    device type stays there, logged once per device type, not skipped in silence."""
    caplog.set_level(logging.WARNING, logger="prime_ac")
    offload = SavedInputOffload(pin_memory=False)
    offload._pack(torch.empty(1024, device="meta"))  # tracing: stays, says nothing
    assert "moves CUDA tensors only" not in caplog.text

    class Elsewhere(torch.Tensor):  # a stand-in for an xpu / mps / hpu tensor
        @property
        def device(self):
            return torch.device("xpu")

    x = torch.empty(1024).as_subclass(Elsewhere)
    for _ in range(2):
        assert isinstance(offload._pack(x), offload_module._Kept)
    assert caplog.text.count("moves CUDA tensors only; what autograd saves on xpu") == 1
