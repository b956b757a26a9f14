"""A finishing request frees exactly the slots the prefix cache does not keep, at every
remainder of its last page, and a duplicate of what the cache holds is freed even when it
is one token long. (The session's clean-engine check, `conftest.py`, fails any test here
that leaves a slot neither free nor cached.)"""

from __future__ import annotations

import pytest

from lmprog_runtime import Engine


@pytest.mark.parametrize("page_size", [1, 4])
def test_identical_requests_free_their_duplicate_slots(tiny_path, page_size):
    """Two identical greedy requests: the second to finish finds all it computed cached by
    the first (by one token past the prompt at `max_new_tokens=2`) and frees its own."""
    prompt = list(range(5, 13))  # 8 tokens: whole pages of 1 and 4
    with Engine(tiny_path, page_size=page_size, max_total_tokens=512) as engine:
        for new in (1, 2, 3, 6):
            params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
            outs = engine.generate(input_ids=[prompt, prompt], sampling_params=params)
            assert outs[0]["output_ids"] == outs[1]["output_ids"]
            state = engine.memory_state()
            assert state["kv_slots_free"] + state["kv_slots_cached"] == state["kv_slots_total"]
            assert engine.flush_cache()
            assert engine.memory_state()["kv_slots_free"] == state["kv_slots_total"]


def test_every_remainder_of_the_last_page_is_freed(tiny_path):
    """Pages of 4: requests ending 0, 1, 2 and 3 tokens into their last page free the
    slots past the cached whole pages, with the cache on and off."""
    prompts = [list(range(3, 3 + n)) for n in (5, 6, 7, 8)]
    for disable in (False, True):
        with Engine(
            tiny_path, page_size=4, max_total_tokens=512, disable_radix_cache=disable
        ) as engine:
            for new in (1, 2, 3, 4):
                params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
                engine.generate(input_ids=prompts, sampling_params=params)
                state = engine.memory_state()
                cached = state["kv_slots_cached"]
                assert state["kv_slots_free"] + cached == state["kv_slots_total"]
                assert cached % 4 == 0 and (cached == 0) == disable
