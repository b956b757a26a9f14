"""Bad GGUF input is refused with a clear ValueError, and nothing of it stays behind.

Truncated files, a wrong magic or version, an unsupported architecture or tensor type, a
conversion that fails midway: each raises a `ValueError` naming the problem through
`lp.Engine`, leaves no conversion directory (finished or partial) and no mapping of the file
in the process. Also: conversions are cached and keyed by the file, and the engine takes a
GGUF file or a directory holding one.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    Q,
    encode,
    source_model,
    use_private_cache,
    write_gguf,
)

import lmprog as lp  # noqa: E402
from lmprog_runtime.models import gguf_convert  # noqa: E402


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> Path:
    return use_private_cache(tmp_path, monkeypatch)


@pytest.fixture
def good_gguf(tmp_path, tiny_path) -> Path:
    return write_gguf(source_model("llama"), tmp_path / "good.gguf", "llama", Q.F32, tiny_path)


def _assert_refused(path: Path, match: str, cache: Path) -> None:
    """lp.Engine refuses the file with a ValueError, and nothing of it stays behind: no
    conversion directory (finished or partial), no mapping of the file in this process."""

    with pytest.raises(ValueError, match=match) as info:
        lp.Engine(str(path), max_total_tokens=64)
    del info  # its traceback holds the frames that held the reader
    gc.collect()
    leftovers = list((cache / "gguf").iterdir()) if (cache / "gguf").exists() else []
    assert leftovers == []
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(path.resolve()) not in maps.read_text()


def _rewrite(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_truncated_files_are_refused(good_gguf, private_cache):
    data = good_gguf.read_bytes()
    _assert_refused(
        _rewrite(good_gguf, data[: len(data) // 2]), "truncated or corrupt", private_cache
    )
    _assert_refused(_rewrite(good_gguf, data[:2000]), "truncated or corrupt", private_cache)
    _assert_refused(_rewrite(good_gguf, data[:6]), "truncated", private_cache)


def test_bad_magic_and_version_are_refused(good_gguf, private_cache):
    data = good_gguf.read_bytes()
    _assert_refused(_rewrite(good_gguf, b"GGUX" + data[4:]), "not a GGUF file", private_cache)
    bad_version = data[:4] + (7).to_bytes(4, "little") + data[8:]
    _assert_refused(_rewrite(good_gguf, bad_version), "version 7 is not supported", private_cache)
    # A big-endian file (its version's bytes swapped) failed in conversion, naming no file.
    version = int.from_bytes(data[4:8], "little")
    big = data[:4] + version.to_bytes(4, "big") + data[8:]
    _assert_refused(_rewrite(good_gguf, big), "big-endian GGUF", private_cache)


def test_unsupported_architecture_is_refused(tmp_path, private_cache):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_refused(
        tmp_path / "gpt2.gguf", r"architecture 'gpt2' is not supported.*qwen3", private_cache
    )


def test_unsupported_tensor_type_is_refused(tmp_path, tiny_path, private_cache):
    def with_q8_1(name: str, data: np.ndarray):
        if name == "blk.0.ffn_up.weight":  # Q8_1: a type llama.cpp only uses internally
            block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
            raw = np.zeros((data.shape[0], data.shape[1] // block * size), np.uint8)
            return raw, {"raw_dtype": Q.Q8_1}
        return encode(data, Q.F32)

    path = write_gguf(source_model("llama"), tmp_path / "q8_1.gguf", "llama", with_q8_1, tiny_path)
    _assert_refused(path, r"'blk.0.ffn_up.weight' has type Q8_1.*Q4_K", private_cache)


def test_a_failed_conversion_leaves_no_directory(good_gguf, monkeypatch, private_cache):
    def fail(checkpoint, out_dir):
        raise ValueError("disk full (simulated)")

    monkeypatch.setattr(gguf_convert, "_write_weights", fail)
    _assert_refused(good_gguf, "disk full", private_cache)


def test_conversion_is_cached_and_keyed_by_the_file(good_gguf, tiny_path):
    first = gguf_convert.convert_gguf(good_gguf)
    assert gguf_convert.convert_gguf(good_gguf) == first
    write_gguf(source_model("llama"), good_gguf, "llama", Q.F16, tiny_path)  # replaced in place
    second = gguf_convert.convert_gguf(good_gguf)
    assert second != first and Path(second, "model.safetensors").is_file()


def test_engine_takes_a_gguf_file_or_a_directory_holding_one(good_gguf, engine):
    """The tiny llama GGUF through lp.Engine: a file path or its directory, same tokens."""

    params = {"max_new_tokens": 8, "temperature": 0}
    outs = []
    for model_path in (good_gguf, good_gguf.parent):
        with lp.Engine(model_path, max_total_tokens=256) as gguf_engine:
            assert gguf_engine.config.model_path == str(good_gguf.resolve())
            outs.append(gguf_engine.generate("Once upon a time", params)["output_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 8
    (good_gguf.parent / "second.gguf").write_bytes(good_gguf.read_bytes())
    with pytest.raises(ValueError, match="several GGUF files"):
        lp.Engine(good_gguf.parent)


def _field_value_at(path: Path, key: str) -> int:
    """The byte where metadata `key`'s value starts (past its key and type), read with the
    `gguf` package's own reader from the intact file."""
    field = gguf.GGUFReader(path).fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def _patched(path: Path, at: int, value: int, size: int) -> Path:
    data = bytearray(path.read_bytes())
    data[at : at + size] = value.to_bytes(size, "little")
    return _rewrite(path, bytes(data))


