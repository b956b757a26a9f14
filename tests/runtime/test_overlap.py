"""Overlap scheduling (issue 18): step N+1's forward is queued before step N's tokens reach
the host (its inputs take them on the device), and the loop checks them while that forward
runs, with results token-identical to the synchronous loop (`overlap_engines.py`: the same
engine built with `overlap_schedule=False`, both with a fake slow forward).

Every test ends with the engines clean (the autouse check in conftest): a request that
finishes while a forward that carries it runs gives that forward's slots back at once.
Faults, aborts, pool pressure and shutdown are in `test_overlap_faults.py`.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading

import jsonschema
import pytest
import torch
from helpers import PROMPTS, forbid_host_syncs
from overlap_engines import (
    POOL,
    SCHEMA,
    WORKERS,
    assert_slots_free,
    engine_pair,
    on_loop_thread,
    result_key,
    stop_inside,
)

from lmprog_runtime import Engine
from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.forward_worker import ForwardWorker, InlineExecutor


@pytest.fixture(scope="module", params=list(WORKERS))
def engines(tiny_path, request):
    """(synchronous, overlapped) engines, both with a slow forward; the overlapped one's
    forward worker a thread, or on the loop thread (as on CUDA)."""
    with engine_pair(tiny_path, request.param) as pair:
        yield pair


def test_overlap_schedule_is_validated_and_on_for_cuda_only():
    assert not RuntimeConfig().is_overlapped
    assert RuntimeConfig(device="cuda").is_overlapped
    assert RuntimeConfig(device="cuda:1").is_overlapped
    assert RuntimeConfig(overlap_schedule=True).is_overlapped
    assert not RuntimeConfig(device="cuda", overlap_schedule=False).is_overlapped
    for bad in ("yes", 1, 0.0):
        with pytest.raises(TypeError, match="overlap_schedule"):
            RuntimeConfig(overlap_schedule=bad)


def test_outputs_are_token_identical_to_the_synchronous_loop(engines):
    """Requests finishing at different steps (lengths, EOS, stop strings and regexes, a
    prefill-only one), greedy and seeded, with penalties, min_new_tokens and logprobs, all
    in one batch."""
    sync, overlapped = engines
    unstopped = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    mix = [
        {"max_new_tokens": 1, "temperature": 0},
        {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 0},
        {"max_new_tokens": 17, "temperature": 0.8, "seed": 7},
        {**unstopped, "stop": [stop_inside(sync, PROMPTS[4], unstopped)]},
        {**unstopped, "stop_regex": [re.escape(stop_inside(sync, PROMPTS[5], unstopped))]},
        {"max_new_tokens": 30, "temperature": 1.0, "top_p": 0.9, "seed": 3},
        {"max_new_tokens": 20, "temperature": 0, "frequency_penalty": 0.5, "min_new_tokens": 9},
        {"max_new_tokens": 9, "temperature": 0.7, "seed": 1, "presence_penalty": 0.3},
        {"max_new_tokens": 40, "temperature": 0},
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(mix))]
    kwargs = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    want = sync.generate(prompts, mix, **kwargs)
    got = overlapped.generate(prompts, mix, **kwargs)
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    assert {o["meta_info"]["finish_reason"]["type"] for o in want} == {"length", "stop"}
    for g, w in zip(got, want):
        for name in ("input_token_logprobs", "output_token_logprobs"):
            assert [t for _, t, _ in g["meta_info"][name]] == [
                t for _, t, _ in w["meta_info"][name]
            ]
            lps = [lp for lp, *_ in g["meta_info"][name]]
            assert lps == pytest.approx([lp for lp, *_ in w["meta_info"][name]], abs=1e-5)


def test_logprobs_of_a_mixed_batch_equal_transformers_in_both_loops(engines, hf_tiny, monkeypatch):
    """One batch of requests asking for no logprobs, the drawn token's alone, and 1, 5 and
    40 alternatives, greedy and seeded: every prompt and drawn token's logprob and each top
    list equal transformers' log-softmax (the top values in order, each listed token's own
    logprob), in both loops. The overlapped loop gathers each draw's logprobs in the
    worker's draw, with no host read (on a GPU the loop then never reads a draw's logits,
    which would wait for all it queued since)."""
    from lmprog_runtime.forward_worker import ForwardWorker
    from lmprog_runtime.logprobs import LogprobAsk

    model, tokenizer = hf_tiny
    in_draw = threading.local()
    gathered: list[bool] = []  # per gather: inside a worker's draw
    plain_gather, plain_sample = LogprobAsk.gather, ForwardWorker._sample

    def guarded_gather(ask, logits, token_ids):
        gathered.append(getattr(in_draw, "on", False))
        with forbid_host_syncs():
            return plain_gather(ask, logits, token_ids)

    def marked_sample(worker, *args):
        in_draw.on = True
        try:
            return plain_sample(worker, *args)
        finally:
            in_draw.on = False

    monkeypatch.setattr(LogprobAsk, "gather", guarded_gather)
    monkeypatch.setattr(ForwardWorker, "_sample", marked_sample)
    wants = [False, True, True, True, True, True]
    tops = [3, 0, 1, 5, 40, 5]
    params = [
        {"max_new_tokens": 7, "ignore_eos": True, "temperature": 0.0 if i % 2 else 0.9, "seed": i}
        for i in range(len(wants))
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(wants))]
    kwargs = {"return_logprob": wants, "top_logprobs_num": tops, "logprob_start_len": 0}
    for engine in engines:
        gathered.clear()
        outs = engine.generate(prompts, params, **kwargs)
        for out, prompt, want, top in zip(outs, prompts, wants, tops):
            meta = out["meta_info"]
            if not want:
                assert "output_token_logprobs" not in meta
                continue
            ids = tokenizer(prompt).input_ids
            with torch.inference_mode():
                full = torch.tensor([ids + out["output_ids"]])
                ref = torch.log_softmax(model(full).logits[0], dim=-1)
            scored = meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]
            assert [token for _, token, _ in scored] == full[0, 1:].tolist()
            expected = ref[torch.arange(full.shape[1] - 1), full[0, 1:]].tolist()
            assert [lp for lp, *_ in scored] == pytest.approx(expected, abs=1e-4)
            if not top:
                assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
                continue
            alternatives = meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]
            assert len(alternatives) == len(scored)
            for position, listed in enumerate(alternatives):
                best = ref[position].topk(top).values.tolist()
                assert [value for value, *_ in listed] == pytest.approx(best, abs=1e-4)
                assert len({token for _, token, _ in listed}) == top
                for value, token, _ in listed:
                    assert value == pytest.approx(ref[position, token].item(), abs=1e-4)
        if engine._worker is not None:
            assert gathered and all(gathered)  # (a draw after each prefill and decode)


def test_keyed_draws_are_identical_to_the_synchronous_loop(engines, monkeypatch):
    """The accelerators' sampler (keyed races, run here on the CPU): each draw is keyed by
    the tokens its request has so far, which the overlapped loop counts as the synchronous
    one does (placeholders resolved, jump-forward tokens in); a seeded request draws the
    same tokens alone and among others, and not multinomial's tokens."""
    from lmprog_runtime import sampling

    sync, overlapped = engines
    mix = [
        {"max_new_tokens": 20, "temperature": 0.9, "seed": 7, "ignore_eos": True},
        {"max_new_tokens": 80, "temperature": 0.9, "seed": 2, "json_schema": json.dumps(SCHEMA)},
        {"max_new_tokens": 12, "temperature": 0},
        {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 3, "ignore_eos": True},
        {
            "max_new_tokens": 9,
            "temperature": 0.7,
            "seed": 1,
            "presence_penalty": 0.3,
            "ignore_eos": True,
        },
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(mix))]
    multinomial = sync.generate(prompts, mix)
    monkeypatch.setattr(sampling, "on_accelerator", lambda device: True)
    want = sync.generate(prompts, mix)
    got = overlapped.generate(prompts, mix)
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    jsonschema.validate(json.loads(got[1]["text"]), SCHEMA)
    assert want[0]["output_ids"] != multinomial[0]["output_ids"]
    assert want[3]["output_ids"] != multinomial[3]["output_ids"]
    alone = overlapped.generate(prompts[0], mix[0])
    assert alone["output_ids"] == want[0]["output_ids"]


