"""Read a GGUF checkpoint (llama.cpp's format) as a Hugging Face config and tensors.

`GGUFCheckpoint.open` validates the whole header before any weight is read: the magic and
version, every count and length in the metadata and tensor table against the file's size
(`gguf_header.py`; a truncated file fails there), the tensors' layout, the architecture,
every tensor's name, type and shape. Anything wrong raises a `ValueError` naming it.
`hf_config` turns the metadata into a transformers `config.json` dict, and `hf_tensors`
yields the weights under transformers' names, dequantized with the `gguf` package (llama.cpp's own reader) and with llama.cpp's
Q/K row permutation undone. This module only reads; `gguf_convert.py` writes the result
out as a checkpoint directory, and the tokenizer is built there.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmprog_runtime.models.gguf_config import GGUF_ARCHITECTURES, expected_shapes, hf_config
from lmprog_runtime.models.gguf_header import check_header, check_tensor_layout

# llama.cpp's converter interleaves the rotary halves of q/k rows for these (its rope is
# GPT-J style there); Qwen models keep the rotate-half layout and are stored as they are.
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
_SUPPORTED_VERSIONS = (2, 3)

# GGUF tensor name -> transformers name ({i} is the layer).
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROPE = "rope_freqs.weight"
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFCheckpoint:
    """A validated GGUF file: metadata, tensor table, and a lazy (memory-mapped) reader.

    Example:
        >>> ckpt = GGUFCheckpoint.open("model.gguf")  # doctest: +SKIP
        >>> ckpt.hf_config()["architectures"]  # doctest: +SKIP
        ['LlamaForCausalLM']
    """

    def __init__(self, path: Path, reader: Any) -> None:
        self.path = path
        self.reader = reader
        shards = self.get("split.count")
        if shards is not None and int(shards) > 1:  # (its tensors were said to be missing)
            raise ValueError(
                f"{path} is shard {int(self.get('split.no', 0)) + 1} of a GGUF split into "
                f"{int(shards)} files, which lmprog does not read: merge them into one "
                "first (llama.cpp's `llama-gguf-split --merge FIRST-SHARD OUT.gguf`)"
            )
        self.architecture = str(self.get("general.architecture", ""))
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{path}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {sorted(GGUF_ARCHITECTURES)}"
            )
        # transformers name -> the reader's tensor (data is a view into the mapped file)
        self.tensors = {_hf_name(t.name, path): t for t in reader.tensors if t.name != _ROPE}
        # llama.cpp's per-frequency RoPE factors (Llama 3.1-style scaling), not a weight.
        self.rope_freqs = next((t for t in reader.tensors if t.name == _ROPE), None)

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        path = Path(path)
        _check_magic_and_version(path)
        check_header(path)  # (the reader trusts its counts: it once grew without bound)
        try:
            reader = _reader_class()(path)
        except Exception as exc:  # the reader fails in many ways on a damaged file
            raise ValueError(f"{path} is a truncated or corrupt GGUF file ({exc})") from exc
        check_tensor_layout(reader, path)
        checkpoint = cls(path, reader)
        checkpoint._validate()
        return checkpoint

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        """A key under the architecture's prefix, e.g. `llama.block_count`."""
        return self.get(f"{self.architecture}.{key}", default)

    # ---- the transformers view ---------------------------------------------------------
    def hf_config(self) -> dict[str, Any]:
        """The transformers `config.json` this file's metadata describes."""
        return hf_config(self)

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(transformers name, tensor)`, each read from the mapped file once.

        Float tensors keep their type (exact); quantized ones dequantize to float32."""
        from gguf import GGMLQuantizationType as T
        from gguf.quants import dequantize

        config = self.hf_config()
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        for name, t in self.tensors.items():
            if t.tensor_type in (T.F32, T.F16):
                tensor = torch.from_numpy(np.array(t.data))
            elif t.tensor_type == T.BF16:
                tensor = torch.from_numpy(np.array(t.data).view(np.uint16)).view(torch.bfloat16)
            else:
                tensor = torch.from_numpy(dequantize(t.data, t.tensor_type))
            tensor = tensor.reshape(_torch_shape(t))
            proj = name.split(".")[-2]
            if self.architecture in _PERMUTED_ARCHITECTURES and proj in heads:
                tensor = _unpermute_rows(tensor, heads[proj])
            yield name, tensor

    # ---- validation ----------------------------------------------------------------------
    def _validate(self) -> None:
        for t in self.reader.tensors:
            if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
                raise ValueError(
                    f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which is not "
                    f"supported; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
                )
        config = self.hf_config()
        expected = expected_shapes(config, self.architecture)
        missing = sorted(set(expected) - set(self.tensors))
        unexpected = sorted(set(self.tensors) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{self.path}: tensors do not match a {self.architecture} model "
                f"(missing {missing[:6]}, unexpected {unexpected[:6]})"
            )
        for name, shape in expected.items():
            if _torch_shape(self.tensors[name]) != shape:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has shape {_torch_shape(self.tensors[name])}, "
                    f"expected {shape} from the metadata"
                )


def _reader_class() -> type:
    from gguf import GGUFReader

    class PlainArrayReader(GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map: the same bytes, but the
        many small slices of parsing skip `np.memmap`'s per-slice Python hooks (~3x faster
        on a 50k-token vocabulary)."""

        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain_data = mapped.view(np.ndarray)

    return PlainArrayReader


def _check_magic_and_version(path: Path) -> None:
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file: it starts with {head[:4]!r}, not b'GGUF'")
    if len(head) < 8:
        raise ValueError(f"{path} is a truncated GGUF file ({len(head)} bytes)")
    version = int.from_bytes(head[4:8], "little")
    if (
        version not in _SUPPORTED_VERSIONS
        and int.from_bytes(head[4:8], "big") in _SUPPORTED_VERSIONS
    ):
        # (its weights failed to convert, with numpy's byte-order message naming no file)
        raise ValueError(
            f"{path} is a big-endian GGUF file (as converted for s390x), which lmprog does "
            "not read: use the little-endian file"
        )
    if version not in _SUPPORTED_VERSIONS:
        raise ValueError(
            f"{path}: GGUF version {version} is not supported; supported: {_SUPPORTED_VERSIONS}"
        )


def _hf_name(gguf_name: str, path: Path) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight"
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"{path}: tensor {gguf_name!r} is not supported")
    layer, module, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[module]}.{kind}"


def _torch_shape(t: Any) -> tuple[int, ...]:
    # ggml lists dimensions fastest-moving first; torch the other way round.
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def _unpermute_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows [0, h, 1, h+1, ...] (h = half
    the head) go back to [0, 1, ..., h-1, h, ...], the rotate-half layout transformers uses."""
    rows = tensor.shape[0]
    half = rows // num_heads // 2
    # [heads, half, 2, *rest] -> [heads, 2, half, *rest]
    grouped = tensor.reshape(num_heads, half, 2, *tensor.shape[1:])
    return grouped.transpose(1, 2).reshape(tensor.shape).contiguous()
