"""prime_ac's checkpoint contexts on the patterns real models use.

In-place writes to kept results (MoE routers that normalise top-k values in place, ReLU(inplace)
after a kept matmul), higher-order operators (flex_attention, nested_compile_region), and
replay tolerance (modes active only around backward). Every reference is the same model without
checkpointing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ac_models import assert_bitwise_equal, grads
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

import prime_ac

MODES = [{"mode": "full"}, {"mode": "selective"}, {"mode": "selective", "targets": []}]


def _train(model, x, settings=None):
    model = copy.deepcopy(model)
    if settings is not None:
        prime_ac.checkpoint_blocks(model, **settings)
    model(x).backward()
    return grads(model)


def _recording(contexts):
    """A context_fn that also returns the (forward, recompute) modes it created."""
    made = []

    def record():
        pair = contexts()
        made.append(pair)
        return pair

    return record, made


class Stack(nn.Module):
    def __init__(self, block, n=2):
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().sum()


# --- kept results written in place later in the block ------------------------------------------


class InPlaceRouter(nn.Module):
    """Hugging Face Mixtral / Qwen3-MoE routing: top-k values normalised in place."""

    def __init__(self, dim=8, n_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_experts))

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights /= weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return x + out


class InPlaceActivation(nn.Module):
    """VGG/ResNet style: ReLU(inplace=True) straight after a kept conv and a kept matmul."""

    def __init__(self, channels=3):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.lin = nn.Linear(channels, channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.relu(self.conv(x))
        return self.relu(self.lin(h.transpose(1, -1))).transpose(1, -1)


@pytest.mark.parametrize("settings", MODES)
def test_router_normalising_top_k_in_place_trains_bitwise(settings):
    torch.manual_seed(0)
    model, x = Stack(InPlaceRouter), torch.randn(16, 8)
    assert_bitwise_equal(_train(model, x, settings), _train(model, x))


@pytest.mark.parametrize("settings", MODES)
def test_in_place_activation_after_kept_matmul_trains_bitwise(settings):
    torch.manual_seed(0)
    model, x = Stack(InPlaceActivation), torch.randn(2, 3, 5, 5)
    assert_bitwise_equal(_train(model, x, settings), _train(model, x))


def test_copy_on_write_copies_only_the_results_written():
    # topk (mandatory) and the two gate/expert matmuls are kept; only topk's values are written.
    torch.manual_seed(0)
    block, x = InPlaceRouter(), torch.randn(16, 8, requires_grad=True)
    contexts, made = _recording(prime_ac.context_fn("selective", name="router"))
    checkpoint(block, x, use_reentrant=False, context_fn=contexts).sum().backward()
    ((forward, recompute),) = made
    store = forward.store
    assert store.copies == 1
    assert store.copied_bytes == 16 * 2 * 4  # the [16, 2] float32 top-k values, nothing else
    assert store.stored == store.hits  # every kept result reached the recompute
    assert torch.ops.aten.topk.default in store.kept_ops()


def test_kept_result_written_after_the_block_returned_names_block_and_operator():
    class KeptOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.topk(self.lin(x).sigmoid(), 2).values

    model = nn.Sequential(KeptOutput(), nn.Identity())
    prime_ac.checkpoint_blocks(model, mode="full", blocks=lambda name, m: name == "0")
    out = model(torch.randn(3, 4))
    out.mul_(2)  # outside the block: no mode sees it
    with pytest.raises(prime_ac.KeptOutputMutatedError, match=r"block '0'.*aten\.topk"):
        out.sum().backward()
    assert issubclass(prime_ac.KeptOutputMutatedError, CheckpointError)


# --- replay tolerance --------------------------------------------------------------------------


class Dense(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


@pytest.mark.parametrize("settings", MODES)
@pytest.mark.parametrize("around_backward", ["flop_counter", "module_tracker"])
def test_modes_active_only_around_backward_replay_like_plain_checkpoint(settings, around_backward):
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils.module_tracker import ModuleTracker

    torch.manual_seed(0)
    model, x = Stack(Dense), torch.randn(4, 8)
    reference = _train(model, x)
    wrapped = copy.deepcopy(model)
    prime_ac.checkpoint_blocks(wrapped, **settings)
    loss = wrapped(x)
    tracker = (
        FlopCounterMode(display=False) if around_backward == "flop_counter" else ModuleTracker()
    )
    with tracker:
        loss.backward()
    assert_bitwise_equal(grads(wrapped), reference)


class CallsTopkAgainOnRecompute(nn.Module):
    """A mismatch that matters: the recompute calls a kept operator more often than the forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        h = self.lin(x)
        if self.forwards > 1:
            torch.topk(h, 2)  # e.g. a cache filled in the forward, read again in the recompute
        return torch.topk(h, 2).values.exp()


