"""The runtime's forward pass reproduces transformers' logits for every supported architecture.

Tiny random checkpoints are built with transformers (weights re-drawn at a scale that makes
logits far from constant), saved as safetensors and loaded with `lmprog_runtime`'s loader.
`ModelRunner` + `Scheduler` then drive the paged KV pool and each attention backend (the
torch reference, the native C++ kernels, Triton under `TRITON_INTERPRET=1`) through a
mixed-length EXTEND (logits at every prompt position), DECODE steps of the whole
batch (one request leaving midway), and an EXTEND on top of a cached prefix batched with a
fresh request. Every logits row must match transformers' float32 forward of the full
sequence within 1e-4 relative error (max |ours - ref| / max |ref|). Cases cover Llama (GQA,
tied + MHA + biases + linear RoPE, llama3 RoPE from `rope_parameters`), Mistral with a
sliding window shorter than the sequences, Qwen2 (qkv bias, tied) and Qwen3 (q/k norm,
head_dim != hidden / heads). The torch and Triton backends are the references of the kernel
tests, so they are held to transformers here too. Every test ends with all KV slots and
request rows free.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import LLAMA3_ROPE, TINY_ARCH_CONFIG, edit_config, random_hf_model  # noqa: E402

from lmprog_runtime.config import RuntimeConfig  # noqa: E402
from lmprog_runtime.forward_batch import ForwardMode  # noqa: E402
from lmprog_runtime.kvcache.req_cache import ReqCache  # noqa: E402
from lmprog_runtime.model_runner import ModelRunner  # noqa: E402
from lmprog_runtime.models import SUPPORTED_ARCHITECTURES, load_model  # noqa: E402
from lmprog_runtime.request import Req  # noqa: E402
from lmprog_runtime.sampling_params import SamplingParams  # noqa: E402
from lmprog_runtime.scheduled_batch import ScheduledBatch  # noqa: E402
from lmprog_runtime.scheduler import Scheduler  # noqa: E402
from lmprog_runtime.stats import EngineStats  # noqa: E402

REL_TOL = 1e-4
BACKENDS = ["torch", "native", "triton"]
# Triton under the interpreter takes seconds per case: `make test` runs it on GQA and the
# sliding window, `pytest -m slow` on every case.
FAST_TRITON_CASES = {"llama-gqa", "mistral-sliding-window"}
BASE = TINY_ARCH_CONFIG
CASES = {
    "llama-gqa": ("llama", {}),
    "llama-tied-mha-bias-linear-rope": (
        "llama",
        {
            "tie_word_embeddings": True,
            "num_key_value_heads": 4,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        },
    ),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 8}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32, "num_key_value_heads": 1}),
}


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """case name -> (checkpoint dir, transformers model in eval mode); built once per module."""
    built: dict[str, tuple[str, torch.nn.Module]] = {}

    def build(case: str):
        if case not in built:
            model_type, overrides = CASES[case]
            model = random_hf_model(model_type, **{**BASE, **overrides})
            path = tmp_path_factory.mktemp(case)
            model.save_pretrained(path, safe_serialization=True)
            built[case] = (str(path), model)
        return built[case]

    return build


def _setup(path: str, backend: str, case: str):
    if backend == "triton":
        pytest.importorskip("triton")
    config = RuntimeConfig(
        max_total_tokens=4096,
        max_running_requests=8,
        model_path=path,
        attention_backend=backend,
        dtype="float32",
    )
    runner = ModelRunner(config, path)
    assert runner.attention_backend == backend
    # The sliding-window case must really run each backend's windowed path.
    expected_window = CASES[case][1].get("sliding_window")
    assert runner.attention.layout.sliding_window == expected_window
    # No prefix cache here: these tests check the forward pass, not reuse.
    req_cache = ReqCache(None, runner.allocator, runner.req_to_token)
    return runner, Scheduler(
        config, runner.allocator, runner.req_to_token, req_cache, EngineStats()
    )


def _req(rid: int, ids: list[int], runner: ModelRunner) -> Req:
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    kw = dict(tokenizer=_Tokenizer(), eos_token_ids=frozenset(), return_logprob=True)
    return Req(rid, ids, params, context_len=runner.context_len, logprob_start_len=0, **kw)


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _assert_logits_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert ref.std() > 0.5, "reference logits are near-constant; the check would be vacuous"
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel <= REL_TOL, f"max relative logits error {rel:.2e} > {REL_TOL}"


def _run(runner, scheduler, batch: ScheduledBatch, rows_of: dict[int, list[torch.Tensor]]):
    logits, rows = runner.forward(batch)
    scheduler.on_forward_done(batch)
    assert logits.dtype == torch.float32
    for req, req_rows in zip(batch.reqs, rows):
        rows_of[req.rid].append(logits[req_rows])


def _release_all(runner, scheduler, reqs) -> None:
    for req in reqs:
        scheduler.release(req)
    assert not scheduler.running and not scheduler.waiting
    assert runner.allocator.num_free == runner.allocator.num_slots
    assert runner.req_to_token.num_free == runner.req_to_token.num_reqs


@pytest.mark.parametrize(
    ("case", "backend"),
    [
        pytest.param(
            case,
            backend,
            marks=pytest.mark.slow if backend == "triton" and case not in FAST_TRITON_CASES else (),
        )
        for case in CASES
        for backend in BACKENDS
    ],
)
def test_extend_then_decode_matches_transformers(case, backend, checkpoint):
    path, hf = checkpoint(case)
    runner, scheduler = _setup(path, backend, case)
    gen = torch.Generator().manual_seed(2)
    reqs = [
        _req(i, torch.randint(0, 256, (n,), generator=gen).tolist(), runner)
        for i, n in enumerate([5, 17, 11])
    ]
    # Tokens fed in the decode steps, chosen up front (not sampled).
    feed = {r.rid: torch.randint(0, 256, (6,), generator=gen).tolist() for r in reqs}
    rows_of: dict[int, list[torch.Tensor]] = {r.rid: [] for r in reqs}
    for req in reqs:
        scheduler.add(req)
    batch = scheduler.next_batch()
    assert batch.mode is ForwardMode.EXTEND and batch.reqs == reqs
    _run(runner, scheduler, batch, rows_of)
    for step in range(6):
        if step == 3:
            scheduler.release(reqs[0])  # a request leaves; the others keep decoding
        for req in scheduler.running:
            req.append_token(feed[req.rid][step])
        batch = scheduler.next_batch()
        assert batch.mode is ForwardMode.DECODE and len(batch.reqs) == (3 if step < 3 else 2)
        _run(runner, scheduler, batch, rows_of)
    for req in reqs:
        ours = torch.cat(rows_of[req.rid])
        assert ours.shape[0] == req.seq_len == req.prompt_len + (3 if req.rid == 0 else 6)
        _assert_logits_match(ours, _reference(hf, req.fill_ids))
    _release_all(runner, scheduler, reqs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["llama-gqa", "mistral-sliding-window", "qwen3-qk-norm"])
def test_extend_after_cached_prefix_matches_transformers(case, backend, checkpoint):
    """Request A: 7 prompt tokens, then 12 more in a second EXTEND that attends to the cached
    7 (chunked-prefill style), batched with a fresh request B; then two DECODE steps.

    The second EXTEND is built by hand so the test controls exactly what is cached."""
    path, hf = checkpoint(case)
    runner, scheduler = _setup(path, backend, case)
    gen = torch.Generator().manual_seed(3)
    full_a = torch.randint(0, 256, (19,), generator=gen).tolist()
    a = _req(0, full_a[:7], runner)
    b = _req(1, torch.randint(0, 256, (9,), generator=gen).tolist(), runner)
    rows_of: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    scheduler.add(a)
    _run(runner, scheduler, scheduler.next_batch(), rows_of)
    assert a.kv_len == 7 and a.req_pool_idx is not None

    # Second part of A's prompt on top of its cached prefix, in one EXTEND with B.
    scheduler.running.remove(a)
    a.input_ids = full_a
    slots = runner.allocator.alloc(12 + 9)
    runner.req_to_token.write(a.req_pool_idx, a.kv_len, slots[:12])
    b.req_pool_idx = runner.req_to_token.alloc()
    runner.req_to_token.write(b.req_pool_idx, 0, slots[12:])
    batch = ScheduledBatch(ForwardMode.EXTEND, [a, b], slots, [a.kv_len, 0], [12, 9])
    _run(runner, scheduler, batch, rows_of)
    assert [r.kv_len for r in (a, b)] == [19, 9] and scheduler.running == [a, b]

    for token in (11, 42):
        for req in (a, b):
            req.append_token(token)
        batch = scheduler.next_batch()
        assert batch.mode is ForwardMode.DECODE
        assert batch.prefix_lens == [a.seq_len - 1, b.seq_len - 1]
        _run(runner, scheduler, batch, rows_of)
    for req in (a, b):
        ours = torch.cat(rows_of[req.rid])
        assert ours.shape[0] == req.seq_len
        _assert_logits_match(ours, _reference(hf, req.fill_ids))
    _release_all(runner, scheduler, [a, b])


def test_checkpoint_configs_are_parsed_as_transformers_wrote_them(checkpoint):
    path, _ = checkpoint("llama3-rope")
    raw = json.loads(Path(path, "config.json").read_text())
    rope = raw.get("rope_parameters") or raw.get("rope_scaling")
    assert rope["rope_type"] == "llama3"
    model = load_model(path, torch.float32, "cpu")
    assert model.config.rope_scaling["rope_type"] == "llama3"
    assert model.config.rope_theta == LLAMA3_ROPE["rope_theta"]
    mistral = load_model(checkpoint("mistral-sliding-window")[0], torch.float32, "cpu")
    assert mistral.attention_layout().sliding_window == 8
    tied = load_model(checkpoint("qwen2-bias-tied")[0], torch.float32, "cpu")
    assert tied.lm_head.weight is tied.embed_tokens.weight and tied.config.qkv_bias
    # Made in its dtype (float32 checkpoint, bfloat16 model): still tied, rounded once.
    tied16 = load_model(checkpoint("qwen2-bias-tied")[0], torch.bfloat16, "cpu")
    assert tied16.lm_head.weight is tied16.embed_tokens.weight
    assert tied16.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(tied16.embed_tokens.weight, tied.embed_tokens.weight.bfloat16())
    assert load_model(checkpoint("qwen3-qk-norm")[0], torch.float32, "cpu").config.head_dim == 32


def test_unsupported_architecture_names_supported_ones(tmp_path):
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_attention_heads": 4,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        load_model(str(tmp_path), torch.float32, "cpu")
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_checkpoint_without_safetensors_is_rejected(tmp_path, checkpoint):
    path, _ = checkpoint("llama-gqa")
    (tmp_path / "config.json").write_text(Path(path, "config.json").read_text())
    torch.save({}, tmp_path / "pytorch_model.bin")  # pickle weights are never read
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")


def _copy_checkpoint(checkpoint, tmp_path: Path) -> Path:
    path, _ = checkpoint("llama-gqa")
    for file in Path(path).iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    return tmp_path


def test_a_quantized_checkpoint_is_refused_not_read_as_floats(tmp_path, checkpoint):
    """An FP8 release (`quantization_config`, fp8 weights with their scales beside them)
    loaded without a word: raw fp8 values cast to float, every token wrong."""
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(checkpoint, tmp_path)
    edit_config(path, quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match="'fp8' quantization_config"):
        load_model(str(path), torch.float32, "cpu")
    edit_config(path, quantization_config=None)  # the weights alone say it too
    weights = load_file(path / "model.safetensors")
    name = next(k for k in weights if k.endswith("down_proj.weight"))
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        load_model(str(path), torch.float32, "cpu")


def test_broken_files_are_value_errors_naming_them(tmp_path, checkpoint):
    path = _copy_checkpoint(checkpoint, tmp_path)
    edit_config(path, intermediate_size=None)
    with pytest.raises(ValueError, match="config.json has no 'intermediate_size'"):
        load_model(str(path), torch.float32, "cpu")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(str(path), torch.float32, "cpu")
    path = _copy_checkpoint(checkpoint, tmp_path)
    weights = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # a cut download
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors"):
        load_model(str(path), torch.float32, "cpu")


def test_rope_tables_cover_the_context_served_not_the_models(checkpoint):
    """A model made for a million positions held a GiB of tables at any context_len."""
    path, _ = checkpoint("llama-gqa")
    full = load_model(path, torch.float32, "cpu")
    short = load_model(path, torch.float32, "cpu", context_len=24)
    assert short.rotary.cos.shape == (24, full.rotary.cos.shape[1])
    assert torch.equal(short.rotary.cos, full.rotary.cos[:24])
    assert torch.equal(short.rotary.sin, full.rotary.sin[:24])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_smoothing_leaves_every_architecture_bit_for_bit(case, dtype, checkpoint):
    """W8A8's smoothing (`models/smoothing.py`) folds power-of-two scales into the norms,
    the value rows (biases included, one scale per kv head's channel under GQA), the up rows
    and the projections' columns: the float model's logits do not change in any bit, with
    biases, tied embeddings, Q/K norms and sliding windows alike, while its weights do."""
    from lmprog_runtime.models.smoothing import (
        activation_ranges,
        forward_tokens,
        smooth_for_w8a8,
    )

    model = load_model(checkpoint(case)[0], dtype, "cpu")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=gen).tolist()
    before = forward_tokens(model, ids)
    qkv = model.layers[0].self_attn.qkv_proj.weight.clone()
    assert smooth_for_w8a8(model, activation_ranges(model, ids[:20])) == 4 * len(model.layers)
    assert not torch.equal(qkv, model.layers[0].self_attn.qkv_proj.weight)
    assert torch.equal(forward_tokens(model, ids), before)
