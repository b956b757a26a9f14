"""Decode runs (`decode_steps` > 1, issue 18: the host's share of a decode step): several
decode steps from one scheduling, their tokens fed forward on the device and checked
together. The reference is the same engine with `decode_steps=1`: outputs, texts, finish
reasons and streamed chunks must be identical, whatever stops a request inside a run.
Every test ends with the engines clean (the autouse check in conftest): the pages a run's
later steps started for a request that finished earlier are freed.
"""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
from helpers import PROMPTS, forbid_host_syncs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from overlap_engines import (
    SCHEMA,
    assert_each_draw_counts_its_tokens,
    assert_same_logprobs,
    assert_slots_free,
    assert_stream_aborts_match,
    check_plan,
    count_launches_before_check,
    count_runs,
    count_runs_ahead,
    on_loop_thread,
    plans,
    record_penalty_counts,
    result_key,
    stop_inside,
)

from lmprog_runtime import Engine
from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.engine import RequestAborted

POOL = {"max_total_tokens": 4096, "max_running_requests": 16}
# A KV pool far smaller than the demand put on it, with short prefill chunks.
PRESSED = {"max_total_tokens": 160, "max_running_requests": 8, "chunked_prefill_size": 8}
STEPS = 4


@pytest.fixture(scope="module", params=[1, 4], ids=["page1", "page4"])
def engines(tiny_path, request):
    """(one step at a time, runs of `STEPS`) engines on pages of 1 and 4 slots."""
    with (
        Engine(tiny_path, page_size=request.param, **POOL) as single,
        Engine(tiny_path, page_size=request.param, decode_steps=STEPS, **POOL) as runs,
    ):
        runs._launches_ahead = True  # as on a GPU (on a CPU a run computes as it launches)
        yield single, runs


def test_decode_steps_is_validated_and_leaves_overlap_as_it_is():
    for bad in (0, -3):
        with pytest.raises(ValueError, match="decode_steps"):
            RuntimeConfig(decode_steps=bad)
    for bad in (2.0, True, "4"):
        with pytest.raises(TypeError, match="decode_steps"):
            RuntimeConfig(decode_steps=bad)
    assert RuntimeConfig(device="cuda", decode_steps=4).is_overlapped
    assert RuntimeConfig(decode_steps=4, overlap_schedule=True).is_overlapped
    assert not RuntimeConfig(decode_steps=4).is_overlapped  # (a CPU)
    assert not RuntimeConfig(device="cuda", decode_steps=4, overlap_schedule=False).is_overlapped


def test_outputs_are_token_identical_to_single_steps(engines):
    """Requests stopping at every point of a run (lengths, EOS, stop strings and regexes),
    greedy and seeded with filters, in one batch; the runs really ran."""
    single, runs = engines
    unstopped = {"max_new_tokens": 23, "temperature": 0, "ignore_eos": True}
    mix = [
        {"max_new_tokens": 1, "temperature": 0},
        {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 0},
        {"max_new_tokens": 17, "temperature": 0.8, "seed": 7},
        {**unstopped, "stop": [stop_inside(single, PROMPTS[4], unstopped)]},
        {**unstopped, "stop_regex": [re.escape(stop_inside(single, PROMPTS[5], unstopped))]},
        {"max_new_tokens": 30, "temperature": 1.0, "top_p": 0.9, "seed": 3},
        {"max_new_tokens": 19, "temperature": 0.9, "top_k": 5, "min_p": 0.05, "seed": 11},
        {"max_new_tokens": 40, "temperature": 0},
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(mix))]
    want = single.generate(prompts, mix)
    taken, launched = count_runs(runs), count_runs_ahead(runs)
    try:
        got = runs.generate(prompts, mix)
    finally:
        del runs._step_run, runs._launch_run
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    assert {o["meta_info"]["finish_reason"]["type"] for o in want} == {"length", "stop"}
    assert taken and max(taken) == STEPS and launched


