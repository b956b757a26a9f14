"""bfloat16 linear layers for decode batches on AMX tiles or by AVX512-BF16 dot products
(`csrc/amx_linear.cpp`, `models/amx_linear.py`), against float32 matmuls of the same
bfloat16 values and against `F.linear`.

The kernel's products are exact in float32 and its output is rounded once to bfloat16, so
it must lie within one bfloat16 rounding (2^-8 relative, plus float32 summation order) of
the float32 product; `F.linear` in bfloat16 must meet the same bound (checked alongside),
and a wrong tile layout or a missed block is far outside it. Runs where AMX is compiled in
and granted by the OS, or AVX512-BF16 compiled in (the path taken is AMX where it runs);
elsewhere the layers stay `nn.Linear`, which the other tests cover.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmprog_runtime import Engine
from lmprog_runtime.models.amx_linear import AMXLinear, pack_for_amx, use_amx_linears
from lmprog_runtime.native import load_native


def _native():
    try:
        native = load_native()
    except RuntimeError:
        return None
    return native if native.amx_linear_available() else None


pytestmark = pytest.mark.skipif(_native() is None, reason="no AMX or AVX512-BF16 here")


def _within_one_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """|got - exact| <= 2^-8 |exact| + a float32-summation allowance, elementwise."""
    allowance = 2**-8 * exact.abs() + 1e-5 * exact.abs().max()
    excess = (got.float() - exact).abs() - allowance
    assert excess.max() <= 0, f"worst excess {excess.max():.3g}"


@pytest.mark.parametrize(
    ("out_features", "in_features"), [(16, 32), (48, 64), (960, 576), (80, 1536)]
)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 31, 32, 33, 70, 256])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_is_the_float32_product_rounded_once(out_features, in_features, rows, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    x[:, 5] *= 40  # an outlier channel
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    exact = x.float() @ w.float().t() + (bias.float() if with_bias else 0)
    got = _native().amx_linear(x, pack_for_amx(w), bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    _within_one_rounding(got, exact)
    _within_one_rounding(F.linear(x, w, bias), exact)  # the bound torch itself meets


def test_kernel_refuses_mismatched_inputs():
    native = _native()
    packed = pack_for_amx(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="inputs"):
        native.amx_linear(torch.randn(2, 96).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.amx_linear(torch.randn(2, 64), packed)
    with pytest.raises(RuntimeError, match="bias"):
        native.amx_linear(torch.randn(2, 64).bfloat16(), packed, torch.zeros(31).bfloat16())


def test_layer_uses_the_packed_weight_for_decode_rows_and_repacks_when_the_weight_changes():
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48).bfloat16()
    layer = AMXLinear(linear, _native())
    assert layer.weight is linear.weight and layer.bias is linear.bias
    x = torch.randn(4, 64, generator=gen).bfloat16()
    exact = lambda inp: inp.float() @ layer.weight.float().t() + layer.bias.float()  # noqa: E731
    with torch.no_grad():
        _within_one_rounding(layer(x), exact(x))
        layer.weight.mul_(-2)  # in place: packed again on next use
        assert not layer.is_current()
        _within_one_rounding(layer(x), exact(x))
        layer.weight = nn.Parameter(torch.randn(48, 64, generator=gen).bfloat16())  # replaced
        _within_one_rounding(layer(x), exact(x))
        assert layer.is_current()
        assert layer.max_rows in (32, 256)  # AMX tiles, AVX512-BF16 dot products
        many = torch.randn(layer.max_rows + 1, 64, generator=gen).bfloat16()
        assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))
        batched = torch.randn(2, 3, 64, generator=gen).bfloat16()  # leading dims kept
        assert torch.equal(layer(batched), layer(batched.reshape(6, 64)).reshape(2, 3, 48))


def test_swap_keeps_tied_weights_and_respects_the_memory_limit():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.proj = nn.Linear(32, 32, bias=False)
            self.odd = nn.Linear(32, 24)  # outputs not a multiple of 16: stays nn.Linear
            self.head = nn.Linear(32, 64, bias=False)
            self.head.weight = self.embed.weight

    model = Tied().bfloat16()
    keys = set(model.state_dict())
    assert use_amx_linears(model, free_bytes=1024) == 0  # copies over a quarter of it
    assert type(model.proj) is nn.Linear
    assert use_amx_linears(model, free_bytes=1 << 30) == 2
    assert isinstance(model.proj, AMXLinear) and isinstance(model.head, AMXLinear)
    assert type(model.odd) is nn.Linear
    assert model.head.weight is model.embed.weight
    assert set(model.state_dict()) == keys


def _greedy(engine: Engine, prompts: list[str]) -> tuple[list, torch.Tensor]:
    params = {"max_new_tokens": 8, "min_new_tokens": 8, "temperature": 0}
    outs = engine.generate(prompts, params, return_logprob=True, top_logprobs_num=5)
    rows = [row for o in outs for row in o["meta_info"]["output_top_logprobs"]]
    return [o["output_ids"] for o in outs], torch.tensor([[v for v, *_ in r] for r in rows])


def test_engine_in_bfloat16_decodes_as_without_amx_linears(tiny_path):
    """The tiny model's linears with whole tiles (LM head included) become AMXLinear; greedy
    tokens equal a run with them disabled, log-probabilities within bfloat16 noise; and a
    weight changed in place reaches the decode stack's packed copy."""
    prompts = ["The quick brown fox", "Once upon a time there", "1, 2, 3,"]
    with Engine(tiny_path, dtype="bfloat16", max_total_tokens=1024, disable_amx_linears=True) as e:
        ref_tokens, ref_logprobs = _greedy(e, prompts)
    with Engine(tiny_path, dtype="bfloat16", max_total_tokens=1024) as engine:
        model = engine.runner.model
        assert isinstance(model.lm_head, AMXLinear)
        assert isinstance(model.layers[0].mlp.gate_up_proj, AMXLinear)
        tokens, logprobs = _greedy(engine, prompts)
        assert tokens == ref_tokens
        torch.testing.assert_close(logprobs, ref_logprobs, atol=0.05, rtol=0)
        with torch.no_grad():
            model.layers[1].mlp.gate_up_proj.weight.mul_(3)
        engine.flush_cache()
        changed = _greedy(engine, prompts)
        model.use_decode_stack = False
        engine.flush_cache()
        python_path = _greedy(engine, prompts)
    assert changed[0] == python_path[0]
    assert torch.equal(changed[1], python_path[1])


