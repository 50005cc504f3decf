"""prime-rl's async all-to-all is mandatory: kept in every mode, never replayed.

Its output is complete only after the ``sync_all_to_all`` that follows it; a recompute stops as
soon as it has every tensor the backward needs, so a replayed exchange could be read before its
rows arrive (and would start an exchange the other ranks do not). One gloo rank shows the rule.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from ac_models import assert_bitwise_equal
from torch import nn

import prime_ac
import prime_ops.collectives as collectives


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class AsyncExchange(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.up, self.down = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        out, handle = collectives.all_to_all_single_async(self.up(x), [x.shape[0]], [x.shape[0]])
        collectives.sync_all_to_all(handle)
        return x + self.down(out.sin())


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_async_all_to_all_runs_once_per_step_in_every_mode(one_rank, mode):
    torch.manual_seed(0)
    model = nn.Sequential(AsyncExchange(), AsyncExchange())
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    reference(x).square().sum().backward()
    prime_ac.checkpoint_blocks(model, mode=mode)
    before = collectives._issued
    model(x).square().sum().backward()
    assert collectives._issued - before == 2  # one exchange per block: none replayed
    assert_bitwise_equal(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in reference.named_parameters()},
    )
