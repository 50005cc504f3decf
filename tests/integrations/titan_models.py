"""torchtitan 0.3.0's own model configs, made tiny for a CPU: two layers, SDPA attention.

Its language models use flex attention, which has no backward on a CPU; its
``ScaledDotProductAttention`` takes that place (causal, no document masks). The MoE configs keep
their structure with fewer experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

MODELS = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3")
VOCAB = 2048  # the debug models' vocabulary


def _rewrite(cfg: Any, swap) -> Any:
    """``cfg`` with ``swap`` applied to every config object in its tree, leaves first."""
    if isinstance(cfg, list):
        return [_rewrite(c, swap) for c in cfg]
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        changes = {
            f.name: _rewrite(getattr(cfg, f.name), swap) for f in dataclasses.fields(cfg) if f.init
        }
        cfg = dataclasses.replace(cfg, **changes)
        return swap(cfg)
    return cfg


def _tiny(cfg: Any, experts: int = 8, top_k: int = 2) -> Any:
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    def swap(node: Any) -> Any:
        if isinstance(node, FlexAttention.Config):
            return ScaledDotProductAttention.Config()
        names = {f.name for f in dataclasses.fields(node)}
        changes = {}
        if "num_experts" in names and node.num_experts:
            changes["num_experts"] = experts
        if "top_k" in names and node.top_k:
            changes["top_k"] = top_k
        if "gate" in names and node.gate is not None and "num_experts" in names:
            changes["gate"] = dataclasses.replace(node.gate, out_features=experts)
        return dataclasses.replace(node, **changes) if changes else node

    cfg = _rewrite(cfg, swap)
    return dataclasses.replace(cfg, layers=cfg.layers[:2])


def config(name: str) -> Any:
    if name == "llama3":
        from torchtitan.models.llama3 import llama3_configs

        return _tiny(llama3_configs["debugmodel"](attn_backend="flex"))
    if name in ("qwen3", "qwen3_moe"):
        from torchtitan.models.qwen3 import qwen3_configs

        flavor = "debugmodel_moe" if name == "qwen3_moe" else "debugmodel"
        return _tiny(qwen3_configs[flavor](attn_backend="flex"))
    if name == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import deepseekv3_configs

        return _tiny(
            deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard")
        )
    raise ValueError(f"unknown model {name!r}: one of {MODELS}")


def build(name: str) -> torch.nn.Module:
    """The model, initialised the same on every call."""
    torch.manual_seed(0)
    model = config(name).build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


TOKENS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))


def loss(model: torch.nn.Module) -> torch.Tensor:
    return model(TOKENS).float().logsumexp(-1).mean()
