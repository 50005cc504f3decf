"""Small models and a counting custom op shared by the prime_ac tests."""

from __future__ import annotations

import torch
from torch import nn

CALLS = {"count": 0}


@torch.library.custom_op("prime_ac_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A stand-in for an expensive kernel: counts its forward executions."""
    CALLS["count"] += 1
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scaled_tanh_backward(ctx, grad):
    (out,) = ctx.saved_tensors
    return grad * (ctx.scale - out * out / ctx.scale), None


def _scaled_tanh_setup(ctx, inputs, output):
    ctx.scale = inputs[1]
    ctx.save_for_backward(output)


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


class CountingBlock(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return x + scaled_tanh(self.norm(self.proj(x)), 2.0)


class CountingModel(nn.Module):
    def __init__(self, n_blocks: int = 4, dim: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(CountingBlock(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs: {(a[name] - b[name]).abs().max()}"


class BlockStack(nn.Module):
    """``blocks`` instances of ``block`` in ``layers`` (where checkpoint_blocks finds them), and a
    loss: the mean square of the last output."""

    def __init__(self, block: type[nn.Module], blocks: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()