def test_keyed_draws_count_the_tokens_drawn_ahead(engines, monkeypatch):
    """The accelerators' sampler (keyed races, run here on the CPU): step k of a run is
    keyed by the tokens its request will have by then, so a seed draws what it draws one
    step at a time, and not multinomial's tokens."""
    from lmprog_runtime import sampling

    single, runs = engines
    mix = [
        {"max_new_tokens": 20, "temperature": 0.9, "seed": 7, "ignore_eos": True},
        {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 3, "ignore_eos": True},
        {"max_new_tokens": 12, "temperature": 0},
    ]
    prompts = PROMPTS[: len(mix)]
    multinomial = single.generate(prompts, mix)
    monkeypatch.setattr(sampling, "on_accelerator", lambda device: True)
    want = single.generate(prompts, mix)
    got = runs.generate(prompts, mix)
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    assert want[0]["output_ids"] != multinomial[0]["output_ids"]


def test_requests_that_cannot_run_ahead_keep_single_steps(engines):
    """A grammar keeps its batch to single steps (its mask follows each token). The
    outputs are identical either way."""
    single, runs = engines
    base = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}
    blockers = [
        {"max_new_tokens": 80, "json_schema": json.dumps(SCHEMA), "ignore_eos": False},
        {"temperature": 0.7, "seed": 2, "regex": "[a-z]{3,9}( ok)?", "ignore_eos": False},
    ]
    for params in blockers:
        # (the other request ends first: alone, it would run)
        mix = [{**base, "max_new_tokens": 3}, {**base, **params}]
        want = single.generate(PROMPTS[:2], mix)
        taken = count_runs(runs)
        try:
            got = runs.generate(PROMPTS[:2], mix)
        finally:
            del runs._step_run
        assert [result_key(o) for o in got] == [result_key(o) for o in want], params
        assert taken == [], params


@pytest.mark.parametrize("seed", [None, 6], ids=["greedy", "seeded"])
def test_penalties_run_ahead_counting_the_tokens_drawn_on_the_device(engines, seed, monkeypatch):
    """Penalties do not keep a batch to single steps: each step ahead counts what the host
    holds and, on the device, the tokens drawn since (the run's, and in a run launched
    ahead the run before's, not yet committed). Frequency, presence and negative
    penalties strong enough to change the tokens, one stopping inside a run: outputs
    equal single steps', in runs launched ahead too, and each draw counts exactly its
    request's tokens so far."""
    single, runs = engines
    free = {"max_new_tokens": 26, "ignore_eos": True}
    free |= {"temperature": 0} if seed is None else {"temperature": 0.9, "seed": seed}
    mix = [
        {**free, "frequency_penalty": -1.5},  # (repeats: the counts matter at once)
        {**free, "presence_penalty": -1.2, "max_new_tokens": 19},
        {**free, "frequency_penalty": 1.0, "presence_penalty": 0.8},
        {**free, "frequency_penalty": 0.9, "stop": [stop_inside(single, PROMPTS[3], free)]},
        free,
    ]
    prompts = PROMPTS[: len(mix)]
    want = single.generate(prompts, mix)
    unpenalised = single.generate(prompts, [free] * len(mix))
    taken, launched = count_runs(runs), count_runs_ahead(runs)
    counted = record_penalty_counts(monkeypatch)
    try:
        got = runs.generate(prompts, mix)
    finally:
        del runs._step_run, runs._launch_run
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    assert_each_draw_counts_its_tokens(
        counted, {o["meta_info"]["id"]: o["output_ids"] for o in got}
    )
    changed = [want[i]["output_ids"] != unpenalised[i]["output_ids"] for i in range(4)]
    assert sum(changed) >= 2
    assert taken and max(taken) == STEPS and launched


def test_logprobs_run_ahead_and_equal_single_steps(engines):
    """Logprobs do not keep a batch to single steps: each step's are gathered with its
    draw, on the device, and read back with its tokens. Requests asking for the drawn
    token's logprob alone or with 1 or 6 alternatives, greedy and seeded, one stopping
    inside a run, beside one asking for none: outputs, prompt and output logprobs and top
    lists equal single steps', in runs launched ahead too."""
    single, runs = engines
    greedy = {"max_new_tokens": 21, "temperature": 0, "ignore_eos": True}
    mix = [
        greedy,
        {"max_new_tokens": 17, "temperature": 0.9, "seed": 5, "ignore_eos": True},
        {**greedy, "stop": [stop_inside(single, PROMPTS[2], greedy)]},
        {**greedy, "max_new_tokens": 9},
    ]
    kwargs = {
        "return_logprob": [True, True, True, False],
        "top_logprobs_num": [0, 1, 6, 0],
        "logprob_start_len": 0,
    }
    prompts = PROMPTS[: len(mix)]
    want = single.generate(prompts, mix, **kwargs)
    taken, launched = count_runs(runs), count_runs_ahead(runs)
    try:
        got = runs.generate(prompts, mix, **kwargs)
    finally:
        del runs._step_run, runs._launch_run
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    assert want[2]["meta_info"]["finish_reason"]["type"] == "stop"
    for mine, theirs in zip(got, want):
        assert_same_logprobs(mine, theirs)
    assert len(got[2]["meta_info"]["output_top_logprobs"][0]) == 6
    assert taken and max(taken) == STEPS and launched


