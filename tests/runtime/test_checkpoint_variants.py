"""Checkpoints as released models write them, read as transformers reads them.

Each case saves a tiny random transformers model (the tiny built-in model's tokenizer
beside it), changes what a release may change (its config's keys, its files), and holds
lmprog's greedy tokens to those of transformers' `from_pretrained` of the same directory:
the reference reads the files itself, so a file or key lmprog reads differently shows. A
config transformers reads but lmprog cannot run is refused with a ValueError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import LLAMA3_ROPE, TINY_ARCH_CONFIG, edit_config, hf_greedy_ids, random_hf_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import lmprog as lp  # noqa: E402
from lmprog_runtime.models import ModelConfig, default_model_path, load_model  # noqa: E402
from lmprog_runtime.models.loader import INDEX_FILE  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 250, 42, 7], list(range(3, 250, 6))]  # (7 and 42 tokens)
NEW_TOKENS = 12


def _save(model, path: Path, **save_options) -> Path:
    model.save_pretrained(path, safe_serialization=True, **save_options)
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path("tiny"))
    tokenizer.save_pretrained(path)
    return path


def _assert_same_greedy_tokens(path: Path) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    expected = hf_greedy_ids(reference, PROMPTS, NEW_TOKENS)
    with lp.Engine(str(path), dtype="float32", max_total_tokens=1024) as engine:
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
        assert [out["output_ids"] for out in outs] == expected
        assert engine.memory_state()["kv_slots_locked"] == 0


def _model(model_type: str, **overrides):
    return random_hf_model(model_type, **{**TINY_ARCH_CONFIG, **overrides})


@pytest.mark.parametrize(
    "model_type, config",
    [
        # (transformers' Mistral and Qwen2 classes read neither key: it failed as
        # "missing weights")
        ("mistral", {"attention_bias": True, "mlp_bias": True}),
        ("qwen2", {"attention_bias": True, "mlp_bias": True}),
        ("llama", {"hidden_act": "swish"}),  # (SiLU's other name: it was refused)
        # (use_sliding_window where max_window_layers covers every layer: no layer slides)
        (
            "qwen2",
            {
                "use_sliding_window": True,
                "sliding_window": 4,
                "max_window_layers": 2,
                "layer_types": None,
            },
        ),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "layer_types": None}),
    ],
)
def test_config_keys_the_architecture_ignores_are_ignored(tmp_path, model_type, config):
    path = _save(_model(model_type), tmp_path)
    edit_config(path, **config)
    _assert_same_greedy_tokens(path)


def test_bias_tensors_the_architecture_ignores_are_ignored(tmp_path):
    """transformers' Mistral builds no biases and skips such tensors in a checkpoint."""
    path = _save(_model("mistral"), tmp_path)
    weights = load_file(path / "model.safetensors")
    for name in [k for k in weights if k.endswith(("q_proj.weight", "down_proj.weight"))]:
        weights[name.replace(".weight", ".bias")] = torch.ones(weights[name].shape[0])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    _assert_same_greedy_tokens(path)


def test_a_sliding_qwen_layer_is_refused(tmp_path):
    path = _save(_model("qwen2"), tmp_path)
    windowed = {"use_sliding_window": True, "sliding_window": 4}
    edit_config(path, **windowed, max_window_layers=1, layer_types=None)
    with pytest.raises(ValueError, match="use_sliding_window"):
        lp.Engine(str(path))
    edit_config(path, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="use_sliding_window"):
        lp.Engine(str(path))


@pytest.mark.parametrize(
    "rope, top_level",
    [
        # (transformers takes max_position_embeddings: it was a bare KeyError)
        ({k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}, {}),
        # (a top-level value wins over the dict's, as in Phi-3's configs: it was ignored)
        (LLAMA3_ROPE, {"original_max_position_embeddings": 16}),
    ],
)
def test_llama3_ropes_original_context_is_read_as_transformers_reads_it(tmp_path, rope, top_level):
    path = _save(_model("llama", rope_parameters=LLAMA3_ROPE), tmp_path)
    edit_config(path, rope_parameters=rope, **top_level)
    _assert_same_greedy_tokens(path)


