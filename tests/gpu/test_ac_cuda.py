"""prime_ac on CUDA: bf16 Llama-style and MoE models under full and selective checkpointing.

The CPU suite reaches the host-sync rule (``aten::_to_copy`` from a device to the host,
``aten::_local_scalar_dense`` on a device tensor) only through stand-ins; here it meets real CUDA
syncs. Each test's reference is the same model without checkpointing, run with the same kernels:

- gradients: bitwise equal where the no-AC step is itself bitwise repeatable (it is with
  deterministic algorithms on, which the module turns on), else within ``GRAD_TOLERANCE``;
- host reads inside a block run once per step, and a checkpointed step syncs the host exactly as
  often as the no-AC step plus the syncs of the operators its recompute replays;
- blocks compiled one by one (``block.compile()`` after wrapping) train as compiled no-AC blocks;
- the audit's held bytes equal what the CUDA caching allocator holds at backward start.
"""

from __future__ import annotations

import copy
import gc
import warnings
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import prime_ac
from prime_ac.models import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

aten = torch.ops.aten
KINDS = ("dense", "moe")
MODES = ("full", "selective")
# Used only where the no-AC step is not bitwise repeatable: four bf16 ulps at the gradient's
# largest magnitude (bf16 keeps 8 significant bits; sums reordered by atomics move a few ulps).
GRAD_TOLERANCE = 2**-6
# Compiled blocks: inductor fuses a recomputed op into a backward kernel and may keep it in fp32
# where the no-AC graph rounded it to bf16 when saving it, so compiled AC is close, not bitwise.
COMPILED_TOLERANCE = 2e-2
# Syncing operators a recompute may run again: their result lives on the device, so replaying
# them costs a sync but reads nothing new into the host (the MoE router's torch.where).
REPLAYABLE_SYNCS = (aten.nonzero.default,)
ALLOCATOR_ROUNDING = 512  # the caching allocator rounds every block up to a multiple of 512 B


@pytest.fixture(autouse=True, scope="module")
def deterministic_kernels():
    """Deterministic algorithms (SDPA's flash backward, index_add) so AC vs no-AC is bitwise;
    warn_only, so an op without a deterministic kernel still runs (the tolerance then applies)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _model(kind: str, n_layers: int = 2) -> nn.Module:
    hidden = 512 if kind == "dense" else 256
    model = build_model(
        kind, n_layers=n_layers, dim=256, hidden_dim=hidden, n_heads=4, n_kv_heads=2
    )
    return model.to(device="cuda", dtype=torch.bfloat16)  # buffers too: RoPE tables in bf16


def _tokens(model: nn.Module, batch: int = 2, seq: int = 128) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab = model.cfg.vocab_size
    return torch.randint(0, vocab, (batch, seq + 1), device="cuda", generator=gen)


def _grads(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.loss(tokens).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _max_error(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    return (got.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()


def _assert_grads_match(got, ref, *, bitwise: bool, tolerance: float) -> None:
    assert got.keys() == ref.keys()
    for name in ref:
        if bitwise:
            err, _ = _max_error(got[name], ref[name])
            assert torch.equal(got[name], ref[name]), f"{name} differs by up to {err}"
        else:
            err, scale = _max_error(got[name], ref[name])
            assert err <= tolerance * max(scale, 1e-6), f"{name}: max error {err} of {scale}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_no_ac(kind, mode, record_property):
    base = _model(kind)
    tokens = _tokens(base)
    reference = _grads(base, tokens)
    again = _grads(base, tokens)
    repeatable = all(torch.equal(reference[name], again[name]) for name in reference)
    record_property("comparison", "bitwise" if repeatable else f"tolerance {GRAD_TOLERANCE}")
    model = copy.deepcopy(base)
    assert prime_ac.checkpoint_blocks(model, mode=mode) == ["layers.0", "layers.1"]
    _assert_grads_match(
        _grads(model, tokens), reference, bitwise=repeatable, tolerance=GRAD_TOLERANCE
    )


# --- host syncs -----------------------------------------------------------------------------------


class HostReads(nn.Module):
    """A block that reads device values on the host before its computation, as trainers do:
    ``.item()`` for a scale, ``.tolist()`` for counts, ``.cpu()`` for a host copy. The value read
    feeds the result, and the reads come before every op backward needs, so a recompute cannot
    stop before reaching them."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        peak = x.detach().abs().amax().item()  # aten::_local_scalar_dense on CUDA
        positive = x.detach()[0, :, 0].gt(0).tolist()  # a device-to-host copy
        host = x.detach()[0, 0].float().cpu()  # aten::_to_copy to the CPU
        scale = 1.0 / max(peak, 1.0) + 0.0 * (sum(positive) + host.sum().item())
        return self.block(x * scale, cos, sin)


