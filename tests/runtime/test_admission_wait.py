"""Admission that waits to admit several requests at once (`admission_wait_steps`).

On CUDA a step that admits runs eagerly (a prompt, or a mixed step) where a decode step
replays a graph, so a dataset run that admits one request whenever one finishes runs
eagerly at most steps. With the setting, admission waits up to N steps while requests
decode, unless the room already takes a group. Checked here against the rule step by step
(a trace of what each scheduling saw and did), against the same engine admitting at once,
and against transformers' greedy outputs.
"""

from __future__ import annotations

import pytest
from helpers import hf_greedy_ids

from lmprog_runtime import Engine
from lmprog_runtime.admission_wait import ADMISSION_GROUP_DIVISOR, GRAPHED_ADMISSION_WAIT_STEPS
from lmprog_runtime.config import RuntimeConfig

POOL = {"max_total_tokens": 16384, "max_running_requests": 64}
PROMPTS = [[5 + (i * 7 + j) % 1000 for j in range(4 + i % 5)] for i in range(128)]
# (lengths spread so widely that at times fewer than a group finish in the steps it waits)
PARAMS = [
    {"max_new_tokens": 8 + (i * 37) % 181, "temperature": 0, "ignore_eos": True} for i in range(128)
]


def _traced_run(
    engine: Engine, prompts: list[list[int]] = PROMPTS, params: list[dict] | dict = PARAMS
) -> tuple[list[list[int]], list[dict]]:
    """The outputs of `prompts`, and for each scheduling: how many requests were waiting,
    decoding, the free room before it, and how many it admitted."""
    sched = engine.scheduler
    trace: list[dict] = []
    next_batch = sched.next_batch

    def traced():
        waiting = list(sched.waiting)
        active = len(sched.running) + (sched.chunked_req is not None)
        seen = {"waiting": len(waiting), "decoding": len(sched.decoding)}
        seen["room"] = sched._room(active)
        held = engine.stats()["admission_waits"]
        batch = next_batch()
        seen["held"] = engine.stats()["admission_waits"] - held
        admitted = set(map(id, batch.reqs)) & set(map(id, waiting)) if batch else set()
        seen["admitted"] = len(admitted)
        trace.append(seen)
        return batch

    sched.next_batch = traced
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        del sched.next_batch
    return [out["output_ids"] for out in outs], trace


LOOPS = {
    "synchronous": {},
    "overlapped": {"overlap_schedule": True},
    "decode runs of 4": {"decode_steps": 4},
}


@pytest.mark.parametrize("loop", LOOPS)
def test_admissions_wait_to_be_made_together(tiny_path, hf_tiny, loop):
    wait = 8
    with Engine(tiny_path, **POOL, **LOOPS[loop]) as engine:
        assert engine.scheduler.admission_wait.max_steps == 0  # (a CPU: no graphs)
        at_once, at_once_trace = _traced_run(engine)
    with Engine(tiny_path, admission_wait_steps=wait, **POOL, **LOOPS[loop]) as engine:
        waited, trace = _traced_run(engine)
        waits = engine.stats()["admission_waits"]

    # The same tokens as admitted at once, and as transformers' greedy decoding.
    assert waited == at_once
    model, _ = hf_tiny
    longest = max(p["max_new_tokens"] for p in PARAMS[:3])
    assert waited[:3] == [
        ids[: p["max_new_tokens"]]
        for ids, p in zip(hf_greedy_ids(model, PROMPTS[:3], longest), PARAMS)
    ]

    # The rule, step by step. (The pool is large: only the rule keeps out a request that
    # has room.)
    group = POOL["max_running_requests"] // ADMISSION_GROUP_DIVISOR
    held_in_a_row = num_held = 0
    for seen in trace:
        could_admit = seen["waiting"] and seen["room"] > 0
        if could_admit and not seen["admitted"]:  # it waited
            assert seen["held"] and seen["decoding"], seen  # never while nothing decodes
            assert seen["room"] < min(group, seen["waiting"]), seen
            held_in_a_row += 1
            num_held += 1
            assert held_in_a_row <= wait
            continue
        assert not seen["held"], seen
        if could_admit:  # all that fit, once the room takes a group or it waited its steps
            assert seen["admitted"] == min(seen["room"], seen["waiting"]), seen
            took_a_group = seen["room"] >= min(group, seen["waiting"])
            assert not seen["decoding"] or took_a_group or held_in_a_row == wait, seen
        if seen["admitted"] or not seen["waiting"]:
            held_in_a_row = 0
    assert waits == num_held > 0

    # Fewer steps admit: each admits a group instead of a request or two.
    def admitting(steps: list[dict]) -> int:
        return sum(1 for s in steps if s["admitted"])

    assert admitting(trace) * 2 <= admitting(at_once_trace)
    assert sum(s["admitted"] for s in trace) == len(PROMPTS)
    if "runs" not in loop:  # (a held run is up to 4 steps: the room fills before 8 runs)
        assert any(held == wait for held in _held_runs(trace))  # (the bound was reached)


