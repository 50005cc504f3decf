"""Block discovery on the module layouts of common transformers / diffusers models.

Each fake model below copies only the module tree of a real family (container names, nesting,
the containers inside a block), with a few parameters; tests/conformance checks the real classes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ac_models import assert_bitwise_equal, grads
from torch import nn

import prime_ac


def lin() -> nn.Linear:
    return nn.Linear(4, 4)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = lin(), lin()
        self.to_out = nn.ModuleList([lin(), nn.Dropout(0.0)])  # diffusers: leaves only


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = lin(), lin()


class GELUProj(nn.Module):  # diffusers' GELU holds its projection
    def __init__(self):
        super().__init__()
        self.proj = lin()


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.ModuleList([GELUProj(), nn.Dropout(0.0), lin()])


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attention(), MLP()


class MoE(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.gate = nn.Linear(4, n)
        self.experts = nn.ModuleList(MLP() for _ in range(n))
        self.shared_expert = MLP()


class MoEDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attention(), MoE()


class LoraLinear(nn.Module):  # PEFT: base layer plus adapter dicts of leaves
    def __init__(self):
        super().__init__()
        self.base_layer = lin()
        self.lora_A = nn.ModuleDict({"default": lin()})
        self.lora_B = nn.ModuleDict({"default": lin()})


class LoraDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attention(), MLP()
        self.mlp.up = LoraLinear()


class MambaMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = lin(), lin()


class MambaDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mamba, self.feed_forward = MambaMixer(), MoE(2)


def lm(layers) -> nn.Module:
    inner = nn.Module()
    inner.embed_tokens = nn.Embedding(10, 4)
    inner.layers = nn.ModuleList(layers)
    inner.norm = nn.LayerNorm(4)
    root = nn.Module()
    root.model, root.lm_head = inner, lin()
    return root


def gpt2():
    root, transformer = nn.Module(), nn.Module()
    transformer.wte, transformer.wpe = nn.Embedding(10, 4), nn.Embedding(10, 4)
    transformer.h = nn.ModuleList(Decoder() for _ in range(3))
    transformer.ln_f = nn.LayerNorm(4)
    root.transformer, root.lm_head = transformer, lin()
    return root


def bert():
    root, bert_, encoder, embeddings = nn.Module(), nn.Module(), nn.Module(), nn.Module()
    embeddings.word, embeddings.norm = nn.Embedding(10, 4), nn.LayerNorm(4)
    encoder.layer = nn.ModuleList(Decoder() for _ in range(2))
    bert_.embeddings, bert_.encoder, bert_.pooler = embeddings, encoder, MLP()
    root.bert, root.cls = bert_, MLP()
    return root


def vit():
    root, embeddings = nn.Module(), nn.Module()
    embeddings.patch = nn.Conv2d(3, 4, 2)
    root.embeddings = embeddings
    root.layers = nn.ModuleList(Decoder() for _ in range(2))
    root.layernorm = nn.LayerNorm(4)
    return root


class T5Block(nn.Module):
    def __init__(self, cross: bool):
        super().__init__()
        parts = [Attention(), Attention(), MLP()] if cross else [Attention(), MLP()]
        self.layer = nn.ModuleList(parts)  # non-leaf children: a stack inside each block


def t5():
    root = nn.Module()
    root.shared = nn.Embedding(10, 4)
    root.encoder, root.decoder = nn.Module(), nn.Module()
    root.encoder.block = nn.ModuleList(T5Block(False) for _ in range(2))
    root.decoder.block = nn.ModuleList(T5Block(True) for _ in range(2))
    return root


class DoubleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.ff, self.ff_context = Attention(), FeedForward(), FeedForward()


class SingleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.proj_mlp = Attention(), lin()


def flux():
    root = nn.Module()
    root.x_embedder, root.time_text_embed = lin(), MLP()
    root.transformer_blocks = nn.ModuleList(DoubleBlock() for _ in range(2))
    root.single_transformer_blocks = nn.ModuleList(SingleBlock() for _ in range(3))
    root.norm_out, root.proj_out = nn.LayerNorm(4), lin()
    return root


def wan():
    root = nn.Module()
    root.patch_embedding, root.condition_embedder = nn.Conv3d(3, 4, 1), MLP()
    root.blocks = nn.ModuleList(DoubleBlock() for _ in range(2))
    root.proj_out = lin()
    return root


def hunyuan_video():
    root, embedder, refiner = nn.Module(), nn.Module(), nn.Module()
    refiner.refiner_blocks = nn.ModuleList(SingleBlock() for _ in range(2))
    embedder.time_text_embed, embedder.token_refiner = MLP(), refiner
    root.x_embedder, root.context_embedder = lin(), embedder
    root.transformer_blocks = nn.ModuleList(DoubleBlock() for _ in range(2))
    root.single_transformer_blocks = nn.ModuleList(SingleBlock() for _ in range(2))
    return root


class TextProjection(nn.Module):  # one layer in a wrapper
    def __init__(self):
        super().__init__()
        self.linear = lin()


def hidream():
    root = flux()
    root.caption_projection = nn.ModuleList(TextProjection() for _ in range(3))
    return root


def chroma():
    root = flux()
    approximator = nn.Module()
    approximator.in_proj = lin()
    approximator.layers = nn.ModuleList(MLP() for _ in range(3))  # per-token MLPs
    approximator.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(3))
    root.distilled_guidance_layer = approximator
    return root


def qwen3_vl():
    root, model, visual = nn.Module(), nn.Module(), nn.Module()
    visual.patch_embed = nn.Conv3d(3, 4, 1)
    visual.blocks = nn.ModuleList(Decoder() for _ in range(2))
    visual.deepstack_merger_list = nn.ModuleList(MLP() for _ in range(2))
    model.visual, model.language_model = visual, lm(Decoder() for _ in range(2)).model
    root.model, root.lm_head = model, lin()
    return root


class WideMLP(nn.Module):  # a per-token MLP as large as an attention block
    def __init__(self):
        super().__init__()
        self.up, self.mid, self.gate, self.down, self.out = (lin() for _ in range(5))


def wide_mlp_stack():
    root = lm(Decoder() for _ in range(2))
    root.mlps = nn.ModuleList(WideMLP() for _ in range(2))
    return root


def names(path, n):
    return [f"{path}.{i}" for i in range(n)]


LAYOUTS = {
    "decoder LM": (lambda: lm(Decoder() for _ in range(3)), names("model.layers", 3)),
    "DeepSeek-V3 (dense then MoE)": (
        lambda: lm([Decoder(), MoEDecoder(), MoEDecoder()]),
        names("model.layers", 3),
    ),
    "MoE LM (experts in every layer)": (
        lambda: lm(MoEDecoder() for _ in range(2)),
        names("model.layers", 2),
    ),
    "Jamba (mamba and attention layers)": (
        lambda: lm([MambaDecoder(), Decoder(), MambaDecoder(), MoEDecoder()]),
        names("model.layers", 4),
    ),
    "LoRA decoder": (lambda: lm(LoraDecoder() for _ in range(2)), names("model.layers", 2)),
    "one layer": (lambda: lm([MoEDecoder()]), ["model.layers.0"]),
    "GPT-2": (gpt2, names("transformer.h", 3)),
    "BERT": (bert, names("bert.encoder.layer", 2)),
    "ViT": (vit, names("layers", 2)),
    "T5": (t5, names("encoder.block", 2) + names("decoder.block", 2)),
    "one-layer T5": (lambda: _one_layer_t5(), ["encoder.block.0", "decoder.block.0"]),
    "Flux": (flux, names("transformer_blocks", 2) + names("single_transformer_blocks", 3)),
    "Wan": (wan, names("blocks", 2)),
    "HiDream (a list of one-layer projections too)": (
        hidream,
        names("transformer_blocks", 2) + names("single_transformer_blocks", 3),
    ),
    "Chroma (a stack of guidance MLPs too)": (
        chroma,
        names("transformer_blocks", 2) + names("single_transformer_blocks", 3),
    ),
    "Qwen3-VL (merger MLPs beside vision and text blocks)": (
        qwen3_vl,
        names("model.visual.blocks", 2) + names("model.language_model.layers", 2),
    ),
    "per-token MLPs as large as the blocks": (
        wide_mlp_stack,
        names("model.layers", 2) + names("mlps", 2),
    ),
    "toy model of one-layer blocks": (
        lambda: nn.Sequential(TextProjection(), TextProjection()),
        ["0", "1"],
    ),
    "HunyuanVideo": (
        hunyuan_video,
        names("context_embedder.token_refiner.refiner_blocks", 2)
        + names("transformer_blocks", 2)
        + names("single_transformer_blocks", 2),
    ),
    "torchtitan (ModuleDict of layers)": (lambda: _titan(), names("layers", 3)),
    "Sequential of blocks at the root": (
        lambda: nn.Sequential(Decoder(), MoEDecoder()),
        ["0", "1"],
    ),
}


def _one_layer_t5():
    model = t5()
    model.encoder.block = nn.ModuleList([T5Block(False)])
    model.decoder.block = nn.ModuleList([T5Block(True)])
    return model


def _titan():
    root = nn.Module()
    root.tok_embeddings = nn.Embedding(10, 4)
    root.layers = nn.ModuleDict({str(i): Decoder() for i in range(3)})
    root.output = lin()
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_discovery_picks_the_stack_of_blocks(layout):
    build, expected = LAYOUTS[layout]
    model = build()
    found = [name for group in prime_ac.find_blocks(model) for name, _ in group]
    assert found == expected
    assert prime_ac.checkpoint_blocks(model, mode="selective") == expected
    # nothing inside a block is ever wrapped: experts, adapters, T5's per-block layer lists
    wrapped = [n for n, m in model.named_modules() if type(m).__name__.startswith("Checkpointed")]
    assert wrapped == expected


def test_a_layer_shared_between_blocks_is_one_block_of_its_first_path():
    # Zamba2: one attention block reused by several hybrid layers
    shared = Decoder()
    model = lm([MambaDecoder(), MambaDecoder()])
    for layer in model.model.layers:
        layer.shared_transformer = shared
    model.model.blocks = nn.ModuleList([shared])  # also registered on its own
    assert prime_ac.checkpoint_blocks(model) == names("model.layers", 2)


class Block(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.mlp = MoE(3) if moe else MLP()

    def forward(self, x):
        h = self.norm(x)
        if isinstance(self.mlp, MoE):
            weights = torch.softmax(self.mlp.gate(h), -1)
            out = sum(
                w[:, None] * e.down(torch.relu(e.up(h)))
                for w, e in zip(weights.unbind(-1), self.mlp.experts, strict=True)
            )
            out = out + self.mlp.shared_expert.down(self.mlp.shared_expert.up(h))
        else:
            out = self.mlp.down(torch.relu(self.mlp.up(h)))
        return x + out


class MixedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(False), Block(True), Block(True)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().sum()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_mixed_stack_trains_bitwise_equal(mode):
    torch.manual_seed(0)
    model, x = MixedStack(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    reference(x).backward()
    assert prime_ac.checkpoint_blocks(model, mode=mode) == names("layers", 3)
    model(x).backward()
    assert_bitwise_equal(grads(model), grads(reference))


def test_blocks_mixed_with_leaves_in_one_container_are_undecidable():
    # the blocks are not in a stack of their own: the only stacks are the experts inside them
    model = nn.Sequential(nn.Embedding(10, 4), MoEDecoder(), MoEDecoder(), lin())
    with pytest.raises(ValueError) as info:
        prime_ac.checkpoint_blocks(model)
    message = str(info.value)
    assert "cannot tell which modules are the blocks" in message
    assert "['1', '2']" in message and "1.mlp.experts, 2.mlp.experts" in message
    assert "isinstance(module, MoEDecoder)" in message
    assert not any(type(m).__name__.startswith("Checkpointed") for m in model.modules())
    names = prime_ac.checkpoint_blocks(model, blocks=lambda n, m: isinstance(m, MoEDecoder))
    assert names == ["1", "2"]
