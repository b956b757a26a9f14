"""`decode_steps="auto"` (`run_choice.py`, issue 18): decode runs while the device waits
for the host, single steps while the host waits for the device.

The overlapped loop probes with single decode steps and measures its waits for the
device. On a CPU, with the forward worker on the loop thread (as on CUDA), a step's tokens
are drawn as it is launched, so the loop never waits for them: the device idle, runs.
The device is made busy by a wait where CUDA's is (the loop reading a step's tokens,
`ForwardWorker.sampled`), or, with the worker a thread, by a slow forward (the loop waits
for it before it commits the step): single steps. Either way the outputs must be the
synchronous single steps', which transformers' greedy decoding checks in turn.
"""

from __future__ import annotations

import time

import pytest
from helpers import hf_greedy_ids
from overlap_engines import POOL, on_loop_thread, result_key, short_probes, slow_forward

from lmprog_runtime import Engine
from lmprog_runtime.config import AUTO_DECODE_STEPS, RuntimeConfig
from lmprog_runtime.forward_batch import ForwardMode

PROMPTS = [[5 + (i * 7 + j) % 500 for j in range(4 + i % 5)] for i in range(12)]
# (lengths that end at every point of a run)
PARAMS = [{"max_new_tokens": 9 + 5 * i, "temperature": 0, "ignore_eos": True} for i in range(12)]


def _outputs(engine: Engine) -> list[tuple]:
    return [result_key(o) for o in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]


def _record_turns(engine: Engine) -> list[str]:
    """What the overlapped loop does, in order: "run" for each decode run committed,
    "decode" for a single decode step launched, "extend" for a prompt step."""
    turns: list[str] = []
    commit_run, launch = engine._commit_run, engine._launch

    def committed(run):
        turns.append("run")
        return commit_run(run)

    def launched(batch):
        turns.append("decode" if batch.mode is ForwardMode.DECODE else "extend")
        return launch(batch)

    engine._commit_run, engine._launch = committed, launched
    return turns


@pytest.fixture(scope="module")
def single_steps(tiny_path, hf_tiny):
    """The synchronous single steps' outputs, their first tokens checked against
    transformers' greedy decoding."""
    with Engine(tiny_path, **POOL) as engine:
        want = _outputs(engine)
    hf = hf_greedy_ids(hf_tiny[0], PROMPTS[:3], 8)
    assert [list(w[0][:8]) for w in want[:3]] == hf
    return want


def test_auto_is_a_setting_of_its_own():
    assert RuntimeConfig(decode_steps="auto").run_steps == AUTO_DECODE_STEPS
    assert RuntimeConfig(decode_steps=3).run_steps == 3 and RuntimeConfig().run_steps == 1
    for bad in ("fast", "8", 2.0, None):
        with pytest.raises(TypeError, match="decode_steps must be an int or 'auto'"):
            RuntimeConfig(decode_steps=bad)


def test_the_synchronous_loop_always_runs_runs(tiny_path, single_steps):
    """Without overlap every step's host work leaves the device idle: runs throughout."""
    with Engine(tiny_path, decode_steps="auto", **POOL) as engine:
        assert engine._run_choice is None
        assert _outputs(engine) == single_steps
        assert engine.stats()["decode_runs"] > 0


def test_a_device_done_before_the_loop_asks_gets_runs_between_probes(tiny_path, single_steps):
    """The worker on the loop thread: each step's tokens are ready when the loop collects
    them, so every probe finds the device idle; runs follow, `turns_between_probes` at a
    time, each stretch after a probe of single decode steps."""
    with Engine(tiny_path, overlap_schedule=True, decode_steps="auto", **POOL) as engine:
        on_loop_thread(engine)
        engine._launches_ahead = True  # (as on a GPU)
        choice = short_probes(engine)
        turns = _record_turns(engine)
        assert _outputs(engine) == single_steps
    assert choice.num_probes >= 2 and choice.num_host_bound == choice.num_probes
    decoding = [t for t in turns if t != "extend"]
    # The first probe's 3 steps, the step launched while the last of them was checked,
    # then runs.
    assert decoding[:5] == ["decode"] * 4 + ["run"]
    # Once runs started, single steps come only as probes, after 2 runs (or fewer where
    # the requests ran out).
    stretch = []
    for turn in decoding[4:]:
        if turn == "run":
            stretch.append(turn)
            assert len(stretch) <= 2
        else:
            stretch = []


def _waiting_device(engine: Engine, seconds: float, when=lambda: True) -> None:
    """The loop waits `seconds` for each single step's tokens (while `when()`), as on
    CUDA, where it waits for the event of their copy while the device still computes."""
    sampled = engine._worker.sampled

    def waiting(future, ask):
        if when():
            time.sleep(seconds)
        return sampled(future, ask)

    engine._worker.sampled = waiting


