"""Chaos: random mixes of valid and invalid requests, aborts, stream closes, timeouts and
injected faults, on a KV pool far smaller than the demand (issue 14).

After each run: every request got its result or a clear error, every request that was not
disturbed produced exactly its clean greedy output, all KV and request slots are free (the
autouse check in conftest) and the loop thread is alive. Run with requests admitted at once
(the CPU's default), with admissions waiting up to 8 steps to be made together (CUDA's),
and overlapped with `decode_steps="auto"` (the forward worker on the loop thread, as on
CUDA, so that its probes of single steps choose decode runs in between).
"""

from __future__ import annotations

import random
import threading

import pytest
from overlap_engines import on_loop_thread, short_probes

from lmprog_runtime import Engine
from lmprog_runtime.engine import RequestAborted

NUM_REQUESTS = 60
BAD_PARAMS = [
    {"temperature": float("nan")},
    {"max_new_tokens": -1},
    {"top_p": 0.0},
    {"stop": [""]},
    {"timeout_s": 0},
    {"regex": "("},
    {"max_tokens": 4},
]


def _prompt(i: int) -> str:
    return f"Request {i}: " + "word " * (i % 7)


def _params(rng: random.Random) -> dict:
    return {"max_new_tokens": rng.randint(4, 40), "temperature": 0, "ignore_eos": True}


LOOPS = {
    "admitted-at-once": {"admission_wait_steps": 0},
    "admissions-wait": {"admission_wait_steps": 8},
    "auto-runs": {"overlap_schedule": True, "decode_steps": "auto"},
}


@pytest.fixture(scope="module", params=list(LOOPS))
def chaos_engine(tiny_path, request):
    # Demand is about 60 x 50 tokens; the pool holds a tenth of it.
    config = {"max_total_tokens": 320, "max_running_requests": 16}
    with Engine(tiny_path, **LOOPS[request.param], **config) as engine:
        if engine._run_choice is not None:
            on_loop_thread(engine)
            engine._launches_ahead = True  # (as on a GPU)
            short_probes(engine)
        yield engine


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chaos(chaos_engine, tiny_path, seed):
    engine = chaos_engine
    rng = random.Random(seed)
    plans = []  # (prompt, params, fate)
    for i in range(NUM_REQUESTS):
        fate = rng.choices(
            [
                "ok",
                "bad",
                "abort",
                "close",
                "timeout",
                "fault_sample",
                "fault_schedule",
                "fault_forward",
            ],
            weights=[10, 2, 2, 2, 1, 1, 1, 1],
        )[0]
        params = _params(rng)
        if fate == "timeout":
            params["timeout_s"] = rng.choice([1e-4, 1e-3, 0.05])
        plans.append((_prompt(i), params, fate))

    faulty = {p for p, _, fate in plans if fate.startswith("fault")}
    points = {p: fate.removeprefix("fault_") for p, _, fate in plans if p in faulty}
    encoded = {tuple(engine.encode(p)): p for p in faulty}

    def hook(point: str, req) -> None:
        prompt = encoded.get(tuple(req.input_ids))
        if prompt is not None and points[prompt] == point:
            raise RuntimeError(f"injected fault at {point}")

    engine.fault_hook = hook
    engine.reset_stats()
    futures: dict[int, object] = {}
    streams = []
    try:
        for i, (prompt, params, fate) in enumerate(plans):
            if fate == "bad":
                with pytest.raises((ValueError, TypeError)):
                    engine.submit(prompt, {**params, **rng.choice(BAD_PARAMS)})
            elif fate == "close":
                stream = engine.generate(prompt, params, stream=True)
                streams.append((i, stream, rng.randint(0, 3)))
            else:
                futures[i] = engine.submit(prompt, params)[0]
                if fate == "abort":
                    delay = rng.choice([0.0, 0.001, 0.01])
                    threading.Timer(delay, engine.abort, (futures[i].request_id,)).start()
        for _, stream, keep in streams:  # read a few chunks, then walk away
            for _ in range(keep):
                if next(stream, None) is None:
                    break
            stream.close()
        results = {i: (f.exception(timeout=120), f) for i, f in futures.items()}
    finally:
        engine.fault_hook = None

    clean = Engine(tiny_path, max_total_tokens=4096)
    try:
        for i, (error, future) in results.items():
            prompt, params, fate = plans[i]
            if error is None:
                assert fate in ("ok", "abort", "timeout"), (i, fate)  # aborts may come late
                expected = clean.generate(prompt, params)["output_ids"]
                assert future.result()["output_ids"] == expected, (i, fate)
            elif fate == "abort":
                assert isinstance(error, RequestAborted), error
            elif fate == "timeout":
                assert isinstance(error, TimeoutError), error
            else:
                assert fate.startswith("fault"), (i, fate, error)
                assert "injected fault" in str(error)
        assert all(results[i][0] is None for i, (_, _, f) in enumerate(plans) if f == "ok")
    finally:
        clean.shutdown()
    stats = engine.stats()
    assert stats["retracted_requests"] + stats["evicted_tokens"] > 0  # the pool was short
    if engine.scheduler.admission_wait.max_steps:
        assert stats["admission_waits"] > 0  # (admissions did wait)
    if engine._run_choice is not None:  # (probes chose runs, and runs ran)
        assert engine._run_choice.num_host_bound > 0 and stats["decode_runs"] > 0
    assert engine._thread.is_alive()
    assert len(engine.generate("after the chaos", {"max_new_tokens": 4})["output_ids"]) == 4
