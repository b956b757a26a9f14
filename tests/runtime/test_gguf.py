"""GGUF checkpoints: lmprog's logits equal transformers' own GGUF loading.

Each test writes a tiny GGUF file from a tiny random transformers model, the way llama.cpp's
converter does (`gguf_files.py`), lmprog converts it (into a per-test cache), and its
forward must match `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` within 1e-4
relative error at every prompt position: Llama, Mistral (what llama.cpp writes for it:
architecture `llama`, a Mistral name), Qwen2, Qwen3, in F32, F16, Q8_0 and Q4_1, plus BF16
and every other supported block type. For quantized files both sides dequantize the same
blocks, so they agree as tightly as float files. Where transformers cannot read a file's
feature, its forward of the source model with the file's (dequantized) weights is the
reference. Bad input is in `test_gguf_errors.py`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loading needs it

from gguf_files import (  # noqa: E402
    K_SCALE_OFFSETS,
    LLAMA3_ROPE,
    Q,
    encode,
    random_blocks,
    random_model,
    source_model,
    use_private_cache,
    write_gguf,
)
from helpers import PROMPTS  # noqa: E402

import lmprog as lp  # noqa: E402
from lmprog_runtime.config import RuntimeConfig  # noqa: E402
from lmprog_runtime.kvcache.req_cache import ReqCache  # noqa: E402
from lmprog_runtime.model_runner import ModelRunner  # noqa: E402
from lmprog_runtime.models import gguf_convert  # noqa: E402
from lmprog_runtime.request import Req  # noqa: E402
from lmprog_runtime.sampling_params import SamplingParams  # noqa: E402
from lmprog_runtime.scheduler import Scheduler  # noqa: E402
from lmprog_runtime.stats import EngineStats  # noqa: E402

REL_TOL = 1e-4
TYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "Q4_1": Q.Q4_1}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> Path:
    return use_private_cache(tmp_path, monkeypatch)


def _our_logits(model_dir: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every position of each sequence, prefilled together in one EXTEND."""
    config = RuntimeConfig(
        max_total_tokens=512, max_running_requests=4, model_path=model_dir, dtype="float32"
    )
    runner = ModelRunner(config, model_dir)
    req_cache = ReqCache(None, runner.allocator, runner.req_to_token)
    scheduler = Scheduler(config, runner.allocator, runner.req_to_token, req_cache, EngineStats())
    reqs = []
    for rid, ids in enumerate(sequences):
        req = Req(
            rid,
            ids,
            SamplingParams(max_new_tokens=1, ignore_eos=True),
            tokenizer=None,
            eos_token_ids=frozenset(),
            context_len=runner.context_len,
            return_logprob=True,
            logprob_start_len=0,
        )
        reqs.append(req)
        scheduler.add(req)
    batch = scheduler.next_batch()
    logits, rows = runner.forward(batch)
    scheduler.on_forward_done(batch)
    for req in reqs:
        scheduler.release(req)
    assert runner.allocator.num_free == runner.allocator.num_slots
    return [logits[r] for r in rows]


def _reference_logits(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in sequences]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert ref.std() > 0.5, "reference logits are near-constant; the check would be vacuous"
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel <= REL_TOL, f"max relative logits error {rel:.2e} > {REL_TOL}"


# transformers cannot load these from GGUF (no Mistral GGUF loader; it ignores a Llama
# GGUF's attention biases and RoPE frequency factors); the reference is then its forward of
# the source model with every weight replaced by what the file stores (quantized and
# dequantized by the `gguf` package in the test).
SOURCE_REFERENCED = {"mistral", "llama-tied-bias", "llama3-rope"}


def _dequantized_copy(model, qtype):
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            if p.ndim == 2:
                data, _ = encode(p.numpy(), qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(p.shape)))
    return reference


SEQUENCES = [
    torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (13, 5)
]


MATRIX = [
    *[
        (arch, t)
        for arch in ("llama", "mistral", "qwen2", "qwen3")
        for t in ("F32", "F16", "Q8_0", "Q4_1")
    ],
    ("llama", "BF16"),
    ("llama-tied-bias", "F32"),
    ("llama-tied-bias", "Q8_0"),
    ("llama3-rope", "F32"),
]


