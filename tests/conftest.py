"""Shared fixtures: one tiny-model engine per session and the clean-engine check.

Every test that uses `engine` is followed by a check that all KV slots and request slots are
free again and nothing is left running or waiting.
"""

from __future__ import annotations

import os
import time

# Triton kernels run on CPU tensors only in interpreter mode; it must be chosen before
# Triton compiles (decorates) any kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from lmprog_runtime import default_model_path

    return default_model_path("tiny")


@pytest.fixture(scope="session")
def _session_engine(tiny_path):
    from lmprog_runtime import Engine

    engine = Engine(tiny_path, max_total_tokens=16384, max_running_requests=32)
    yield engine
    engine.shutdown()


def assert_engine_clean(engine) -> None:
    # The loop finishes a request just before waking its caller; give it a moment to settle.
    deadline = time.monotonic() + 5
    while True:
        state = engine.memory_state()
        # Every slot is either free or owned by the prefix cache, and nothing is locked.
        clean = (
            state["kv_slots_free"] + state["kv_slots_cached"] == state["kv_slots_total"]
            and state["kv_slots_locked"] == 0
            and state["req_slots_free"] == state["req_slots_total"]
            and state["num_running"] == 0
            and state["num_waiting"] == 0
        )
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert clean, f"engine not clean after test: {state}"


@pytest.fixture
def engine(_session_engine):
    yield _session_engine
    assert_engine_clean(_session_engine)


@pytest.fixture(scope="session")
def hf_tiny(tiny_path):
    """transformers' own model and tokenizer for the same tiny checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_path)
