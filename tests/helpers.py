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
