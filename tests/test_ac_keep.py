"""prime_ac.keep: the output of a call no dispatch mode sees, kept by name instead of run again in
the recompute (an autograd.Function launching a kernel outside torch.library)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

import prime_ac


class Invisible(torch.autograd.Function):
    """A fused tanh(x @ w) whose forward no dispatch mode sees, as a Triton launch would not."""

    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        Invisible.calls += 1
        with _disable_current_modes():
            y = torch.tanh(x @ w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w, y = ctx.saved_tensors
        g = grad * (1 - y * y)
        return g @ w.t(), x.t() @ g


kept_tanh_mm = prime_ac.keep(Invisible.apply, "tanh_mm")


class Block(nn.Module):
    def __init__(self, fused, dim: int = 8):
        super().__init__()
        self.fused = fused
        self.proj = nn.Linear(dim, dim)
        self.w = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.out(self.fused(self.proj(x), self.w))


class Model(nn.Module):
    def __init__(self, fused, n: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Block(fused) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build(fused) -> Model:
    torch.manual_seed(0)
    return Model(fused)


def grads_and_calls(model: nn.Module) -> tuple[list[torch.Tensor], int]:
    Invisible.calls = 0
    torch.manual_seed(1)
    model(torch.randn(6, 8)).square().sum().backward()
    return [p.grad for p in model.parameters()], Invisible.calls


@pytest.mark.parametrize(
    "settings", [dict(mode="full"), dict(mode="selective", targets=["aten::addmm"])]
)
def test_kept_call_runs_once_and_gradients_are_bitwise(settings):
    want, calls = grads_and_calls(build(Invisible.apply))
    assert calls == 2  # one per block, no checkpointing

    replayed = build(Invisible.apply)
    prime_ac.checkpoint_blocks(replayed, **settings)
    got, calls = grads_and_calls(replayed)
    assert calls == 4  # the recompute runs each again
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

    kept = build(kept_tanh_mm)
    prime_ac.checkpoint_blocks(kept, **settings)
    got, calls = grads_and_calls(kept)
    assert calls == 2  # handed back in the recompute
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_dispatched_operators_inside_a_kept_call_do_not_shift_the_kept_ones():
    """The kept function's own mm is neither counted nor kept in the forward (the recompute
    never runs it), so the block's other kept mm calls line up in the recompute."""
    inner = prime_ac.keep(lambda x, w: torch.tanh(x @ w), "visible_tanh_mm")
    want, _ = grads_and_calls(build(lambda x, w: torch.tanh(x @ w)))
    model = build(inner)
    prime_ac.checkpoint_blocks(model, mode="selective", targets=["aten::mm", "aten::addmm"])
    got, _ = grads_and_calls(model)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_outside_a_checkpointed_block_it_is_a_plain_call():
    Invisible.calls = 0
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4)
    assert torch.equal(kept_tanh_mm(x, w), Invisible.apply(x, w))
    assert Invisible.calls == 2


def test_decorator_forms_and_names():
    @prime_ac.keep
    def doubled(x):
        return x * 2

    @prime_ac.keep(name="tripled")
    def tripled(x):
        return x * 3

    x = torch.ones(2)
    assert torch.equal(doubled(x), x * 2) and torch.equal(tripled(x), x * 3)
    assert doubled.__name__ == "doubled"
    with pytest.raises(TypeError, match="prime_ac.keep takes the function"):
        prime_ac.keep(3)
    with pytest.raises(TypeError, match="name="):
        prime_ac.keep(doubled, name="")


class Shifting(nn.Module):
    """Calls the kept function with other shapes in the recompute than in the forward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.rows = 6

    def forward(self, x):
        y = kept_tanh_mm(x[: self.rows], self.w)
        self.rows -= 1  # state the recompute sees changed
        return y.sin()  # saves y: the recompute runs


def test_a_recompute_that_calls_it_differently_raises_naming_it():
    model = nn.Sequential(Shifting())
    prime_ac.checkpoint_blocks(model, blocks=lambda name, module: isinstance(module, Shifting))
    loss = model(torch.randn(6, 8)).sum()
    with pytest.raises(prime_ac.ReplayMismatchError, match=r"prime_ac\.keep\('tanh_mm'\)"):
        loss.backward()
