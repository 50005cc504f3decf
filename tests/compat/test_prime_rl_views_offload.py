"""Saved views under prime-rl's activation offloading: moved through their base's storage.

prime-rl's offloader (src/prime_rl/utils/act_offloading.py @ 0202477d4dd4, torchtune's with
streams off) copies every saved tensor of at least 1024 bytes (``element_size() * nelement()``)
that is not a ``Parameter`` or ``Buffer`` to the host, views included, and leaves the rest. In
prime-rl's layers without AC (``freq = 2``, or ``layer_modes`` with ``"none"``) autograd saves
many views (q/k/v after their transposes, the MLP's halves): ``SavedInputOffload`` used to leave
them, and so their whole storages, on the device (136,684 B on the tiny Qwen3 below, 3,948 B
for prime-rl's rule). It now moves each saved storage once, however many of its views are
saved, and rebuilds each view on the storage brought back; parameters and their views stay.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import prime_ac
from prime_ac.offload import SavedInputOffload

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_ac_input_offload import _StandInCuda  # noqa: E402
from test_ac_input_offload import stand_in_streams as stand_in_streams  # noqa: E402, F401


def _of_parameter(t: torch.Tensor) -> bool:
    return any(isinstance(x, torch.nn.Parameter) for x in (t, t._base) if x is not None)


class PrimeRlRule(torch.autograd.graph.saved_tensors_hooks):
    """What prime-rl's offloader leaves on the device, by its rule (its pack hook's condition),
    counted as the bytes of the storages left (parameters and their views aside: the model's
    memory); it copies the rest, whose bytes it counts by elements."""

    def __init__(self):
        self.left: dict[int, int] = {}
        self.moved = 0

        def pack(t):
            nbytes = t.element_size() * t.nelement()
            if nbytes >= 1024 and not isinstance(t, torch.nn.Parameter):
                self.moved += nbytes
            elif not _of_parameter(t):
                self.left[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)


@pytest.fixture(scope="module")
def qwen3():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # transformers imports what its forward needs, before any stand-in
        model(input_ids=IDS)
    return model


IDS = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "table",
    [{"freq": 2}, {"layer_modes": ["full", "none", "selective", "none"]}],
    ids=["freq=2", "layer_modes with none"],
)
def test_layers_without_ac_leave_no_more_than_prime_rls_offloader(qwen3, table):
    reference = copy.deepcopy(qwen3)
    reference(input_ids=IDS, labels=IDS).loss.backward()

    config = prime_ac.ACConfig.from_dict({**table, "ac_offloading": {"pin_memory": False}})
    model = copy.deepcopy(qwen3)
    prime_ac.checkpoint_blocks(model, config=config)
    offload = config.input_offload()
    with offload:
        loss = model(input_ids=IDS, labels=IDS).loss
    moved = offload.ledger.host
    loss.backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name

    theirs = copy.deepcopy(qwen3)
    prime_ac.checkpoint_blocks(theirs, config=config)
    rule = PrimeRlRule()
    with rule:
        loss = theirs(input_ids=IDS, labels=IDS).loss
    loss.backward()
    left_by_prime_rl = sum(rule.left.values())
    assert 0 < offload.left_bytes <= left_by_prime_rl == 3_948
    # what moved: whole storages, each once (prime-rl copies by elements, parameters' views too)
    assert moved == 465_664 and rule.moved == 902_144
    assert offload.ledger.host == 0


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class _Pair(torch.autograd.Function):
    """y = a * b, recording what backward gets back."""

    seen: list = []

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        _Pair.seen.append((a, b))
        return grad * b, grad * a


def test_two_views_of_one_storage_move_once_and_alias_on_the_way_back():
    x = torch.randn(64, 32, requires_grad=True)
    offload = SavedInputOffload(pin_memory=False)
    _Pair.seen = []
    with offload:
        h = x * 2.0
        left, right = h[:, :16], h[:, 16:]  # views of h's storage (8 KiB)
        out = _Pair.apply(left, right)
    assert offload.ledger.offloaded == 1 and offload.ledger.host == 64 * 32 * 4
    assert offload.left_bytes == 0
    records = [r for _, r in offload._saved]
    assert len(records) == 2 and records[0].copy is records[1].copy
    del records
    out.sum().backward()
    a, b = _Pair.seen[0]
    assert _aliases(a, b) and not _aliases(a, h)  # one storage brought back, not the device one
    assert (a.storage_offset(), b.storage_offset()) == (0, 16)
    assert a.stride() == b.stride() == (32, 1)
    assert torch.equal(x.grad, _grad(x))
    assert offload.ledger.host == 0


def _grad(x):
    y = x.detach().clone().requires_grad_()
    h = y * 2.0
    (h[:, :16] * h[:, 16:]).sum().backward()
    return y.grad


def test_a_storage_written_between_two_saves_is_copied_again_and_raises_as_without():
    """A view saved after its storage was written (in place, as autograd sees it) is not
    served by the copy made before the write; the view saved before it raises in backward,
    as without the offload (views share their base's version counter)."""

    def run(offload):
        x = torch.randn(64, 32, requires_grad=True)
        with offload if offload is not None else torch.enable_grad():
            h = x * 2.0
            first = h[:, :16].sin()  # saves h[:, :16]
            with torch.no_grad():
                h[:, 16:] += 1.0
            second = h[:, 16:].cos()  # saves h[:, 16:], after the write
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (first.sum() + second.sum()).backward()

    run(None)
    offload = SavedInputOffload(pin_memory=False)
    run(offload)
    assert offload.ledger.offloaded == 2


@pytest.mark.parametrize("where", ["the view", "the base", "another part of the storage"])
def test_an_in_place_write_after_a_view_is_saved_raises_as_without_offload(where):
    def run(offload):
        x = torch.randn(64, 32, requires_grad=True)
        with offload if offload is not None else torch.enable_grad():
            h = x * 2.0
            view = h[:, :16]
            out = view.sin()
        target = {"the view": view, "the base": h, "another part of the storage": h[:, 16:]}
        with torch.no_grad():
            target[where].add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
            out.sum().backward()
        return raised

    run(None)
    run(SavedInputOffload(pin_memory=False))


def test_views_of_parameters_stay():
    linear = torch.nn.Linear(64, 64)
    offload = SavedInputOffload(pin_memory=False)
    with offload:
        out = torch.nn.functional.linear(torch.randn(8, 64), linear.weight)
    # addmm / mm save weight.t(), a view of the parameter: the model's memory, not moved
    assert offload.ledger.offloaded == 1  # the input (2 KiB)
    assert offload.left_bytes == 0
    out.sum().backward()


@pytest.mark.usefixtures("stand_in_streams")
def test_the_stream_path_moves_views_by_storage_with_two_forwards_in_flight(qwen3):
    """The CUDA path's bookkeeping (stand-in streams, tests/test_ac_input_offload.py) on prime-rl's
    layers without AC: views share their storage's copy and its inbound copy, the unpack before
    each starts bringing back the storage saved before it; bitwise, the pool serving step 2."""
    reference = copy.deepcopy(qwen3)
    reference(input_ids=IDS, labels=IDS).loss.backward()
    model = copy.deepcopy(qwen3)
    prime_ac.checkpoint_blocks(model, config=prime_ac.ACConfig(freq=2))
    offload = _StandInCuda(pin_memory=False, max_inflight=2)
    allocations = []
    for _ in range(2):
        model.zero_grad()
        with offload:
            first = model(input_ids=IDS, labels=IDS).loss
        with offload:
            second = model(input_ids=IDS, labels=IDS).loss
        (0.5 * first + 0.5 * second).backward()
        del first, second
        allocations.append(offload.buffer_allocations)
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
        assert offload.ledger.host == 0
    assert allocations[0] > 0 and allocations[1] == allocations[0]
    assert "prefetched" in offload.found
