"""A GGUF file's metadata as a transformers `config.json`, and the tensor shapes it implies.

llama.cpp keeps the model's hyperparameters under `<architecture>.<key>` (`llama.block_count`,
`qwen3.attention.key_length`, ...) and the special token ids under `tokenizer.ggml.*`. This
module maps them to transformers' names and refuses what the runtime does not implement
(partial rotary, per-layer head counts, YaRN). Llama 3.1-style RoPE scaling is stored by
llama.cpp only as per-frequency factors (`rope_freqs.weight`); its transformers parameters
are recovered from them and checked to reproduce every factor.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmprog_runtime.models.model_config import llama3_inv_freq

if TYPE_CHECKING:
    from lmprog_runtime.models.gguf import GGUFCheckpoint


# GGUF architecture -> transformers architecture.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def hf_config(ckpt: GGUFCheckpoint) -> dict[str, Any]:
    arch = ckpt.architecture
    hidden = _required(ckpt, "embedding_length")
    # (a per-layer array of one value, as llama.cpp accepts, is that value: it garbled the
    # shape check's message)
    num_heads = _uniform(ckpt, "attention.head_count")
    num_kv_heads = _uniform(ckpt, "attention.head_count_kv", num_heads)
    head_dim = ckpt.arch_get("attention.key_length") or hidden // num_heads
    rope_dim = ckpt.arch_get("rope.dimension_count", head_dim)
    if rope_dim != head_dim or ckpt.arch_get("attention.value_length", head_dim) != head_dim:
        raise ValueError(
            f"{ckpt.path}: partial rotary or value width != key width is not supported "
            f"(head_dim {head_dim}, rope dims {rope_dim})"
        )
    rope_theta = float(ckpt.arch_get("rope.freq_base", 10000.0))
    biases = {n for n in ckpt.tensors if n.endswith(".bias")}
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": _uniform(ckpt, "feed_forward_length"),
        "num_hidden_layers": _required(ckpt, "block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _required(ckpt, "context_length"),
        "rms_norm_eps": float(_required(ckpt, "attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(ckpt, head_dim, rope_theta),
        # Qwen2 always has q/k/v biases (and never an o_proj one); elsewhere any attention
        # bias means all four projections have one.
        "attention_bias": any(".self_attn." in n for n in biases) and arch != "qwen2",
        "mlp_bias": any(".mlp." in n for n in biases),
        "tie_word_embeddings": "lm_head.weight" not in ckpt.tensors,
        "vocab_size": _vocab_size(ckpt),
        "bos_token_id": ckpt.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_token_ids(ckpt),
        "pad_token_id": ckpt.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": _torch_dtype(ckpt),
    }
    if arch == "mistral":
        config["sliding_window"] = ckpt.arch_get("attention.sliding_window")
    return config


def eos_token_ids(ckpt: GGUFCheckpoint) -> list[int]:
    """EOS plus llama.cpp's other end-of-generation ids (end of turn, end of message)."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = ckpt.get(f"tokenizer.ggml.{key}")
        if value is not None and value not in ids:
            ids.append(int(value))
    return ids


def _required(ckpt: GGUFCheckpoint, key: str) -> Any:
    value = ckpt.arch_get(key)
    if value is None:
        raise ValueError(f"{ckpt.path}: metadata key {ckpt.architecture}.{key} is missing")
    return value


def _uniform(ckpt: GGUFCheckpoint, key: str, default: int | None = None) -> int:
    """A count that may be given per layer (an array of one value); required without a
    default."""
    value = _required(ckpt, key) if default is None else ckpt.arch_get(key, default)
    values = set(value) if isinstance(value, list) else {value}
    if len(values) != 1:
        raise ValueError(f"{ckpt.path}: per-layer {key} values {sorted(values)} not supported")
    return int(values.pop())