def test_disabled_or_float32_keeps_nn_linear(tiny_path):
    with Engine(tiny_path, dtype="float32", max_total_tokens=256) as engine:
        assert type(engine.runner.model.lm_head) is nn.Linear
    with Engine(
        tiny_path, dtype="bfloat16", max_total_tokens=256, disable_amx_linears=True
    ) as engine:
        assert type(engine.runner.model.lm_head) is nn.Linear


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_stack_steps_of_amx_layers_in_one_region_equal_the_python_forward(num_prompts):
    """The built-in `small` model has whole tiles in every layer, so a bfloat16 decode step
    of up to 32 tokens runs its AMX linears split among the threads of one parallel region
    (`csrc/decode_stack.cpp`); tokens and log-probabilities equal the Python forward's."""
    from lmprog_runtime.models.default_model import default_model_path

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prompts = ["The quick brown fox", "Once upon a time there", "1, 2, 3,"][:num_prompts]
        with Engine(default_model_path("small"), dtype="bfloat16", max_total_tokens=1024) as engine:
            model = engine.runner.model
            assert all(
                isinstance(linear, AMXLinear)
                for layer in model.layers
                for linear in (
                    layer.self_attn.qkv_proj,
                    layer.self_attn.o_proj,
                    layer.mlp.gate_up_proj,
                    layer.mlp.down_proj,
                )
            )
            # Gate/up projections fused with the activation where the kernel runs here.
            gated = _native().amx_gated_available()
            assert all(layer.mlp.gate_up_proj.gated == gated for layer in model.layers)
            cache, built = model._decode_stack, []
            get = cache.get
            cache.get = lambda m, b: built.append(get(m, b)) or built[-1]
            tokens, logprobs = _greedy(engine, prompts)
            assert sum(stack is not None for stack in built) >= 7  # the decode steps
            model.use_decode_stack = False
            engine.flush_cache()
            ref_tokens, ref_logprobs = _greedy(engine, prompts)
    finally:
        torch.set_num_threads(before)
    assert tokens == ref_tokens
    assert torch.equal(logprobs, ref_logprobs)


