"""Plain helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import torch

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Question: What is 17 plus 25? Answer:",
    "Dear customer, thank you for writing to us about your parcel",
    "Once upon a time in a small village by the sea, there lived an old fisherman who",
    '{"name": "Alice", "age": 31, "city":',
    "def add(a, b):\n    return a + b\n\nprint(add(2,",
    "The weather report for Monday says that the morning will be cloudy with light rain, "
    "and the afternoon will bring sunshine across most of the region before",
]


# The shape of the tiny random checkpoints built per architecture (logits and GGUF tests).
TINY_ARCH_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=128,
    max_position_embeddings=256,
)
# Llama 3.1 frequency-dependent RoPE scaling, with a short original context so it matters.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def random_hf_model(model_type: str, **config):
    """A transformers model of `model_type` with weights re-drawn at a scale that makes its
    logits far from constant (default initialisation gives near-uniform logits, which would
    make logits comparisons vacuous). Eager attention: a path independent of ours (SDPA)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif p.ndim == 1:  # biases
                p.copy_(0.5 * noise)
            elif "embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 1.5 / p.shape[1] ** 0.5)
    return model


def hf_greedy_ids(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` on token ids, one prompt at a time (no padding)."""
    outs = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        outs.append(out[0, len(ids) :].tolist())
    return outs


def hf_greedy(hf_tiny, prompt: str, max_new_tokens: int) -> list[int]:
    model, tokenizer = hf_tiny
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def decode_batch(table, rows: list[int], seq_lens: list[int]):
    """A DECODE ForwardBatch: each request's newest token (position seq_len - 1) is new."""
    from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode

    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(rows), dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in seq_lens]),
        out_cache_loc=torch.stack([table.table[r, n - 1] for r, n in zip(rows, seq_lens)]),
        req_pool_indices=torch.tensor(rows),
        seq_lens=list(seq_lens),
        prefix_lens=[n - 1 for n in seq_lens],
        logits_indices=torch.arange(len(rows)),
    )


def run_backend(name: str, layout, pool, table, batch, q, k, v):
    """One attention layer of `batch` through backend `name`."""
    from lmprog_runtime.attention import create_attention_backend

    backend = create_attention_backend(name, layout, pool, table)
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, 0, batch)
