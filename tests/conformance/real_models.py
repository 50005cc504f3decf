"""Tiny random-weight configs of real ``transformers`` and ``diffusers`` model classes.

Each case builds its model from a config (nothing is downloaded), in float32, train mode, with
every dropout at 0, and one fixed batch; it names the blocks that discovery must wrap. Sizes are
the smallest the classes accept, so a training step takes milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB = 128
SEQ = 8
BATCH = 2
HELD_RATIOS = "conformance_held_bytes_ratio"  # test property the conftest tabulates


@dataclass(frozen=True)
class Case:
    """One model family: how to build it and its batch, and the blocks discovery must find."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], dict[str, Any]]
    blocks: tuple[str, ...]

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The model's own loss where it has one, else a fixed random projection of its output.

        A projection, not ``out.pow(2).mean()``: after a final LayerNorm the latter is a constant.
        """
        out = model(**batch)
        if getattr(out, "loss", None) is not None:
            return out.loss
        first = out[0] if isinstance(out, tuple) else next(iter(out.values()))
        if isinstance(first, (list, tuple)):  # ControlNet: a list of residuals, then one more
            first = torch.cat([t.flatten() for t in torch.utils._pytree.tree_leaves(out)])
        weights = torch.randn(first.shape, generator=torch.Generator().manual_seed(2))
        return (first.float() * weights).sum()


def _names(container: str, n: int) -> tuple[str, ...]:
    return tuple(f"{container}.{i}" for i in range(n))


def _hf(config_class: str, model_class: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_class)(**config)
        torch.manual_seed(0)
        return getattr(transformers, model_class)(cfg).float().train()

    return build


def _tokens(**extra: Any) -> Callable[[], dict[str, Any]]:
    def batch() -> dict[str, Any]:
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        return {"input_ids": ids, "labels": ids, **extra}

    return batch


def _seq2seq() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "labels": torch.randint(0, VOCAB, (BATCH, 5), generator=g),
        "use_cache": False,
    }


def _pixels() -> dict[str, Any]:
    return {
        "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    }


# Causal LMs are called with use_cache=False: in training a KV cache filled in the forward would
# be filled again by the recompute (see docs/checkpointing.md, Recipes).
_LM_BATCH = _tokens(use_cache=False)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
    **_IDS,
)
_MOE = dict(num_experts_per_tok=2)


def _flux(double: int = 2, single: int = 2) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from diffusers import FluxTransformer2DModel

        torch.manual_seed(0)
        return FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=double,
            num_single_layers=single,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            pooled_projection_dim=16,
            axes_dims_rope=(2, 2, 4),
        ).train()

    return build


def _flux_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    image, text = 16, 4
    return {
        "hidden_states": torch.randn(BATCH, image, 4, generator=g),
        "encoder_hidden_states": torch.randn(BATCH, text, 16, generator=g),
        "pooled_projections": torch.randn(BATCH, 16, generator=g),
        "timestep": torch.tensor([0.25, 0.75]),
        "img_ids": torch.randn(image, 3, generator=g),
        "txt_ids": torch.zeros(text, 3),
        "return_dict": False,
    }


def _wan() -> nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    ).train()


def _wan_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(BATCH, 4, 2, 4, 4, generator=g),  # (B, C, frames, H, W)
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(BATCH, 6, 16, generator=g),
        "return_dict": False,
    }


def _hunyuan_video() -> nn.Module:
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    return HunyuanVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_single_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        guidance_embeds=False,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 2, 4),
    ).train()


def _hunyuan_video_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(BATCH, 4, 2, 4, 4, generator=g),
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(BATCH, 5, 16, generator=g),
        "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
        "pooled_projections": torch.randn(BATCH, 8, generator=g),
        "return_dict": False,
    }


def _hidream() -> nn.Module:
    from diffusers import HiDreamImageTransformer2DModel

    torch.manual_seed(0)
    return HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        caption_channels=[8, 4],
        text_emb_dim=8,
        num_routed_experts=4,
        num_activated_experts=2,
        axes_dims_rope=(4, 2, 2),
        max_resolution=(16, 16),
        llama_layers=(0, 1, 0, 1),
    ).train()


def _hidream_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(BATCH, 4, 8, 8, generator=g),
        "timesteps": torch.tensor([10, 500]),
        "encoder_hidden_states_t5": torch.randn(BATCH, 6, 8, generator=g),
        "encoder_hidden_states_llama3": torch.randn(2, BATCH, 6, 4, generator=g),  # 2 LLM layers
        "pooled_embeds": torch.randn(BATCH, 8, generator=g),
        "return_dict": False,
    }


def _whisper_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "input_features": torch.randn(BATCH, 8, 16, generator=g),  # 8 mel bins, 16 frames
        "labels": torch.randint(3, VOCAB, (BATCH, 5), generator=g),
        "use_cache": False,
    }


def _blip2_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB - 1, (BATCH, SEQ + 4), generator=g)
    ids[:, :4] = VOCAB - 1  # the image's 4 query tokens
    return {
        "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
        "input_ids": ids,
        "labels": ids,
        "use_cache": False,
    }


def _switch_batch() -> dict[str, Any]:
    return {k: v for k, v in _seq2seq().items() if k != "use_cache"}


def _controlnet() -> nn.Module:
    from diffusers import ControlNetModel

    torch.manual_seed(0)
    return ControlNetModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        in_channels=4,
        cross_attention_dim=16,
        attention_head_dim=2,
        norm_num_groups=4,
        conditioning_embedding_out_channels=(8, 8),
    ).train()


def _controlnet_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "sample": torch.randn(BATCH, 4, 8, 8, generator=g),
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(BATCH, 4, 16, generator=g),
        "controlnet_cond": torch.randn(BATCH, 3, 16, 16, generator=g),
        "return_dict": False,
    }


CASES = [
    # dense decoder LMs
    Case(
        "llama",
        _hf("LlamaConfig", "LlamaForCausalLM", **_DECODER),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    Case(
        "qwen2",
        _hf("Qwen2Config", "Qwen2ForCausalLM", **_DECODER),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    Case(
        "qwen3",
        _hf("Qwen3Config", "Qwen3ForCausalLM", head_dim=8, **_DECODER),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    Case(
        "gpt2",
        _hf(
            "GPT2Config",
            "GPT2LMHeadModel",
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **_IDS,
        ),
        _LM_BATCH,
        _names("transformer.h", 2),
    ),
    # MoE LMs: Mixtral and Qwen3-MoE (norm_topk_prob=True) normalise the top-k values in place
    Case(
        "mixtral",
        _hf("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, **_MOE, **_DECODER),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    Case(
        "qwen3_moe",
        _hf(
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            head_dim=8,
            num_experts=4,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            **_MOE,
            **_DECODER,
        ),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    Case(
        "olmoe",
        _hf(
            "OlmoeConfig",
            "OlmoeForCausalLM",
            num_experts=4,
            norm_topk_prob=False,
            **_MOE,
            **_DECODER,
        ),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    # GPT-OSS: attention sinks, sliding-window layers, MoE with biased experts
    Case(
        "gpt_oss",
        _hf(
            "GptOssConfig",
            "GptOssForCausalLM",
            head_dim=8,
            num_local_experts=4,
            sliding_window=4,
            **_MOE,
            **_DECODER,
        ),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    # GLM-4-MoE: a dense first layer, then MoE layers normalising a gathered copy of the top-k
    Case(
        "glm4_moe",
        _hf(
            "Glm4MoeConfig",
            "Glm4MoeForCausalLM",
            head_dim=8,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            **_MOE,
            **_DECODER,
        ),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    # DeepSeek-V3: one dense layer, then MoE layers (MLA attention, grouped routing)
    Case(
        "deepseek_v3",
        _hf(
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            **{**_DECODER, "num_hidden_layers": 3, "num_key_value_heads": 4},
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_routed_experts=4,
            n_group=2,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            **_MOE,
        ),
        _LM_BATCH,
        _names("model.layers", 3),
    ),
    # hybrids (PyTorch mamba paths, no kernels needed): blocks of different classes in one stack
    Case(
        "jamba",
        _hf(
            "JambaConfig",
            "JambaForCausalLM",
            **_DECODER,
            num_experts=2,
            num_experts_per_tok=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=4,
            mamba_dt_rank=4,
        ),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    # Qwen3-Next: gated-delta-net linear attention (PyTorch path) then full attention; MoE
    Case(
        "qwen3_next",
        _hf(
            "Qwen3NextConfig",
            "Qwen3NextForCausalLM",
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **_MOE,
            **_DECODER,
        ),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    # Zamba2: two hybrid layers share one transformer whose LoRA adapters sit in ModuleLists
    Case(
        "zamba2",
        _hf(
            "Zamba2Config",
            "Zamba2ForCausalLM",
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            layers_block_type=["mamba", "hybrid", "hybrid"],
            mamba_d_state=8,
            mamba_headdim=8,
            n_mamba_heads=8,
            chunk_size=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_dropout=0.0,
            num_mem_blocks=1,
            use_shared_attention_adapter=True,
            adapter_rank=4,
            max_position_embeddings=64,
            **_IDS,
        ),
        _LM_BATCH,
        _names("model.layers", 3),
    ),
    # encoder, encoder-decoder, vision encoders
    # Gemma 3: sliding-window and global layers, QK norms, scaled embeddings
    Case(
        "gemma3",
        _hf("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=4, **_DECODER),
        _LM_BATCH,
        _names("model.layers", 2),
    ),
    Case(
        "bert",
        _hf(
            "BertConfig",
            "BertForMaskedLM",
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        ),
        _tokens(),
        _names("bert.encoder.layer", 2),
    ),
    Case(
        "t5",
        _hf(
            "T5Config",
            "T5ForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            **_IDS,
        ),
        _seq2seq,
        _names("encoder.block", 2) + _names("decoder.block", 2),
    ),
    Case(
        "vit",
        _hf(
            "ViTConfig",
            "ViTModel",
            image_size=16,
            patch_size=4,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        _pixels,
        _names("layers", 2),
    ),
    Case(
        "clip_vision",
        _hf(
            "CLIPVisionConfig",
            "CLIPVisionModel",
            image_size=16,
            patch_size=4,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            attention_dropout=0.0,
        ),
        _pixels,
        _names("encoder.layers", 2),
    ),
    # DiTs: double-stream and single-stream blocks; a video DiT
    Case(
        "flux",
        _flux(),
        _flux_batch,
        _names("transformer_blocks", 2) + _names("single_transformer_blocks", 2),
    ),
    Case("wan", _wan, _wan_batch, _names("blocks", 2)),
    # HunyuanVideo: a one-block token-refiner stack in the text embedder, one double block
    Case(
        "hunyuan_video",
        _hunyuan_video,
        _hunyuan_video_batch,
        ("context_embedder.token_refiner.refiner_blocks.0", "transformer_blocks.0")
        + _names("single_transformer_blocks", 2),
    ),
    # HiDream-I1: double/single-stream blocks with MoE feed-forwards whose experts sit in a
    # ModuleList, next to a ModuleList of per-layer caption projections (not blocks)
    Case(
        "hidream",
        _hidream,
        _hidream_batch,
        _names("double_stream_blocks", 2) + _names("single_stream_blocks", 2),
    ),
    # where the first step's no-AC bytes once disagreed with the audit's (issue 30)
    Case(
        "opt",
        _hf(
            "OPTConfig",
            "OPTForCausalLM",
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            **_IDS,
        ),
        _LM_BATCH,
        _names("model.decoder.layers", 2),
    ),
    Case(
        "whisper",
        _hf(
            "WhisperConfig",
            "WhisperForConditionalGeneration",
            vocab_size=VOCAB,
            num_mel_bins=8,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=8,
            max_target_positions=16,
            dropout=0.0,
            attention_dropout=0.0,
            decoder_start_token_id=1,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            **_IDS,
        ),
        _whisper_batch,
        _names("model.encoder.layers", 2) + _names("model.decoder.layers", 2),
    ),
    Case(
        "blip2",
        _hf(
            "Blip2Config",
            "Blip2ForConditionalGeneration",
            vision_config=dict(
                image_size=16,
                patch_size=4,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                attention_dropout=0.0,
            ),
            qformer_config=dict(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                encoder_hidden_size=32,
                cross_attention_frequency=1,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            ),
            text_config=dict(
                model_type="opt",
                vocab_size=VOCAB,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                word_embed_proj_dim=32,
                max_position_embeddings=64,
                dropout=0.0,
                **_IDS,
            ),
            num_query_tokens=4,
            image_token_index=VOCAB - 1,
        ),
        _blip2_batch,
        _names("vision_model.encoder.layers", 2)
        + _names("qformer.encoder.layer", 2)
        + _names("language_model.model.decoder.layers", 2),
    ),
    Case(
        "switch_transformers",
        _hf(
            "SwitchTransformersConfig",
            "SwitchTransformersForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=16,
            d_kv=4,
            d_ff=32,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            num_experts=4,
            expert_capacity=8,
            decoder_start_token_id=0,
            dropout_rate=0.0,
            router_jitter_noise=0.0,
            **_IDS,
        ),
        _switch_batch,  # its encoder refuses use_cache=True, so the cache test does not apply
        _names("encoder.block", 2) + _names("decoder.block", 2),
    ),
    # a ControlNet: down blocks and the mid block's attention and resnets, each a stack
    Case(
        "controlnet",
        _controlnet,
        _controlnet_batch,
        _names("down_blocks", 2)
        + ("mid_block.attentions.0", "mid_block.resnets.0", "mid_block.resnets.1"),
    ),
]

# One-layer stacks (a debug config, a DiT with one double block): discovery only.
ONE_LAYER_CASES = [
    Case(
        "llama_1_layer",
        _hf("LlamaConfig", "LlamaForCausalLM", **{**_DECODER, "num_hidden_layers": 1}),
        _LM_BATCH,
        ("model.layers.0",),
    ),
    Case(
        "flux_1_double_1_single",
        _flux(double=1, single=1),
        _flux_batch,
        ("transformer_blocks.0", "single_transformer_blocks.0"),
    ),
]
