"""Parse a Hugging Face `config.json` into the few facts our forward passes need.

Reads the raw JSON (no transformers import, no remote code) and refuses anything we do not
implement with an error that names what is supported.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# architecture -> (q/k/v biases, the output projection's bias, the MLP's biases, q/k
# RMSNorm per head), as transformers builds each: a bias is True, False, or the config key
# that says (Mistral's and Qwen2's classes read neither `attention_bias` nor `mlp_bias`).
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool | str, bool | str, bool | str, bool]] = {
    "LlamaForCausalLM": ("attention_bias", "attention_bias", "mlp_bias", False),
    "MistralForCausalLM": (False, False, False, False),
    "Qwen2ForCausalLM": (True, False, False, False),
    "Qwen3ForCausalLM": ("attention_bias", "attention_bias", False, True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# The keys each scaled RoPE type needs (transformers refuses the config without them).
_ROPE_KEYS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    context_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @classmethod
    def from_path(cls, model_path: str | Path) -> ModelConfig:
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {str(model_path)!r} has no config.json")
        raw = _read_json(path / "config.json")
        generation = {}
        if (path / "generation_config.json").is_file():
            generation = _read_json(path / "generation_config.json")
        try:
            return cls.from_dict(raw, generation)
        except KeyError as error:
            raise ValueError(f"{path / 'config.json'} has no {error.args[0]!r}") from None

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        quantized = raw.get("quantization_config")
        if quantized:  # (its weights are integers or fp8 with scales beside them)
            method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
            raise ValueError(
                f"the checkpoint is quantized ({method!r} quantization_config), which lmprog "
                "does not read: use its float16/bfloat16 release (and quantization=... to "
                "quantize it here) or a GGUF file"
            )
        qkv_bias, o_bias, mlp_bias, qk_norm = (
            bool(raw.get(bias, False)) if isinstance(bias, str) else bias
            for bias in SUPPORTED_ARCHITECTURES[arch]
        )
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # (transformers' names of one function)
            raise ValueError(f"unsupported hidden_act {act!r}; supported: ['silu', 'swish']")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim") or hidden // num_heads

        rope = dict(raw.get("rope_scaling") or {})
        rope.update(raw.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )
        rope["rope_type"] = rope_type
        if rope_type == "llama3":  # (transformers': a top-level value first, as Phi-3 has it)
            if "original_max_position_embeddings" in raw:
                rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
            if "original_max_position_embeddings" not in rope:
                context = raw.get("max_position_embeddings", 2048)
                rope["original_max_position_embeddings"] = context
        for key in _ROPE_KEYS.get(rope_type, ()):
            if not isinstance(rope.get(key), (int, float)):
                raise ValueError(f"rope_scaling type {rope_type!r} needs a number {key!r}")

        # (Mistral's window covers every layer; Llama has none, Qwen none this can run)
        sliding_window = raw.get("sliding_window") if arch == "MistralForCausalLM" else None
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            _refuse_windowed_qwen_layers(raw)

        eos: list[int] = []
        for source in (generation or {}, raw):
            value = source.get("eos_token_id")
            for token in value if isinstance(value, list) else [value]:
                if isinstance(token, int) and token not in eos:
                    eos.append(token)
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            context_len=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            rope_theta=rope_theta,
            rope_scaling=rope,
            sliding_window=sliding_window,
            eos_token_ids=tuple(eos),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies [head_dim // 2], computed as transformers computes them."""
        dim = self.head_dim
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
        inv_freq = 1.0 / (self.rope_theta**exponent)
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type", "default")
        if rope_type == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        return inv_freq


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent RoPE scaling: low frequencies stretched by `factor`."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _refuse_windowed_qwen_layers(raw: dict[str, Any]) -> None:
    """ValueError where a Qwen2 / Qwen3 layer attends to a window: with `use_sliding_window`,
    the layers from `max_window_layers` on (or those `layer_types` names); a config where no
    layer does loads."""
    if not raw.get("use_sliding_window", False) or raw.get("sliding_window") is None:
        return
    types = raw.get("layer_types")
    if types is None:
        windowed = raw["num_hidden_layers"] > raw.get("max_window_layers", 28)
    else:
        windowed = "sliding_attention" in types
    if windowed:
        raise ValueError("Qwen sliding-window attention (use_sliding_window) is not supported")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data
