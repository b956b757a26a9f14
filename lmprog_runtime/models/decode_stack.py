"""Decode steps of the whole decoder in one native call (CPU, the native backend).

`csrc/decode_stack.cpp` runs every layer of a plain decode step (no shared-prefix cascade,
no prefill tokens in the batch) with the same kernels, in the same order, as the Python
forward, so the results are identical and only the interpreter's share of the step goes.
`DecodeStackCache` builds it from a model's modules on first use and rebuilds it when any
module has registered a parameter, buffer or submodule since (a weight or a layer
replaced): torch calls the global registration hooks below on every such assignment, so
checking costs one comparison per step. Changes in place need nothing: the stack holds the
same tensors, except the AMX-packed copies of `AMXLinear` weights, which are checked each
step (a version number per layer) and packed again, with a rebuild, when stale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lmprog_runtime.models.amx_linear import AMXLinear
from lmprog_runtime.models.quantization import Q4Linear, Q8Linear, W8A8Linear, dense_rows

if TYPE_CHECKING:
    from lmprog_runtime.attention.native_backend import NativeAttentionBackend
    from lmprog_runtime.models.llama import LlamaForCausalLM


_registrations = [0]  # parameters, buffers and submodules registered in this process


def _count_registration(*args: object) -> None:
    _registrations[0] += 1


nn.modules.module.register_module_parameter_registration_hook(_count_registration)
nn.modules.module.register_module_buffer_registration_hook(_count_registration)
nn.modules.module.register_module_module_registration_hook(_count_registration)


def _linear_parts(layer: nn.Module) -> tuple | None:
    """(kind, weight, scales, mins, bias) as the native stack takes a linear; None if it
    cannot. AMX layers pass their packed weight as `scales`, W8A8 ones theirs (or None) as
    `mins`."""
    if isinstance(layer, Q8Linear):
        return ("q8_0", layer.qweight, layer.scales, None, layer.bias)
    if isinstance(layer, Q4Linear):
        return ("q4_1", layer.packed, layer.scales, layer.mins, layer.bias)
    if isinstance(layer, W8A8Linear):
        kind = "w8a8_gated" if layer.gated else "w8a8"
        return (kind, layer.qweight, layer.scales, layer.packed, layer.bias)
    if isinstance(layer, AMXLinear):
        kind = "amx_gated" if layer.gated else "amx"
        return (kind, layer.weight, layer.packed_weight(), None, layer.bias)
    if type(layer) is nn.Linear:
        return ("dense", layer.weight, None, None, layer.bias)
    return None


def _stack_supports(model: LlamaForCausalLM) -> bool:
    """No Q/K norms, and every projection a float, Q8_0 / Q4_1 or W8A8 linear."""
    linears = (
        linear
        for layer in model.layers
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    )
    return not model.config.qk_norm and all(_linear_parts(x) is not None for x in linears)


class DecodeStackCache:
    """The model's native decode stack, built lazily; `get` returns None when the model has
    something the stack does not cover (Q/K norms, another layer type)."""

    def __init__(self) -> None:
        self._stack = None
        self._built_at = -1  # the registration count the stack was built at
        self._kv_pool = None
        self._amx_layers: list[AMXLinear] = []  # whose packed weights the stack holds

    def get(self, model: LlamaForCausalLM, backend: NativeAttentionBackend):
        if (
            self._built_at != _registrations[0]
            or self._kv_pool is not backend.kv_pool
            or not all(layer.is_current() for layer in self._amx_layers)
        ):
            self._built_at, self._kv_pool = _registrations[0], backend.kv_pool
            self._stack = _build(model, backend) if _stack_supports(model) else None
            self._amx_layers = [m for m in model.layers.modules() if isinstance(m, AMXLinear)]
        return self._stack


def _build(model: LlamaForCausalLM, backend: NativeAttentionBackend):
    layout, config, pool = backend.layout, model.config, backend.kv_pool
    activations = model.norm.weight.dtype  # the dtype the whole forward runs in
    quantized_dense_rows = dense_rows(backend.native_ops, activations)
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
            quantized_dense_rows,
            int(backend.native_ops.amx_linear_max_rows()),
        )
    return stack
