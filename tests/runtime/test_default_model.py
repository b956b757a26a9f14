"""The built-in checkpoints: HF format, loadable by transformers, deterministic, race-safe."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmprog_runtime.models.default_model import SPECS, build_default_model


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_transformers_loads_tiny_with_its_chat_template(tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params < 500_000
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Where is my parcel?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert text.endswith("<|im_start|>user\nWhere is my parcel?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer("Hello, world!").input_ids) == "Hello, world!"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (Path(tiny_path) / name).is_file()


def test_small_spec_is_about_thirty_million_parameters():
    s = SPECS["small"]
    head_dim = s.hidden_size // s.num_heads
    per_layer = (
        s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * head_dim
        + s.num_heads * head_dim * s.hidden_size
        + 3 * s.hidden_size * s.intermediate_size
        + 2 * s.hidden_size
    )
    total = s.num_layers * per_layer + s.vocab_size * s.hidden_size * (1 if s.tie_embeddings else 2)
    assert 25e6 < total < 35e6
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads) == (512, 8, 8, 4)
    assert s.vocab_size >= 4096


def test_two_builds_give_the_same_bytes(tmp_path, tiny_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    build_default_model(SPECS["tiny"], a)
    build_default_model(SPECS["tiny"], b)
    assert _digest(a) == _digest(b)
    assert _digest(a) == {k: v for k, v in _digest(Path(tiny_path)).items() if k in _digest(a)}


def test_concurrent_first_use_from_two_processes(tmp_path):
    env = {**os.environ, "LMPROG_CACHE_DIR": str(tmp_path / "cache")}
    code = "from lmprog_runtime import default_model_path; print(default_model_path('tiny'))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1
    built = Path(paths.pop())
    assert (built / "model.safetensors").is_file()
    # Nothing half-built is left behind.
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [built.name]


def test_unknown_size():
    from lmprog_runtime import default_model_path

    with pytest.raises(ValueError, match="size"):
        default_model_path("huge")


def test_lmprog_engine_defaults_to_tiny(tiny_path):
    import lmprog as lp

    with lp.Engine(max_total_tokens=256) as engine:
        assert engine.config.model_path == tiny_path
