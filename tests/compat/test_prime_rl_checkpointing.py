"""prime-rl's activation-checkpointing contract, run against prime_ac.

Mirrors prime-rl's tests/unit/train/models/test_checkpointing.py (the versions testing
``_selective_checkpoint_policy``, ``_mandatory_checkpoint_policy``, rng and gradient
preservation and routing recorded once) and the policy in
src/prime_rl/trainer/activation_checkpointing.py (the newest in the index: the one defining
``REPLAYABLE_EXPERT_OPERATIONS``, ``MODE_TARGETS`` and ``get_layer_modes``), with its config
table src/prime_rl/configs/trainer.py (``ActivationCheckpointConfig``: ``mode`` one of
full_moe/full/projections/attention/matmul/selective, ``freq``, ``targets``, ``layer_modes``,
``recompute_engram``). prime-rl's lists are written out below as the reference; the models are
plain PyTorch, and each checkpointed run is compared with the same model unwrapped.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

import prime_ac
import prime_ops  # noqa: F401  (registers prime_rl, prime_rl_collectives)
from prime_ac import ACConfig, make_policy
from prime_ac.targets import DEFAULT_TARGETS, LEVEL_TARGETS, MANDATORY_TARGETS, Target, TargetSet
from prime_ac.wrapping import checkpoint_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import run_distributed  # noqa: E402

SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
aten = torch.ops.aten
collectives = torch.ops.prime_rl_collectives

# prime-rl's lists (activation_checkpointing.py), the reference for prime_ac's
PRIME_RL_MANDATORY = {
    "deepep",
    "aten::topk",
    "prime_rl::fp8_indexer",
    "prime_rl::dsv41_index_topk",
    "prime_rl::deepep_moe",
    "prime_rl::mega_moe",
    "prime_rl::mega_moe_fp8",
    "prime_kernels::dsv41_index_topk",
    "prime_kernels::select_indexed_blocks",
    "prime_rl::record_moe_routing_statistics",
}
PRIME_RL_DEFAULT = {
    "_c10d_functional",
    "flash_attn",
    "flash_attn_3",
    "prime_rl_attn",
    "prime_rl_collectives",
    "prime_rl_ring",
    "aten::_efficient_attention_forward",
    "aten::_flash_attention_forward",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::_scaled_grouped_mm",
    "aten::_scaled_mm",
    "aten::_scaled_mm_v2",
    "aten::_grouped_mm",
    "aten::addmm",
    "aten::bmm",
    "aten::convolution",
    "aten::linear",
    "aten::mm",
    "prime_rl::dsv4_sparse_attn",
    "prime_rl::dsv41_sparse_attn",
    "prime_rl::dsv41_sparse_attn_rope",
    "prime_rl::dsv4_linear_rope",
    "prime_rl::fp8_blockwise_mm",
    "prime_rl::grouped_fp8_gemm",
    "prime_rl::sparse_mla",
    "quack::gemm_act_out",
    "quack::gemm_gated_out",
    "quack::gemm_out",
    "prime_kernels::indexed_attention_forward",
}
PRIME_RL_FUSED = {"prime_rl::fp8_gate_up_mm"}  # saved where fp8_blockwise_mm is named
PRIME_RL_PROJECTIONS = {
    "_c10d_functional",
    "prime_rl_collectives",
    "aten::_grouped_mm",
    "aten::_scaled_grouped_mm",
    "aten::_scaled_mm",
    "aten::_scaled_mm_v2",
    "aten::addmm",
    "aten::bmm",
    "aten::linear",
    "aten::mm",
    "prime_kernels::mhc_gates_forward",
    "prime_rl::fp8_blockwise_mm",
    "prime_rl::grouped_fp8_gemm",
    "prime_rl::grouped_linear",
    "quack::gemm_act_out",
    "quack::gemm_gated_out",
    "quack::gemm_out",
}
PRIME_RL_ATTENTION = PRIME_RL_PROJECTIONS | {
    "flash_attn",
    "flash_attn_3",
    "prime_kernels::indexed_attention_forward",
    "prime_kernels::mhc_projection_forward",
    "prime_kernels::mhc_update_projection_forward",
    "prime_rl::dsv4_sparse_attn",
    "prime_rl::dsv41_sparse_attn",
    "prime_rl::sparse_mla",
    "prime_rl_attn",
    "prime_rl_ring",
}
PRIME_RL_MATMUL = PRIME_RL_ATTENTION | {"prime_rl::dsv4_linear_rope", "prime_rl::dsv4_q_norm_rope"}
# the one deliberate difference (docs/checkpointing.md, "Lists"): not the all-gathers
NOT_KEPT = {"_c10d_functional"}
# aten::linear and the math SDPA decompose before any dispatch mode sees them; prime_ac names
# what they dispatch instead
COMPOSITE = {"aten::linear", "aten::_scaled_dot_product_attention_math"}


def decide(policy, op, *args, **kwargs):
    return policy(SelectiveCheckpointContext(is_recompute=False), op, *args, **kwargs)


def keeps(targets, name: str) -> bool:
    """Whether prime_ac's ``targets`` keep every call prime-rl's target ``name`` matches."""
    t = Target.parse(name)
    key = (t.namespace, t.op or "any_op", "default")
    return TargetSet(targets).matches(key)


# --- prime-rl's policy tests ---------------------------------------------------------------------


def test_selective_policy_saves_default_and_custom_targets():
    # mirrors test_selective_policy_saves_default_and_custom_targets
    policy = make_policy("selective")
    for op in (
        aten.topk.default,
        aten._scaled_dot_product_flash_attention.default,
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._grouped_mm.default,
        # the _v2 scaled GEMMs exist from torch 2.10 on
        *(
            getattr(aten, name).default
            for name in ("_scaled_mm_v2", "_scaled_grouped_mm_v2")
            if hasattr(aten, name)
        ),
        collectives.all_to_all_single_equal.default,
        collectives.mxfp8_all_to_all.default,
    ):
        assert decide(policy, op) is SAVE, op
    assert decide(policy, aten.silu.default) is RECOMPUTE

    custom = make_policy("selective", ["aten::silu", "prime_rl_collectives"])
    assert decide(custom, aten.silu.default) is SAVE
    assert decide(custom, collectives.all_to_all_single_equal.default) is SAVE
    assert decide(custom, aten.mm.default) is RECOMPUTE
    assert decide(custom, aten.topk.default) is SAVE  # mandatory: targets cannot remove it


def test_mandatory_policy_only_retains_non_replayable_ops():
    # mirrors test_mandatory_policy_only_retains_non_replayable_ops (prime-rl's "full")
    policy = make_policy("full")
    assert decide(policy, aten.topk.default) is SAVE
    assert decide(policy, torch.ops.prime_rl.record_moe_routing_statistics.default) is SAVE
    for op in (
        collectives.all_to_all_single_equal.default,
        collectives.mxfp8_all_to_all.default,
        aten._scaled_dot_product_flash_attention.default,
    ):
        assert decide(policy, op) is RECOMPUTE, op


class DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(self.proj(x)).square()


class Stack(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _seeded_step(model, x):
    torch.manual_seed(1234)
    out = model(x)
    out.sum().backward()
    return out


@pytest.mark.parametrize("preserve", [True, False])
def test_whole_block_checkpoint_preserves_rng_and_gradients(preserve):
    # mirrors test_whole_block_checkpoint_preserves_rng_and_gradients; the False case shows the
    # key is honoured: the recompute draws another dropout mask
    reference = Stack(DropoutBlock())
    model = copy.deepcopy(reference)
    keys = tuple(model.state_dict())
    config = ACConfig.from_dict({"mode": "selective", "preserve_rng_state": preserve})
    prime_ac.checkpoint_blocks(model, config=config)
    assert tuple(model.state_dict()) == keys
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = _seeded_step(model, x), _seeded_step(reference, x_ref)
    assert torch.equal(out, out_ref)
    same = torch.equal(x.grad, x_ref.grad) and all(
        torch.equal(a.grad, b.grad)
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )
    assert same is preserve


class Router(nn.Module):
    """A top-1 softmax router that records its routing with prime-rl's telemetry op."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.register_buffer("tokens_per_expert", torch.zeros(experts), persistent=False)
        self.register_buffer("routing_confidence_sum", torch.zeros(experts), persistent=False)

    def forward(self, x):
        scores = self.gate(x).softmax(-1)
        top, index = scores.topk(1, dim=-1)
        counts = torch.bincount(index.flatten(), minlength=scores.shape[-1]).float()
        confidence = torch.zeros_like(counts).index_add_(0, index.flatten(), top.flatten())
        torch.ops.prime_rl.record_moe_routing_statistics(
            self.tokens_per_expert, self.routing_confidence_sum, counts, confidence.detach()
        )
        return x * top


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router(4, 2)
        self.expert = nn.Linear(4, 4)

    def forward(self, x):
        return self.expert(self.router(x))


