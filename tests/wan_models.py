"""A tiny diffusers Wan DiT (``WanTransformer3DModel``): the model FastVideo trains, at a size a
CPU test runs in seconds. Imported by the FastVideo tests in tests/compat and tests/integrations."""

from __future__ import annotations

import torch


def tiny_wan() -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
    ).train()