@pytest.mark.parametrize("seed", [None, 4], ids=["greedy", "seeded"])
def test_min_new_tokens_bans_stop_tokens_in_the_steps_ahead_that_need_it(engines, seed):
    """A pending min_new_tokens does not stop a run: its steps that leave it unreached ban
    EOS and the stop tokens, the later ones do not. The stop token here is the token the
    request draws unbanned inside its first run, and again after min_new_tokens."""
    single, runs = engines
    free = {"max_new_tokens": 16, "temperature": 0 if seed is None else 0.9, "seed": seed}
    drawn = single.generate(PROMPTS[3], {**free, "ignore_eos": True})["output_ids"]
    stop = drawn[2]  # the third token: a step ahead of the first run (runs start at the 2nd)
    params = {**free, "min_new_tokens": 7, "stop_token_ids": [stop]}
    want = single.generate(PROMPTS[3], params)
    taken = count_runs(runs)
    try:
        got = runs.generate(PROMPTS[3], params)
    finally:
        del runs._step_run
    assert result_key(got) == result_key(want)
    assert stop not in want["output_ids"][:6] and taken


def test_a_stop_token_stops_a_step_ahead_once_min_new_tokens_is_reached(engines):
    """The ban lifts in the step ahead where min_new_tokens is reached: a stop token first
    drawn past it, at a step ahead, stops the request there, as one step at a time."""
    single, runs = engines
    free = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    drawn = single.generate(PROMPTS[3], free)["output_ids"]
    # Runs of 4 from the 2nd token: the 6th, 10th, ... are first steps, not steps ahead.
    at = next(j for j in (7, 8, 10, 11) if drawn[j] not in drawn[:j])
    params = {**free, "min_new_tokens": 7, "stop_token_ids": [drawn[at]]}
    want = single.generate(PROMPTS[3], params)
    got = runs.generate(PROMPTS[3], params)
    assert result_key(got) == result_key(want)
    assert len(want["output_ids"]) == at + 1  # stopped by it


def test_streamed_chunks_are_identical_in_order_and_content(engines):
    single, runs = engines
    unstopped = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    mix = [
        {**unstopped, "stop": [stop_inside(single, PROMPTS[2], unstopped)]},
        {"max_new_tokens": 12, "temperature": 0.9, "seed": 5},
        unstopped,
    ]
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[7]]

    def chunks(engine: Engine) -> list:
        seen: list[list] = [[] for _ in mix]

        def on_chunk(i: int, chunk: dict) -> None:
            meta = {k: v for k, v in chunk["meta_info"].items() if k != "id"}
            seen[i].append((chunk["text"], chunk["output_ids"], meta))

        # (each engine from an empty cache: `cached_tokens` is in every chunk's meta_info,
        # and `stop_inside` ran a prompt on `single` only)
        assert engine.flush_cache()
        futures = engine.submit(prompts, mix, on_chunk=on_chunk)
        for future in futures:
            future.result(timeout=60)
        return seen

    assert chunks(runs) == chunks(single)