@pytest.mark.parametrize("mode", ["full", "selective", "full_moe", "projections", "matmul"])
def test_checkpoint_records_moe_routing_once(mode):
    # mirrors test_checkpoint_records_moe_routing_once, in every mode
    model = Stack(MoE())
    prime_ac.checkpoint_blocks(model, config=ACConfig.from_dict({"mode": mode}))
    moe = model.layers[0]
    hidden = torch.randn(1, 3, 4, requires_grad=True)
    output = model(hidden)
    tokens = moe.router.tokens_per_expert.clone()
    confidence = moe.router.routing_confidence_sum.clone()
    output.sum().backward()
    assert tokens.sum() == 3
    assert torch.equal(moe.router.tokens_per_expert, tokens)
    assert torch.equal(moe.router.routing_confidence_sum, confidence)
    assert hidden.grad is not None


# --- the lists ---------------------------------------------------------------------------------


def test_mandatory_targets_are_prime_rls():
    assert set(MANDATORY_TARGETS) >= PRIME_RL_MANDATORY


def test_default_targets_keep_what_prime_rl_keeps_but_the_all_gathers():
    missing = [
        name
        for name in sorted(PRIME_RL_DEFAULT | PRIME_RL_FUSED)
        if name not in COMPOSITE | NOT_KEPT and not keeps(DEFAULT_TARGETS, name)
    ]
    assert missing == []
    for op in ("all_to_all_single", "reduce_scatter_tensor", "all_reduce"):
        assert keeps(DEFAULT_TARGETS, f"_c10d_functional::{op}"), op
    for op in ("all_gather_into_tensor", "wait_tensor"):
        assert not keeps(DEFAULT_TARGETS, f"_c10d_functional::{op}"), op
    policy = make_policy("selective", ["aten::linear", "aten::_scaled_dot_product_attention_math"])
    assert decide(policy, aten.addmm.default) is SAVE
    assert decide(policy, aten._scaled_dot_product_flash_attention_for_cpu.default) is SAVE


