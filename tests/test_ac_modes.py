"""prime_ac's eager path: two dispatch modes, no native code, no dispatch key of its own.

Each test reproduces a way the former interceptor (kernels on a dispatch key torch reserves for
RNG libraries, built on first use) went wrong, and checks the modes get it right; references are
the same block without checkpointing, or torch's own selective checkpointing.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from ac_models import assert_bitwise_equal, grads
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import prime_ac

ROOT = Path(__file__).parents[1]


class Block(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x)).view(-1, 2, self.up.out_features // 2)
        return x + self.down(h.flatten(1).tanh())


def _reference(model, x):
    model = copy.deepcopy(model)
    model(x).square().sum().backward()
    return grads(model)


def _checkpointed(model, x, context_fn, around_backward=None):
    model = copy.deepcopy(model)
    loss = checkpoint(model, x, use_reentrant=False, context_fn=context_fn).square().sum()
    if around_backward is None:
        loss.backward()
    else:
        with around_backward:
            loss.backward()
    return grads(model)


_NO_IO = r"""
import sys
events = []
def hook(event, args):
    if event == "open" and args[1] not in (None, "r", "rb") and not str(args[1]).startswith("r"):
        events.append((event, str(args[0])))
    elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn"):
        events.append((event, str(args[:2])))
    elif event == "ctypes.dlopen" and "prime_ac" in str(args[0]):
        events.append((event, str(args[0])))
import torch
from torch.utils.checkpoint import checkpoint

# torch's own first-use imports (torch 2.9's torch._dynamo writes a module file) are not
# prime_ac's: a plain checkpointed step runs first
lin = torch.nn.Linear(4, 4)
checkpoint(lin, torch.randn(2, 4), use_reentrant=False).sum().backward()
torch.compiler.is_compiling()
sys.addaudithook(hook)
import prime_ac
from prime_ac.models import build_model
model = build_model("dense", dim=16, hidden_dim=32)
prime_ac.checkpoint_blocks(model, mode="selective")
model.loss(torch.randint(0, model.cfg.vocab_size, (2, 9))).backward()
assert "torch.utils.cpp_extension" not in sys.modules, "a C++ extension loader was imported"
print(events)
"""


def test_import_and_a_first_step_build_nothing_and_write_nothing():
    out = subprocess.run(
        [sys.executable, "-c", _NO_IO], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_prime_ac_has_no_native_sources():
    assert not (ROOT / "csrc" / "prime_ac").exists()
    assert not list((ROOT / "prime_ac").glob("*.cpp"))


def test_an_operator_registered_after_the_policy_is_kept_every_time():
    """A kernel library imported lazily registers its ops after the blocks were wrapped: a
    mandatory operator naming one is kept (runs once) from its first call on."""
    counts = []
    context_fn = prime_ac.context_fn("full", mandatory=["prime_ac_test_late::count"])
    lib = torch.library.Library("prime_ac_test_late", "DEF")
    lib.define("count(Tensor x) -> Tensor")
    lib.impl("count", lambda x: counts.append(1) or x * 2, "CompositeExplicitAutograd")

    def forward(x):
        h = x.exp()
        torch.ops.prime_ac_test_late.count(h.detach())  # telemetry: must count once per step
        return h.sin()

    x = torch.randn(4, requires_grad=True)
    forward(x).sum().backward()
    expected, x.grad = x.grad, None
    counts.clear()
    checkpoint(forward, x, use_reentrant=False, context_fn=context_fn).sum().backward()
    assert len(counts) == 1
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("targets", [["aten::view"], ["aten::view", "aten::addmm"]])
def test_kept_views_with_a_mode_around_backward_train_bitwise(targets):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(4, 8)
    context_fn = prime_ac.context_fn("selective", targets)
    counter = FlopCounterMode(display=False)
    assert_bitwise_equal(_checkpointed(model, x, context_fn, counter), _reference(model, x))


def test_a_mode_around_backward_sees_only_what_the_recompute_runs():
    """Kept results are handed back above any mode active around backward: FlopCounterMode
    counts no matmul that selective mode kept."""
    model, x = Block(), torch.randn(4, 8)
    flops = {}
    for mode in ("none", "full", "selective"):
        if mode == "none":
            out = model(x)
        else:
            context_fn = prime_ac.context_fn(mode)
            out = checkpoint(model, x, use_reentrant=False, context_fn=context_fn)
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        flops[mode] = counter.get_total_flops()
    assert flops["selective"] == flops["none"]  # both addmm kept: none recounted
    # full replays the first addmm (gelu's backward reads its output); the recompute stops
    # before the second, whose output backward does not need
    assert flops["full"] == flops["none"] + 2 * 4 * 8 * 16


class ExtraCallFirst(nn.Module):
    """The recompute calls a kept operator once more, before the calls the forward made."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        if self.forwards > 1:
            torch.topk(x[:, :6], 2)  # other input shapes than any forward call
        return torch.topk(self.lin(x), 2).values.exp()