@pytest.mark.parametrize("failing", [2, 5], ids=["first_run", "run_ahead"])
def test_a_run_that_fails_runs_its_first_step_again(engines, failing, monkeypatch):
    """A forward fails in the middle of a run: the run is dropped (its further slots
    freed, the seeded generators rewound, the penalty counts its steps counted counted
    again at the next draw) and, for the first run, its first step runs alone; a run
    launched ahead of the one before's commit is dropped and the loop schedules after
    that commit (the next run then counts its penalised requests again first). The
    outputs are those of single steps, and each draw of a run counts exactly its
    request's tokens so far."""
    single, runs = engines
    free = {"max_new_tokens": 15, "ignore_eos": True}
    mix = [
        {**free, "temperature": 0.9, "seed": 21},
        {**free, "temperature": 0},
        {**free, "temperature": 0, "frequency_penalty": -1.5},  # (repeats: counts matter)
        {**free, "temperature": 0.9, "seed": 3, "presence_penalty": -1.0},
    ]
    prompts = PROMPTS[: len(mix)]
    want = single.generate(prompts, mix)
    run, prepare_run = runs.runner.run, runs.runner.prepare_run
    ahead: set[int] = set()  # id() of the runs' steps ahead
    num_ahead = [0]

    def marking_prepare_run(batch, slots):
        steps = prepare_run(batch, slots)
        ahead.update(id(fb) for fb in steps[1:])
        return steps

    def failing_run(fb):
        if id(fb) in ahead:
            num_ahead[0] += 1
            if num_ahead[0] == failing:  # (runs of 4: three steps ahead each)
                raise RuntimeError("injected in a run")
        return run(fb)

    runs.runner.run, runs.runner.prepare_run = failing_run, marking_prepare_run
    counted = record_penalty_counts(monkeypatch)
    try:
        got = runs.generate(prompts, mix)
    finally:
        del runs.runner.run, runs.runner.prepare_run
    assert num_ahead[0] > failing
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    outputs = {o["meta_info"]["id"]: o["output_ids"] for o in got}
    assert_each_draw_counts_its_tokens(counted, outputs)


def test_runs_are_launched_ahead_of_the_commit_before(engines):
    """While nothing waits, each run after the first is launched before the one before
    it is committed, from its last tokens on the device; requests that stop inside a run
    leave the one launched after it."""
    single, runs = engines
    mix = [
        {"max_new_tokens": n, "temperature": t, "seed": 5, "ignore_eos": True}
        for n, t in ((30, 0), (9, 0.9), (22, 0.7), (17, 0))
    ]
    want = single.generate(PROMPTS[:4], mix)
    launched = count_runs_ahead(runs)
    try:
        got = runs.generate(PROMPTS[:4], mix)
    finally:
        del runs._launch_run
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    assert len(launched) >= 5 and set(launched) == {STEPS}


