"""checkpoint_blocks(respect_saved_tensors_hooks=True): the saved-tensor hooks around the step
pack prime_ac's kept results too, each tagged with its kind (prime_ac.saved_tensor_kind)."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from torch import nn

import prime_ac
from prime_ac._compat import CHECKPOINT_RESPECTS_HOOKS


class Block(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.a = nn.Linear(dim, 2 * dim)
        self.b = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Model(nn.Module):
    def __init__(self, n: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class OffloadLike:
    """save_on_cpu's shape on a CPU: pack makes a copy (the "host" tensor), unpack hands it
    back; counts what each kind packed. Torch 2.9's checkpoint saves a zero-element placeholder
    beside each block's inputs (its _NoopSaveInputs; 2.13 and 2.14 save the inputs alone):
    packed and unpacked like them, but left out of the counts, the same on every torch."""

    def __init__(self):
        self.packed: Counter = Counter()
        self.unpacked = 0

    def pack(self, t):
        if t.numel():
            self.packed[prime_ac.saved_tensor_kind()] += 1
        return t.detach().clone()

    def unpack(self, t):
        if t.numel():
            self.unpacked += 1
        return t


def step(model, hooks=None):
    torch.manual_seed(1)
    x = torch.randn(4, 8, requires_grad=True)
    if hooks is None:
        model(x).square().sum().backward()
    else:
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


def build(**settings):
    torch.manual_seed(0)
    model = Model()
    if settings:
        prime_ac.checkpoint_blocks(model, **settings)
    return model


SELECTIVE = dict(mode="selective", targets=["aten::addmm"])


def test_hooks_see_kept_results_and_inputs_with_their_kinds():
    want = step(build())
    hooks = OffloadLike()
    got = step(build(**SELECTIVE, respect_saved_tensors_hooks=True), hooks)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # per block: two kept addmm results, one input; outside the blocks: the loss's square
    assert hooks.packed == {"kept": 4, "checkpoint_input": 2, None: 1}
    assert hooks.unpacked == sum(hooks.packed.values())


def test_off_by_default_kept_results_bypass_the_hooks():
    want = step(build())
    hooks = OffloadLike()
    got = step(build(**SELECTIVE), hooks)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert hooks.packed == {None: 3}  # the two block inputs and the square, untagged


def test_full_mode_keeps_nothing_to_pack():
    hooks = OffloadLike()
    step(build(mode="full", respect_saved_tensors_hooks=True), hooks)
    assert hooks.packed == {"checkpoint_input": 2, None: 1}


def test_without_hooks_in_effect_nothing_changes():
    want = step(build())
    got = step(build(**SELECTIVE, respect_saved_tensors_hooks=True))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_kept_calls_are_tagged_as_such():
    kept = prime_ac.keep(torch.relu, "relu")

    class KeptBlock(Block):
        def forward(self, x):
            return x + self.b(kept(self.a(x)))

    torch.manual_seed(0)
    model = Model()
    model.layers = nn.ModuleList(KeptBlock() for _ in range(2))
    prime_ac.checkpoint_blocks(model, mode="full", respect_saved_tensors_hooks=True)
    hooks = OffloadLike()
    step(model, hooks)
    # per block: relu's output kept, and relu's own save (its output) held through the hooks
    assert hooks.packed == {"kept_call": 4, "checkpoint_input": 2, None: 1}


def test_bad_settings_name_the_argument():
    with pytest.raises(TypeError, match="respect_saved_tensors_hooks="):
        build(mode="full", respect_saved_tensors_hooks="yes")
    with pytest.raises(ValueError, match="offload="):
        build(**SELECTIVE, offload=["aten::addmm"], respect_saved_tensors_hooks=True)


@pytest.mark.parametrize("respect", [False, True])
def test_eager_blocks_under_hooks_raise_no_future_warning(respect):
    """torch 2.14 warns when a user's hooks surround its own selective checkpoint; prime_ac's
    eager regions run its own modes, so neither setting warns (on every torch)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(build(**SELECTIVE, respect_saved_tensors_hooks=respect), OffloadLike())
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.skipif(
    not CHECKPOINT_RESPECTS_HOOKS, reason="torch < 2.14 has no respect_saved_tensors_hooks"
)
def test_compiled_blocks_pass_torchs_flag_so_no_future_warning():
    model = build(**SELECTIVE)
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(compiled, OffloadLike())
    assert not [w for w in caught if "respect_saved_tensors_hooks" in str(w.message)]