def _held_runs(trace: list[dict]) -> list[int]:
    """The lengths of the runs of steps at which admission waited."""
    runs, n = [], 0
    for seen in trace:
        if seen["held"]:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_nothing_waits_while_nothing_decodes(tiny_path, hf_tiny):
    """Admission never waits while nothing decodes, even where a group would not fit:
    the wait is only ever for a step the running requests take anyway. A lone request,
    and a batch after the one before it has finished, are admitted at once."""
    model, _ = hf_tiny
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, admission_wait_steps=8, **POOL) as engine:
        first = engine.generate(input_ids=PROMPTS[:1], sampling_params=params)
        second = engine.generate(input_ids=PROMPTS[1:9], sampling_params=params)
        assert engine.stats()["admission_waits"] == 0
    got = [out["output_ids"] for out in first + second]
    assert got == hf_greedy_ids(model, PROMPTS[:9], 6)

    # A pool of 120 tokens: a group's estimate (8 requests of 8 + 0.7 x 40) does not fit,
    # three requests at a time do. Admission waits only once requests decode.
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    prompts = [PROMPTS[i] for i in range(4, 128, 5)][:8]
    small = {"max_total_tokens": 120, "max_running_requests": 64}
    with Engine(tiny_path, admission_wait_steps=8, **small) as engine:
        got, trace = _traced_run(engine, prompts, params)
    assert trace[0]["admitted"] and not trace[0]["held"]
    assert all(seen["decoding"] for seen in trace if seen["held"])
    assert any(seen["held"] for seen in trace)  # (once some decode, a group may wait)
    assert got == hf_greedy_ids(model, prompts, 40)


def test_the_default_waits_where_decode_steps_replay_graphs(tiny_path, monkeypatch):
    from lmprog_runtime.cuda_graph import DecodeGraphRunner
    from lmprog_runtime.model_runner import ModelRunner

    init = ModelRunner.__init__

    def with_graphs(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.graphs = DecodeGraphRunner(self, capture=False)  # (as on CUDA, not captured)

    monkeypatch.setattr(ModelRunner, "__init__", with_graphs)
    with Engine(tiny_path, **POOL) as engine:
        assert engine.scheduler.admission_wait.max_steps == GRAPHED_ADMISSION_WAIT_STEPS
    with Engine(tiny_path, admission_wait_steps=0, **POOL) as engine:
        assert engine.scheduler.admission_wait.max_steps == 0
    with Engine(tiny_path, decode_steps=8, **POOL) as engine:  # (a run waits already)
        assert engine.scheduler.admission_wait.max_steps == 0
    # "auto": single steps between runs where the loop overlaps; runs only where not
    auto = {"decode_steps": "auto", **POOL}
    with Engine(tiny_path, overlap_schedule=True, **auto) as engine:
        assert engine.scheduler.admission_wait.max_steps == GRAPHED_ADMISSION_WAIT_STEPS
    with Engine(tiny_path, overlap_schedule=False, **auto) as engine:
        assert engine.scheduler.admission_wait.max_steps == 0


def test_a_request_that_resumes_is_not_held_back(tiny_path, hf_tiny):
    """A retracted request (its computed tokens given to the cache, requeued first) goes
    back in at once, as before: it is no new arrival to gather with others."""
    prompts = [PROMPTS[i] for i in range(0, 60, 5)]  # 12 prompts of 4 tokens
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    # (admitting what fits now, with nothing set aside for the outputs: decoding runs the
    # pool dry and retracts)
    tight = {"max_total_tokens": 160, "max_running_requests": 64}
    with Engine(
        tiny_path, admission_wait_steps=8, schedule_conservativeness=0.0, **tight
    ) as engine:
        sched = engine.scheduler
        steps: list[tuple[bool, int]] = []  # (a request resumes, the step waited)
        next_batch = sched.next_batch

        def traced():
            resuming = any(r.output_ids for r in sched.waiting)
            held = engine.stats()["admission_waits"]
            batch = next_batch()
            steps.append((resuming, engine.stats()["admission_waits"] - held))
            return batch

        sched.next_batch = traced
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        del sched.next_batch
        assert engine.stats()["retracted_requests"] > 0
        assert any(resuming for resuming, _ in steps)
        assert not any(held for resuming, held in steps if resuming)
    model, _ = hf_tiny
    assert [out["output_ids"] for out in outs] == hf_greedy_ids(model, prompts, 40)


def test_prompts_too_long_for_one_step_are_not_held_back(tiny_path):
    """Where a group's prompts exceed one step's `max_prefill_tokens`, they would not be
    admitted in one step anyway: admission does not wait."""
    prompts = [[5 + (i * 11 + j) % 1000 for j in range(40)] for i in range(48)]
    params = [
        {"max_new_tokens": 4 + (i * 7) % 37, "temperature": 0, "ignore_eos": True}
        for i in range(48)
    ]
    config = {"max_running_requests": 16, "max_prefill_tokens": 64, "max_total_tokens": 8192}
    with Engine(tiny_path, admission_wait_steps=8, **config) as engine:
        waited = engine.generate(input_ids=prompts, sampling_params=params)
        assert engine.stats()["admission_waits"] == 0  # (a group of 2: 80 tokens > 64)
    with Engine(tiny_path, **config) as engine:
        at_once = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in waited] == [o["output_ids"] for o in at_once]


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (True, TypeError), ("8", TypeError), (2.0, TypeError)]
)
def test_admission_wait_steps_is_checked(value, error):
    with pytest.raises(error, match="admission_wait_steps"):
        RuntimeConfig(admission_wait_steps=value)
    for fine in (None, 0, 3):
        assert RuntimeConfig(admission_wait_steps=fine).admission_wait_steps == fine
