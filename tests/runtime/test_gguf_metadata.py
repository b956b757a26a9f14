"""GGUF metadata the existing GGUF tests never vary: every test file has rope_theta 10000,
rms eps 1e-6, no linear RoPE factor that scales, and no file of GGUF architecture
`mistral` (llama.cpp's Mistral files in the tests are architecture `llama`). Each case here
writes a tiny model whose value differs and holds the converted model's logits to the
source model's forward (F32: exact weights)."""

from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import gguf_files  # noqa: E402
from gguf_files import Q, random_model, use_private_cache, write_gguf  # noqa: E402
from test_gguf import SEQUENCES, _assert_close, _our_logits, _reference_logits  # noqa: E402

from lmprog_runtime.models import gguf_convert  # noqa: E402


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    return use_private_cache(tmp_path, monkeypatch)


def _check(model, path, tiny_path, case="llama", qtype=Q.F32, meta=None):
    write_gguf(model, path, case, qtype, tiny_path, meta)
    ours = _our_logits(gguf_convert.convert_gguf(path), SEQUENCES)
    for mine, ref in zip(ours, _reference_logits(model, SEQUENCES)):
        _assert_close(mine, ref)


def test_rope_freq_base_is_read(tmp_path, tiny_path):
    model = random_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 50.0})
    _check(model, tmp_path / "theta.gguf", tiny_path)


def test_rms_epsilon_is_read(tmp_path, tiny_path):
    model = random_model("llama", rms_norm_eps=0.3)
    _check(model, tmp_path / "eps.gguf", tiny_path)


@pytest.mark.parametrize("key", ["factor", "scale_linear"])
def test_a_linear_rope_factor_scales(tmp_path, tiny_path, key):
    rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    model = random_model("llama", rope_parameters=rope)

    def extra(w):
        if key == "factor":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(4.0)
        else:  # the older key, as llama.cpp still reads it
            w.add_float32("llama.rope.scale_linear", 4.0)

    _check(model, tmp_path / f"linear-{key}.gguf", tiny_path, meta={"extra": extra})


def test_a_mistral_architecture_file_is_unpermuted_and_keeps_its_window(
    tmp_path, tiny_path, monkeypatch
):
    """GGUF architecture `mistral`: llama.cpp permutes its Q/K rows like Llama's, and the
    window comes from `mistral.attention.sliding_window` (8 < the 13-token sequence)."""
    monkeypatch.setitem(
        gguf_files.ARCHS, "mistral-arch", ("mistral", {}, "mistral", "tiny Mistral")
    )
    model = random_model("mistral", sliding_window=8)
    cfg = model.config

    def qtype(name, data):  # F32, with llama.cpp's Q/K permutation (the writer does it for
        # architecture "llama" only)
        if ".attn_q." in name or ".attn_k." in name:
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            data = gguf_files._llama_cpp_permute(data, heads)
        return data.astype(np.float32), {}

    meta = {"extra": lambda w: w.add_sliding_window(8)}
    _check(model, tmp_path / "mistral.gguf", tiny_path, case="mistral-arch", qtype=qtype, meta=meta)