@pytest.mark.parametrize("mode", prime_ac.MODES)
def test_c10d_functional_decisions_where_prime_ac_differs_from_prime_rl(mode):
    # prime-rl keeps all of _c10d_functional where it keeps communication, nothing of it in full.
    # prime_ac: point-to-point ops are mandatory (their peer, another pipeline stage, does not
    # recompute this block: a replayed irecv waits for a send that never comes); broadcast is
    # kept where communication is; in-place forms and wait_tensor replay (docs/checkpointing.md)
    c10d = torch.ops._c10d_functional
    policy = make_policy(mode)
    # torch 2.9 has none of the point-to-point ops (2.13 and 2.14 have all three)
    point_to_point = [
        getattr(c10d, n) for n in ("isend", "irecv", "batch_p2p_ops") if hasattr(c10d, n)
    ]
    for op in point_to_point:
        assert decide(policy, op.default) is SAVE, (mode, op)
    communicates = mode not in ("full", "full_moe")
    assert (decide(policy, c10d.broadcast.default) is SAVE) is communicates
    assert (decide(policy, c10d.all_reduce.default) is SAVE) is communicates
    for op in (c10d.broadcast_, c10d.all_reduce_, c10d.wait_tensor, c10d.all_gather_into_tensor):
        assert decide(policy, op.default) is RECOMPUTE, (mode, op)


