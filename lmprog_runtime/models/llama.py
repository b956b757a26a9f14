"""One forward pass for the Llama family (Llama, Mistral, Qwen2, Qwen3) over the paged pool.

Tokens arrive flat, `[num_tokens]`, with no padding; attention goes through the backend,
which owns the KV pool. q/k/v and gate/up projections are fused into one matmul each at
load time. Numerics follow transformers (RMSNorm in float32, rotate-half RoPE) so logits
match its forward.
"""

from __future__ import annotations

import torch
from torch import nn

from lmprog_runtime.attention import AttentionLayout, BaseAttentionBackend
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
from lmprog_runtime.models.decode_stack import DecodeStackCache
from lmprog_runtime.models.model_config import ModelConfig
from lmprog_runtime.models.ops import NativeOps, TorchOps


class RMSNorm(nn.Module):
    """Holds the weight; the computation is `ops.rms_norm` / `ops.add_rms_norm`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE tables: cos/sin `[length, head_dim]`, a row per position (`length`:
    the model's context, or the shorter one the engine serves: a model made for a million
    tokens would otherwise hold a GiB of tables)."""

    def __init__(self, config: ModelConfig, length: int | None = None) -> None:
        super().__init__()
        # Computed on the CPU even while the model is built on the meta device: the tables are
        # small, and the first meta-device arange costs seconds of one-time setup in torch.
        with torch.device("cpu"):
            positions = torch.arange(length or config.context_len, dtype=torch.float32)
            freqs = positions[:, None] * config.inv_freq()[None, :]  # [context_len, head_dim // 2]
            emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: BaseAttentionBackend,
        batch: ForwardBatch,
        ops: TorchOps,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Views into the fused projection: [num_tokens, heads, head_dim]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: RMSNorm per head, fused (one row per head)
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.k_norm.eps)
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = ops.rope(q, k, batch.positions, rotary.cos, rotary.sin)
        return self.o_proj(backend.forward(q, k, v, self.layer_id, batch))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        # W8A8, or bfloat16 on AVX512-BF16: the activation in one pass with the product.
        if getattr(self.gate_up_proj, "gated", False):
            return self.down_proj(self.gate_up_proj.gated_activation(x))
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head over a flat token batch."""

    def __init__(self, config: ModelConfig, rope_length: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, rope_length)
        self.ops: TorchOps = TorchOps()  # ModelRunner may swap in NativeOps
        # Plain decode steps on the native backend run every layer in one native call.
        self.use_decode_stack = True
        self._decode_stack = DecodeStackCache()

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
        residual = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        stack_inputs = self._decode_stack_inputs(batch, backend)
        if stack_inputs is not None:
            stack, inputs = stack_inputs
            hidden = stack.forward(residual, batch.positions, batch.out_cache_loc, *inputs)
        else:
            hidden = self._layers(residual, batch, backend)
        if batch.mode is not ForwardMode.DECODE:  # a decode step needs every row, in order
            hidden = hidden.index_select(0, batch.logits_indices)
        return self.lm_head(hidden).float()

    def _layers(
        self, residual: torch.Tensor, batch: ForwardBatch, backend: BaseAttentionBackend
    ) -> torch.Tensor:
        """Every decoder layer and the final norm, from the embeddings (consumed: they
        become the residual stream)."""
        ops, eps = self.ops, self.config.rms_norm_eps
        hidden = ops.rms_norm(residual, self.layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(self.layers):
            attn_out = layer.self_attn(hidden, self.rotary, backend, batch, ops)
            hidden, residual = ops.add_rms_norm(
                attn_out, residual, layer.post_attention_layernorm.weight, eps
            )
            mlp_out = layer.mlp(hidden, ops)
            # The next norm is the next layer's input norm, or the final norm after the last.
            is_last = i + 1 == len(self.layers)
            next_norm = self.norm if is_last else self.layers[i + 1].input_layernorm
            hidden, residual = ops.add_rms_norm(mlp_out, residual, next_norm.weight, eps)
        return hidden

    def _decode_stack_inputs(
        self, batch: ForwardBatch, backend: BaseAttentionBackend
    ) -> tuple[object, tuple[torch.Tensor, ...]] | None:
        """(native stack, its attention inputs) when this step can run as one native call."""
        plain = getattr(backend, "plain_decode_inputs", None)
        if not self.use_decode_stack or plain is None or not isinstance(self.ops, NativeOps):
            return None
        inputs = plain(batch)
        if inputs is None:
            return None
        stack = self._decode_stack.get(self, backend)
        return None if stack is None else (stack, inputs)