def _vocab_size(ckpt: GGUFCheckpoint) -> int:
    embedding = ckpt.tensors.get("model.embed_tokens.weight")
    if embedding is None or len(embedding.shape) != 2:
        raise ValueError(f"{ckpt.path}: no 2-D token embedding (token_embd.weight)")
    return int(embedding.shape[1])


def _torch_dtype(ckpt: GGUFCheckpoint) -> str:
    # What the weights are stored in; quantized files compute in bfloat16 where that is the
    # fast type (the runner picks float32 on CPU either way).
    types = {t.tensor_type.name for t in ckpt.reader.tensors if len(t.shape) > 1}
    if types == {"F32"}:
        return "float32"
    return "float16" if types <= {"F16", "F32"} else "bfloat16"


def _rope_scaling(ckpt: GGUFCheckpoint, head_dim: int, theta: float) -> dict[str, Any] | None:
    # As llama.cpp reads them: no type is linear, "none" never scales, and a factor that is
    # missing or 0 scales nothing (its float(None) was a TypeError once).
    kind = ckpt.arch_get("rope.scaling.type")
    factor = ckpt.arch_get("rope.scaling.factor") or ckpt.arch_get("rope.scale_linear")
    if kind not in (None, "none", "linear"):
        raise ValueError(f"{ckpt.path}: rope scaling {kind!r} is not supported (only linear)")
    if kind != "none" and factor not in (None, 1.0):
        return {"rope_type": "linear", "factor": float(factor)}
    if ckpt.rope_freqs is None:
        return None
    from gguf.quants import dequantize

    t = ckpt.rope_freqs
    factors = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
    return llama3_rope_from_factors(factors, head_dim, theta, str(ckpt.path))


def llama3_rope_from_factors(
    factors: np.ndarray, head_dim: int, theta: float, where: str
) -> dict[str, Any]:
    """transformers' `llama3` RoPE parameters that reproduce llama.cpp's factors.

    llama.cpp divides frequency i by factors[i]: 1 for short wavelengths λ < L / high,
    `factor` for long ones λ > L / low, and 1 / ((1 - s) / factor + s) in between, where
    s = (L / λ - low) / (high - low). Scaling L, low and high together changes nothing, so
    low = 1 is chosen, and the in-between factors fix the rest: s is linear in 1 / λ."""
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    error = f"{where}: rope_freqs do not follow Llama 3 RoPE scaling; not supported"
    if len(factors) != len(inv_freq) or factor <= 1 or medium.sum() < 2:
        raise ValueError(error)
    smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_freq[medium] / (2 * math.pi), smooth, 1)
    high = 1 - 1 / intercept  # low / (high - low) = -intercept, with low = 1
    original = round(slope * (high - 1))  # L / (high - low) = slope
    rope = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": round(float(high), 6),
        "original_max_position_embeddings": int(original),
    }
    rebuilt = llama3_inv_freq(torch.from_numpy(inv_freq), rope).numpy()
    if not np.allclose(rebuilt, inv_freq / factors, rtol=1e-4, atol=0):
        raise ValueError(error)
    return rope


def expected_shapes(config: dict[str, Any], architecture: str) -> dict[str, tuple[int, ...]]:
    """transformers name -> shape, for every tensor a file with this config must hold."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    linear = {
        "self_attn.q_proj": (q_dim, hidden),
        "self_attn.k_proj": (kv_dim, hidden),
        "self_attn.v_proj": (kv_dim, hidden),
        "self_attn.o_proj": (hidden, q_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    biased = set()
    if architecture == "qwen2" or config["attention_bias"]:
        biased |= {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
    if config["attention_bias"]:
        biased.add("self_attn.o_proj")
    if config["mlp_bias"]:
        biased |= {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for module, shape in linear.items():
            shapes[p + module + ".weight"] = shape
            if module in biased:
                shapes[p + module + ".bias"] = (shape[0],)
        if architecture == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (config["head_dim"],)
            shapes[p + "self_attn.k_norm.weight"] = (config["head_dim"],)
    return shapes
