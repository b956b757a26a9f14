"""Tiny GGUF files for the tests, written the way llama.cpp's converter writes them.

`write_gguf` turns a tiny random transformers model into a GGUF with `gguf.GGUFWriter`:
llama.cpp tensor names, the Q/K row permutation for Llama-family attention, 1-D tensors in
F32, Llama 3.1-style RoPE as per-frequency factors, and the built-in tiny model's
byte-level BPE vocabulary as `gpt2` tokenizer metadata. Shared by the GGUF test modules
(the fixtures are imported there).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from helpers import LLAMA3_ROPE, TINY_ARCH_CONFIG, random_hf_model  # noqa: E402

from lmprog_runtime.models import gguf_convert  # noqa: E402

Q = gguf.GGMLQuantizationType
BASE = {**TINY_ARCH_CONFIG, "vocab_size": 2048}  # the built-in tiny tokenizer's vocabulary
# name -> (transformers model type, config overrides, GGUF architecture, general.name)
ARCHS = {
    "llama": ("llama", {}, "llama", "tiny llama"),
    "llama-tied-bias": (
        "llama",
        {"tie_word_embeddings": True, "attention_bias": True, "num_key_value_heads": 4},
        "llama",
        "tiny llama",
    ),
    "mistral": ("mistral", {"sliding_window": None}, "llama", "tiny Mistral"),
    # llama.cpp stores Llama 3.1-style RoPE scaling only as per-frequency factors.
    "llama3-rope": ("llama", {"head_dim": 64, "rope_parameters": LLAMA3_ROPE}, "llama", "tiny"),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}, "qwen2", "tiny qwen2"),
    # head_dim 128 != hidden / heads, as in real Qwen3 models (and transformers' default).
    "qwen3": ("qwen3", {"head_dim": 128}, "qwen3", "tiny qwen3"),
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def use_private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Send conversions to a per-test cache (the native kernels stay in the shared one)."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(gguf_convert, "cache_dir", lambda: cache)
    return cache


@functools.cache
def source_model(case: str) -> torch.nn.Module:
    """The transformers model of `case` (float32, random weights), built once."""
    model_type, overrides, _, _ = ARCHS[case]
    return random_model(model_type, **overrides)


def random_model(model_type: str, **overrides):
    return random_hf_model(model_type, **{**BASE, **overrides})


def write_gguf(
    model, path: Path, case: str, qtype, tokenizer_dir: str, meta: dict | None = None
) -> Path:
    """Write `model` as llama.cpp's converter would, with every 2-D weight in `qtype` (or
    encoded by `qtype(gguf_name, data)` when it is a function). `meta`: the writer's `add_*`
    methods to call with other values than the model's (None: not at all), and `extra`, a
    function given the writer before the tensors are added."""
    meta = meta or {}
    _, _, arch, name = ARCHS[case]
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer = gguf.GGUFWriter(str(path), arch)
    values = {
        "name": name,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers,
        "feed_forward_length": cfg.intermediate_size,
        "head_count": cfg.num_attention_heads,
        "head_count_kv": cfg.num_key_value_heads,
        "layer_norm_rms_eps": cfg.rms_norm_eps,
        "rope_freq_base": rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)),
        "rope_dimension_count": head_dim,
        "key_length": head_dim,
        "value_length": head_dim,
        "vocab_size": cfg.vocab_size,
    }
    for key, value in {**values, **meta}.items():
        if key != "extra" and value is not None:
            getattr(writer, f"add_{key}")(value)
    _add_tokenizer(writer, tokenizer_dir, merges=meta.get("token_merges", True) is not None)
    if meta.get("extra") is not None:
        meta["extra"](writer)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
    permuted = arch == "llama"
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if permuted and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads
            data = _llama_cpp_permute(data, heads)
        name = _gguf_name(hf_name)
        data, raw = qtype(name, data) if callable(qtype) else encode(data, qtype)
        writer.add_tensor(name, data, **raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, tokenizer_dir: str, merges: bool = True) -> None:
    spec = json.loads(Path(tokenizer_dir, "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = control
    if merges:
        writer.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        json.loads(Path(tokenizer_dir, "tokenizer_config.json").read_text())["chat_template"]
    )


def _llama3_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's converter: frequency i is divided by factor i."""
    base, old_len = rope["rope_theta"], rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for freq in base ** -(np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp interleaves the two rotary halves of every head's rows.
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def encode(data: np.ndarray, qtype) -> tuple[np.ndarray, dict]:
    if data.ndim == 1 or qtype == Q.F32:
        return data.astype(np.float32), {}
    if qtype == Q.F16:
        return data.astype(np.float16), {}
    return gguf.quants.quantize(data, qtype), {"raw_dtype": qtype}


K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(shape: tuple[int, int], qtype, gen: np.random.Generator) -> np.ndarray:
    """Random k-quant blocks whose dequantized values have std 1.5 / sqrt(in_features)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = gen.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)

    def with_scale(scale: float) -> np.ndarray:
        blocks = raw.copy()
        for offset in K_SCALE_OFFSETS[qtype]:
            blocks[..., offset : offset + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
        return blocks.reshape(shape[0], -1)

    unit_std = gguf.quants.dequantize(with_scale(1.0), qtype).std()
    return with_scale(1.5 / shape[1] ** 0.5 / unit_std)