def test_a_forward_on_the_gpu_path_never_waits_for_the_device(tiny_path):
    """The worker's forwards with the CUDA set (Triton attention and fused ops, under the
    interpreter): prefills, prefix-cache hits and decodes with placeholder inputs read no
    device value on the host (`forbid_host_syncs`; tensors from Python data are allowed
    here: outside a graph their pinned copies wait for nothing), so on a GPU the forward
    after them is queued at once."""
    from lmprog_runtime.models.triton_ops import TritonOps

    config = {"attention_backend": "triton", "overlap_schedule": True, **POOL}
    with Engine(tiny_path, **config) as engine:
        runner = engine.runner
        runner.model.ops = TritonOps()  # as the runner sets them on CUDA
        plain_run = runner.run
        modes: list[ForwardMode] = []
        placeholders = []
        syncs: list[str] = []  # (the loop would recover by running each request alone)

        def guarded_run(fb):
            modes.append(fb.mode)
            placeholders.append(fb.has_future_ids)
            try:
                with forbid_host_syncs(python_data=True):
                    return plain_run(fb)
            except AssertionError as error:
                syncs.append(f"{fb.mode.name}: {error}")
                raise

        runner.run = guarded_run
        try:
            params = {"max_new_tokens": 4, "temperature": 0}
            first = engine.generate(PROMPTS[:3], params)
            again = engine.generate([PROMPTS[0], PROMPTS[1] + " and more"], params)
        finally:
            del runner.run
        assert syncs == []
        assert again[0]["output_ids"] == first[0]["output_ids"]
        assert ForwardMode.EXTEND in modes and ForwardMode.DECODE in modes and any(placeholders)


