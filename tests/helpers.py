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
