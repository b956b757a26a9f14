"""float32 CPU linear weights stored input-major (`models/weight_layout.py`): the same
values in another layout, so the same tokens; the embedding keeps its rows; a tied head
gets its own copy, or stays tied where memory is short. The probe is forced here (its
answer depends on the machine's BLAS); its own figures are in the Benchmarks section."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmprog_runtime import Engine
from lmprog_runtime.models import weight_layout

PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time", "def f(x):"] * 2
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def probe_says(monkeypatch):
    def set_answer(answer: bool) -> None:
        monkeypatch.setattr(weight_layout, "input_major_is_faster", lambda i, o: answer)

    return set_answer


def linears(engine) -> dict[str, nn.Linear]:
    model = engine.runner.model
    return {name: m for name, m in model.named_modules() if type(m) is nn.Linear}


def test_input_major_weights_give_the_same_tokens(tiny_path, probe_says):
    config = {"max_total_tokens": 2048}
    with Engine(tiny_path, disable_input_major_weights=True, **config) as plain:
        expected = [o["output_ids"] for o in plain.generate(PROMPTS, GREEDY)]
        alone = plain.generate(PROMPTS[0], GREEDY)["output_ids"]
        before = {name: m.weight.detach().clone() for name, m in linears(plain).items()}
    probe_says(True)
    with Engine(tiny_path, **config) as engine:
        model = engine.runner.model
        for name, layer in linears(engine).items():
            out, inp = layer.weight.shape
            assert layer.weight.stride() == (1, out), name  # stored [in, out]
            assert torch.equal(layer.weight, before[name])
        assert model.embed_tokens.weight.is_contiguous()
        assert [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)] == expected
        assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == alone


def test_a_tied_head_gets_its_own_copy_or_stays_tied_without_memory(probe_says):
    probe_says(True)
    hidden, vocab = 32, 100

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, hidden)
            self.proj = nn.Linear(hidden, 3 * hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

    model = Tied()
    assert weight_layout.use_input_major_weights(model, free_bytes=0) == 1  # (proj only)
    assert model.lm_head.weight is model.embed_tokens.weight
    model = Tied()
    embed = model.embed_tokens.weight.detach().clone()
    assert weight_layout.use_input_major_weights(model, free_bytes=1 << 30) == 2
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, embed) and model.embed_tokens.weight.is_contiguous()
    assert model.lm_head.weight.stride() == (1, vocab)


def test_where_the_probe_finds_no_gain_nothing_changes(tiny_path, probe_says):
    probe_says(False)
    with Engine(tiny_path, max_total_tokens=1024) as engine:
        assert all(m.weight.is_contiguous() for m in linears(engine).values())