def test_a_caller_wakes_to_free_slots_and_the_synchronous_counters(engines):
    """When `generate` returns, the slots of the forward launched for the requests that had
    just finished are already free, and the counters equal the synchronous loop's (the
    dropped tokens of that forward are not counted)."""
    sync, overlapped = engines
    unstopped = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    mix = [{**unstopped, "max_new_tokens": n} for n in (1, 4, 9, 13)]
    mix.append({**unstopped, "stop": [stop_inside(sync, PROMPTS[4], unstopped)]})
    outs, stats = [], []
    for engine in (sync, overlapped):
        assert engine.flush_cache()
        engine.reset_stats()
        outs.append([result_key(o) for o in engine.generate(PROMPTS[:5], mix)])
        state, counters = assert_slots_free(engine), engine.stats()  # no waiting: at once
        assert state["num_running"] == 0
        stats.append({k: v for k, v in counters.items() if not k.endswith("_seconds")})
    assert outs[1] == outs[0]
    assert stats[1] == stats[0]
    assert stats[0]["finished_requests"] == len(mix)


def test_streamed_chunks_are_identical_in_order_and_content(engines):
    sync, overlapped = engines
    unstopped = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    mix = [
        {**unstopped, "stop": [stop_inside(sync, PROMPTS[2], unstopped)]},
        {"max_new_tokens": 12, "temperature": 0.9, "seed": 5},
        {**unstopped, "max_new_tokens": 3},
        unstopped,
    ]
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[6], PROMPTS[7]]

    def chunks(engine: Engine) -> tuple[list, list]:
        seen: list[list] = [[] for _ in mix]

        def on_chunk(i: int, chunk: dict) -> None:
            meta = {k: v for k, v in chunk["meta_info"].items() if k != "id"}
            seen[i].append((chunk["text"], chunk["output_ids"], meta))

        assert engine.flush_cache()

        futures = engine.submit(prompts, mix, on_chunk=on_chunk)
        outs = [f.result(timeout=60) for f in futures]
        single = [
            (c["text"], c["output_ids"]) for c in engine.generate(PROMPTS[1], mix[1], stream=True)
        ]
        return seen + [single], outs

    want_chunks, want = chunks(sync)
    got_chunks, got = chunks(overlapped)
    assert got_chunks == want_chunks
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    for seen, out in zip(got_chunks, got):
        assert "".join(text for text, _, _ in seen) == out["text"]


