"""A tiny transformers Llama (SDPA attention, nothing downloaded) and one batch for it."""

from __future__ import annotations

import torch

VOCAB = 256
IDS = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))


def llama(lora: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=8, target_modules=projections))
    return model.train()


def loss(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=IDS, labels=IDS).loss


def hf_checkpointing_on(model: torch.nn.Module) -> None:
    """The model's own activation checkpointing, non-reentrant as TRL and transformers 5 use."""
    model.activation_checkpointing_enable({"use_reentrant": False})