@pytest.mark.parametrize("damage", ["array length", "value type", "metadata count"])
def test_an_impossible_count_is_refused_before_the_reader_runs(
    good_gguf, private_cache, monkeypatch, damage
):
    """The reader trusts the header's counts: an array length of 2**40 (or a string's
    value type turned into ARRAY) made it read on past the file, growing to 23 GB. The
    counts are now bounded by the file's size before it runs (here it must not run)."""
    from lmprog_runtime.models import gguf as gguf_module

    if damage == "array length":  # (past the array's item type)
        at = _field_value_at(good_gguf, "tokenizer.ggml.tokens") + 4
        _patched(good_gguf, at, 2**40, 8)
    elif damage == "value type":
        _patched(good_gguf, _field_value_at(good_gguf, "general.architecture") - 4, 9, 4)
    else:
        _patched(good_gguf, 16, 2**40, 8)

    def no_reader():
        raise AssertionError("the reader ran on a header with an impossible count")

    monkeypatch.setattr(gguf_module, "_reader_class", no_reader)
    _assert_refused(good_gguf, "corrupt GGUF file: .*more than the .* bytes left", private_cache)


def _tensor_entry(path: Path, i: int) -> tuple[int, int, str, str]:
    """Tensor i's table entry: where its type is written, its offset in the data section,
    its name and the next tensor's (read with the `gguf` package's reader, then dropped:
    a live reader keeps the file mapped)."""
    reader = gguf.GGUFReader(path)
    tensor = reader.tensors[i]
    type_at = tensor.field.offset + 8 + len(tensor.name.encode()) + 4 + 8 * len(tensor.shape)
    offset = int(tensor.data_offset - reader.data_offset)
    return type_at, offset, tensor.name, reader.tensors[i + 1].name


@pytest.mark.parametrize("damage", ["offset", "type"])
def test_a_damaged_tensor_table_is_refused_naming_the_tensor(good_gguf, private_cache, damage):
    """A tensor's offset moved by one alignment unit, or its type changed (F32 to F16:
    half the bytes), was read from the wrong bytes: NaN logits or another tensor's
    weights. llama.cpp's rule now holds: each tensor starts where the one before ended."""
    type_at, offset, name, following = _tensor_entry(good_gguf, 3)
    if damage == "offset":
        _patched(good_gguf, type_at + 4, offset + 32, 8)
        bad = name
    else:
        _patched(good_gguf, type_at, int(Q.F16), 4)
        bad = following  # (the next one is misplaced)
    _assert_refused(good_gguf, f"tensor '{re.escape(bad)}' starts at byte", private_cache)