def test_a_busy_device_keeps_single_steps(tiny_path, single_steps):
    """The worker on the loop thread, as on CUDA, and the device busy when the loop asks
    for each step's tokens: the loop waits for most of each step, so no probe chooses
    runs."""
    with Engine(tiny_path, overlap_schedule=True, decode_steps="auto", **POOL) as engine:
        on_loop_thread(engine)
        engine._launches_ahead = True
        _waiting_device(engine, 0.02)
        choice = short_probes(engine)
        assert _outputs(engine) == single_steps
        assert engine.stats()["decode_runs"] == 0
    assert choice.num_probes >= 3 and choice.num_host_bound == 0


def test_a_worker_thread_waited_for_keeps_single_steps(tiny_path, single_steps):
    """The worker a thread (as on a CPU) and its forward slow: the loop waits for the
    forward before it commits it, and that counts as the device's time."""
    with Engine(tiny_path, overlap_schedule=True, decode_steps="auto", **POOL) as engine:
        slow_forward(engine, 0.02)
        engine._launches_ahead = True
        choice = short_probes(engine)
        assert _outputs(engine) == single_steps
        assert engine.stats()["decode_runs"] == 0
    assert choice.num_probes >= 3 and choice.num_host_bound == 0


def test_a_device_that_turns_busy_goes_back_to_single_steps(tiny_path, single_steps):
    """The device idle for the first probe, busy from the first run on: after the runs
    between probes, the next probe keeps single steps, and so does every later one."""
    with Engine(tiny_path, overlap_schedule=True, decode_steps="auto", **POOL) as engine:
        on_loop_thread(engine)
        engine._launches_ahead = True
        choice = short_probes(engine)
        _waiting_device(engine, 0.02, when=lambda: choice.num_host_bound > 0)
        turns = _record_turns(engine)
        assert _outputs(engine) == single_steps
        assert engine.stats()["decode_runs"] == 2
    assert choice.num_host_bound == 1 and choice.num_probes >= 3
    decoding = [t for t in turns if t != "extend"]
    assert decoding[:6] == ["decode"] * 4 + ["run"] * 2  # (as in the test above)
    assert set(decoding[6:]) == {"decode"}


def test_the_choice_starts_afresh_on_new_work(tiny_path, single_steps):
    """Runs chosen for one generate do not carry over to the next: once the loop has
    nothing to do, it probes again."""
    with Engine(tiny_path, overlap_schedule=True, decode_steps="auto", **POOL) as engine:
        on_loop_thread(engine)
        engine._launches_ahead = True
        choice = short_probes(engine, turns_between_probes=1000)
        assert _outputs(engine) == single_steps
        assert not choice.is_probing  # (runs, with turns to spare)
        engine.generate(input_ids=PROMPTS[:1], sampling_params=PARAMS[0])  # (a new work)
        turns = _record_turns(engine)
        assert _outputs(engine) == single_steps
    decoding = [t for t in turns if t != "extend"]
    assert decoding[:5] == ["decode"] * 4 + ["run"]  # (as in the first generate)


@pytest.mark.parametrize("busy", [False, True], ids=["runs", "single-steps"])
def test_admissions_wait_only_between_single_steps(tiny_path, busy):
    """With admissions waiting up to 8 steps (CUDA's default with "auto"): while the choice
    takes runs, admission does not wait (a run's end makes it wait already); while it
    keeps single steps, it does. 48 requests of lengths spread so widely that fewer than a
    group (32 running: 4) finish in most runs of 8 steps."""
    prompts = [[5 + (i * 11 + j) % 500 for j in range(4 + i % 3)] for i in range(48)]
    params = [
        {"max_new_tokens": 8 + (i * 37) % 150, "temperature": 0, "ignore_eos": True}
        for i in range(48)
    ]
    pool = {"max_total_tokens": 16384, "max_running_requests": 32}
    config = {"overlap_schedule": True, "decode_steps": "auto", "admission_wait_steps": 8}
    with (
        Engine(tiny_path, **pool) as single,
        Engine(tiny_path, **config, **pool) as engine,
    ):
        want = single.generate(input_ids=prompts, sampling_params=params)
        on_loop_thread(engine)
        engine._launches_ahead = True
        if busy:
            _waiting_device(engine, 0.01)
        choice = short_probes(engine, turns_between_probes=1000)
        got = engine.generate(input_ids=prompts, sampling_params=params)
        assert list(map(result_key, got)) == list(map(result_key, want))
        stats = engine.stats()
    if busy:
        assert choice.num_host_bound == 0 and stats["decode_runs"] == 0
        assert stats["admission_waits"] > 0
    else:
        assert choice.num_host_bound >= 1 and stats["decode_runs"] > 0
        assert stats["admission_waits"] == 0
