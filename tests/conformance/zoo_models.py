"""Tiny configs of model families with state beside the blocks' inputs and helper stacks.

RecurrentGemma passes its cache positionally and keeps recurrent state on its modules; ResNet
updates BatchNorm statistics in its stages; Chroma has a stack of guidance MLPs beside its
blocks; Qwen3-VL a stack of merger MLPs beside its vision blocks. All are called as users call
them in training: with the default ``use_cache``.
"""

from __future__ import annotations

from typing import Any

import torch
from real_models import BATCH, VOCAB, Case, _hf, _names, _tokens
from torch import nn

_IMAGE, _VISION_START, _VISION_END = 100, 102, 103


def _chroma() -> nn.Module:
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(0)
    return ChromaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
        approximator_num_channels=8,
        approximator_hidden_dim=16,
        approximator_layers=2,
    ).train()


def _chroma_batch() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    image, text = 16, 4
    return {
        "hidden_states": torch.randn(BATCH, image, 4, generator=g),
        "encoder_hidden_states": torch.randn(BATCH, text, 16, generator=g),
        "timestep": torch.tensor([0.25, 0.75]),
        "img_ids": torch.randn(image, 3, generator=g),
        "txt_ids": torch.zeros(text, 3),
        "return_dict": False,
    }


def _pixels() -> dict[str, Any]:
    return {
        "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    }


def _qwen3_vl_batch() -> dict[str, Any]:
    """Two images of 4x4 patches (4 tokens each after the 2x2 merge) inside a text sequence."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (BATCH, 10), generator=g)
    ids[:, 1], ids[:, 2:6], ids[:, 6] = _VISION_START, _IMAGE, _VISION_END
    return {
        "input_ids": ids,
        "labels": ids,
        "mm_token_type_ids": (ids == _IMAGE).long(),
        "pixel_values": torch.randn(BATCH * 16, 3 * 2 * 4 * 4, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * BATCH),
    }


ZOO = [
    # recurrent (RG-LRU, conv state on the modules) and local-attention blocks; cache positional
    Case(
        "recurrent_gemma",
        _hf(
            "RecurrentGemmaConfig",
            "RecurrentGemmaForCausalLM",
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            lru_width=32,
            attention_window_size=8,
            head_dim=8,
            block_types=["recurrent", "recurrent", "attention"],
        ),
        _tokens(),
        _names("model.layers", 3),
    ),
    # BatchNorm in every stage: running statistics and counters
    Case(
        "resnet",
        _hf(
            "ResNetConfig",
            "ResNetModel",
            num_channels=3,
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
        ),
        _pixels,
        _names("encoder.stages", 2),
    ),
    # Flux-like blocks beside distilled_guidance_layer.layers (per-token MLPs: not blocks)
    Case(
        "chroma",
        _chroma,
        _chroma_batch,
        _names("transformer_blocks", 1) + _names("single_transformer_blocks", 2),
    ),
    # vision blocks and text layers beside visual.deepstack_merger_list (per-token MLPs). The
    # text MLP is 8x hidden so that, as in the released sizes, a text layer outweighs a merger.
    Case(
        "qwen3_vl",
        _hf(
            "Qwen3VLConfig",
            "Qwen3VLForConditionalGeneration",
            text_config=dict(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=64,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 1, 1],
                    "mrope_interleaved": True,
                },
                pad_token_id=0,
            ),
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=4,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
                out_hidden_size=32,
                num_position_embeddings=16,
                deepstack_visual_indexes=[0, 1],
            ),
            image_token_id=_IMAGE,
            video_token_id=101,
            vision_start_token_id=_VISION_START,
            vision_end_token_id=_VISION_END,
        ),
        _qwen3_vl_batch,
        _names("model.visual.blocks", 2) + _names("model.language_model.layers", 2),
    ),
]
