"""Baselines shared by the benchmarks: transformers' own batched `generate`."""

from __future__ import annotations

import time

import torch


def hf_generate_seconds(
    model_path: str, prompts: list[list[int]], new_tokens: int, batch_size: int
) -> float:
    """Greedy `generate` over equal-length prompts in batches; returns wall seconds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = torch.tensor(prompts[i : i + batch_size])  # equal lengths: no padding
            out = model.generate(
                chunk,
                attention_mask=torch.ones_like(chunk),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            assert out.shape[1] == chunk.shape[1] + new_tokens
    return time.perf_counter() - start
