"""prime_ac with saved-tensor offloading, and with FSDP2's all-gathers.

Offloading: the audit splits held bytes per device, so a saved-tensor hook that moves saved
tensors off a device shows up in that device's figure. The hook here moves each saved tensor
out of torch's storages (into Python bytes) and back: everything autograd saves leaves the
figure (under full AC that includes the blocks' inputs, which checkpoint saves), and what
selective AC keeps inside a region stays, because kept outputs live in the region's own cache
and never pass through saved-tensor hooks (docs/checkpointing.md, "Offloading"). Gradients stay
bitwise equal to the model without AC.

FSDP2: on 2 gloo ranks, the all-gathers of one training step are counted per checkpoint mode
and ``reshard_after_forward`` setting; full AC adds none.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ac_models import CountingModel, assert_bitwise_equal, grads

import prime_ac


def _pack(t: torch.Tensor):
    """Take a saved tensor's data out of torch storages (as offloading to disk would)."""
    data = t.data if t.is_contiguous() else t.data.contiguous()
    return data.numpy().tobytes(), data.dtype, data.shape


def _unpack(packed) -> torch.Tensor:
    raw, dtype, shape = packed
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)


def _offloaded(loss_fn):
    def run(model):
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            return loss_fn(model)

    return run


def test_offloading_moves_saved_tensors_out_of_the_device_figure_but_not_kept_outputs():
    torch.manual_seed(0)
    base, x = CountingModel(), torch.randn(16, 8)

    def loss(m):
        return m(x * 1.0)  # the batch is made in the step, as on a device

    plain = copy.deepcopy(base)
    loss(plain).backward()
    expected = grads(plain)

    reports = {}
    for mode, targets in (("full", None), ("selective", ["prime_ac_test"])):
        model = copy.deepcopy(base)
        prime_ac.checkpoint_blocks(model, mode=mode, targets=targets)
        reports[mode] = report = prime_ac.audit(model, _offloaded(loss))
        # the baseline without AC offloads every saved tensor: nothing stays in torch storages
        assert report.held_bytes_no_ac_by_device == {}
        assert report.held_bytes == sum(report.held_bytes_by_device.values())
        model.zero_grad(set_to_none=True)
        _offloaded(loss)(model).backward()
        assert_bitwise_equal(grads(model), expected)

    # selective holds exactly what its regions kept: the hooks never saw it
    kept = sum(reports["selective"].block_kept_bytes().values())
    assert kept > 0
    # full AC: the blocks' inputs are checkpoint's saved inputs, offloaded like any saved tensor
    assert reports["full"].held_bytes_by_device == {}
    held = {mode: r.held_bytes_by_device.get("cpu", 0) for mode, r in reports.items()}
    assert held["selective"] == kept
    without_hooks = prime_ac.audit(model, loss)
    assert without_hooks.held_bytes_by_device["cpu"] > held["selective"]
    assert without_hooks.held_bytes_no_ac_by_device["cpu"] > 0
    assert "held per device: cpu" in str(without_hooks)


def _count_all_gathers(counts: dict[str, int], phase: list[str]):
    """Count FSDP2's all-gathers per phase: it calls them through ``torch.distributed``."""
    import torch.distributed as dist

    for name in ("all_gather_single", "all_gather_into_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, **kwargs):
            counts[phase[0]] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _all_gather_body(rank: int, world_size: int, results) -> None:
    from torch.distributed.fsdp import fully_shard

    from prime_ac.models import build_model

    counts: dict[str, int] = {}
    phase = ["forward"]
    _count_all_gathers(counts, phase)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    base = build_model("moe", n_layers=2)
    table = {}
    for reshard in (True, False):
        reference = None
        for mode in ("none", "full", "selective"):
            model = copy.deepcopy(base)
            if mode != "none":
                prime_ac.checkpoint_blocks(model, mode=mode)
            for layer in model.layers:
                fully_shard(layer, reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
            counts.update(forward=0, backward=0)
            phase[0] = "forward"
            loss = model.loss(tokens)
            phase[0] = "backward"
            loss.backward()
            table[(mode, reshard)] = (counts["forward"], counts["backward"])
            local = {n: p.grad.to_local() for n, p in model.named_parameters()}
            if reference is None:
                reference = local
            else:
                assert_bitwise_equal(local, reference)
    results.put((rank, table))


@pytest.mark.slow
def test_full_ac_adds_no_fsdp2_all_gathers():
    """Per mode and reshard_after_forward: the recompute runs inside the block's backward, after
    FSDP's pre-backward all-gather, so checkpointing gathers nothing more (docs: "With
    torch.compile and FSDP")."""
    import torch.multiprocessing as mp

    from tests.dist_utils import run_distributed

    results = mp.get_context("forkserver").SimpleQueue()
    run_distributed(_all_gather_body, 2, results, timeout=120)
    tables = dict(results.get() for _ in range(2))
    assert tables[0] == tables[1]
    table = tables[0]
    for reshard in (True, False):
        assert table[("full", reshard)] == table[("none", reshard)]
        assert table[("selective", reshard)] == table[("none", reshard)]
    # 3 FSDP groups (2 layers, the root) gather in the forward; resharded after it (the root
    # too, being told so), each gathers once more in the backward
    assert table[("none", True)] == (3, 3)
    assert table[("none", False)] == (3, 0)


def _input_offload_body(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import fully_shard

    from prime_ac.models import build_model

    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    base = build_model("dense", n_layers=2)
    local = {}
    for offloaded in (False, True):
        model = copy.deepcopy(base)
        config = prime_ac.ACConfig.from_dict({"freq": 1, "ac_offloading": {}})
        prime_ac.checkpoint_blocks(model, config=config)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        offload = config.input_offload() if offloaded else None
        for _ in range(2):  # micro-batches: the second step draws its host buffers from the pool
            with offload if offload is not None else torch.enable_grad():
                loss = model.loss(tokens)
            loss.backward()
            del loss
        local[offloaded] = {n: p.grad.to_local() for n, p in model.named_parameters()}
        if offload is not None:
            # the blocks' inputs moved, not FSDP's parameters or their unsharded copies
            assert offload.ledger.offloaded >= 2 * 2 and offload.ledger.host == 0
            assert offload.buffer_allocations == offload.ledger.offloaded // 2
    assert_bitwise_equal(local[True], local[False])


def test_prime_rls_offloading_under_fsdp2():
    """prime-rl's [trainer.model.ac_offloading] with full AC on FSDP2 (2 gloo ranks,
    reshard_after_forward): the sharded gradients equal those without offload bitwise."""
    from tests.dist_utils import run_distributed

    run_distributed(_input_offload_body, 2, timeout=120)
