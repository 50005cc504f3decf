"""Compiled blocks with a plan that offloads, on CUDA (issue 44): torch's compile-side offload.

The CPU suite (tests/test_ac_compile_plans.py) checks the tags, the offload graph on the meta
device and the gradients; here the offload runs: ``ao::offload`` / ``ao::reload`` on torch's
side stream into its pinned pool. Each block offloads the results of its two GEMMs (the plan a
peak budget would make where replay is dear); gradients are bitwise those of the same blocks
compiled keeping those results, and the step's peak is lower by at least one block's share of
what left the device (the reloads are prefetched one block ahead).
Times are printed (compiled offload, compiled keep, eager offload), never asserted.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch import nn

import prime_ac
from prime_ac.budget import BlockPlan, budget_context_fn
from prime_ac.compiled import compiled_offload_supported
from prime_ac.measure import measure_peak
from prime_ac.offload import Offloader
from prime_ac.wrapping import checkpoint_state, wrap_block

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,  # inductor compiles cold: scripts/gpu_check.sh's ac_compile step
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not compiled_offload_supported(), reason="needs torch 2.13+"),
]

DIM, TOKENS, LAYERS = 1024, 8192, 4
MM = torch.ops.aten.mm.default
ADDMM = torch.ops.aten.addmm.default


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


def _model(decision, backend):
    """LAYERS blocks, each keeping or offloading (``decision``) both its GEMMs' results."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(LAYERS))).cuda()
    prime_ac.checkpoint_blocks(model, mode="full", blocks=lambda n, m: isinstance(m, Block))
    offloader = Offloader(None)
    calls = ((ADDMM, 0), (ADDMM, 1))
    for name, block in model.named_children():
        state = checkpoint_state(block)
        kept, offloaded = (calls, ()) if decision == "keep" else ((), calls)
        plan = BlockPlan(name, 0, kept, 0, 0, offloaded=offloaded, offloader=offloader)
        fn = budget_context_fn(
            state.policy, frozenset(kept), name, frozenset(offloaded), offloader
        )
        wrap_block(block, dataclasses.replace(state, plan=plan, context_fn=fn))
        if backend is not None:
            block.compile(backend=backend, fullgraph=True)
    return model


def _step(model):
    x = torch.randn(TOKENS, DIM, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    return (
        time.perf_counter() - t0,
        torch.cuda.max_memory_allocated() - start,
        [p.grad.clone() for p in model.parameters()],
    )


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_offload_moves_the_planned_results_and_keeps_gradients(backend):
    torch._dynamo.reset()
    offload, keep = _model("offload", backend), _model("keep", backend)
    for model in (offload, keep):
        _step(model)  # compiles; the pinned pool fills
    t_off, peak_off, g_off = _step(offload)
    t_keep, peak_keep, g_keep = _step(keep)
    eager = _model("offload", None)
    _step(eager)
    t_eager, peak_eager, _ = _step(eager)
    assert all(torch.equal(a, b) for a, b in zip(g_off, g_keep, strict=True))
    # up's result (gelu's backward reads it) leaves; down's is read by no backward, so the
    # partitioner saves nothing of it either way
    moved = LAYERS * TOKENS * 4 * DIM * 4
    assert peak_off < peak_keep - moved // 4, (peak_off, peak_keep, moved)
    print(
        f"\n{backend}: compiled offload {t_off * 1e3:.1f} ms, peak {peak_off >> 20} MiB; "
        f"compiled keep {t_keep * 1e3:.1f} ms, peak {peak_keep >> 20} MiB; "
        f"eager offload {t_eager * 1e3:.1f} ms, peak {peak_eager >> 20} MiB"
    )


def test_a_peak_budget_holds_in_compiled_blocks():
    """checkpoint_blocks(targets="auto", budget=<peak>) calibrated eagerly, then every block
    compiled (inductor): the compiled step's real peak (the allocator's) stays within the
    budget, and planning again on the compiled blocks (the calibration then measures the
    compiled step) keeps it there too."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(TOKENS, DIM, device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def loss(m):
        return m(x).float().square().mean()

    model = nn.Sequential(*(Block() for _ in range(LAYERS))).cuda()
    no_ac = measure_peak(model, loss)  # as the planner measures: weight gradients exist already
    budget = no_ac // 2
    kwargs = dict(mode="selective", targets="auto", budget=budget, profile=loss)
    prime_ac.checkpoint_blocks(model, blocks=lambda n, m: isinstance(m, Block), **kwargs)
    for block in model:
        block.compile(backend="inductor", fullgraph=True)
    measure_peak(model, loss)  # compiles
    compiled_peak = measure_peak(model, loss)
    prime_ac.checkpoint_blocks(model, blocks=lambda n, m: isinstance(m, Block), **kwargs)
    measure_peak(model, loss)
    replanned_peak = measure_peak(model, loss)
    print(
        f"\nbudget {budget >> 20} MiB (no AC {no_ac >> 20} MiB): compiled peak "
        f"{compiled_peak >> 20} MiB, planned on the compiled blocks {replanned_peak >> 20} MiB"
    )
    assert compiled_peak <= budget * 1.05
    assert replanned_peak <= budget * 1.05