def test_constrained_outputs_match_and_are_identical(engines):
    """A JSON schema (jump-forward on) and a regex with logprobs (jump-forward off): the
    grammar mask of each step follows the token the previous step's check accepted."""
    sync, overlapped = engines
    regex = r"[a-z]{2,6}-[0-9]{2,4}( ok)?"
    mix = [
        {"max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(SCHEMA)},
        {"max_new_tokens": 80, "temperature": 0.9, "seed": 2, "json_schema": json.dumps(SCHEMA)},
        {"max_new_tokens": 16, "temperature": 0.8, "seed": 4, "regex": regex},
        {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
    ]
    prompts = ["Extract: Alice ordered", "Extract: Bob", "Code:", PROMPTS[4]]
    sync.reset_stats()
    overlapped.reset_stats()
    want = sync.generate(prompts, mix, return_logprob=[False, False, True, False])
    got = overlapped.generate(prompts, mix, return_logprob=[False, False, True, False])
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    for out in got[:2]:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert re.fullmatch(regex, got[2]["text"])
    jumped = sync.stats()["jump_forward_tokens"]
    assert jumped > 0 and overlapped.stats()["jump_forward_tokens"] == jumped


def test_prefix_cache_hits_are_identical(engines):
    """A prompt, the same prompt continued by its output, and a fork of two branches."""
    sync, overlapped = engines
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}

    def run(engine: Engine) -> list[tuple]:
        assert engine.flush_cache()
        first = engine.generate(PROMPTS[7], params)
        again = engine.generate(PROMPTS[7] + first["text"] + " and", params)
        branches = engine.generate([PROMPTS[6] + " x", PROMPTS[6] + " y"], params, group=True)
        outs = [first, again, *branches]
        return [(*result_key(o), o["meta_info"]["cached_tokens"]) for o in outs]

    want, got = run(sync), run(overlapped)
    assert got == want
    assert all(cached > 0 for *_, cached in want[1:])


def test_checks_run_while_the_next_forward_runs(tiny_path, engines):
    """Structural proof of overlap: the checks of step N and the forward of step N+1 meet
    at a barrier, which needs both to be in progress at once (the synchronous loop runs
    them one after the other: the barrier would time out there)."""
    sync, _ = engines
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, overlap_schedule=True, **POOL) as engine:
        barrier = threading.Barrier(2, timeout=30)
        met = []
        run, check = engine.runner.run, engine._check
        num_forwards = [0]

        def meeting_run(fb):
            num_forwards[0] += 1
            if 2 <= num_forwards[0] <= 4:  # forwards 2-4 run during the checks of steps 1-3
                met.append(("forward", threading.current_thread().name, barrier.wait()))
            return run(fb)

        num_checks = [0]

        def meeting_check(reqs):
            num_checks[0] += 1
            if num_checks[0] <= 3:  # the checks of steps 1-3
                met.append(("check", threading.current_thread().name, barrier.wait()))
            return check(reqs)

        engine.runner.run = meeting_run
        engine._check = meeting_check
        out = engine.generate(PROMPTS[3], params)
    assert out["output_ids"] == sync.generate(PROMPTS[3], params)["output_ids"]
    assert sorted(kind for kind, _, _ in met) == ["check"] * 3 + ["forward"] * 3
    forward_threads = {name for kind, name, _ in met if kind == "forward"}
    check_threads = {name for kind, name, _ in met if kind == "check"}
    assert forward_threads.isdisjoint(check_threads)


