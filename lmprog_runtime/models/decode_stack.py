"""Decode steps of the whole decoder in one native call (CPU, the native backend).

`csrc/decode_stack.cpp` runs every layer of a plain decode step (no shared-prefix cascade,
no prefill tokens in the batch) with the same kernels, in the same order, as the Python
forward, so the results are identical and only the interpreter's share of the step goes.
`DecodeStackCache` builds it from a model's modules on first use and rebuilds it when a
module's weight has been replaced since.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lmprog_runtime.models.quantization import DENSE_ROWS, Q4Linear, Q8Linear

if TYPE_CHECKING:
    from lmprog_runtime.attention.native_backend import NativeAttentionBackend
    from lmprog_runtime.models.llama import LlamaForCausalLM


def _linear_parts(layer: nn.Module) -> tuple | None:
    """(kind, weight, scales, mins, bias) as the native stack takes a linear; None if it
    cannot."""
    if isinstance(layer, Q8Linear):
        return ("q8_0", layer.qweight, layer.scales, None, layer.bias)
    if isinstance(layer, Q4Linear):
        return ("q4_1", layer.packed, layer.scales, layer.mins, layer.bias)
    if type(layer) is nn.Linear:
        return ("dense", layer.weight, None, None, layer.bias)
    return None


def _held_tensors(model: LlamaForCausalLM) -> list[torch.Tensor | None] | None:
    """Every tensor a stack built now would hold, in a fixed order (None where a linear has
    no such part); None if a linear is of a kind the stack cannot run."""
    held: list[torch.Tensor | None] = [model.norm.weight, model.rotary.cos, model.rotary.sin]
    for layer in model.layers:
        held += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            parts = _linear_parts(linear)
            if parts is None:
                return None
            held += parts[1:]
    return held


class DecodeStackCache:
    """The model's native decode stack, built lazily; `get` returns None when the model has
    something the stack does not cover (Q/K norms, another layer type)."""

    def __init__(self) -> None:
        self._stack = None
        self._held: list[torch.Tensor | None] = []
        self._kv_pool = None

    def get(self, model: LlamaForCausalLM, backend: NativeAttentionBackend):
        if model.config.qk_norm:
            return None
        held = _held_tensors(model)
        if held is None:
            return None
        fresh = len(held) == len(self._held) and all(a is b for a, b in zip(held, self._held))
        if self._stack is None or not fresh or self._kv_pool is not backend.kv_pool:
            self._stack = _build(model, backend)
            self._held, self._kv_pool = held, backend.kv_pool
        return self._stack


def _build(model: LlamaForCausalLM, backend: NativeAttentionBackend):
    layout, config, pool = backend.layout, model.config, backend.kv_pool
    stack = backend.native_ops.DecodeStack(
        layout.num_heads,
        layout.num_kv_heads,
        layout.head_dim,
        config.rms_norm_eps,
        layout.scaling,
        layout.sliding_window or 0,
        model.rotary.cos,
        model.rotary.sin,
        model.norm.weight,
    )
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        stack.add_layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            _linear_parts(attn.qkv_proj),
            _linear_parts(attn.o_proj),
            _linear_parts(mlp.gate_up_proj),
            _linear_parts(mlp.down_proj),
            pool.k_buffers[i],
            pool.v_buffers[i],
            DENSE_ROWS,
        )
    return stack
