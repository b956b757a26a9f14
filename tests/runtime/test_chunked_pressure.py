"""A prompt prefilled in chunks beside requests that share a cached prefix, in a KV pool
too small for all of them: every request finishes with the tokens a roomy engine gives.
(The chunk's slots were not counted when admitting the others: one admitted beside it
locked the cached prefix whose eviction the chunk needed, both failed to allocate, and
the loop retried that forever, with nothing decoded.)"""

from __future__ import annotations

import pytest

from lmprog_runtime import Engine, default_model_path

SHARED = "System: you are a careful assistant who answers briefly and politely. " * 3
LONG = " ".join(f"word{i} alpha beta" for i in range(25))
PROMPTS = [SHARED + "Question one: what is two plus two?", LONG, SHARED + "Streamed answer:"]
PARAMS = [{"max_new_tokens": n, "temperature": 0} for n in (16, 24, 30)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with Engine(default_model_path("small"), max_total_tokens=4096) as roomy:
        return [out["output_ids"] for out in roomy.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("pool", [228, 264])
def test_a_chunked_prompt_beside_a_shared_prefix_in_a_tight_pool_finishes(reference, pool):
    with Engine(default_model_path("small"), chunked_prefill_size=100, max_total_tokens=pool) as e:
        futures = e.submit(PROMPTS, PARAMS)
        outs = [future.result(timeout=120)["output_ids"] for future in futures]
        assert outs == reference
        # (each prompt's cached tokens counted once, not again at every retry)
        assert e.stats()["cached_tokens"] <= sum(len(e.encode(p)) for p in PROMPTS)