@pytest.mark.parametrize("mode", ["attention", "matmul"])
def test_attention_levels_keep_sdpa_which_prime_rls_sets_recompute(mode):
    # measured with prime_ac's audit on a tiny HF Qwen3 on SDPA (docs/checkpointing.md, "Lists"):
    # prime_ac's set holds each layer's attention output and logsumexp and replays no attention;
    # prime-rl's set (the level without the aten SDPA kernels) recomputes it
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="sdpa",
        use_cache=False,
    )
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))

    def run(**settings):
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(config)
        prime_ac.checkpoint_blocks(model, **settings)
        return prime_ac.audit(model, lambda m: m(input_ids=ids, labels=ids).loss)

    prime_rl_set = [t for t in LEVEL_TARGETS[mode] if "attention" not in t.split("::")[-1]]
    ours, theirs = run(mode=mode), run(mode="selective", targets=prime_rl_set)
    sdpa_bytes = 2 * (2 * 17 * 4 * 16 * 4 + 2 * 4 * 17 * 4)  # 2 layers: output + logsumexp
    assert ours.held_bytes - theirs.held_bytes == sdpa_bytes == 18_496
    assert ours.replayed_flops == 0 < theirs.replayed_flops


@pytest.mark.parametrize(
    ("mode", "reference"),
    [
        ("projections", PRIME_RL_PROJECTIONS),
        ("attention", PRIME_RL_ATTENTION),
        ("matmul", PRIME_RL_MATMUL),
    ],
)
def test_level_modes_keep_prime_rls_sets(mode, reference):
    # mirrors get_checkpoint_context_fn's MODE_TARGETS, FUSED_OPERATIONS applied
    level = LEVEL_TARGETS[mode]
    skipped = COMPOSITE | NOT_KEPT
    missing = [n for n in sorted(reference) if n not in skipped and not keeps(level, n)]
    assert missing == []
    assert keeps(level, "prime_rl::fp8_gate_up_mm")  # fused with fp8_blockwise_mm
    # each level keeps what the one before keeps; the query's fused projection only in matmul
    assert set(LEVEL_TARGETS["projections"]) < set(LEVEL_TARGETS["attention"])
    assert set(LEVEL_TARGETS["attention"]) < set(LEVEL_TARGETS["matmul"])
    assert keeps(level, "prime_rl::dsv4_linear_rope") is (mode == "matmul")
    assert keeps(level, "flash_attn") is (mode != "projections")


@pytest.fixture
def moe_kernels():
    """CPU stand-ins under prime-rl's names for its mega MoE kernels (prime-rl's own, never
    prime_ops'), counting their runs."""
    calls = Counter()
    lib = torch.library.Library("prime_rl", "FRAGMENT")
    for name in ("mega_moe_fp8", "mega_moe"):
        lib.define(f"{name}(Tensor x, Tensor w) -> Tensor")

        def kernel(x, w, _name=name):
            calls[_name] += 1
            return x @ w

        lib.impl(name, kernel, "CompositeExplicitAutograd")
    yield calls
    lib._destroy()


class MegaMoE(nn.Module):
    def __init__(self, kernel: str) -> None:
        super().__init__()
        self.kernel = kernel
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        # a stand-in without autograd of its own: the gradient flows through the product with w
        return getattr(torch.ops.prime_rl, self.kernel)(x.detach(), self.w.detach()) + x @ self.w


@pytest.mark.parametrize(
    ("mode", "kernel", "runs"),
    [
        ("full", "mega_moe_fp8", 1),
        ("full_moe", "mega_moe_fp8", 2),  # prime-rl's full_moe recomputes the FP8 Mega MoE
        ("full_moe", "mega_moe", 1),  # other MoE backends keep theirs
        ("selective", "mega_moe_fp8", 1),
    ],
)
def test_full_moe_replays_the_fp8_mega_moe_only(moe_kernels, mode, kernel, runs):
    model = Stack(MegaMoE(kernel))
    prime_ac.checkpoint_blocks(model, mode=mode, blocks="layers")
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert moe_kernels[kernel] == runs


# --- the config table ----------------------------------------------------------------------------


def _layers(n: int, names=None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    blocks = [nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6)) for _ in range(n)]
    if names is None:
        model.layers = nn.ModuleList(blocks)
    else:
        model.layers = nn.ModuleDict(dict(zip(names, blocks, strict=True)))
    return model


def _modes(model) -> dict[str, str]:
    return {
        n: checkpoint_state(b).policy.mode
        for n, b in model.layers.named_children()
        if checkpoint_state(b) is not None
    }