def _reads_into_host(func, args, kwargs) -> str | None:
    """Which host read this call is, judged from its arguments alone (not prime_ac's rule)."""
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or not source.is_cuda:
        return None
    if func is aten._local_scalar_dense.default:
        return "item"
    if func is aten._to_copy.default and torch.device(kwargs.get("device", "cuda")).type == "cpu":
        return "to_cpu"
    return None


class SyncLedger(TorchDispatchMode):
    """Counts the operators that really execute (a kept result handed back from the checkpoint
    cache never reaches a mode below the checkpoint's own) and the CUDA syncs each caused.

    A sync warning of ``torch.cuda.set_sync_debug_mode("warn")`` raised while an operator runs
    is charged to it. Autograd's device thread (backward, the recompute) runs the operators
    through this mode too; warnings raised there outside any operator reach Python when
    backward returns, so they count in the step's total but are charged to nothing."""

    def __init__(self, caught: list):
        super().__init__()
        self.caught = caught
        self.calls: Counter = Counter()
        self.syncs: Counter = Counter()  # syncs charged to each operator
        self.host_reads: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = _syncs(self.caught)
        out = func(*args, **kwargs)
        self.calls[func] += 1
        self.syncs[func] += _syncs(self.caught) - before
        read = _reads_into_host(func, args, kwargs)
        if read is not None:
            self.host_reads[read] += 1
        return out


def _syncs(caught: list) -> int:
    return sum("synchroniz" in str(w.message) for w in caught)


