"""float32 CPU linear weights stored input-major (`models/weight_layout.py`): the same
values in another layout, so the same tokens; the embedding keeps its rows; a tied head
gets its own copy, or stays tied where memory is short. The probe's answer is forced here
(it depends on the machine's BLAS); it decides per layer shape and thread count, and leaves
torch's global random state alone. Its figures are in the Benchmarks section."""

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
        monkeypatch.setattr(weight_layout, "input_major_is_faster", lambda w, free: answer)

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


def test_each_shape_is_decided_on_its_own(tiny_path, monkeypatch):
    """The probe once timed only the largest layer, the one shape of SmolLM2 that gains
    nothing on MKL, and so kept torch's layout for every layer, those 5x faster too."""
    asked = []

    def faster_when_square(weight, free_bytes):
        asked.append(tuple(weight.shape))
        return weight.shape[0] == weight.shape[1]

    monkeypatch.setattr(weight_layout, "input_major_is_faster", faster_when_square)
    with Engine(tiny_path, max_total_tokens=1024) as engine:
        layers = linears(engine)
        for name, layer in layers.items():
            out, inp = layer.weight.shape
            assert layer.weight.is_contiguous() == (out != inp), name
    shapes = {tuple(m.weight.shape) for m in layers.values()}
    assert sorted(asked) == sorted(shapes) and any(o == i for o, i in shapes)


def test_the_probe_is_remembered_per_shape_and_thread_count(monkeypatch):
    monkeypatch.setattr(weight_layout, "_decisions", {})
    probed = []
    monkeypatch.setattr(weight_layout, "_probe", lambda w: probed.append(w.shape) or True)
    weight, threads = torch.zeros(24, 16), torch.get_num_threads()
    try:
        for count in (1, 1, 2, 2):
            torch.set_num_threads(count)
            assert weight_layout.input_major_is_faster(weight, free_bytes=1 << 30)
        torch.set_num_threads(1)
        assert weight_layout.input_major_is_faster(torch.zeros(8, 16), free_bytes=1 << 30)
    finally:
        torch.set_num_threads(threads)
    assert len(probed) == 3  # (1 and 2 threads for one shape, 1 for the other)
    assert not weight_layout.input_major_is_faster(torch.zeros(64, 64), free_bytes=1000)
    assert len(probed) == 3  # (no memory for the probe's copy: not probed, torch's layout)


def test_the_probe_leaves_torchs_random_state_alone(monkeypatch):
    monkeypatch.setattr(weight_layout, "_decisions", {})
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    weight_layout.input_major_is_faster(torch.ones(48, 32), free_bytes=1 << 30)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "alone, all_threads, expected",
    [(0.2, 1.0, True), (0.2, 1.05, True), (0.2, 1.5, False), (0.95, 0.2, False)],
)
def test_the_probe_times_one_thread_first(monkeypatch, alone, all_threads, expected):
    """On a loaded machine every multi-threaded product waited a scheduler tick, in either
    layout: the probe said no at random. Input-major is taken where one thread finds it
    clearly faster and all threads do not find it clearly slower."""
    seen = []

    def ratio(weight):
        seen.append(torch.get_num_threads())
        return alone if torch.get_num_threads() == 1 else all_threads

    monkeypatch.setattr(weight_layout, "time_ratio", ratio)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert weight_layout._probe(torch.zeros(4, 4)) is expected
        assert torch.get_num_threads() == 2  # (restored)
    finally:
        torch.set_num_threads(threads)
    assert seen == ([1, 2] if alone < weight_layout.PROBE_MARGIN else [1])


def test_probes_at_once_leave_torchs_thread_count_as_it_was(monkeypatch):
    """Each probe set one thread and restored what it had read: one that began inside the
    other's read one and restored that, and threads started later ran on one thread."""
    import threading
    import time

    shapes = []

    def slow_ratio(weight):
        shapes.append(tuple(weight.shape))
        time.sleep(0.1)
        return 0.5

    monkeypatch.setattr(weight_layout, "time_ratio", slow_ratio)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        probes = [
            threading.Thread(target=weight_layout._probe, args=(torch.zeros(n, 4),))
            for n in (3, weight_layout.PROBE_MAX_OUT + 5)
        ]
        for probe in probes:
            probe.start()
        for probe in probes:
            probe.join(10)
        seen = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join(10)
        assert torch.get_num_threads() == 2 and seen == [2]
    finally:
        torch.set_num_threads(threads)
    # (a tall weight is timed on its first PROBE_MAX_OUT rows)
    assert sorted(shapes) == [(3, 4)] * 2 + [(weight_layout.PROBE_MAX_OUT, 4)] * 2