def test_llama3_rope_without_max_position_embeddings_takes_its_own_original_context():
    """The top-level key defaults to 2048 (its absence was a KeyError once the rope's own
    original context was looked up beside it)."""
    raw = {
        "architectures": ["LlamaForCausalLM"],
        **{k: v for k, v in TINY_ARCH_CONFIG.items() if k != "max_position_embeddings"},
        "rope_scaling": LLAMA3_ROPE,
    }
    config = ModelConfig.from_dict(raw)
    assert config.context_len == 2048
    assert config.rope_scaling["original_max_position_embeddings"] == 32
    del raw["rope_scaling"]["original_max_position_embeddings"]
    assert ModelConfig.from_dict(raw).rope_scaling["original_max_position_embeddings"] == 2048


def test_a_scaled_rope_without_its_factor_is_a_value_error(tmp_path):
    path = _save(_model("llama"), tmp_path)
    edit_config(path, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="'linear' needs a number 'factor'"):
        lp.Engine(str(path))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_head_beside_tied_embeddings_is_the_head(tmp_path, sharded):
    """A config saying tie_word_embeddings over a checkpoint that has its own
    lm_head.weight: transformers unties them. lmprog copied both into one tensor, the last
    file's winning (the head as embeddings, or the other way round), without a word."""
    model = _model("llama")
    options = {"max_shard_size": "40KB"} if sharded else {}
    path = _save(model, tmp_path, **options)
    edit_config(path, tie_word_embeddings=True)
    files = sorted(path.glob("*.safetensors"))
    assert len(files) > 1 if sharded else len(files) == 1
    assert any("lm_head.weight" in load_file(f) for f in files)
    _assert_same_greedy_tokens(path)


def test_a_head_equal_to_the_embeddings_stays_tied(tmp_path):
    """(no second vocabulary-sized tensor, no warning: transformers keeps them tied too)"""
    model = _model("llama")
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    path = _save(model, tmp_path)
    edit_config(path, tie_word_embeddings=True)
    assert "lm_head.weight" in load_file(path / "model.safetensors")
    loaded = load_model(str(path), torch.float32, "cpu")
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    _assert_same_greedy_tokens(path)


def test_the_index_names_the_weight_files(tmp_path):
    """A stray safetensors file beside a sharded checkpoint (an old shard, a copy) was read
    too, its tensors overwriting the index's."""
    path = _save(_model("llama"), tmp_path, max_shard_size="40KB")
    assert (path / INDEX_FILE).is_file()
    shard = sorted(path.glob("*.safetensors"))[0]
    weights = load_file(shard)
    save_file({k: v * 3 for k, v in weights.items()}, path / "zz-stray.safetensors")
    _assert_same_greedy_tokens(path)
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "missing.safetensors"
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names 'missing.safetensors'"):
        lp.Engine(str(path))
    (path / INDEX_FILE).write_text("[]")
    with pytest.raises(ValueError, match="is not a safetensors index"):
        lp.Engine(str(path))


def test_a_prompt_past_the_models_vocabulary_is_a_value_error(tmp_path):
    """A tokenizer with more tokens than the model (2048 against 256 here): a text prompt
    whose token is past the model's table failed inside the engine's step ("index out of
    range"); now the call says which token, and the engine goes on."""
    path = _save(_model("llama"), tmp_path)
    with lp.Engine(str(path), dtype="float32") as engine:
        text = engine.tokenizer.decode([1500, 40])
        with pytest.raises(ValueError, match=r"has token 1500 .*outside the model's vocab"):
            engine.generate(text, {"max_new_tokens": 2})
        with pytest.raises(ValueError, match=r"token ids \[1500\] outside the model's vocab"):
            engine.generate(input_ids=[40, 1500], sampling_params={"max_new_tokens": 2})
        out = engine.generate(
            engine.tokenizer.decode([40, 41]), {"max_new_tokens": 2, "temperature": 0}
        )
        assert len(out["output_ids"]) == 2

        @lp.function
        def program(s, question, choice):  # (its text once got the message of input_ids)
            s += question
            s += lp.gen("x", max_tokens=2) if choice is None else lp.select("c", [ok, choice])

        ok = engine.tokenizer.decode([40, 41])
        for question, choice in [(text, None), (ok, text)]:
            with pytest.raises(ValueError, match=r"has token 1500 .*outside the model's vocab"):
                program.run(question=question, choice=choice, backend=engine)
