"""Tiny built-in models for the demo, the audit CLI, benchmarks and tests.

A Llama-style dense transformer and a mixture-of-experts variant, small enough to train a step
on two CPU cores in milliseconds, with the operator mix real models have: matrix products,
fused attention, RMSNorm, RoPE, SwiGLU, top-k routing. No download, no other package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "TinyTransformer", "build_model"]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 128
    n_experts: int = 0  # 0: dense feed-forward; otherwise a top-k routed MoE
    top_k: int = 2
    max_seq_len: int = 512


def _rope_tables(head_dim: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, S, H, D]; rotate the two halves of the head dimension.
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed experts; tokens are gathered per expert and scattered back."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(
            FeedForward(cfg.dim, cfg.hidden_dim) for _ in range(cfg.n_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores = self.router(tokens).softmax(dim=-1)
        weights, experts = torch.topk(scores, self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            token_idx, slot = torch.where(experts == index)
            routed = expert(tokens[token_idx]) * weights[token_idx, slot, None]
            out = out.index_add(0, token_idx, routed)
        return out.view(shape)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.feed_forward = MoE(cfg) if cfg.n_experts else FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyTransformer(nn.Module):
    """Decoder-only language model; ``forward(tokens)`` returns logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = _rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy on ``tokens`` [B, S]."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def build_model(kind: str = "dense", *, seed: int = 0, **overrides) -> TinyTransformer:
    """``"dense"`` (Llama-style) or ``"moe"`` (8 experts, top-2), initialised from ``seed``."""
    presets = {"dense": {}, "moe": {"n_experts": 8, "hidden_dim": 64}}
    if kind not in presets:
        raise ValueError(f"model kind {kind!r} is not built in: use one of {sorted(presets)}")
    torch.manual_seed(seed)
    return TinyTransformer(ModelConfig(**{**presets[kind], **overrides}))
