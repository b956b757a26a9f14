"""The native decode stack (issue 17): a plain decode step of every layer in one native
call must give exactly the Python forward's results (the same kernels in the same order),
and the Python path must still take every step the stack does not cover."""

from __future__ import annotations

import pytest
import torch

from lmprog_runtime import Engine, default_model_path
from lmprog_runtime.models.amx_linear import AMXLinear

TEXT = "The quick brown fox jumps over the lazy dog, and then it "


def _decode(engine: Engine, prompts: list[str], new: int = 8) -> tuple[list, torch.Tensor]:
    """Greedy tokens and the top-20 log-probabilities of every decode step."""
    params = {"max_new_tokens": new, "min_new_tokens": new, "temperature": 0}
    outs = engine.generate(prompts, params, return_logprob=True, top_logprobs_num=20)
    rows = [row for o in outs for row in o["meta_info"]["output_top_logprobs"]]
    values = torch.tensor([[value for value, *_ in row] for row in rows])
    return [o["output_ids"] for o in outs], values


def _steps_on_stack(engine: Engine, seen: list | None = None) -> list[int]:
    """Counts the forwards that ran on the stack (by wrapping the built stack's forward);
    `seen` gets (stack, arguments) of each."""
    calls = [0]
    cache = engine.runner.model._decode_stack
    build = cache.get

    def counting_get(model, backend):
        stack = build(model, backend)
        if stack is None:
            return None

        class Counted:
            def forward(self, *args):
                calls[0] += 1
                if seen is not None:
                    seen.append((stack, [a.clone() for a in args]))
                return stack.forward(*args)

        return Counted()

    cache.get = counting_get
    return calls


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"dtype": "bfloat16"},
        {"quantization": "int8"},
        {"quantization": "int4", "dtype": "bfloat16"},
        {"quantization": "w8a8_int8"},
        {"quantization": "w8a8_int8", "dtype": "bfloat16"},
    ],
    ids=["float32", "bfloat16", "int8", "int4-bf16", "w8a8", "w8a8-bf16"],
)
def test_stack_equals_python_forward(tiny_path, options):
    prompts = [TEXT, TEXT[:20], "Once upon a time"]
    with Engine(tiny_path, max_total_tokens=1024, **options) as engine:
        assert engine.runner.attention_backend == "native"
        calls = _steps_on_stack(engine)
        tokens, logprobs = _decode(engine, prompts)
        assert calls[0] >= 7  # every decode step after the prefill
        engine.runner.model.use_decode_stack = False
        engine.flush_cache()
        ref_tokens, ref_logprobs = _decode(engine, prompts)
    assert tokens == ref_tokens
    assert torch.equal(logprobs, ref_logprobs)