def test_on_the_loop_thread_the_worker_starts_no_thread(tiny_path, engines):
    """The forward worker as on CUDA: forwards and draws run on the loop thread as they are
    queued, no worker thread is started, and the outputs are the synchronous loop's."""
    sync, _ = engines
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    before = set(threading.enumerate())
    with Engine(tiny_path, overlap_schedule=True, **POOL) as engine:
        on_loop_thread(engine)
        runner = engine.runner
        ran_on: dict[str, set[str]] = {"forward": set(), "draw": set()}
        run, store = runner.run, runner.store_future_tokens

        def recording_run(fb):
            ran_on["forward"].add(threading.current_thread().name)
            return run(fb)

        def recording_store(rows, token_ids):  # the draw's last step
            ran_on["draw"].add(threading.current_thread().name)
            return store(rows, token_ids)

        runner.run, runner.store_future_tokens = recording_run, recording_store
        out = engine.generate(PROMPTS[3], params)
        started = set(threading.enumerate()) - before
        loop_thread = engine._thread
    assert started == {loop_thread}
    assert ran_on == {"forward": {loop_thread.name}, "draw": {loop_thread.name}}
    assert out["output_ids"] == sync.generate(PROMPTS[3], params)["output_ids"]


def test_on_cuda_the_inline_worker_queues_on_the_loops_stream_alone(
    tiny_path, engines, monkeypatch
):
    """An inline worker on a CUDA runner makes no stream of its own and queues no event,
    stream switch or wait per step (each ~15 us of host time on an H200): the loop's stream
    keeps its copies, forwards and draws in order. Here the runner only says CUDA (its
    tensors stay on the CPU), and every stream and event call of torch.cuda is recorded."""
    sync, _ = engines
    calls: list[str] = []

    def recorder(name):
        def record(*args, **kwargs):
            calls.append(name)
            return contextlib.nullcontext()

        return record

    class CudaLooking:  # the engine's runner, as one on a GPU would say where it runs
        def __init__(self, runner):
            self._runner, self.device = runner, torch.device("cuda", 0)

        def __getattr__(self, name):
            return getattr(self._runner, name)

    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, overlap_schedule=True, **POOL) as engine:
        for name in ("Stream", "Event", "stream", "current_stream", "set_device"):
            monkeypatch.setattr(torch.cuda, name, recorder(name))
        engine._worker.close()
        engine._worker = ForwardWorker(CudaLooking(engine.runner), threaded=False)
        out = engine.generate(PROMPTS[:2], params)
        monkeypatch.undo()
        assert engine.stats()["forward_seconds"] > 0  # (timed on the host, as it was queued)
    assert calls == []
    assert [o["output_ids"] for o in out] == [
        o["output_ids"] for o in sync.generate(PROMPTS[:2], params)
    ]


def test_the_inline_executor_runs_each_job_as_it_is_submitted():
    executor, order = InlineExecutor(), []
    done = executor.submit(lambda x: order.append(x) or 2 * x, 21)
    assert order == [21] and done.done() and done.result() == 42
    failed = executor.submit(lambda: 1 / 0)
    assert failed.done() and isinstance(failed.exception(), ZeroDivisionError)


def test_the_next_forward_takes_the_drawn_tokens_on_the_device(tiny_path, engines):
    """Every decode forward is prepared before the tokens it consumes reach the host: its
    inputs are placeholders `-(row + 1)`, filled on the device from what the draw stored,
    and the outputs are the synchronous loop's. A request decodes no further once its
    last token by max_new_tokens is being drawn: no forward more than the synchronous
    loop runs."""
    sync, _ = engines
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (1, 3, 6)]
    with Engine(tiny_path, overlap_schedule=True, **POOL) as engine:
        prepare = engine.runner.prepare
        inputs = []

        def recording_prepare(batch):
            fb, rows = prepare(batch)
            inputs.append((batch.mode, fb.input_ids.tolist()))
            return fb, rows

        engine.runner.prepare = recording_prepare
        got = engine.generate(PROMPTS[:3], params)
        passes = engine.stats()["forward_passes"]
    sync.reset_stats()
    want = sync.generate(PROMPTS[:3], params)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert passes == sync.stats()["forward_passes"] == 6
    decodes = [ids for mode, ids in inputs if mode is ForwardMode.DECODE]
    assert len(decodes) == 5 and all(all(i < 0 for i in ids) for ids in decodes)