# ---- the gated MLP activation (`amx_gated`): AVX512-BF16, no AMX ----------------------------

_gated = pytest.mark.skipif(
    _native() is None or not _native().amx_gated_available(),
    reason="amx_gated runs on AVX512-BF16 CPUs without AMX",
)


def _gated_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(g) * u in float64 of g and u, x's products with the gate and up halves of the
    fused weight as `amx_linear` returns them (the float32 product rounded once to
    bfloat16, which the tests above hold it to; the fused kernel sums in the same order, so
    its g and u are these bit for bit)."""
    fused = _native().amx_linear(x.reshape(-1, x.shape[-1]), pack_for_amx(w))
    g, u = fused.double().chunk(2, dim=-1)
    return g / (1 + torch.exp(-g)) * u


@_gated
@pytest.mark.parametrize(("inter", "in_features"), [(16, 32), (48, 64), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 33, 300])
def test_gated_kernel_is_silu_of_the_rounded_gate_times_up(inter, in_features, rows):
    gen = torch.Generator().manual_seed(rows * 100 + inter)
    w = (torch.randn(2 * inter, in_features, generator=gen) / in_features**0.5).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    x[:, 1] *= 30  # an outlier channel: large gates of both signs
    got = _native().amx_gated(x, pack_for_amx(w, gated=True))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    exact = _gated_reference(x, w)
    # One bfloat16 rounding of the result, plus the float32 activation's own error (that of
    # its exponential: a few parts per million).
    excess = (got.double() - exact).abs() - (2**-8 * exact.abs() + 1e-5 * exact.abs().max())
    assert excess.max() <= 0, f"worst excess {excess.max():.3g}"
    # And what the unfused path returns, but for a last bit here and there (the two
    # exponentials differ in the last float32 bits, which decides a bfloat16 tie).
    unfused = _native().silu_and_mul(_native().amx_linear(x, pack_for_amx(w)))
    differ = got != unfused
    assert differ.sum() <= max(2, differ.numel() // 500)
    torch.testing.assert_close(got.float(), unfused.float(), rtol=2**-7, atol=0)


def test_gated_pack_pairs_gate_and_up_blocks():
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32).bfloat16()  # inter 32
    gate, up = w[:32], w[32:]
    pairs = torch.cat([gate[:16], up[:16], gate[16:], up[16:]])
    assert torch.equal(pack_for_amx(w, gated=True), pack_for_amx(pairs))


@_gated
def test_gated_kernel_refuses_bad_inputs():
    native = _native()
    with pytest.raises(RuntimeError, match="whole blocks"):
        native.amx_gated(
            torch.randn(2, 32).bfloat16(), pack_for_amx(torch.randn(48, 32).bfloat16())
        )
    with pytest.raises(RuntimeError, match="inputs"):
        native.amx_gated(
            torch.randn(2, 64).bfloat16(), pack_for_amx(torch.randn(64, 32).bfloat16())
        )
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.amx_gated(torch.randn(2, 32), pack_for_amx(torch.randn(64, 32).bfloat16()))


@_gated
def test_gated_layer_computes_the_activation_and_forward_stays_the_product():
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 96, bias=False).bfloat16()
    layer = AMXLinear(linear, _native(), gated=True)
    assert layer.gated
    assert not AMXLinear(nn.Linear(64, 96).bfloat16(), _native(), gated=True).gated  # a bias
    with torch.no_grad():
        for rows in (2, 40, 700):  # decode rows and a prefill's
            x = torch.randn(rows, 64, generator=gen).bfloat16()
            assert torch.equal(layer(x), F.linear(x, layer.weight))
            exact = _gated_reference(x, layer.weight)
            got = layer.gated_activation(x.reshape(1, rows, 64))
            assert got.shape == (1, rows, 48)
            torch.testing.assert_close(got[0].double(), exact, rtol=2**-8, atol=1e-5)
        layer.weight.mul_(-2)  # in place: packed again, in pair order
        assert not layer.is_current()
        got = layer.gated_activation(x)
        exact = _gated_reference(x, layer.weight)
        torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5)