@pytest.fixture
def two_threads():
    """Quantized steps of a few tokens run in one parallel region only with two or more
    threads; make sure there are two, whatever the machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8_int8", None])
@pytest.mark.parametrize("num_prompts", [1, 4, 6, 20, 32, 40])
def test_steps_in_one_region_equal_the_python_forward(two_threads, quantization, num_prompts):
    """Below the quantized kernels' dense threshold (16 rows, or 1024 for bfloat16 where the
    CPU has AMX or AVX512-BF16: from 8 rows there, 20 here, the kernel dequantizes blocks of
    outputs to bfloat16 for every row), and up to 32 rows of packed bfloat16 linears on AMX
    tiles (256 by AVX512-BF16 dot products), and up to 32 rows of W8A8 linears with
    AVX512-VNNI, the stack runs a step in one parallel region (the
    threads split each layer's outputs and the attention's requests, one does the small
    steps); other steps take a region per kernel. Both give the Python forward's results
    exactly."""
    prompts = [TEXT[: 12 + 7 * i] for i in range(num_prompts)]
    # The built-in `small` model: every layer whole blocks of 32 and tiles of 16 (the tiny
    # one has a float down projection, which keeps its steps out of the region).
    with Engine(
        default_model_path("small"),
        max_total_tokens=4096,
        dtype="bfloat16",
        quantization=quantization,
    ) as engine:
        if quantization is None and not isinstance(
            engine.runner.model.layers[0].mlp.down_proj, AMXLinear
        ):
            pytest.skip("no AMX or AVX512-BF16: bfloat16 layers stay plain linears")
        seen: list = []
        calls = _steps_on_stack(engine, seen)
        tokens, logprobs = _decode(engine, prompts)
        assert calls[0] >= 7
        stack, _ = seen[-1]
        if quantization == "w8a8_int8":  # the packed VNNI kernel up to its most rows
            native = engine.runner.attention.native_ops
            down = engine.runner.model.layers[0].mlp.down_proj
            in_region = down.packed is not None and num_prompts <= native.w8a8_packed_max_rows()
        elif quantization:
            down = engine.runner.model.layers[0].mlp.down_proj
            in_region = num_prompts < down.dense_rows(torch.bfloat16)
        else:
            in_region = num_prompts <= engine.runner.model.layers[0].mlp.down_proj.max_rows
        assert stack.runs_in_one_region(num_prompts) == in_region
        engine.runner.model.use_decode_stack = False
        engine.flush_cache()
        ref_tokens, ref_logprobs = _decode(engine, prompts)
    assert tokens == ref_tokens
    assert torch.equal(logprobs, ref_logprobs)


@pytest.mark.parametrize("num_prompts", [1, 6])
def test_an_error_inside_the_region_is_raised_and_the_stack_goes_on(two_threads, num_prompts):
    """A failure in a step of the parallel region (here a KV slot out of range) reaches the
    caller as an exception, with no thread left waiting; the next step runs normally."""
    prompts = [TEXT[: 12 + 7 * i] for i in range(num_prompts)]
    small = default_model_path("small")
    with Engine(small, max_total_tokens=1024, quantization="int4") as engine:
        seen: list = []
        _steps_on_stack(engine, seen)
        tokens, _ = _decode(engine, prompts)
        stack, args = seen[-1]
        assert stack.runs_in_one_region(num_prompts)
        bad = list(args)
        bad[2] = torch.full_like(args[2], 10**9)  # out_cache_loc
        with pytest.raises(RuntimeError, match="out of range"):
            stack.forward(*bad)
        good = stack.forward(*[a.clone() for a in args])
        assert torch.isfinite(good).all()
        engine.flush_cache()
        assert _decode(engine, prompts)[0] == tokens


def test_replaced_weights_rebuild_the_stack(tiny_path):
    with Engine(tiny_path, max_total_tokens=1024) as engine:
        model = engine.runner.model
        _decode(engine, [TEXT])  # builds the stack
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            old = model.layers[1].mlp.down_proj.weight
            model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(
                torch.randn(old.shape, generator=gen) * 0.5
            )
        engine.flush_cache()
        tokens, logprobs = _decode(engine, [TEXT])
        model.use_decode_stack = False
        engine.flush_cache()
        ref_tokens, ref_logprobs = _decode(engine, [TEXT])
    assert tokens == ref_tokens and torch.equal(logprobs, ref_logprobs)


SYSTEM = "You are a helpful assistant who answers briefly. " * 8
SHARED_PROMPTS = [SYSTEM + q for q in ("Hi?", "Why?", "How?")]


def _shared_prefix_run(engine: Engine) -> tuple[list, torch.Tensor]:
    engine.flush_cache()
    engine.generate(SYSTEM, {"max_new_tokens": 1})  # caches the prefix
    return _decode(engine, SHARED_PROMPTS)


def test_shared_prefix_steps_stay_on_the_python_path(tiny_path, monkeypatch):
    """Requests sharing a cached prefix long enough for cascade attention (made short
    here) take it, which the stack does not cover: those steps run in Python, with the same
    results as without the stack."""
    from lmprog_runtime.attention import native_backend

    monkeypatch.setattr(native_backend, "CASCADE_MIN_SPARED_KEYS", 0)
    with Engine(tiny_path, max_total_tokens=2048) as engine:
        calls = _steps_on_stack(engine)
        tokens, logprobs = _shared_prefix_run(engine)
        assert calls[0] == 0
        engine.runner.model.use_decode_stack = False
        ref_tokens, ref_logprobs = _shared_prefix_run(engine)
    assert tokens == ref_tokens and torch.equal(logprobs, ref_logprobs)


def test_a_short_shared_prefix_decodes_plainly_on_the_stack(tiny_path, monkeypatch):
    """A cascade that spares fewer key reads than `CASCADE_MIN_SPARED_KEYS` is not formed:
    the steps run on the stack, and give the cascade's tokens (log-probabilities equal up
    to float32 summation order)."""
    from lmprog_runtime.attention import native_backend

    with Engine(tiny_path, max_total_tokens=2048) as engine:
        calls = _steps_on_stack(engine)
        tokens, logprobs = _shared_prefix_run(engine)
        assert calls[0] >= 7
        monkeypatch.setattr(native_backend, "CASCADE_MIN_SPARED_KEYS", 0)
        calls[0] = 0
        ref_tokens, ref_logprobs = _shared_prefix_run(engine)
        assert calls[0] == 0
    assert tokens == ref_tokens
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=0)
