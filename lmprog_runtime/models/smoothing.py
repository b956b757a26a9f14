"""SmoothQuant-style smoothing for `quantization="w8a8_int8"`, calibrated at load.

W8A8 rounds each token's activations to int8 with one scale per token, so a few input
channels with large magnitudes (outliers) cost every other channel of the token its
precision. Smoothing moves part of each channel's range from the activations into the
weights: input channel j of a linear layer is divided by s_j and the layer's weight column
j multiplied by it, with

    s_j = max|x_j| ^ alpha / max|W[:, j]| ^ (1 - alpha)     (alpha = 0.5)

from the activations of a short built-in calibration text (`CALIBRATION_TEXT`, one
forward of the float model). The division is folded into whatever produces the input, so
nothing runs at inference:
- the QKV projection's input: the layer's input RMSNorm weight;
- the gate/up projection's: the post-attention RMSNorm weight;
- the down projection's, silu(gate) * up: the up rows of the gate/up weight (and bias);
- the output projection's, the attention output: the value rows of the QKV weight (one
  scale per kv head's channel, shared by the query heads of its group).
The LM head (its input is the final norm's output; its weight may be the embeddings') is
left as it is.

Every s_j is rounded to a power of two. Scaling by a power of two is exact in float32 and
bfloat16 alike, the norms' outputs, the values and silu(gate) * up scale exactly, and the
products and sums downstream are those of the original model scaled back: the smoothed
float model computes bit for bit what the original did (`tests/runtime/test_w8a8.py`
checks its logits). Only what W8A8's int8 rounding sees changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

ALPHA = 0.5
MAX_EXPONENT = 16  # scales between 2^-16 and 2^16
# A mix of prose, code, dialogue and numbers (about 200 tokens): the activations' channel
# ranges, not any particular text, are what calibration needs.
CALIBRATION_TEXT = (
    "Machine learning is a field of study in artificial intelligence concerned with the "
    "development of statistical algorithms that can learn from data and generalize to unseen "
    "data. In recent years, neural networks have surpassed many previous approaches in "
    "performance.\n\n"
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n\n"
    "User: What is the capital of Italy?\nAssistant: The capital of Italy is Rome.\n\n"
    "The weather today is sunny, with a high of 25 degrees and a low of 14. Tomorrow: rain, "
    "40% chance after 3 PM. Order #12345 shipped on 2024-05-17; total $89.99.\n"
    '{"name": "Ada", "age": 36, "languages": ["en", "fr"]}\n'
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "told stories to the children every evening."
)

# (decoder submodule, linear) whose inputs are smoothed.
_LINEARS = (
    ("self_attn", "qkv_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_up_proj"),
    ("mlp", "down_proj"),
)


def forward_tokens(model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """`model`'s logits at the last of `token_ids` (one sequence from position 0), through
    its own forward with torch ops and attention on a KV pool of its own: what calibration
    runs, outside any engine."""
    from lmprog_runtime.attention import create_attention_backend
    from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode
    from lmprog_runtime.kvcache import KVPool, ReqToTokenPool
    from lmprog_runtime.models.ops import TorchOps

    if not token_ids:
        raise ValueError("token_ids must not be empty")
    config = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    n = len(token_ids)
    pool = KVPool(n, config.num_layers, config.num_kv_heads, config.head_dim, dtype, device)
    table = ReqToTokenPool(1, n, device)
    row = table.alloc()
    slots = torch.arange(1, n + 1, dtype=torch.int64, device=device)
    table.write(row, 0, slots)
    backend = create_attention_backend("torch", model.attention_layout(), pool, table)
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=torch.arange(n, dtype=torch.int64, device=device),
        out_cache_loc=slots,
        req_pool_indices=torch.tensor([row], dtype=torch.int64, device=device),
        seq_lens=[n],
        prefix_lens=[0],
        logits_indices=torch.tensor([n - 1], dtype=torch.int64, device=device),
    )
    ops, use_stack = model.ops, model.use_decode_stack
    model.ops, model.use_decode_stack = TorchOps(), False
    try:
        backend.init_forward_metadata(batch)
        with torch.inference_mode():
            return model(batch, backend)
    finally:
        model.ops, model.use_decode_stack = ops, use_stack


def activation_ranges(
    model: nn.Module, token_ids: list[int]
) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, linear name) -> max |x_j| over the tokens, for every input channel j of the
    decoder layers' projections, from one forward of `model` over `token_ids`
    (`forward_tokens`)."""
    ranges: dict[tuple[int, str], torch.Tensor] = {}

    def record(key: tuple[int, str]) -> Callable:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach()
            ranges[key] = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()

        return hook

    hooks = [
        getattr(getattr(layer, part), name).register_forward_pre_hook(record((i, name)))
        for i, layer in enumerate(model.layers)
        for part, name in _LINEARS
    ]
    try:
        forward_tokens(model, token_ids)
    finally:
        for handle in hooks:
            handle.remove()
    return ranges


