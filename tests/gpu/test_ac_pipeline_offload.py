"""prime-rl's offloading on CUDA: pipeline stages (prime_ac.pipeline_offload) and saved views
moved through their base storage (SavedInputOffload).

The CPU suite (tests/compat/test_prime_rl_pipeline_offload.py, test_prime_rl_views_offload.py)
checks the bookkeeping with copies made at once; here the copies run on side streams into pinned
buffers. Races are provoked by ``torch.cuda._sleep`` on the copy streams ahead of the copies: a
missing wait shows as wrong gradients. Bytes are asserted, times never.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import prime_ac
from prime_ac.offload import SavedInputOffload
from prime_ac.pipeline_offload import (
    PipelineActivationOffload,
    PipelineOffloadConfig,
    dequantize_fp8,
    offload_plan,
    quantize_fp8,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DIM, TOKENS, BATCH, MICRO_BATCHES = 1024, 2048, 2, 4
ACT_BYTES = BATCH * TOKENS * DIM * 2  # bf16: 8 MiB
SLEEP_CYCLES = 20_000_000  # about 10 ms: longer than a block's compute


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class Stage(nn.Module):
    def __init__(self, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _order(n: int) -> list[tuple[str, int, int]]:
    """prime-rl's 1F1B order for stage 0 of 2 (warmup 2)."""
    order = [("F", 0, 0), ("F", 0, 1)]
    for mb in range(n):
        order.append(("B", 0, mb))
        if mb + 2 < n:
            order.append(("F", 0, mb + 2))
    return order


def _run(stage, inputs, offload, slow_copies: bool):
    order = _order(len(inputs))
    offloaded, prefetch_at = offload.plan(order) if offload is not None else (set(), {})
    if offload is not None and slow_copies:  # the copy streams start late: waits must hold
        for index in (0, 1):
            with torch.cuda.stream(offload._stream(index)):
                torch.cuda._sleep(SLEEP_CYCLES)
    xs, outs, held = {}, {}, []
    for index, (kind, idx, mb) in enumerate(order):
        for key in prefetch_at.get(index, ()):
            offload.prefetch(key)
        off = offload is not None and (idx, mb) in offloaded
        if kind == "F":
            xs[mb] = inputs[mb].clone().requires_grad_()
            with offload.forward((idx, mb)) if off else torch.enable_grad():
                outs[mb] = stage(xs[mb])
            if off:
                offload.swap_out((idx, mb), outs[mb])
                assert xs[mb].untyped_storage().nbytes() == 0
            held.append(torch.cuda.memory_allocated())
        else:
            if off:
                offload.wait((idx, mb))
            outs.pop(mb).float().square().mean().backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in stage.parameters()], max(held)


@pytest.mark.parametrize("slow_copies", [False, True])
def test_pipeline_stage_offload_on_cuda_is_bitwise_and_frees_the_device(slow_copies):
    torch.manual_seed(0)
    base = Stage().cuda().bfloat16()
    prime_ac.checkpoint_blocks(base, mode="full")
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [
        torch.randn(BATCH, TOKENS, DIM, device="cuda", generator=g).bfloat16()
        for _ in range(MICRO_BATCHES)
    ]
    reference = copy.deepcopy(base)
    expected, held_without = _run(reference, inputs, None, False)
    stage = copy.deepcopy(base)
    config = PipelineOffloadConfig(min_bytes=2**20, prefetch_ahead=1)
    offload = PipelineActivationOffload([stage], config)
    for step in range(2):
        stage.zero_grad(set_to_none=True)
        got, held = _run(stage, inputs, offload, slow_copies)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), step
        if step == 0:
            allocations = offload.buffer_allocations
    assert offload.buffer_allocations == allocations  # the pool served the second step
    assert offload.ledger.host == 0 and offload.pending() == []
    # each offloaded micro-batch: its stage input (= block 0's) and blocks 1 and 2's inputs
    assert offload.ledger.peak_host == 3 * ACT_BYTES
    # the allocator frees an emptied storage once its outbound copy is done: printed, not asserted
    print(f"held by the forwards: {held_without >> 20} MiB without, {held >> 20} MiB with offload")


def test_pipeline_fp8_target_on_cuda_keeps_the_error_bound():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(8, 4096, device="cuda", generator=g) * 10).bfloat16()
    q, scale = quantize_fp8(x)
    back = torch.empty_like(x)
    dequantize_fp8(q, scale, back)
    groups = x.float().reshape(-1, 128)
    err = (back.float().reshape(-1, 128) - groups).abs()
    assert torch.all(err <= groups.abs() * (2**-4 + 2**-8) + scale[:, None] * 2**-9)
    assert q.device.type == "cuda" and q.numel() + 4 * scale.numel() < x.numel() * 2 * 0.54


def test_offload_plan_is_device_free():
    assert offload_plan(_order(4), None, 2) == ({(0, 1), (0, 2)}, {2: [(0, 1)], 4: [(0, 2)]})


class Attention(nn.Module):
    """Saves views: q, k, v split from one projection, transposed for SDPA."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 8, DIM // 8)).transpose(1, 3).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(attn.transpose(1, 2).flatten(-2))


def test_saved_views_move_through_their_storage_on_cuda_bitwise():
    torch.manual_seed(0)
    base = nn.Sequential(Attention(), Attention()).cuda()
    x = torch.randn(BATCH, 512, DIM, device="cuda")
    reference = copy.deepcopy(base)
    reference(x).square().mean().backward()
    model = copy.deepcopy(base)
    offload = SavedInputOffload()
    torch.cuda._sleep(SLEEP_CYCLES)
    with offload:
        first = model(x).square().mean()
    with offload:  # two forwards in flight before their backwards
        second = model(x).square().mean()
    assert offload.left_bytes <= 2**20  # small tensors only: the views went with their storage
    (first + second).backward()
    torch.cuda.synchronize()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, 2 * b.grad)
    assert offload.ledger.host == 0