def test_a_request_submitted_meanwhile_stops_runs_ahead(engines):
    """A request submitted while runs continue one another is admitted after the run
    being committed (and the one launched ahead of it), not when the others finish."""
    _, runs = engines
    long = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    events: list[tuple[str, int]] = []
    late: list = []

    def on_chunk(i: int, chunk: dict) -> None:
        tokens = chunk["meta_info"]["completion_tokens"]
        events.append(("long", tokens))
        if i == 0 and tokens == 5 and not late:
            late.extend(
                runs.submit(
                    [PROMPTS[5]],
                    [{"max_new_tokens": 2, "temperature": 0}],
                    on_chunk=lambda _, c: events.append(("late", 0)),
                )
            )

    futures = runs.submit(PROMPTS[:2], [long, long], on_chunk=on_chunk)
    for future in futures:
        future.result(timeout=60)
    late[0].result(timeout=60)
    first_late = events.index(("late", 0))
    longest_before = max(n for kind, n in events[:first_late] if kind == "long")
    assert longest_before <= 5 + 3 * STEPS  # not at the end (60)


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_a_run_on_the_gpu_path_never_waits_for_the_device(tiny_path, overlap):
    """A run's inputs and forwards with the CUDA set (Triton attention and fused ops, under
    the interpreter) read no device value on the host (`forbid_host_syncs`; tensors from
    Python data are allowed: their pinned copies wait for nothing), for a run and for one
    launched ahead, whose first inputs are the tokens drawn last, and (overlapped, the
    worker on the loop thread as on CUDA) for one launched before the check of the step
    before it, whose first inputs are placeholders: on a GPU every step of a run is
    queued at once. (The draws read nothing back either: `tests/unit/test_draw.py` draws
    on the `meta` device.)"""
    from lmprog_runtime.models.triton_ops import TritonOps

    config = {"attention_backend": "triton", "decode_steps": 3, "overlap_schedule": overlap}
    mix = [{"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}] * 2
    with Engine(tiny_path, **config, **POOL) as engine:
        if overlap:
            on_loop_thread(engine)
        runner = engine.runner
        runner.model.ops = TritonOps()  # as the runner sets them on CUDA
        engine._launches_ahead = True
        syncs: list[str] = []  # (the loop would recover by running the step alone)
        offsets = count_runs_ahead(engine)

        def guarded(fn):
            def call(*args):
                try:
                    with forbid_host_syncs(python_data=True):
                        return fn(*args)
                except AssertionError as error:
                    syncs.append(f"{fn.__name__}: {error}")
                    raise

            return call

        runner.run, runner.prepare_run = guarded(runner.run), guarded(runner.prepare_run)
        early = count_launches_before_check(engine)
        try:
            engine.generate(PROMPTS[:2], mix)
        finally:
            del runner.run, runner.prepare_run, engine._launch_run, engine._launch_before_check
    assert syncs == []
    assert offsets  # a run launched ahead
    assert any(early) == overlap  # (and one before the check of the step before it)


def test_on_a_cpu_runs_are_not_launched_ahead(tiny_path):
    """On a CPU a run computes as it is launched: launching the next one before the
    checks would only delay them (and waste the steps of requests that stop). The steps'
    seconds hold their forwards' (each run's launch is counted)."""
    mix = [{"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}] * 2
    with Engine(tiny_path, decode_steps=STEPS, max_total_tokens=1024) as engine:
        assert not engine._launches_ahead
        taken, launched = count_runs(engine), count_runs_ahead(engine)
        engine.generate(PROMPTS[:2], mix)
        stats = engine.stats()
    assert taken and launched == []
    assert stats["step_seconds"] >= stats["forward_seconds"] > 0


def test_shutdown_stops_runs_ahead(tiny_path, _engine_registry):
    """Shut down while runs continue one another: the loop stops launching ahead, so the
    requests fail with the shutdown, long before their last tokens."""
    engine = Engine(tiny_path, decode_steps=STEPS, max_total_tokens=2048)
    _engine_registry.reported.add(engine)  # not clean at its shutdown, by design
    engine._launches_ahead = True
    long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    stopper: list[threading.Thread] = []

    def on_chunk(i: int, chunk: dict) -> None:
        if i == 0 and chunk["meta_info"]["completion_tokens"] == 6 and not stopper:
            stopper.append(threading.Thread(target=engine.shutdown))
            stopper[0].start()

    futures = engine.submit(PROMPTS[:2], [long, long], on_chunk=on_chunk)
    results = [f.exception(timeout=120) or f.result() for f in futures]
    stopper[0].join(timeout=120)
    assert all("shut down" in str(r) for r in results), results
    assert_slots_free(engine)


def test_a_commit_that_fails_fails_its_batch_and_frees_every_slot(engines):
    """Reading a step's tokens raises in the middle of a run: the requests of the run fail
    (the loop fails a step that raised), the pages of the steps they did not keep are
    freed (the autouse check), and the engine serves the next requests."""
    single, runs = engines
    mix = [{"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}] * 3
    read_step = runs._read_step
    reads = [0]

    def failing_read(tokens):
        reads[0] += 1
        if reads[0] == 6:  # the second step of the second run
            raise RuntimeError("injected while committing a run")
        return read_step(tokens)

    runs._read_step = failing_read
    try:
        futures = runs.submit(PROMPTS[:3], mix)
        got = [f.exception(timeout=60) or f.result() for f in futures]
    finally:
        del runs._read_step
    assert all(isinstance(g, RuntimeError) and "injected" in str(g) for g in got)
    want = [result_key(o) for o in single.generate(PROMPTS[:3], mix)]
    assert [result_key(o) for o in runs.generate(PROMPTS[:3], mix)] == want


def test_a_caller_wakes_to_free_slots_and_the_single_steps_counters(engines):
    """When `generate` returns, the pages a run's later steps started for requests that
    finished inside it are free, and the counters equal single steps' (what a run computes
    for a request after it finished is not counted)."""
    single, runs = engines
    unstopped = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    mix = [{**unstopped, "max_new_tokens": n} for n in (1, 3, 7, 11)]
    mix.append({**unstopped, "stop": [stop_inside(single, PROMPTS[4], unstopped)]})
    outs, stats = [], []
    for engine in (single, runs):
        assert engine.flush_cache()
        engine.reset_stats()
        outs.append([result_key(o) for o in engine.generate(PROMPTS[:5], mix)])
        state, counters = assert_slots_free(engine), engine.stats()  # no waiting: at once
        assert state["num_running"] == 0
        stats.append({k: v for k, v in counters.items() if not k.endswith("_seconds")})
    assert outs[1] == outs[0]
    assert stats[0]["decode_runs"] == 0 and stats[1].pop("decode_runs") > 0
    assert stats[1] == {k: v for k, v in stats[0].items() if k != "decode_runs"}


def test_a_run_committed_whole_counts_and_finishes_as_single_steps(engines):
    """Runs whose requests are checked by their last token alone are committed at once
    (`_commit_whole`). Stop tokens end the requests inside the second run, before its
    last step, which then is not counted; EOS and max_new_tokens end others. Outputs,
    finish reasons, counters and free slots equal single steps'."""
    single, runs = engines
    free = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}
    mix = []
    for prompt in PROMPTS:  # (runs of 4 from the 2nd token: the 7th and 8th are inside)
        drawn = single.generate(prompt, free)["output_ids"]
        at = next((j for j in (6, 7) if drawn[j] not in drawn[:j]), None)
        if at is not None:
            mix.append((prompt, {**free, "stop_token_ids": [drawn[at]]}))
    assert len(mix) >= 2
    mix += [
        (PROMPTS[0], {**free, "max_new_tokens": 7}),
        (PROMPTS[1], {"max_new_tokens": 8, "temperature": 0}),
    ]
    prompts, params = [p for p, _ in mix], [q for _, q in mix]
    whole, commit_whole = [], runs._commit_whole

    def counted(run, read):
        done = commit_whole(run, read)
        whole.append(done)
        return done

    outs, stats = [], []
    runs._commit_whole = counted
    try:
        for engine in (single, runs):
            assert engine.flush_cache()
            engine.reset_stats()
            outs.append([result_key(o) for o in engine.generate(prompts, params)])
            assert_slots_free(engine)
            stats.append({k: v for k, v in engine.stats().items() if not k.endswith("seconds")})
    finally:
        del runs._commit_whole
    assert outs[1] == outs[0]
    assert {key[2]["type"] for key in outs[0]} == {"stop", "length"}
    assert len(whole) >= 2 and all(whole)
    assert stats[1].pop("decode_runs") > 0
    assert stats[1] == {k: v for k, v in stats[0].items() if k != "decode_runs"}


def test_only_a_run_whose_steps_come_together_is_committed_whole():
    """A run queued step by step on CUDA has an event a step: each step is checked as
    soon as it is on the host (a request that stops at its first step is told then), so
    it is committed step by step. A graph's run (one event) or a CPU's (none) may be
    committed at once; not one that asks for logprobs, failed a row, or has a request
    checked token by token or streamed."""
    from types import SimpleNamespace

    from lmprog_runtime.run_commit import RunCommit

    def run(events, rows=(), errors=None, **req):
        plain = {"done": threading.Event(), "checks_last_token_alone": True, "is_streamed": False}
        batch = SimpleNamespace(reqs=[SimpleNamespace(**{**plain, **req})])
        drawn = [(torch.zeros(1), event) for event in events]
        errors = errors or [{} for _ in events]
        return SimpleNamespace(
            drawn=drawn, ask=SimpleNamespace(rows=list(rows)), errors=errors, batch=batch
        )

    event, other = object(), object()
    whole = RunCommit._checks_whole
    assert whole(run([event, event, event])) and whole(run([None, None]))
    assert not whole(run([event, other, event]))
    assert not whole(run([None, None], rows=[0]))
    assert not whole(run([None, None], errors=[{}, {0: ValueError()}]))
    assert not whole(run([None], checks_last_token_alone=False))
    assert not whole(run([None], is_streamed=True))


@pytest.mark.parametrize("point", ["forward", "sample"])
def test_a_fault_in_one_request_fails_it_alone(engines, point):
    single, runs = engines
    mix = [{"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}] * 3
    want = single.generate(PROMPTS[:3], mix)
    bad = runs.encode(PROMPTS[1])

    def hook(at: str, req) -> None:
        if at == point and req.input_ids == bad and len(req.output_ids) >= 5:
            raise RuntimeError(f"injected at {point}")

    runs.fault_hook = hook
    try:
        futures = runs.submit(PROMPTS[:3], mix)
        got = [f.exception(timeout=60) or f.result() for f in futures]
    finally:
        runs.fault_hook = None
    assert isinstance(got[1], RuntimeError) and "injected" in str(got[1])
    assert [result_key(got[i]) for i in (0, 2)] == [result_key(want[i]) for i in (0, 2)]


def test_a_row_without_mass_fails_its_request_at_its_step(engines, monkeypatch):
    """A step ahead draws -1 for one request (its distribution has no mass: runs of 4 from
    its second token, so its eighth draw is the third step of a run): that request fails,
    naming it, and the others, drawn in the same steps, come out as without it."""
    import lmprog_runtime.sampling as sampling

    _, runs = engines
    params = [
        {"max_new_tokens": 12, "temperature": 0.8, "seed": i, "ignore_eos": True} for i in range(3)
    ]
    want = runs.generate(PROMPTS[1:3], params[1:])
    filtered_probs = sampling._filtered_probs
    draws = []  # the draws of the request seeded 0 (the only one): its 8th is a step ahead

    def massless(logits, rows):
        probs = filtered_probs(logits, rows)
        for i, row in enumerate(rows):
            if row.params.seed == 0:
                draws.append(row.rid)
                if len(draws) == 8:
                    probs[i] = 0.0
        return probs

    monkeypatch.setattr(sampling, "_filtered_probs", massless)
    taken = count_runs(runs)
    try:
        futures = runs.submit(PROMPTS[:3], params)
        results = [f.exception(timeout=60) or f.result() for f in futures]
    finally:
        del runs._step_run
    assert taken
    rid = futures[0].request_id
    assert f"request {rid}: its sampling distribution has no finite" in str(results[0])
    assert [result_key(r) for r in results[1:]] == [result_key(w) for w in want]


def test_an_abort_from_a_stream_ends_its_request_between_a_runs_steps(engines):
    """A request aborted from its stream's callback, at a step inside a run, gets no chunk
    after it (the abort is taken between the run's steps, as between single steps); the
    others produce what single steps produce."""
    single, runs = engines
    params = [{"max_new_tokens": 30, "temperature": 0, "ignore_eos": True} for _ in range(6)]
    taken = count_runs(runs)
    try:  # (the chunks: inside the first and second runs)
        assert_stream_aborts_match(single, runs, params, {1: 2, 3: 5, 4: 7})
    finally:
        del runs._step_run
    assert taken and max(taken) == STEPS


def test_a_request_submitted_and_aborted_during_a_run_ends_aborted(engines):
    """A request submitted and aborted at once while a run is committed (here from another
    request's stream, on the loop thread) ends aborted: its abort waits until the loop
    has taken the request in, and is not lost to the run's taking of aborts."""
    _, runs = engines
    late = []

    def on_chunk(i: int, chunk: dict) -> None:
        if chunk["meta_info"]["completion_tokens"] == 2 and not late:
            late.extend(runs.submit([PROMPTS[1]], {"max_new_tokens": 40, "temperature": 0}))
            runs.abort(late[0].request_id)

    taken = count_runs(runs)
    try:
        params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
        (first,) = runs.submit([PROMPTS[0]], params, on_chunk=on_chunk)
        assert len(first.result(timeout=60)["output_ids"]) == 30
        assert isinstance(late[0].exception(timeout=60), RequestAborted)
    finally:
        del runs._step_run
    assert taken and max(taken) == STEPS


def test_pool_pressure_shortens_runs_and_the_outputs_match(tiny_path, engines):
    """A pool far smaller than the demand: runs stop short where pages run out, requests
    are retracted and resume exactly."""
    single, _ = engines
    prompts = list(PROMPTS)
    # (45 new tokens and more: a prompt in chunks now waits for room for all of it, and with
    # 30 on pages of 4 nothing was retracted)
    mix = [{"max_new_tokens": 45 + i, "temperature": 0, "ignore_eos": True} for i in range(8)]
    page = single.config.page_size
    with Engine(tiny_path, page_size=page, decode_steps=8, **PRESSED) as engine:
        engine._launches_ahead = True
        taken = count_runs(engine)
        got = engine.generate(prompts, mix)
        stats = engine.stats()
    assert stats["retracted_requests"] > 0 and taken
    assert [result_key(o) for o in got] == [result_key(o) for o in single.generate(prompts, mix)]


@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans([None, 1, 6]), st.sampled_from([2, 5, 8]))  # (the second: decode_steps)
def test_random_mixes_under_pool_pressure_match_single_steps(tiny_path, engines, plan, steps):
    """Retractions and evictions (a 160-token pool) while decoding in runs, aborts from
    the streams; a request not aborted produces exactly what single steps produce."""
    single, _ = engines
    page = single.config.page_size
    with Engine(tiny_path, page_size=page, decode_steps=steps, **PRESSED) as engine:
        engine._launches_ahead = True
        check_plan(engine, single, plan)


def test_runs_stop_at_the_context_length(tiny_path):
    """A run never writes a position past the context: a request that ends at it, beside
    one with more tokens to go, finishes as single steps finish it."""
    prompts = [list(range(5, 46)), list(range(5, 15))]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (23, 40)]
    outs = []
    for steps in (1, 8):
        with Engine(tiny_path, context_len=64, decode_steps=steps, max_total_tokens=512) as engine:
            outs.append(engine.generate(input_ids=prompts, sampling_params=params))
    assert [result_key(o) for o in outs[1]] == [result_key(o) for o in outs[0]]
    assert [len(o["output_ids"]) for o in outs[0]] == [23, 40]


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([1, 2, 4, 8]),  # page size
    st.lists(st.integers(1, 30), min_size=1, max_size=4),  # each request's tokens so far
    st.integers(2, 12),  # steps
    st.integers(0, 40),  # slots taken by others first (to run short)
    st.lists(st.integers(1, 14), min_size=4, max_size=4),  # each one's tokens left
)
def test_extend_decode_run_continues_each_requests_pages(page, lengths, steps, taken, left):
    """Each step's slot follows the step before's within a page and starts a fresh page
    at a page boundary, for the steps a request needs (its tokens left), and is the
    padding slot 0 past them; the table holds each slot at its position; a run stops
    short (never fails) when pages run out; freeing the pages the steps started gives
    back every page they took."""
    from types import SimpleNamespace

    from lmprog_runtime.forward_batch import ForwardMode
    from lmprog_runtime.kvcache import ReqToTokenPool, TokenSlotAllocator
    from lmprog_runtime.kvcache.req_cache import ReqCache
    from lmprog_runtime.scheduled_batch import ScheduledBatch
    from lmprog_runtime.scheduler import Scheduler
    from lmprog_runtime.stats import EngineStats

    allocator = TokenSlotAllocator(128, page)
    table = ReqToTokenPool(len(lengths), 64, torch.device("cpu"))
    config = RuntimeConfig(page_size=page, max_total_tokens=128, decode_steps=steps)
    sched = Scheduler(config, allocator, table, ReqCache(None, allocator, table), EngineStats())
    owned = [allocator.alloc(n) for n in lengths]  # positions 0..n-1; n is decoded next
    step0 = allocator.alloc_decode(torch.stack([slots[-1] for slots in owned]))
    others = allocator.alloc(min(taken, allocator.num_free))
    free_before = allocator.num_free
    reqs = [SimpleNamespace(req_pool_idx=i) for i in range(len(lengths))]
    batch = ScheduledBatch(ForwardMode.DECODE, reqs, step0, list(lengths), [1] * len(lengths))
    needs = left[: len(lengths)]
    steps = min(steps, max(needs))  # (as a run's length is: no step no one needs)
    ahead = sched.extend_decode_run(batch, steps, needs)
    assert len(ahead) <= steps - 1
    if len(ahead) < steps - 1:  # it ran short: the next step's pages were not there
        assert allocator.num_free < page * len(lengths)
    for i, n in enumerate(lengths):
        slots = [int(owned[i][-1]), *(int(s[i]) for s in (step0, *ahead))]
        used = slots[: needs[i] + 1]
        assert slots[needs[i] + 1 :] == [0] * len(slots[needs[i] + 1 :])  # padding past them
        for k, (a, b) in enumerate(zip(used, used[1:])):
            assert b == a + 1 if b % page else (a + 1) % page == 0
            if k:  # (step 0's entry is the decode step's own)
                assert int(table.host_table[i, n + k]) == b
    every = [s for s in torch.cat([others, *owned, step0, *ahead]).tolist() if s]
    assert len(set(every)) == len(every)
    for slots in ahead:
        sched.free_started_pages(slots)
    assert allocator.num_free == free_before
