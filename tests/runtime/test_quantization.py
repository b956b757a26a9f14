"""Weight-only quantized linear layers (issue 17) in llama.cpp's Q8_0 ("int8") and Q4_1
("int4") block layouts, on the native kernels (a few rows) or a dense dequantized matmul
(many rows).

The reference is always float32 arithmetic over the dequantized weights (plain torch, in
`dequantized()`). With float32 activations a layer's output and a whole engine's
log-probabilities must equal that reference within 1e-3 relative error (max |ours - ref| /
max |ref|); the AVX-512 kernels compute in float32 (only summation order differs), the AVX2
ones round the activations to int16 per block (15 bits of each block's largest). With bfloat16
activations one layer must be within 2e-2 of the float32 activations' result (bfloat16
keeps 8 bits of mantissa: a rounding is up to 0.4%, and an output sums many such terms),
and within 1e-3 of the float32 product of the same bfloat16 activations (the integer
kernels round them to int16 per block, well below their own rounding). On the real instruct model the greedy
tokens of the quantized engines are compared with a float32 engine holding the same
dequantized weights, position by position.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmprog_runtime import Engine
from lmprog_runtime.models.quantization import (
    BLOCK,
    Q4Linear,
    Q8Linear,
    QuantizedLinear,
)

REL_TOL = 1e-3
BF16_TOL = 2e-2  # one layer (see the module docstring)


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().float(), ref.detach().float()
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("layer_type", [Q8Linear, Q4Linear])
@pytest.mark.parametrize("bias", [False, True])
# Tiles of 4 rows and a tail; the most rows the kernel takes (a tail of 3 on either CPU's
# threshold); the dense path.
@pytest.mark.parametrize("rows", [1, 3, 4, 7, "kernel's most", "dense"])
def test_layer_equals_float32_over_its_dequantized_weight(layer_type, bias, rows):
    gen = torch.Generator().manual_seed(len(str(rows)))
    linear = torch.nn.Linear(160, 96, bias=bias)  # 5 blocks: an odd count exercises the tail
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 160, generator=gen))
    layer = layer_type(linear)
    assert layer._native is not None  # the kernels built; otherwise this tests the fallback
    threshold = layer.dense_rows(torch.float32)
    assert threshold in (16, 64)
    rows = {"kernel's most": threshold - 1, "dense": threshold + 24}.get(rows, rows)
    weight = layer.dequantized()
    x = torch.randn(rows, 160, generator=gen)
    with torch.no_grad():
        ref = F.linear(x, weight, linear.bias)
        assert _rel_err(layer(x), ref) <= REL_TOL
        out = layer(x.bfloat16())
    assert out.dtype == (torch.float32 if bias else torch.bfloat16)
    assert _rel_err(out, ref) <= BF16_TOL
    # The native dequantization (the dense path) equals the reference one.
    assert torch.equal(layer._dense_weight(torch.float32), weight)
    assert torch.equal(layer._dense_weight(torch.bfloat16), weight.bfloat16())
    # The quantizer itself: every weight within half a step of the original (plus the
    # float16 rounding of the scale, at most 2^-11 of it per step).
    original = linear.weight.detach()
    grouped = original.reshape(96, -1, BLOCK)
    if layer_type is Q8Linear:
        step = grouped.abs().amax(-1) / 127
    else:
        step = (grouped.amax(-1) - grouped.amin(-1)) / 15
    step = step.repeat_interleave(BLOCK, dim=1)
    assert bool(((weight - original).abs() <= step * (0.5 + 16 * 2**-11) + 1e-3 * step).all())


@pytest.mark.parametrize("layer_type", [Q8Linear, Q4Linear])
@pytest.mark.parametrize("in_features", [160, 576])  # 5 blocks; 18 (Q4_1: 4 groups of 4 + 2)
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
# Outputs split among threads in tiles of four for one row: whole tiles, and a tail.
@pytest.mark.parametrize("out_features", [72, 90])
def test_bfloat16_activations_give_the_float32_product_of_those_activations(
    layer_type, in_features, rows, out_features
):
    """With bfloat16 activations, the integer kernels round each block of activations to
    int16: the float32 result must still equal float32 arithmetic over the same bfloat16
    activations within 1e-3, also with an outlier channel 50x the others (the block holding
    it keeps fewer bits for its small neighbours)."""
    gen = torch.Generator().manual_seed(rows * in_features + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
    layer = layer_type(linear, float_output=True)
    x = torch.randn(rows, in_features, generator=gen)
    x[:, 3] *= 50
    x = x.bfloat16()
    with torch.no_grad():
        out = layer(x)
    ref = F.linear(x.float(), layer.dequantized())
    assert out.dtype == torch.float32 and _rel_err(out, ref) <= REL_TOL


@pytest.mark.parametrize("layer_type", [Q8Linear, Q4Linear])
@pytest.mark.parametrize("in_features", [160, 576])
# Pairs of blocks of 16 outputs: whole (96), an odd block at the end (80), a partial one (90).
@pytest.mark.parametrize("out_features", [96, 80, 90])
@pytest.mark.parametrize("rows", [8, 21, 40, "most"])
def test_bfloat16_batches_multiply_the_bfloat16_dequantized_weight(
    layer_type, in_features, out_features, rows
):
    """From 8 rows of bfloat16 activations (a decode batch) on a CPU with AVX512-BF16 or AMX,
    the kernel dequantizes 16 outputs at a time to bfloat16 and multiplies every row by them:
    the result must be float32 arithmetic over the bfloat16 activations and the bfloat16
    dequantized weight (what the dense path multiplies) up to summation order, for every row
    count up to the one where the dense path takes over."""
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    layer = layer_type(linear, float_output=True)
    most = layer.dense_rows(torch.bfloat16) - 1
    if most < layer.dense_rows(torch.float32):  # (the tiled path's crossover is far higher)
        # (AVX-512 without BF16, or AVX2: bfloat16 rows go through the float32 kernels)
        pytest.skip("this CPU has neither AVX512-BF16 nor AMX: no tiled bfloat16 path")
    rows = most if rows == "most" else rows
    gen = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = layer._dense_weight(torch.bfloat16)
    assert torch.equal(weight, layer.dequantized().bfloat16())
    with torch.no_grad():
        out = layer(x)
        ref = F.linear(x.float(), weight.float(), linear.bias)
    assert out.dtype == torch.float32 and _rel_err(out, ref) <= 1e-5
    layer.float_output = False  # bfloat16 out: the same sums rounded once
    with torch.no_grad():
        out = layer(x)
    assert out.dtype == torch.float32  # the float32 bias promotes it
    assert _rel_err(out, ref) <= 2 * 2.0**-8


def test_float_output_layer_returns_float32():
    linear = torch.nn.Linear(64, 40, bias=False)
    layer = Q8Linear(linear, float_output=True)
    x = torch.randn(2, 64).bfloat16()
    with torch.no_grad():
        out = layer(x)
        ref = F.linear(x.float(), layer.dequantized())
    assert out.dtype == torch.float32 and _rel_err(out, ref) <= REL_TOL


@pytest.mark.parametrize("layer_type", [Q8Linear, Q4Linear])
def test_gguf_blocks_come_back_exactly(layer_type):
    """Weights that are already Q8_0 / Q4_1 values (as a dequantized GGUF gives them: float16
    scales, each block's extremes at the ends of the integer range) come back unchanged."""
    gen = torch.Generator().manual_seed(0)
    if layer_type is Q8Linear:
        q = torch.randint(-127, 128, (64, 4, BLOCK), generator=gen).float()
        q[:, :, 0] = 127  # Q8_0: d = max |w| / 127
        d = (torch.rand(64, 4, 1, generator=gen) * 0.1 + 0.01).half().float()
        weight = q * d
    else:
        q = torch.randint(0, 16, (64, 4, BLOCK), generator=gen).float()
        q[:, :, 0], q[:, :, 1] = 0, 15  # Q4_1 maps each block's min and max to 0 and 15
        d = (torch.rand(64, 4, 1, generator=gen) * 0.1 + 0.01).half().float()
        m = torch.randn(64, 4, 1, generator=gen).half().float()
        weight = q * d + m
    weight = weight.reshape(64, 4 * BLOCK)
    linear = torch.nn.Linear(4 * BLOCK, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    assert torch.allclose(layer_type(linear).dequantized(), weight, rtol=0, atol=1e-6)


def test_bad_layer_shapes_are_refused():
    with pytest.raises(ValueError, match="in_features"):
        Q8Linear(torch.nn.Linear(40, 8))
    layer = Q4Linear(torch.nn.Linear(64, 8))
    with pytest.raises(RuntimeError, match="x must be"):
        layer._kernel(torch.randn(2, 32))


def _logprobs(engine: Engine, text: str) -> torch.Tensor:
    """The top-20 log-probabilities at every prompt position (many rows at once: the dense
    path) and at 6 greedy decode steps (one row: the native kernels)."""
    out = engine.generate(
        text,
        {"max_new_tokens": 6, "min_new_tokens": 6, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=20,
    )
    meta = out["meta_info"]
    rows = [r for r in meta["input_top_logprobs"] + meta["output_top_logprobs"] if r is not None]
    return torch.tensor([[value for value, *_ in row] for row in rows])


def _dequantized_copy(quantized: Engine, path: str, dtype: str) -> Engine:
    """An engine on the same checkpoint whose layers hold `quantized`'s dequantized weights."""
    layers = {
        name: module
        for name, module in quantized.runner.model.named_modules()
        if isinstance(module, QuantizedLinear)
    }
    reference = Engine(path, dtype=dtype, max_total_tokens=4096)
    modules = dict(reference.runner.model.named_modules())
    dtype_of = next(reference.runner.model.parameters()).dtype
    with torch.no_grad():
        for name, layer in layers.items():  # the LM head too (untied from the embeddings)
            modules[name].weight = torch.nn.Parameter(layer.dequantized(dtype_of))
    return reference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_equals_engine_over_dequantized_weights(tiny_path, method, dtype):
    """float32: within 1e-3. bfloat16: within twice what bfloat16 costs this model anyway
    (a bfloat16 engine against the float32 one)."""
    text = "The quick brown fox jumps over the lazy dog, and then it " * 3
    with Engine(tiny_path, quantization=method, dtype=dtype, max_total_tokens=1024) as quantized:
        names = [
            n for n, m in quantized.runner.model.named_modules() if isinstance(m, QuantizedLinear)
        ]
        # The LM head is Q8_0 with either method (the tiny model's down projection, 176
        # inputs, is not a whole number of blocks of 32 and stays in float).
        assert isinstance(quantized.runner.model.lm_head, Q8Linear)
        assert "layers.0.self_attn.qkv_proj" in names and "layers.0.mlp.down_proj" not in names
        ours = _logprobs(quantized, text)
        with _dequantized_copy(quantized, tiny_path, dtype) as reference:
            ref = _logprobs(reference, text)
    tolerance = REL_TOL
    if dtype == "bfloat16":
        with Engine(tiny_path, max_total_tokens=1024) as float32:
            plain = _logprobs(float32, text)
        with Engine(tiny_path, dtype="bfloat16", max_total_tokens=1024) as bf16:
            tolerance = 2 * _rel_err(_logprobs(bf16, text), plain)
        assert REL_TOL < tolerance <= 0.1
    assert ours.shape == ref.shape and _rel_err(ours, ref) <= tolerance


def test_bad_quantization_is_refused(tiny_path):
    with pytest.raises(ValueError, match="quantization"):
        Engine(tiny_path, quantization="int3")
    with pytest.raises(ValueError, match="quantization"):
        Engine(tiny_path, quantization="int8", device="cuda")


PROMPTS = [
    "The capital of France is",
    "Here is a recipe for pancakes:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of robotics are",
    "Water boils at",
    "A haiku about autumn:",
    "The best way to learn a language is",
]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_greedy_tokens_of_the_instruct_model_equal_its_dequantized_float32_run(method):
    """8 x 64 greedy tokens of the real instruct model (its GGUF's Q4_1 and Q8_0 blocks come
    back exactly), position by position, against a float32 engine holding the same
    dequantized weights: a token after a divergence counts as a disagreement too, so this
    bounds the agreement from below. Only summation order differs (and, on AVX2, the
    activations' int16 rounding), so nearly all agree."""
    params = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    name = "smollm2-135m-instruct"
    with Engine(name, dtype="float32", quantization=method, max_total_tokens=4096) as engine:
        outs = [o["output_ids"] for o in engine.generate(PROMPTS, params)]
        with _dequantized_copy(engine, name, "float32") as reference:
            refs = [o["output_ids"] for o in reference.generate(PROMPTS, params)]
    same = sum(a == b for ours, ref in zip(outs, refs) for a, b in zip(ours, ref))
    assert same >= 0.95 * 8 * 64, same