def test_layer_modes_give_each_layer_its_mode_bitwise():
    table = {"layer_modes": ["full", "none", "selective", "matmul"], "targets": ["aten::addmm"]}
    model, reference = _layers(4), _layers(4)
    wrapped = prime_ac.checkpoint_blocks(model, config=ACConfig.from_dict(table))
    assert wrapped == ["layers.0", "layers.2", "layers.3"]
    assert _modes(model) == {"0": "full", "2": "selective", "3": "matmul"}
    x = torch.randn(5, 6)

    def loss(m):
        h = x
        for layer in m.layers:
            h = layer(h)
        return h.square().sum()

    loss(model).backward()
    loss(reference).backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_layer_modes_on_a_pipeline_stage_use_the_full_models_indices():
    # mirrors get_layer_modes: a stage holding layers 2 and 3 of 4 keeps their names
    table = {"mode": "selective", "layer_modes": ["none", "none", "projections", "none"]}
    model = _layers(2, names=["2", "3"])
    assert prime_ac.checkpoint_blocks(model, config=ACConfig.from_dict(table)) == ["layers.2"]
    assert _modes(model) == {"2": "projections"}
    short = ACConfig.from_dict({"layer_modes": ["full", "full"]})
    with pytest.raises(ValueError, match="layer_modes has 2 entries.*is layer 2"):
        prime_ac.checkpoint_blocks(_layers(2, names=["2", "3"]), config=short)
    halves = ACConfig.from_dict({"layer_modes": ["full", ["full", "attention"]]})
    with pytest.raises(ValueError, match=r"layer_modes\[1\].*per half"):
        prime_ac.checkpoint_blocks(_layers(2), config=halves)