def test_an_extra_kept_call_before_the_real_ones_raises_replay_mismatch():
    model = nn.Sequential(nn.Linear(8, 8), ExtraCallFirst())
    prime_ac.checkpoint_blocks(model, mode="full", blocks=lambda name, m: name == "1")
    loss = model(torch.randn(4, 8)).sum()
    with pytest.raises(prime_ac.ReplayMismatchError, match=r"block '1'.*aten\.topk.*\[4, 6\]"):
        loss.backward()


def test_context_fn_built_inside_a_compiled_function():
    """The form context_fn's docstring shows, inside @torch.compile: torch's partial of
    create_selective_checkpoint_contexts works there, and so must prime_ac's."""
    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(x):
        context_fn = prime_ac.context_fn("selective")
        return checkpoint(block, x, use_reentrant=False, context_fn=context_fn).square().sum()

    torch._dynamo.reset()
    step(x).backward()
    compiled = grads(block)
    block.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    expected = _reference(block, x)
    for name, grad in compiled.items():
        torch.testing.assert_close(grad, expected[name])


@torch.library.custom_op("prime_ac_test_modes::pieces", mutates_args=())
def _pieces(x: torch.Tensor) -> list[torch.Tensor]:
    return [x * 2, x.sin()]


_pieces.register_fake(lambda x: [torch.empty_like(x), torch.empty_like(x)])
_pieces.register_autograd(
    lambda ctx, grads: grads[0] * 2 + grads[1] * ctx.x.cos(),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]),
)


class Pieces(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        doubled, sine = _pieces(self.proj(x))
        return (doubled * sine).tanh()


def test_a_kept_operator_returning_a_list_is_kept_and_handed_back():
    torch.manual_seed(0)
    model, x = Pieces(), torch.randn(4, 8, requires_grad=True)
    made = []
    context_fn = prime_ac.context_fn("selective", ["prime_ac_test_modes::pieces"])

    def recording():
        made.append(context_fn())
        return made[-1]

    assert_bitwise_equal(_checkpointed(model, x, recording), _reference(model, x))
    ((keep, _),) = made
    assert keep.store.kept_ops() == {torch.ops.prime_ac_test_modes.pieces.default}
    assert keep.store.stored == keep.store.hits == 1


def test_a_kept_result_written_after_the_forward_raises_in_backward():
    model, x = Pieces(), torch.randn(4, 8)
    kept = []

    def forward(x):
        doubled, sine = _pieces(model.proj(x))
        kept.append(sine)
        return (doubled * sine).tanh()

    context_fn = prime_ac.context_fn("selective", ["prime_ac_test_modes::pieces"])
    out = checkpoint(forward, x, use_reentrant=False, context_fn=context_fn)
    with torch.no_grad():
        kept[0].add_(1.0)  # after the region: no mode sees it, the version counter does
    with pytest.raises(prime_ac.KeptOutputMutatedError, match=r"prime_ac_test_modes\.pieces"):
        out.sum().backward()


def test_a_region_on_one_thread_leaves_other_threads_alone():
    keep, _ = prime_ac.context_fn("selective")()
    with keep:
        thread = threading.Thread(target=lambda: torch.mm(torch.ones(2, 2), torch.ones(2, 2)))
        thread.start()
        thread.join()
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    assert keep.store.forward_calls == {torch.ops.aten.mm.default: 1}


def _eager_benchmark():
    import importlib.util

    path = ROOT / "benchmarks" / "eager_overhead.py"
    spec = importlib.util.spec_from_file_location("eager_overhead", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_eager_benchmark_reports_every_variant_and_the_blocks_operator_calls():
    """The benchmark's own code, in-process on the smallest model (no timing is asserted): its
    rows carry every variant, its operator count is what a mode sees in the blocks' forward, and
    its per-operator table has both modes of both libraries."""
    from prime_ac.models import build_model

    bench = _eager_benchmark()
    row = bench.measure("moe", 16, steps=1, warmup=0)
    assert row["steps"] == 16  # x16 below dim 256
    assert set(row["vs_plain"]) == set(bench.VARIANTS) and row["vs_plain"]["plain"] == 1.0
    model = build_model("moe", dim=16, hidden_dim=16)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 17))
    assert row["ops"] == bench._block_forward_ops(model, tokens) > 0
    cost = bench.per_operator_cost(calls=20, rounds=1)
    sides = {
        f"{lib} {side} {kind}"
        for lib in ("torch_sac", "prime_ac")
        for side in ("forward", "recompute")
        for kind in ("replayed", "kept")
    }
    assert sides <= set(cost)


def test_eager_benchmark_wraps_the_llama_blocks_in_every_variant():
    pytest.importorskip("transformers")
    bench = _eager_benchmark()
    base = bench._Llama(64)
    names = {n: type(bench._variant(base, n).layers[0]).__name__ for n in bench.VARIANTS}
    assert names["plain"] == names["torch_sac"] == "_Region"
    assert names["full"] == names["selective"] == "CheckpointedLlamaDecoderLayer"
