"""prime-rl's pipeline activation offloading, served by prime_ac.pipeline_offload, on CPU.

Mirrors PrimeIntellect-ai/prime-rl's src/prime_rl/trainer/pipeline_offload.py @ 3b2b0ef2a021
(``PipelineActivationOffloader``: ``forward(key)`` around a forward collects what is passed into
the stage and into its ``layers`` / ``engrams`` blocks, ``swap_out(key, output)`` moves it off the
device with ``storage.resize_(0)`` (tensor identity kept), ``prefetch(key)`` / ``wait(key)`` before
the backward; ``target="fp8"`` keeps bf16 on the device as FP8 e4m3 with one fp32 scale (amax /
448) per 128 values; ``offload_plan(run_ops, stages, prefetch_ahead)``), how its
``AsyncPipelineSchedule`` calls them (src/prime_rl/trainer/parallel/pipeline.py, index file id
70228977324: prefetch at ``prefetch_at[run_index]`` before each run op, ``wait`` before a backward
of an offloaded micro-batch), its 1F1B order (``one_f_one_b_order``: rank r runs
``min(n, pp - r)`` warmup forwards with step 1, then alternates backward and forward) and its
config (src/prime_rl/configs/trainer.py, index file id 70119220815:
``PipelineActivationOffloadConfig``: ``min_bytes`` 64 MiB, ``prefetch_ahead`` 2, ``stages``
None). The two-stage schedule runs on two gloo ranks (tests/dist_utils.py); gradients are
compared bitwise with the same schedule without offload.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import prime_ac
from prime_ac.pipeline_offload import (
    PipelineActivationOffload,
    PipelineOffloadConfig,
    dequantize_fp8,
    offload_plan,
    quantize_fp8,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import run_distributed  # noqa: E402

DIM, TOKENS, BATCH, MICRO_BATCHES = 64, 32, 2, 4
ACT_BYTES = BATCH * TOKENS * DIM * 4  # one activation: 16 KiB


def one_f_one_b_order(pp: int, n: int, rank: int) -> list[tuple[str, int, int]]:
    """prime-rl's 1F1B order with warmup step 1 (rank r: min(n, pp - r) warmup forwards)."""
    warmup = min(n, pp - rank)
    order = [("F", rank, mb) for mb in range(warmup)]
    for mb in range(n):
        order.append(("B", rank, mb))
        if warmup + mb < n:
            order.append(("F", rank, warmup + mb))
    return order


# --- the config and the plan ----------------------------------------------------------------------