def _scales(x_range: torch.Tensor, w_range: torch.Tensor, alpha: float) -> torch.Tensor:
    """Powers of two nearest (in log) to x_range^alpha / w_range^(1 - alpha); 1 where
    either range is zero (a channel that never fires or is never read)."""
    x, w = x_range.double(), w_range.double()
    raw = x.pow(alpha) / w.pow(1 - alpha)
    usable = (x > 0) & (w > 0) & torch.isfinite(raw)
    exponent = torch.where(usable, torch.log2(raw).round(), torch.zeros_like(raw))
    return torch.pow(2.0, exponent.clamp(-MAX_EXPONENT, MAX_EXPONENT))


@torch.no_grad()
def smooth_for_w8a8(
    model: nn.Module, ranges: dict[tuple[int, str], torch.Tensor], alpha: float = ALPHA
) -> int:
    """Fold smoothing scales into `model`'s decoder layers, in place (see the module
    docstring). Returns how many projections' inputs were smoothed."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    count = 0
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not all(
            type(m) is nn.Linear
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ):
            raise TypeError("smooth_for_w8a8 needs the float model's nn.Linear projections")
        _into_norm(layer.input_layernorm, attn.qkv_proj, ranges[(i, "qkv_proj")], alpha)
        _into_norm(
            layer.post_attention_layernorm, mlp.gate_up_proj, ranges[(i, "gate_up_proj")], alpha
        )
        _into_up_rows(mlp.gate_up_proj, mlp.down_proj, ranges[(i, "down_proj")], alpha)
        _into_value_rows(attn, ranges[(i, "o_proj")], alpha)
        count += 4
    return count


def _column_ranges(linear: nn.Linear) -> torch.Tensor:
    return linear.weight.abs().amax(dim=0).float()


def _into_norm(norm: nn.Module, linear: nn.Linear, x_range: torch.Tensor, alpha: float) -> None:
    """An input produced by an RMSNorm: its weight / s, the projection's columns * s."""
    s = _scales(x_range, _column_ranges(linear), alpha)
    norm.weight.div_(s.to(norm.weight.dtype))
    linear.weight.mul_(s.to(linear.weight.dtype))


def _into_up_rows(gate_up: nn.Linear, down: nn.Linear, x_range: torch.Tensor, alpha: float) -> None:
    """silu(gate) * up, the down projection's input: the up rows (and bias) / s, the down
    projection's columns * s."""
    inter = down.in_features
    s = _scales(x_range, _column_ranges(down), alpha)
    gate_up.weight[inter:].div_(s.to(gate_up.weight.dtype)[:, None])
    if gate_up.bias is not None:
        gate_up.bias[inter:].div_(s.to(gate_up.bias.dtype))
    down.weight.mul_(s.to(down.weight.dtype))


def _into_value_rows(attn: nn.Module, x_range: torch.Tensor, alpha: float) -> None:
    """The attention output, the output projection's input: channel (head h, dim d) is
    value channel (h // group, d), so one scale per kv head's channel, from the largest
    range over its query heads; the value rows (and bias) of the QKV weight / s, the output
    projection's columns * s."""
    kv_heads, head_dim = attn.num_kv_heads, attn.head_dim
    group = attn.num_heads // kv_heads
    shape = (kv_heads, group, head_dim)
    qkv, o = attn.qkv_proj, attn.o_proj
    s_kv = _scales(
        x_range.view(shape).amax(dim=1).reshape(-1),
        _column_ranges(o).view(shape).amax(dim=1).reshape(-1),
        alpha,
    )
    s_o = s_kv.view(kv_heads, 1, head_dim).expand(shape).reshape(-1)
    v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
    qkv.weight[v_rows].div_(s_kv.to(qkv.weight.dtype)[:, None])
    if qkv.bias is not None:
        qkv.bias[v_rows].div_(s_kv.to(qkv.bias.dtype))
    o.weight.mul_(s_o.to(o.weight.dtype))


def calibrate_and_smooth(
    model: nn.Module, tokenize: Callable[[str], list[int]], alpha: float = ALPHA
) -> int:
    """Measure the activations' ranges over `CALIBRATION_TEXT` (tokenized by `tokenize`)
    and smooth the model (the text cut to the model's context). Returns how many projection
    inputs were smoothed."""
    ids = tokenize(CALIBRATION_TEXT)[: model.config.context_len]
    served_rope = model.rotary
    if len(ids) > served_rope.cos.shape[0]:
        # Tables for the calibration text (those of a short `context_len` are shorter):
        # the smoothing does not depend on the context served.
        from lmprog_runtime.models.llama import RotaryEmbedding

        model.rotary = RotaryEmbedding(model.config, len(ids)).to(served_rope.cos.device)
    try:
        ranges = activation_ranges(model, ids)
    finally:
        model.rotary = served_rope
    count = smooth_for_w8a8(model, ranges, alpha)
    logger.info("W8A8 smoothing: %d projection inputs over %d calibration tokens", count, len(ids))
    return count