class _SubLayered(nn.Module):
    """Four layers, each an nn.Sequential whose first child is a linear (``layers.N.0``)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(6, 6), nn.SiLU(), nn.Linear(6, 6)) for _ in range(4)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_layer_modes_with_sub_module_blocks_read_their_layers_entries():
    # blocks= picking a part of each layer: entry N is layer N's, not the part's own index (0)
    model, reference = _SubLayered(), _SubLayered()
    reference.load_state_dict(model.state_dict())
    config = ACConfig.from_dict({"layer_modes": ["full", "none", "matmul", "none"]})
    first = lambda name, module: name.count(".") == 2 and name.endswith(".0")  # noqa: E731
    assert prime_ac.checkpoint_blocks(model, config=config, blocks=first) == [
        "layers.0.0",
        "layers.2.0",
    ]
    x = torch.randn(5, 6)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    # a single sub-module block cannot say which of its numbers is the layer's: it raises
    only = lambda name, module: name == "layers.2.0"  # noqa: E731
    with pytest.raises(ValueError, match="several numeric parts.*model.layers.N"):
        prime_ac.checkpoint_blocks(_SubLayered(), config=config, blocks=only)


@pytest.mark.parametrize("mode", ["full", "full_moe", "projections", "attention", "matmul"])
def test_context_fn_of_a_fixed_mode_takes_and_ignores_targets(mode, caplog):
    # mirrors prime-rl's get_checkpoint_context_fn(config, mode): config.targets are passed for
    # every mode and read only by "selective"; logged once per setting
    caplog.set_level(logging.INFO, logger="prime_ac")
    targets = ["aten::mm", f"prime_ac_test_{mode}_ns"]
    block = nn.Sequential(nn.Linear(6, 6), nn.SiLU(), nn.Linear(6, 6))
    x = torch.randn(5, 6, requires_grad=True)
    grads = []
    for fn in (prime_ac.context_fn(mode, targets), prime_ac.context_fn(mode)):
        block.zero_grad()
        torch.utils.checkpoint.checkpoint(
            block, x, use_reentrant=False, context_fn=fn
        ).sum().backward()
        grads.append([p.grad.clone() for p in block.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    prime_ac.context_fn(mode, targets)
    assert caplog.text.count(f"prime_ac_test_{mode}_ns") == 1 and "prime-rl ignores" in caplog.text
    with pytest.raises(ValueError, match="'bad name'"):  # a typo still surfaces
        prime_ac.context_fn(mode, ["bad name"])


def test_get_layer_modes_is_prime_rls_loop_helper():
    # mirrors prime-rl's get_layer_modes(config, layer_names, num_layers): "none" for unchecked
    get = prime_ac.get_layer_modes
    assert get(ACConfig(mode="selective", freq=2), ["layers.0", "layers.1", "layers.2"]) == [
        "selective",
        "none",
        "selective",
    ]
    stage = ["model.layers.2", "model.layers.3"]
    config = ACConfig(layer_modes=("full", "none", "attention", "none"))
    assert get(config, stage, 4) == ["attention", "none"]
    with pytest.raises(ValueError, match="4 entries and the model 6 decoder layers"):
        get(config, stage, 6)
    model = _layers(4)
    names = [f"layers.{i}" for i in range(4)]
    modes = dict(zip(names, get(config, names), strict=True))
    wrapped = prime_ac.checkpoint_blocks(model, config=config)
    assert wrapped == [name for name, mode in modes.items() if mode != "none"]


def test_targets_under_a_mode_that_keeps_none_are_ignored_as_prime_rl_does(caplog):
    caplog.set_level(logging.INFO, logger="prime_ac")
    config = ACConfig.from_dict({"mode": "full", "targets": ["aten::mm"]})
    assert (config.mode, config.targets) == ("full", None)
    assert "unused with mode='full'" in caplog.text
    config = ACConfig.from_dict({"mode": "matmul", "targets": ["aten::mm"]})
    assert config.targets is None
    # with a selective layer they are that layer's
    config = ACConfig.from_dict({"targets": ["aten::mm"], "layer_modes": ["full", "selective"]})
    assert config.targets == ("aten::mm",)
    with pytest.raises(ValueError, match="'bad name'"):  # typos still surface
        ACConfig.from_dict({"mode": "full", "targets": ["bad name"]})


@pytest.mark.parametrize(
    "table",
    [
        {"freq": 2},  # the first release: freq only
        {"mode": "selective", "freq": 1, "targets": ["aten::mm", "prime_rl_collectives"]},
        {"mode": "selective", "preserve_rng_state": True},
        {"mode": "full_moe", "freq": 1, "layer_modes": None, "recompute_engram": False},
        {"mode": "selective", "attention": False, "moe": False},  # scope flags off
    ],
)
def test_older_and_newest_tables_load(table):
    config = ACConfig.from_dict(table)
    assert config.mode == table.get("mode", "full") and config.freq == table.get("freq", 1)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"mode": "selective", "targets": ["norm", "attn_proj"]}, "targets=.*'norm'.*blocks="),
        ({"moe": True}, "moe=True.*parts of each layer.*blocks="),
        ({"recompute_engram": True}, "recompute_engram=true.*prime-rl's model setup"),
        ({"layer_modes": ["full", "fast"]}, r"layer_modes\[1\]='fast'"),
        ({"mode": "selective", "targets": "auto", "budget": 0.5, "layer_modes": ["full"]}, "one"),
        ({"mode": "fast"}, "mode='fast'"),
        ({"preserve_rng_state": "yes"}, "preserve_rng_state='yes'"),
    ],
)
def test_meanings_prime_ac_cannot_honour_raise_naming_the_key(table, message):
    with pytest.raises(ValueError, match=message):
        ACConfig.from_dict(table)


def test_a_level_mode_takes_no_targets_of_its_own():
    with pytest.raises(ValueError, match="mode='attention' keeps a fixed set"):
        make_policy("attention", ["aten::mm"])
    with pytest.raises(ValueError, match="no effect with mode='projections'"):
        ACConfig(mode="projections", targets=("aten::mm",))


# --- QuACK's out= GEMMs: kept with what they wrote -----------------------------------------------


@pytest.fixture
def quack_out_gemms():
    """CPU stand-ins for QuACK's out= custom ops (quack-kernels quack/gemm_interface.py:
    ``gemm_out`` writes ``out``; ``gemm_act_out`` writes ``preact_out`` and ``postact_out``),
    registered under QuACK's names, counting their runs."""
    calls = Counter()
    lib = torch.library.Library("quack", "FRAGMENT")
    lib.define("gemm_out(Tensor A, Tensor B, Tensor(a!) out) -> ()")
    lib.define(
        "gemm_act_out(Tensor A, Tensor B, Tensor(a!) preact_out, Tensor(b!) postact_out) -> ()"
    )

    def gemm_out(a, b, out):
        calls["gemm_out"] += 1
        torch.mm(a, b, out=out)

    def gemm_act_out(a, b, preact_out, postact_out):
        calls["gemm_act_out"] += 1
        torch.mm(a, b, out=preact_out)
        torch.tanh(preact_out, out=postact_out)

    lib.impl("gemm_out", gemm_out, "CompositeExplicitAutograd")
    lib.impl("gemm_act_out", gemm_act_out, "CompositeExplicitAutograd")
    yield calls
    lib._destroy()


