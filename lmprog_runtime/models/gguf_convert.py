"""Convert a GGUF file once into a Hugging Face checkpoint directory in the cache.

The directory (`$LMPROG_CACHE_DIR/gguf/<stem>-<key>/`) holds config.json and
generation_config.json built from the GGUF metadata, model.safetensors with the weights
dequantized and un-permuted by `gguf.py`, and the tokenizer (tokenizer.json,
tokenizer_config.json with the special tokens, the chat template). Every later part (the
config parser, the loader, `AutoTokenizer`, transformers itself) then reads an ordinary
checkpoint, and later loads skip the GGUF entirely. The key hashes the file's path, size
and modification time, so a replaced file converts again.

Conversion happens in a temporary sibling directory renamed into place at the end: a
failure (a corrupt file, an unsupported tensor) leaves nothing behind, and two processes
converting at once cannot leave a half-written checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from lmprog_runtime.env import cache_dir
from lmprog_runtime.models.gguf import GGUFCheckpoint

# Bump when the output of a conversion changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1
FINGERPRINT_BYTES = 4 << 20
FINGERPRINT_SAMPLES = 16
# Dequantized weights are written in shards of about this size, so a conversion holds at
# most one shard in memory (float32 is 4 bytes per parameter).
SHARD_BYTES = 2 << 30


def convert_gguf(gguf_path: str | Path) -> str:
    """Return the HF-format directory for `gguf_path`, converting it on first use.

    Example:
        >>> from transformers import AutoModelForCausalLM
        >>> AutoModelForCausalLM.from_pretrained(convert_gguf("model.gguf"))  # doctest: +SKIP
    """
    path = Path(gguf_path).resolve()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    final = conversion_dir(path)
    if final.is_dir():  # it only ever appears complete (renamed into place)
        return str(final)
    checkpoint = GGUFCheckpoint.open(path)  # validates everything before any weight is read
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".convert-{path.stem}-", dir=final.parent))
    try:
        write_checkpoint(checkpoint, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished first; its conversion is the same as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def conversion_dir(path: Path) -> Path:
    stat = path.stat()
    # The libraries that shape the output (dequantization, tokenizer.json) are part of the
    # key, so an upgrade converts again instead of reusing a stale directory.
    versions = f"{_version('gguf')}:{_version('transformers')}"
    # (and its first and last bytes: a file replaced by another of the same size and
    # modification time, as `cp -p` or `rsync -t` leave it, once reused the old weights)
    file = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{_fingerprint(path, stat.st_size)}"
    key = f"{CONVERTER_VERSION}:{versions}:{file}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{digest}"


def _fingerprint(path: Path, size: int) -> str:
    """A digest of the file's first and last FINGERPRINT_BYTES and of FINGERPRINT_SAMPLES
    blocks of 64 KiB spread between them (all of a smaller file): its header and weights
    throughout, in a few ms (the whole of a 4 GB file took seconds)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if size <= 2 * FINGERPRINT_BYTES:
            digest.update(f.read())
            return digest.hexdigest()[:16]
        digest.update(f.read(FINGERPRINT_BYTES))
        middle = size - 2 * FINGERPRINT_BYTES
        for i in range(FINGERPRINT_SAMPLES):
            f.seek(FINGERPRINT_BYTES + middle * i // FINGERPRINT_SAMPLES)
            digest.update(f.read(64 << 10))
        f.seek(size - FINGERPRINT_BYTES)
        digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "none"


def write_checkpoint(checkpoint: GGUFCheckpoint, out_dir: Path) -> None:
    """Write config, generation config, tokenizer and weights of `checkpoint` to `out_dir`."""
    config = checkpoint.hf_config()
    _write_json(out_dir / "config.json", config)
    generation = {"eos_token_id": config["eos_token_id"], "do_sample": False}
    for key in ("bos_token_id", "pad_token_id"):
        if config[key] is not None:
            generation[key] = config[key]
    _write_json(out_dir / "generation_config.json", generation)
    _write_tokenizer(checkpoint, out_dir, config["max_position_embeddings"])
    _write_weights(checkpoint, out_dir)


def _write_weights(checkpoint: GGUFCheckpoint, out_dir: Path) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors shards plus the index
    transformers reads (name -> file) when the weights pass SHARD_BYTES."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []  # the tensor names of each shard written
    pending: dict[str, torch.Tensor] = {}
    total = pending_bytes = 0

    def flush() -> None:
        nonlocal pending_bytes
        save_file(pending, str(out_dir / f"shard-{len(shards)}"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()
        pending_bytes = 0

    for name, tensor in checkpoint.hf_tensors():
        pending[name] = tensor
        total += tensor.nbytes
        pending_bytes += tensor.nbytes
        if pending_bytes >= SHARD_BYTES:
            flush()
    if pending or not shards:
        flush()
    if len(shards) == 1:
        os.rename(out_dir / "shard-0", out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(out_dir / f"shard-{i}", out_dir / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out_dir / "model.safetensors.index.json", index)


def _write_tokenizer(checkpoint: GGUFCheckpoint, out_dir: Path, context_len: int) -> None:
    """The tokenizer transformers builds from the same metadata, saved as tokenizer.json.

    transformers' converter is fed the fields this reader already holds, so the file's
    vocabulary is parsed once; transformers versions without that converter rebuild the
    tokenizer from the file through the public `gguf_file` argument instead (before 5.18;
    theirs fail on a file without a BOS token id, with an AttributeError or a request for
    protobuf: a ValueError says what helps)."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        from transformers import AutoTokenizer, __version__

        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(checkpoint.path.parent), gguf_file=checkpoint.path.name, local_files_only=True
            )
        except (AttributeError, ImportError, TypeError) as error:
            raise ValueError(
                f"{checkpoint.path}: transformers {__version__} cannot build its tokenizer "
                f"({type(error).__name__}: {' '.join(str(error).split())[:160]}); "
                "transformers 5.18 or later builds it from the file's metadata"
            ) from error
    else:
        from transformers import PreTrainedTokenizerFast

        fields, settings = _tokenizer_fields(checkpoint, GGUF_TOKENIZER_MAPPING)
        try:
            backend, extra = convert_gguf_tokenizer(checkpoint.architecture, fields)
        except KeyError as error:  # (a field the converter needs: a bare KeyError once)
            keys = {name: key for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()}
            missing = keys.get(error.args[0], error.args[0])
            raise ValueError(
                f"{checkpoint.path}: the tokenizer's metadata lacks tokenizer.{missing}"
            ) from None
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **extra)
    tokenizer.model_max_length = context_len
    tokenizer.save_pretrained(str(out_dir))


def _tokenizer_fields(
    checkpoint: GGUFCheckpoint, mapping: dict[str, dict[str, str]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the vocabulary fields the converter takes, the tokenizer settings), from metadata."""
    grouped = [
        {name: checkpoint.get(f"tokenizer.{key}") for key, name in mapping[group].items()}
        for group in ("tokenizer", "tokenizer_config")
    ]
    fields, settings = ({k: v for k, v in g.items() if v is not None} for g in grouped)
    tokens = fields.get("tokens")
    if not tokens:
        raise ValueError(f"{checkpoint.path} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    if fields.get("tokenizer_type") == "gpt2" and not fields.get("merges"):
        raise ValueError(
            f"{checkpoint.path}: its BPE (gpt2) tokenizer has no merges (tokenizer.ggml.merges)"
        )
    if fields.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS for a sentencepiece vocabulary unless the file says otherwise.
        settings.setdefault("add_bos_token", True)
    for name in ("bos", "eos", "unk", "pad"):
        key = "unknown" if name == "unk" else ("padding" if name == "pad" else name)
        token_id = checkpoint.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            settings[f"{name}_token"] = tokens[token_id]
    settings["clean_up_tokenization_spaces"] = False
    return fields, settings


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