def _ledger_of_step(model, tokens) -> tuple[SyncLedger, int, dict[object, float]]:
    """One forward + backward under a ledger; returns it, the step's total syncs and each
    syncing operator's syncs per call in the forward alone."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with SyncLedger(caught) as ledger:
                loss = model.loss(tokens)
                per_call = {op: n / ledger.calls[op] for op, n in ledger.syncs.items() if n}
                loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return ledger, _syncs(caught), per_call


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_host_reads_run_once_and_sync_once(kind, mode, record_property):
    base = _model(kind)
    base.layers = nn.ModuleList(HostReads(block) for block in base.layers)
    tokens = _tokens(base)
    model = copy.deepcopy(base)
    prime_ac.checkpoint_blocks(model, mode=mode)
    for warm_up in (base, model):  # lazy CUDA and cuBLAS set-up happen outside the counts
        _grads(warm_up, tokens)
    no_ac, no_ac_syncs, per_call = _ledger_of_step(base, tokens)
    ckpt, ckpt_syncs, _ = _ledger_of_step(model, tokens)
    layers = len(base.layers)

    # the counter sees real executions, the recompute included (full mode replays every mm)
    assert no_ac.host_reads["item"] == layers and no_ac.host_reads["to_cpu"] >= layers
    if mode == "full":
        assert ckpt.calls[aten.mm.default] > no_ac.calls[aten.mm.default]
    assert ckpt.host_reads == no_ac.host_reads, "a host read ran again in the recompute"

    # every extra sync is one of a replayed operator, at that operator's syncs per forward call,
    # and the only syncing operator replayed is the MoE router's torch.where (aten::nonzero)
    replayed = {op: ckpt.calls[op] - no_ac.calls[op] for op in per_call}
    resynced = sorted(str(op) for op, n in replayed.items() if n and op not in REPLAYABLE_SYNCS)
    assert not resynced, f"{mode} replays operators that sync the host: {resynced}"
    expected = no_ac_syncs + sum(per_call[op] * n for op, n in replayed.items())
    record_property("syncs", f"no AC {no_ac_syncs}, {mode} {ckpt_syncs}")
    record_property("syncing_ops", ", ".join(sorted(str(op) for op in per_call)))
    assert ckpt_syncs == expected, (
        f"{mode} synced {ckpt_syncs} times, expected {expected}: no AC {no_ac_syncs}, "
        f"replayed syncing ops {replayed}"
    )


# --- memory -------------------------------------------------------------------------------------


def _allocator_step(model: nn.Module, tokens: torch.Tensor) -> tuple[int, int, int]:
    """(bytes allocated at backward start, peak during the step, operators of the forward),
    from the CUDA caching allocator, relative to before the forward."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()

    class Calls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Calls.n += 1
            return func(*args, **(kwargs or {}))

    with Calls():
        loss = model.loss(tokens)
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - before
    del loss
    return held, peak, Calls.n


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_audit_held_bytes_match_the_caching_allocator(kind, mode, record_property):
    base = _model(kind, n_layers=4)
    tokens = _tokens(base, batch=4, seq=256)
    model = copy.deepcopy(base)
    prime_ac.checkpoint_blocks(model, mode=mode)
    for warm_up in (base, model):  # cuBLAS workspaces (one per thread) are allocated once
        _grads(warm_up, tokens)
    report = prime_ac.audit(model, lambda m: m.loss(tokens))
    device = f"cuda:{torch.cuda.current_device()}"
    measured = {"none": _allocator_step(base, tokens), mode: _allocator_step(model, tokens)}
    audited = {
        "none": report.held_bytes_no_ac_by_device[device],
        mode: report.held_bytes_by_device[device],
    }
    for name, (held, peak, ops) in measured.items():
        record_property(
            f"{name}_MiB",
            f"audit {audited[name] / 2**20:.2f}, allocator {held / 2**20:.2f}, "
            f"peak {peak / 2**20:.2f}",
        )
        # the allocator also holds the loss and rounds each storage up: at most 511 B per output
        slack = ALLOCATOR_ROUNDING * (ops + 1)
        assert audited[name] <= held <= audited[name] + slack, (
            f"{name}: audit says {audited[name]} B held for backward, the allocator {held} B "
            f"(allowed rounding {slack} B over {ops} operators)"
        )
        assert peak >= held
    assert audited[mode] < audited["none"]
    if mode == "full":  # one block's activations live at a time instead of four
        assert measured["full"][1] < measured["none"][1]


# --- torch.compile --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled_no_ac():
    """Per kind: the model, tokens and gradients of its blocks compiled without checkpointing."""
    cache = {}

    def get(kind):
        if kind not in cache:
            base = _model(kind)
            tokens = _tokens(base)
            reference = copy.deepcopy(base)
            for block in reference.layers:
                block.compile(fullgraph=kind == "dense")
            cache[kind] = base, tokens, _grads(reference, tokens)
        return cache[kind]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_blocks_match_compiled_no_ac(kind, mode, compiled_no_ac, record_property):
    """The dense block compiles whole (fullgraph); the MoE block's data-dependent routing
    (``torch.where``) breaks its graph, as it does without checkpointing. Compared with compiled
    no-AC blocks (like with like); the distance to eager no-AC is recorded, not asserted."""
    base, tokens, reference = compiled_no_ac(kind)
    model = copy.deepcopy(base)
    prime_ac.checkpoint_blocks(model, mode=mode)
    for block in model.layers:  # after wrapping, as docs/checkpointing.md says
        block.compile(fullgraph=kind == "dense")
    got = _grads(model, tokens)
    _assert_grads_match(got, reference, bitwise=False, tolerance=COMPILED_TOLERANCE)
    eager = _grads(base, tokens)
    errors = [_max_error(got[name], eager[name]) for name in eager]
    worst = max(err / max(scale, 1e-6) for err, scale in errors)
    record_property("vs_eager_no_ac", f"max relative error {worst:.2g}")