@pytest.mark.parametrize(("case", "type_name"), MATRIX)
def test_logits_match_transformers_gguf_loading(case, type_name, tmp_path, tiny_path):
    model = source_model(case)
    path = write_gguf(model, tmp_path / f"{case}.gguf", case, TYPES[type_name], tiny_path)
    model_dir = gguf_convert.convert_gguf(path)
    ours = _our_logits(model_dir, SEQUENCES)
    if case in SOURCE_REFERENCED:
        reference = _dequantized_copy(model, TYPES[type_name])
    else:
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, dtype=torch.float32
        ).eval()
    for mine, ref in zip(ours, _reference_logits(reference, SEQUENCES)):
        _assert_close(mine, ref)
    if case == "llama3-rope":
        rope = json.loads(Path(model_dir, "config.json").read_text())["rope_scaling"]
        assert rope == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}


# Byte offsets of the float16 scales (d, and dmin where there is one) inside one 256-value
# block of each k-quant type, from ggml's block layouts.
def test_k_quants_and_legacy_quants_match_transformers(tmp_path, tiny_path):
    """Every other supported block type, one per projection, on rows of 256 values."""
    model = random_model("llama", hidden_size=256, intermediate_size=256)
    types = {
        "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q2_K,
        "ffn_gate": Q.Q3_K, "ffn_up": Q.Q4_0, "ffn_down": Q.Q5_0, "output": Q.Q5_1,
    }  # fmt: skip
    gen = np.random.default_rng(0)

    def mixed(name: str, data: np.ndarray):
        qtype = types.get(name.split(".")[-2], Q.F32)
        if qtype in K_SCALE_OFFSETS:
            return random_blocks(data.shape, qtype, gen), {"raw_dtype": qtype}
        return encode(data, qtype)

    path = write_gguf(model, tmp_path / "kquants.gguf", "llama", mixed, tiny_path)
    ours = _our_logits(gguf_convert.convert_gguf(path), SEQUENCES)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    for mine, ref in zip(ours, _reference_logits(reference, SEQUENCES)):
        _assert_close(mine, ref)


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path, tiny_path):
    """The engine's tokenizer for a GGUF encodes like transformers' tokenizer for the same
    file and like the source tokenizer, renders the same chat template, and stops on EOS."""
    from transformers import AutoTokenizer

    path = write_gguf(source_model("qwen2"), tmp_path / "tok.gguf", "qwen2", Q.F32, tiny_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    source = AutoTokenizer.from_pretrained(tiny_path)
    messages = [{"role": "user", "content": "Where is my parcel?"}]
    with lp.Engine(path, max_total_tokens=64) as gguf_engine:
        ours = gguf_engine.tokenizer
        eos_ids = gguf_engine.eos_token_ids
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for tokenizer in (theirs, source):
        for text in [*PROMPTS, "<|im_start|>user\nhi<|im_end|>", " leading  spaces\n\ttab"]:
            assert ours(text).input_ids == tokenizer(text).input_ids
        assert (
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == rendered
        )
    assert ours.eos_token == "<|im_end|>" and ours.pad_token == "<|endoftext|>"
    assert eos_ids == {ours.eos_token_id}
    config = json.loads(Path(gguf_convert.convert_gguf(path), "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"]


def test_a_transformers_that_cannot_build_the_tokenizer_says_what_helps(
    tmp_path, tiny_path, monkeypatch
):
    """Before 5.18 transformers has no metadata converter there, and lmprog reads the file
    through `gguf_file`, whose build fails on a file without a BOS id (4.45-5.17: an
    AttributeError, or a request for protobuf): a ValueError says which version builds it.
    (Old transformers' own failure is replayed here: this suite runs a newer one.)"""
    import sys

    from transformers import AutoTokenizer

    def old_build(*args, **kwargs):
        raise AttributeError("'GGUFTokenizerSkeleton' object has no attribute 'bos_token_id'")

    path = write_gguf(source_model("llama"), tmp_path / "old.gguf", "llama", Q.F32, tiny_path)
    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf", None)  # (ImportError)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", old_build)
    with pytest.raises(ValueError, match=r"old\.gguf: transformers .* 5\.18 or later builds it"):
        gguf_convert.convert_gguf(path)


def test_large_conversions_are_sharded_and_load_in_transformers(tmp_path, tiny_path, monkeypatch):
    """Past SHARD_BYTES the weights go to several files with the standard index; the
    directory stays an ordinary checkpoint that transformers loads on its own."""
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 200_000)
    path = write_gguf(source_model("qwen3"), tmp_path / "shards.gguf", "qwen3", Q.Q8_0, tiny_path)
    model_dir = Path(gguf_convert.convert_gguf(path))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for mine, ref in zip(
        _our_logits(str(model_dir), SEQUENCES), _reference_logits(reference.eval(), SEQUENCES)
    ):
        _assert_close(mine, ref)
