"""Bad GGUF input is refused with a clear ValueError, and nothing of it stays behind.

Truncated files, a wrong magic or version, an unsupported architecture or tensor type, a
conversion that fails midway: each raises a `ValueError` naming the problem through
`lp.Engine`, leaves no conversion directory (finished or partial) and no mapping of the file
in the process. Also: conversions are cached and keyed by the file, and the engine takes a
GGUF file or a directory holding one.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_files import Q, encode, source_model, use_private_cache, write_gguf  # noqa: E402

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