def test_placeholders_read_the_tokens_stored_for_their_rows(engines):
    _, overlapped = engines
    runner = overlapped.runner
    runner.store_future_tokens([3, 0], torch.tensor([11, 22]))
    resolved = runner.resolve_future_ids(torch.tensor([5, -4, -1, 7]))
    assert resolved.tolist() == [5, 11, 22, 7]


def test_the_decoding_requests_placeholders_resolve_as_one_gather(tiny_path, engines):
    """A decode step whose every id is a placeholder, and a mixed step whose running
    requests' ids all are, mark them as a tail (`future_tail`) and resolve it by one
    gather of those requests' rows: the ids the model reads are what the id-by-id
    resolution gives from the same future tokens, and the outputs the synchronous loop's.
    (Four requests running at most, of different lengths: prompts are admitted while
    others decode.)"""
    from lmprog_runtime.forward_batch import resolve_future_ids

    sync, _ = engines
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(10)]
    params = [
        {"max_new_tokens": 3 + 5 * (i % 3), "temperature": 0, "ignore_eos": True} for i in range(10)
    ]
    pool = {**POOL, "max_running_requests": 4}
    with Engine(tiny_path, overlap_schedule=True, **pool) as engine:
        if isinstance(engines[1]._worker._executor, InlineExecutor):
            on_loop_thread(engine)  # (the fixture's other worker: on the loop, as on CUDA)
        runner = engine.runner
        model = runner.model
        seen = []  # (mode, requests decoding, future_tail, ids read == the reference)

        def checking_model(fb, attention):
            seen.append((fb.mode, fb.num_decodes, tail, fb.input_ids.tolist() == want))
            return model(fb, attention)

        plain_run = runner.run

        def recording_run(fb):
            nonlocal tail, want
            tail = fb.future_tail
            want = resolve_future_ids(fb.input_ids, runner.future_tokens.clone()).tolist()
            return plain_run(fb)

        tail, want = 0, None
        runner.model, runner.run = checking_model, recording_run
        try:
            got = engine.generate(prompts, params)
        finally:
            runner.model = model
            del runner.run
    assert [g["output_ids"] for g in got] == [
        w["output_ids"] for w in sync.generate(prompts, params)
    ]
    assert all(same for *_, same in seen)
    decodes = [tail for mode, _, tail, _ in seen if mode is ForwardMode.DECODE]
    mixed = [(n, tail) for mode, n, tail, _ in seen if mode is ForwardMode.EXTEND and n]
    assert decodes and all(tail > 0 for tail in decodes)
    assert mixed and all(tail == n for n, tail in mixed)


def test_a_tail_is_only_the_decoding_requests_own_placeholders_and_none_before():
    from lmprog_runtime.model_runner import _future_tail
    from lmprog_runtime.scheduled_batch import ScheduledBatch

    def batch(mode, num_reqs, num_decodes=0):
        slots = torch.zeros(0, dtype=torch.int64)
        return ScheduledBatch(mode, [None] * num_reqs, slots, [], [], num_decodes=num_decodes)

    decode, extend = ForwardMode.DECODE, ForwardMode.EXTEND
    assert _future_tail(batch(decode, 3), [-1, -3, -2], [0, 2, 1]) == 3
    assert _future_tail(batch(decode, 3), [-1, 5, -2], [0, 2, 1]) == 0  # one token known
    assert _future_tail(batch(decode, 3), [-1, -2, -3], [0, 2, 1]) == 0  # another's row
    mixed = batch(extend, 3, num_decodes=2)
    assert _future_tail(mixed, [7, 8, 9, -1, -4], [5, 0, 3]) == 2
    assert _future_tail(mixed, [7, -2, 9, -1, -4], [5, 0, 3]) == 0  # a prompt's placeholder
    assert _future_tail(mixed, [7, 8, 9, 4, -4], [5, 0, 3]) == 0
    assert _future_tail(batch(extend, 1), [7, 8, -1], [0]) == 0  # no decoding request