def test_a_split_gguf_is_refused_with_how_to_merge_it(tmp_path, tiny_path, private_cache):
    """Its first shard was said to lack tensors, naming none of the split."""
    path = write_gguf(
        source_model("llama"),
        tmp_path / "model-00001-of-00002.gguf",
        "llama",
        Q.F32,
        tiny_path,
        meta={"extra": lambda w: (w.add_uint16("split.no", 0), w.add_uint16("split.count", 2))},
    )
    _assert_refused(path, "shard 1 of a GGUF split into 2 files.*--merge", private_cache)


def test_a_bpe_vocabulary_without_merges_is_a_value_error_naming_the_key(
    tmp_path, tiny_path, private_cache
):
    """It was a KeyError 'scores', naming no file."""
    meta = {"token_merges": None}
    path = write_gguf(source_model("llama"), tmp_path / "m.gguf", "llama", Q.F32, tiny_path, meta)
    _assert_refused(path, r"BPE \(gpt2\) tokenizer has no merges", private_cache)


def test_per_layer_counts_of_one_value_are_that_value(tmp_path, tiny_path):
    """llama.cpp reads the head count and feed-forward length per layer too; an array of
    one value was refused with a garbled shape message. Reference: the same model with
    plain counts, token for token."""
    model, layers = source_model("llama"), source_model("llama").config.num_hidden_layers
    config = model.config
    per_layer = {
        "head_count": [config.num_attention_heads] * layers,
        "feed_forward_length": [config.intermediate_size] * layers,
    }
    # A linear RoPE without its factor scales nothing, as llama.cpp reads it (it was a
    # TypeError of float(None)).
    linear = {"extra": lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)}
    # An explicit type "none" never scales, whatever factor is given (it scaled linearly).
    none = {
        "extra": lambda w: (
            w.add_rope_scaling_type(gguf.RopeScalingType.NONE),
            w.add_rope_scaling_factor(4.0),
        )
    }
    params = {"max_new_tokens": 8, "temperature": 0}
    outs = []
    cases = (("plain", None), ("per-layer", per_layer), ("linear", linear), ("none", none))
    for name, meta in cases:
        path = write_gguf(model, tmp_path / f"{name}.gguf", "llama", Q.F32, tiny_path, meta)
        with lp.Engine(str(path), max_total_tokens=256, dtype="float32") as gguf_engine:
            outs.append(gguf_engine.generate("Once upon a time", params)["output_ids"])
    assert outs[0] == outs[1] == outs[2] == outs[3] and len(outs[0]) == 8


def test_a_file_replaced_with_the_same_size_and_time_converts_again(good_gguf, tiny_path):
    """The cache was keyed by path, size and modification time: a file replaced by `cp -p`
    or `rsync -t` with another of the same size served the old weights."""
    import os

    first = gguf_convert.convert_gguf(good_gguf)
    stat = good_gguf.stat()

    def negated(name: str, data: np.ndarray):  # (other weights, the same bytes of header)
        return encode(-data, Q.F32)

    model = source_model("llama")
    replacement = write_gguf(model, good_gguf.with_name("b.gguf"), "llama", negated, tiny_path)
    assert replacement.stat().st_size == stat.st_size
    os.replace(replacement, good_gguf)
    os.utime(good_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = gguf_convert.convert_gguf(good_gguf)
    assert second != first and Path(second, "model.safetensors").is_file()


def test_the_conversion_key_sees_a_change_at_either_end_or_in_a_sampled_block(tmp_path):
    """Past 8 MiB the key digests the first and last 4 MiB and 16 blocks between them (a
    whole 4 GB file took seconds); a change in any of them is a new conversion."""
    size = 20 << 20
    path = tmp_path / "big.gguf"
    path.write_bytes(bytes(size))
    middle = size - 2 * gguf_convert.FINGERPRINT_BYTES
    sampled = gguf_convert.FINGERPRINT_BYTES + middle * 5 // gguf_convert.FINGERPRINT_SAMPLES
    digests = {gguf_convert._fingerprint(path, size)}
    for at in (0, sampled + 10, size - 1):
        data = bytearray(path.read_bytes())
        data[at] ^= 1
        path.write_bytes(bytes(data))
        digests.add(gguf_convert._fingerprint(path, size))
    assert len(digests) == 4
