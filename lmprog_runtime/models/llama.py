"""One forward pass for the Llama family (Llama, Mistral, Qwen2, Qwen3) over the paged pool.

Tokens arrive flat, `[num_tokens]`, with no padding; attention goes through the backend,
which owns the KV pool. q/k/v and gate/up projections are fused into one matmul each at
load time. Numerics follow transformers (RMSNorm in float32, rotate-half RoPE) so logits
match its forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmprog_runtime.attention import AttentionLayout, BaseAttentionBackend
from lmprog_runtime.forward_batch import ForwardBatch
from lmprog_runtime.models.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table for every position up to the context length."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        positions = torch.arange(config.context_len, dtype=torch.float32)
        freqs = positions[:, None] * config.inv_freq()[None, :]  # [context_len, head_dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, 1, head_dim]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: BaseAttentionBackend,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(batch.positions, q, k)
        return self.o_proj(backend.forward(q, k, v, self.layer_id, batch))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head over a flat token batch."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)

    def attention_layout(self) -> AttentionLayout:
        c = self.config
        return AttentionLayout(
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            scaling=c.head_dim**-0.5,
            sliding_window=c.sliding_window,
        )

    def forward(self, batch: ForwardBatch, backend: BaseAttentionBackend) -> torch.Tensor:
        """Return logits `[len(batch.logits_indices), vocab]` in float32."""
        hidden = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        for layer in self.layers:
            residual = hidden
            hidden = layer.self_attn(layer.input_layernorm(hidden), self.rotary, backend, batch)
            hidden = residual + hidden
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = hidden.index_select(0, batch.logits_indices)
        return self.lm_head(self.norm(hidden)).float()