def test_extra_call_of_a_kept_operator_raises_naming_block_operator_and_kv_cache():
    model = nn.Sequential(nn.Linear(8, 8), CallsTopkAgainOnRecompute())
    prime_ac.checkpoint_blocks(model, mode="full", blocks=lambda name, m: name == "1")
    loss = model(torch.randn(4, 8)).sum()
    with pytest.raises(prime_ac.ReplayMismatchError, match=r"block '1'.*aten\.topk") as error:
        loss.backward()
    assert "use_cache=False" in str(error.value)
    assert issubclass(prime_ac.ReplayMismatchError, CheckpointError)


def test_extra_replayed_operator_is_not_an_error():
    class ExtraOnRecompute(Dense):
        forwards = 0

        def forward(self, x):
            self.forwards += 1
            if self.forwards > 1:
                torch.empty(3).fill_(1.0).exp()  # replayed ops the forward never ran
            return super().forward(x)

    torch.manual_seed(0)
    model, x = Stack(ExtraOnRecompute), torch.randn(4, 8)
    reference = _train(model, x)
    for settings in MODES:
        assert_bitwise_equal(_train(model, x, settings), reference)


# --- higher-order operators --------------------------------------------------------------------


def _flex_attention(q, k, v):
    # The flex_attention HOP itself: the public wrapper refuses backward on CPU, the HOP does not.
    from torch.nn.attention.flex_attention import _create_empty_block_mask

    mask = _create_empty_block_mask(q, k).as_tuple()
    options = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}
    out = torch.ops.higher_order.flex_attention(
        q, k, v, _relative_bias, mask, q.shape[-1] ** -0.5, options
    )
    return out[0]


def _relative_bias(score, b, h, q, kv):
    return score + (q - kv) * 0.01