def test_the_table_reads_with_prime_rls_defaults_and_meaning():
    config = prime_ac.ACConfig.from_dict({"mode": "full", "pp_activation_offload": {}})
    table = config.pp_activation_offload
    assert (table.min_bytes, table.prefetch_ahead, table.stages, table.target) == (
        64 * 2**20,
        2,
        None,
        "host",
    )
    alone = prime_ac.ACConfig.from_dict({"prefetch_ahead": 1, "stages": [0, 3]})
    assert alone.pp_activation_offload.stages == (0, 3)
    assert prime_ac.ACConfig().pipeline_offload([nn.Linear(2, 2)]) is None
    for bad, match in [
        ({"prefetch_ahead": 0}, "prefetch_ahead=0 must be an integer >= 1"),
        ({"min_bytes": 0}, "min_bytes=0 must be an integer >= 1"),
        ({"target": "nvme"}, "target='nvme' must be 'host'"),
        ({"stages": "0"}, "stages='0' must be a list"),
        ({"prefetch": 2}, r"unknown pp_activation_offload key\(s\) \['prefetch'\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            prime_ac.ACConfig.from_dict({"mode": "full", "pp_activation_offload": bad})
    assert PipelineOffloadConfig().target == "host"  # fp8 (lossy) only when asked for


def test_offload_plan_on_prime_rls_1f1b_order():
    order = one_f_one_b_order(2, MICRO_BATCHES, 0)
    assert order == [
        ("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2),
        ("B", 0, 1), ("F", 0, 3), ("B", 0, 2), ("B", 0, 3),
    ]  # fmt: skip
    offloaded, prefetch_at = offload_plan(order, None, 1)
    assert offloaded == {(0, 0), (0, 1), (0, 2), (0, 3)}
    assert prefetch_at == {1: [(0, 0)], 3: [(0, 1)], 5: [(0, 2)], 6: [(0, 3)]}
    offloaded, prefetch_at = offload_plan(order, None, 2)  # prime-rl's default
    assert offloaded == {(0, 1), (0, 2)} and prefetch_at == {2: [(0, 1)], 4: [(0, 2)]}
    assert offload_plan(order, [1], 1) == (set(), {})  # stage 0 does not offload
    last = one_f_one_b_order(2, MICRO_BATCHES, 1)  # each backward right after its forward
    assert offload_plan(last, None, 1) == (set(), {})


# --- one stage, one process --------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(nn.functional.silu(self.up(x)))


class Stage(nn.Module):
    """A pipeline stage as prime-rl's model parts hold it: its decoder layers in ``layers``."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _inputs(seed: int, n: int = MICRO_BATCHES, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, TOKENS, DIM, generator=g).to(dtype) for _ in range(n)]


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def test_one_stage_keeps_identity_empties_storages_and_gives_bitwise_gradients():
    torch.manual_seed(0)
    base = Stage()
    reference, stage = copy.deepcopy(base), copy.deepcopy(base)
    for m in (reference, stage):
        prime_ac.checkpoint_blocks(m, mode="full")
    xs = _inputs(0, 2)
    for x in xs:
        reference(x.clone()).square().mean().backward()

    offload = PipelineActivationOffload([stage], PipelineOffloadConfig(min_bytes=1024))
    for step in range(2):
        stage.zero_grad(set_to_none=True)
        inputs = [x.clone() for x in xs]
        losses = []
        for mb, x in enumerate(inputs):
            with offload.forward((0, mb)):
                out = stage(x)
            offload.swap_out((0, mb), out)
            assert x.untyped_storage().nbytes() == 0  # emptied in place: the same tensor object
            losses.append(out.square().mean())
        assert offload.pending() == [(0, 0), (0, 1)]
        # the stage input and each block's input, per micro-batch (the output stays: it is sent)
        assert offload.ledger.host == 2 * 2 * ACT_BYTES
        for mb in reversed(range(2)):
            offload.wait((0, mb))
            assert torch.equal(inputs[mb], xs[mb])  # refilled, identity kept
            losses[mb].backward()
        if step == 0:
            allocations = offload.buffer_allocations
        assert offload.ledger.host == 0 and offload.pending() == []
    assert offload.buffer_allocations == allocations == 4  # the second step drew from the pool
    assert all(torch.equal(a, b) for a, b in zip(_grads(stage), _grads(reference), strict=True))
    offload.close()


def test_the_host_cap_leaves_what_does_not_fit_and_a_recompute_is_not_collected():
    torch.manual_seed(0)
    stage = Stage()
    prime_ac.checkpoint_blocks(stage, mode="full")
    reference = copy.deepcopy(stage)
    x = _inputs(1, 1)[0]
    reference(x.clone()).sum().backward()
    config = PipelineOffloadConfig(min_bytes=1024, host_cap=ACT_BYTES)
    offload = PipelineActivationOffload([stage], config)
    with offload.forward((0, 0)):
        out = stage(x.clone())
    offload.swap_out((0, 0), out)
    assert offload.ledger.offloaded == 1 and offload.ledger.overflowed == 1
    assert offload.ledger.peak_host == ACT_BYTES
    offload.wait((0, 0))
    out.sum().backward()  # the recompute's block inputs run outside forward(): not collected
    assert offload._candidates == {}
    assert all(torch.equal(a, b) for a, b in zip(_grads(stage), _grads(reference), strict=True))


def test_fp8_target_error_bound_and_what_it_leaves():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 3, 256, generator=g) * torch.logspace(-6, 3, 256)).bfloat16()
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert q.numel() == x.numel() and scale.numel() == x.numel() // 128  # one scale per 128
    back = torch.empty_like(x)
    dequantize_fp8(q, scale, back)
    groups = x.float().reshape(-1, 128)
    err = (back.float().reshape(-1, 128) - groups).abs()
    # e4m3: 3 mantissa bits (half an ulp: 1/16 relative), subnormals below 2**-6 of the scale
    # (spacing 2**-9), then bf16's rounding of the result (2**-9 relative)
    bound = groups.abs() * (2**-4 + 2**-8) + scale[:, None] * 2**-9
    assert torch.all(err <= bound)
    assert err.max() > 0  # lossy: never the default
    assert (err / bound).max() > 0.5  # the bound is not loose by more than 2x

    # prime-rl's condition: bf16, contiguous, whole storage, last dim a multiple of 128
    stage = Stage().bfloat16()  # DIM = 64
    fp8 = PipelineOffloadConfig(min_bytes=1024, target="fp8")
    offload = PipelineActivationOffload([stage], fp8)
    x = _inputs(2, 1, torch.bfloat16)[0]
    with offload.forward((0, 0)):
        out = stage(x)
    offload.swap_out((0, 0), out)
    assert offload.ledger.offloaded == 0 and x.untyped_storage().nbytes() > 0


def test_fp8_target_compresses_on_the_device_and_refills_in_place():
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(2)
            )

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    stage = Wide().bfloat16()
    prime_ac.checkpoint_blocks(stage, mode="full")
    x = torch.randn(4, 16, 128).bfloat16()
    fp8 = PipelineOffloadConfig(min_bytes=1024, target="fp8")
    offload = PipelineActivationOffload([stage], fp8)
    with offload.forward((0, 0)):
        out = stage(x)
    offload.swap_out((0, 0), out)
    assert offload.ledger.offloaded == 2  # the stage input (= block 0's) and block 1's input
    assert x.untyped_storage().nbytes() == 0
    assert offload.ledger.device == 2 * (4 * 16 * 128 + 4 * 4 * 16)  # fp8 values + scales
    offload.wait((0, 0))
    assert x.untyped_storage().nbytes() == 4 * 16 * 128 * 2
    out.float().sum().backward()  # no "modified by an inplace operation": refilled via an alias
    assert offload.ledger.device == 0


# --- two stages on two gloo ranks ---------------------------------------------------------------


def _pipeline_step(rank, stage, inputs, offload, plan):
    """One step of prime-rl's 1F1B order on this rank (stage = rank), as its schedule calls the
    offloader; activations and gradients cross with isend / recv."""
    order = one_f_one_b_order(2, MICRO_BATCHES, rank)
    offloaded, prefetch_at = plan if plan is not None else (set(), {})
    sends, outs, xs, losses = [], {}, {}, {}
    for index, (kind, idx, mb) in enumerate(order):
        for key in prefetch_at.get(index, ()):
            offload.prefetch(key)
        offload_this = offload is not None and (idx, mb) in offloaded
        if kind == "F":
            if rank == 0:
                x = inputs[mb].clone()
            else:
                x = torch.empty(BATCH, TOKENS, DIM)
                dist.recv(x, src=0)
                x.requires_grad_()
            xs[mb] = x
            with offload.forward((idx, mb)) if offload_this else torch.enable_grad():
                out = stage(x)
            if offload_this:
                offload.swap_out((idx, mb), out)
                assert x.untyped_storage().nbytes() == 0
            if rank == 0:
                sends.append(dist.isend(out.detach(), dst=1))
                outs[mb] = out
            else:
                losses[mb] = out.square().mean()
        else:
            if offload_this:
                offload.wait((idx, mb))
            if rank == 1:
                losses.pop(mb).backward()
                sends.append(dist.isend(xs.pop(mb).grad, dst=0))
            else:
                grad = torch.empty(BATCH, TOKENS, DIM)
                dist.recv(grad, src=1)
                outs.pop(mb).backward(grad)
                xs.pop(mb)
    for work in sends:
        work.wait()


def _two_stages(rank, world_size):
    torch.manual_seed(0)
    full = nn.ModuleList(Stage() for _ in range(2))  # the same weights on both ranks
    inputs = _inputs(3)
    results = {}
    for label, config in [
        ("no offload", None),
        ("offload", PipelineOffloadConfig(min_bytes=1024, prefetch_ahead=1)),
        (
            "offload, capped",
            PipelineOffloadConfig(min_bytes=1024, prefetch_ahead=1, host_cap=ACT_BYTES),
        ),
    ]:
        stage = copy.deepcopy(full[rank])
        prime_ac.checkpoint_blocks(stage, mode="full")
        offload = None if config is None else PipelineActivationOffload([stage], config)
        plan = None if offload is None else offload.plan(one_f_one_b_order(2, MICRO_BATCHES, rank))
        for step in range(2):
            _pipeline_step(rank, stage, inputs, offload, plan)
            if offload is not None:
                assert offload.pending() == [] and offload.ledger.host == 0
                if step == 0:
                    allocations = offload.buffer_allocations
        results[label] = _grads(stage)
        if offload is None:
            continue
        assert offload.buffer_allocations == allocations  # the second step drew from the pool
        if rank == 1:  # 1F1B's last stage runs each backward right after its forward
            assert offload.ledger.offloaded == 0
        elif config.host_cap is None:
            # 4 micro-batches x (stage input = block 0's input, block 1's input), two steps
            assert offload.ledger.offloaded == 2 * 4 * 2
            # one micro-batch off the device at a time: with prefetch_ahead=1 each comes back
            # before the next forward (prefetch_at {1: mb 0, 3: mb 1, 5: mb 2, 6: mb 3})
            assert offload.ledger.peak_host == 2 * ACT_BYTES
        else:
            assert offload.ledger.peak_host == ACT_BYTES and offload.ledger.overflowed > 0
    for label in ("offload", "offload, capped"):
        assert all(
            torch.equal(a, b) for a, b in zip(results[label], results["no offload"], strict=True)
        ), (rank, label)


def test_a_two_stage_1f1b_schedule_on_gloo_ranks_is_bitwise_with_offload():
    run_distributed(_two_stages, 2)
