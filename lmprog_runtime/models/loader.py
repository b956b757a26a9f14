"""Build a forward-pass module from a Hugging Face checkpoint directory.

Weights come from `*.safetensors` only (never pickle, never remote code): the files that
`model.safetensors.index.json` names where there is one, as transformers reads them (a
stray file beside them once overwrote weights), else every one. Separate q/k/v and gate/up
tensors are copied into their rows of the fused projections of `llama.py`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch

from lmprog_runtime.models.llama import LlamaForCausalLM, RotaryEmbedding
from lmprog_runtime.models.model_config import ModelConfig

_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
INDEX_FILE = "model.safetensors.index.json"
logger = logging.getLogger(__name__)


def load_model(
    model_path: str, dtype: torch.dtype, device: str, context_len: int | None = None
) -> LlamaForCausalLM:
    """The checkpoint's model, its RoPE tables `context_len` positions long (None: the
    model's whole context)."""
    path = Path(model_path)
    if not path.is_dir():
        raise ValueError(f"model_path {model_path!r} does not exist or is not a directory")
    config = ModelConfig.from_path(path)
    files = weight_files(path)
    if config.tie_word_embeddings and _head_differs(files):
        # transformers unties them then (and warns): the checkpoint's head is the head
        logger.warning("%s: tie_word_embeddings, but its lm_head.weight differs: used", path)
        config = dataclasses.replace(config, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, rope_length=1)  # (its tables are made below)
    # Made where it runs, in the dtype it runs in: each checkpoint tensor is converted once
    # as it is copied in (no float32 copy of the whole model in host memory first: 28 GB
    # for a 7B model).
    if config.tie_word_embeddings:
        # `to_empty` would give the LM head a copy of its own, dropped at once when tied
        # again below (on a GPU, memory the caching allocator keeps from the KV pool).
        model.lm_head.register_parameter("weight", None)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    fused_rows = _fused_rows(config)
    parts_loaded: dict[str, set[int]] = {}
    loaded: set[str] = set()

    for file in files:
        with _open_safetensors(file) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                target = _target_name(key)
                if target is None:
                    continue
                name, part = target
                if name.endswith(".bias") and name not in params:
                    continue  # (a bias the architecture's class does not build, nor reads)
                tensor = f.get_tensor(key)
                if part is None:
                    _copy(params, name, tensor)
                    loaded.add(name)
                    continue
                # A piece of a fused projection goes straight into its rows (no concatenated
                # copy of the whole projection).
                rows = fused_rows[name.split(".", 2)[2].rsplit(".", 1)[0]]
                start = sum(rows[:part])
                _copy(params, name, tensor, rows=(start, rows[part]))
                parts_loaded.setdefault(name, set()).add(part)
                if len(parts_loaded[name]) == len(rows):
                    loaded.add(name)
    if config.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(n for n in params if n not in loaded)
    if missing:
        raise ValueError(f"checkpoint {model_path!r} is missing weights: {missing[:8]}")
    model.rotary = RotaryEmbedding(
        config, min(context_len or config.context_len, config.context_len)
    )
    return model.to(device=device, dtype=dtype).eval()


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every one."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index} is not a safetensors index (a weight_map)") from None
        for file in files:
            if not file.is_file():
                raise ValueError(f"{index} names {file.name!r}, which is not in {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path {str(path)!r} has no .safetensors weights")
    return files


def _head_differs(files: list[Path]) -> bool:
    """Whether the checkpoint holds an `lm_head.weight` other than its embeddings (one
    equal to them stays tied, as transformers keeps it)."""
    where: dict[str, Path] = {}  # (read from the headers: a tied model has no head)
    for file in files:
        with _open_safetensors(file) as f:
            where.update({key: file for key in f.keys()})  # noqa: SIM118 - not a dict
    if "lm_head.weight" not in where:
        return False
    found = {}
    for key in ("lm_head.weight", "model.embed_tokens.weight"):
        if key in where:
            with _open_safetensors(where[key]) as f:
                found[key] = f.get_tensor(key)
    embeddings = found.get("model.embed_tokens.weight")
    return embeddings is None or not torch.equal(found["lm_head.weight"], embeddings)


def _open_safetensors(file: Path):  # noqa: ANN202 - safetensors' reader
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as error:  # (not a ValueError, and it names no file)
        raise ValueError(f"{file} is not a readable safetensors file: {error}") from None


def _target_name(key: str) -> tuple[str, int | None] | None:
    """Map a checkpoint key to (our parameter name, index within a fused tensor or None)."""
    if key.startswith("model.embed_tokens.") or key.startswith("model.norm."):
        return key.removeprefix("model."), None
    if key == "lm_head.weight":
        return key, None
    match = _LAYER_KEY.match(key)
    if match is None:
        return None  # e.g. rotary inv_freq buffers saved by old checkpoints
    layer, module, kind = match.groups()
    if module in _FUSED:
        fused, part = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", part
    return f"layers.{layer}.{module}.{kind}", None


def _copy(
    params: dict[str, torch.nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    rows: tuple[int, int] | None = None,
) -> None:
    """Copy `tensor` into parameter `name`, or into its `rows` = (start, count) slice."""
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} for this architecture")
    target = params[name].data
    if rows is not None:
        target = target.narrow(0, *rows)
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"weight {name!r} is {tensor.dtype}: lmprog reads float32, float16 and bfloat16 "
            "checkpoints (a quantized one needs its scales, which it does not read)"
        )
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


def _fused_rows(config: ModelConfig) -> dict[str, list[int]]:
    """Rows of each piece of a fused projection, in `_FUSED` part order."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    return {
        "self_attn.qkv_proj": [q_size, kv_size, kv_size],
        "mlp.gate_up_proj": [config.intermediate_size] * 2,
    }


def read_torch_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]