class FlexBlock(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return x + self.out(_flex_attention(q, k, v).transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("settings", MODES)
def test_flex_attention_eager_trains_bitwise(settings):
    torch.manual_seed(0)
    model, x = Stack(FlexBlock), torch.randn(2, 8, 16)
    assert_bitwise_equal(_train(model, x, settings), _train(model, x))


@pytest.mark.parametrize("mode, kept", [("selective", True), ("full", False)])
def test_flex_attention_target_keeps_it(mode, kept):
    torch.manual_seed(0)
    block, x = FlexBlock(), torch.randn(2, 8, 16, requires_grad=True)
    contexts, made = _recording(prime_ac.context_fn(mode, name="flex"))
    checkpoint(block, x, use_reentrant=False, context_fn=contexts).sum().backward()
    ((forward, _),) = made
    flex = torch.ops.higher_order.flex_attention
    assert (flex in forward.store.entries) is kept
    assert forward.store.handed_back(flex) == int(kept)  # handed back: the recompute skips it


def _graph_capturing_backend():
    """An AOTAutograd backend with torch's min-cut partitioner that runs the graphs as traced
    (no kernel fusion, so gradients compare bitwise) and keeps the backward graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    backward_graphs = []

    def forward(gm, example_inputs):
        return make_boxed_func(gm.forward)

    def backward(gm, example_inputs):
        backward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=forward,
        bw_compiler=backward,
        partition_fn=min_cut_rematerialization_partition,
    )
    return backend, backward_graphs


def _train_compiled(model, x, settings=None):
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    if settings is not None:
        prime_ac.checkpoint_blocks(model, **settings)
    backend, backward_graphs = _graph_capturing_backend()
    torch.compile(model, backend=backend, fullgraph=True)(x).backward()
    return grads(model), backward_graphs


@pytest.mark.slow
@pytest.mark.parametrize("mode, reruns", [("selective", 0), ("full", 2)])
def test_flex_attention_compiled_keeps_it_and_trains_bitwise(mode, reruns):
    torch.manual_seed(0)
    model, x = Stack(FlexBlock), torch.randn(2, 8, 16)
    reference, _ = _train_compiled(model, x)
    trained, backward_graphs = _train_compiled(model, x, {"mode": mode})
    assert_bitwise_equal(trained, reference)
    flex = torch.ops.higher_order.flex_attention
    in_backward = sum(
        node.target is flex for graph in backward_graphs for node in graph.graph.nodes
    )
    assert in_backward == reruns  # one recomputed flex_attention per block in full mode


def _torch_sac_handles_invoke_subgraph() -> bool:
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
    from torch.utils.checkpoint import _CachingTorchDispatchMode

    return _CachingTorchDispatchMode in invoke_subgraph.python_key_table


@pytest.mark.slow
@pytest.mark.skipif(
    not _torch_sac_handles_invoke_subgraph(),
    reason="this torch's own selective checkpointing has no rule for invoke_subgraph (2.9)",
)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_nested_compile_region_in_a_compiled_region_trains_bitwise(mode):
    @torch.compiler.nested_compile_region
    def mlp(x, w1, w2):
        return torch.relu(x @ w1) @ w2

    class Block(nn.Module):
        def __init__(self, dim=16):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(dim, dim) * 0.1)
            self.w2 = nn.Parameter(torch.randn(dim, dim) * 0.1)
            self.norm = nn.LayerNorm(dim)

        def forward(self, x):
            return x + mlp(self.norm(x), self.w1, self.w2)

    torch.manual_seed(0)
    model, x = Stack(Block), torch.randn(4, 16)
    results = [_train_compiled(model, x)[0], _train_compiled(model, x, {"mode": mode})[0]]
    eager = _train(model, x, {"mode": mode})  # outside compile the region runs eagerly
    assert_bitwise_equal(results[1], results[0])
    for name, g in eager.items():
        torch.testing.assert_close(g, results[0][name])


# --- what the contexts store -------------------------------------------------------------------


def test_replayed_operators_store_nothing():
    torch.manual_seed(0)
    block, x = Dense(), torch.randn(4, 8, requires_grad=True)
    contexts, made = _recording(prime_ac.context_fn("full", name="dense"))
    checkpoint(block, x, use_reentrant=False, context_fn=contexts).sum().backward()
    ((forward, _),) = made
    assert forward.store.stored == 0 and forward.store.entries == {}
    assert forward.store.forward_calls == {}  # replayed operators are not even counted


def test_user_policy_callable_decides_per_call():
    from torch.utils.checkpoint import CheckpointPolicy

    calls = []

    def keep_second_addmm(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.addmm.default:
            calls.append(op)
            if len(calls) == 2:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    block, x = Dense(), torch.randn(4, 8)
    reference = copy.deepcopy(block)
    reference(x).sum().backward()
    contexts, made = _recording(prime_ac.context_fn(policy=keep_second_addmm, name="dense"))
    checkpoint(block, x, use_reentrant=False, context_fn=contexts).sum().backward()
    ((forward, _),) = made
    assert len(calls) == 2  # called in the forward only
    assert list(forward.store.entries[torch.ops.aten.addmm.default]) == [1]
    assert_bitwise_equal(grads(block), grads(reference))


def test_second_backward_through_a_region_with_kept_results_raises():
    torch.manual_seed(0)
    block, x = Dense(), torch.randn(4, 8, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=False, context_fn=prime_ac.context_fn("selective"))
    out.sum().backward(retain_graph=True)
    with pytest.raises(CheckpointError, match="second time"):
        out.sum().backward()