class QuackMLP(torch.autograd.Function):
    """How QuACK's autograd wrappers call its out= GEMMs: allocate, write, return.
    ``tanh(x @ w) @ v``, the activation fused into the first GEMM."""

    @staticmethod
    def forward(ctx, x, w, v):
        pre = x.new_empty(x.shape[0], w.shape[1])
        post = torch.empty_like(pre)
        torch.ops.quack.gemm_act_out(x, w, pre, post)
        out = x.new_empty(x.shape[0], v.shape[1])
        torch.ops.quack.gemm_out(post, v, out)
        ctx.save_for_backward(x, w, v, post)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w, v, post = ctx.saved_tensors
        grad_pre = (grad @ v.t()) * (1 - post.square())
        return grad_pre @ w.t(), x.t() @ grad_pre, post.t() @ grad


class QuackBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6, dtype=torch.float64))
        self.v = nn.Parameter(torch.randn(6, 6, dtype=torch.float64))

    def forward(self, x):
        y = QuackMLP.apply(x, self.w, self.v)
        y.mul_(0.5)  # the forward writes the kept output afterwards: copy on write keeps it
        return torch.sin(y) + y


@pytest.mark.parametrize(("mode", "runs"), [("selective", 1), ("full", 2)])
def test_a_kept_out_gemm_keeps_what_it_wrote_bitwise(quack_out_gemms, mode, runs):
    torch.manual_seed(0)
    model = Stack(QuackBlock(), QuackBlock())
    reference = copy.deepcopy(model)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).sum().backward()
    prime_ac.checkpoint_blocks(model, mode=mode, blocks="layers")  # defaults name QuACK's GEMMs
    quack_out_gemms.clear()
    model(x).sum().backward()
    # two blocks: each out= GEMM ran once per forward, and the recompute ran it again only
    # where it was not kept
    assert quack_out_gemms == {"gemm_out": 2 * runs, "gemm_act_out": 2 * runs}
    assert torch.equal(x.grad, x_ref.grad)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_torchs_sac_policy_recomputes_an_out_gemm_it_cannot_keep(quack_out_gemms):
    # torch's own SAC caches a call's return, which for an out= op is nothing: the policy
    # callable (used for compiled regions) replays it instead of skipping the write
    policy = make_policy("selective")
    assert decide(policy, torch.ops.quack.gemm_out.default) is RECOMPUTE


# --- _c10d_functional: why the all-gathers are not kept -----------------------------------------


def _all_gather_bytes(rank, world_size):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    class ShardedBlock(nn.Module):
        """A SimpleFSDP-style block: its weight's shard is all-gathered inside the forward."""

        def __init__(self):
            super().__init__()
            self.shard = nn.Parameter(torch.randn(32 // world_size, 32))

        def forward(self, x):
            weight = funcol.all_gather_tensor(self.shard, 0, dist.group.WORLD)
            return torch.tanh(x @ weight)

    def held(targets):
        torch.manual_seed(rank)
        model = Stack(ShardedBlock(), ShardedBlock(), ShardedBlock())
        prime_ac.checkpoint_blocks(model, mode="selective", targets=targets, blocks="layers")
        # the audit's step keeps the list as asked (a first step would drop the matmul outputs
        # no backward reads from the blocks holding more than no AC: prime_ac.watch)
        return prime_ac.audit(model, lambda m: m(torch.randn(4, 32)).sum()).held_bytes

    prime_rl_rule = [*DEFAULT_TARGETS, "_c10d_functional"]
    difference = held(prime_rl_rule) - held(None)
    # keeping the namespace holds each block's unsharded weight: 3 x 32 x 32 float32
    assert difference == 3 * 32 * 32 * 4, difference


@pytest.mark.slow
@pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 10),
    reason="torch 2.9's functional all-gather (no _wrap_tensor_autograd) measures the same bytes "
    "kept or replayed; the figure the docs quote is torch 2.13's",
)
def test_keeping_fsdp_all_gathers_would_hold_the_unsharded_weights():
    run_distributed(_all_gather_bytes, 2)
