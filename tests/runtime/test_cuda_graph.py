"""CUDA-graph decode without a GPU: the padded static-buffer path, run eagerly on the CPU.

`DecodeGraphRunner(runner, capture=False)` runs exactly what a captured graph replays
(inputs copied into static buffers, the batch padded to its bucket with requests that read
and write only the padding slot), without the capture. Its logits must equal the plain
forward's for every decode step of real workloads, and engines using it must produce the
same tokens. The capture itself needs CUDA (`benchmarks/gpu_check.py`).
"""

from __future__ import annotations

import pytest
import torch
from helpers import forbid_host_syncs

from lmprog_runtime import Engine
from lmprog_runtime.cuda_graph import MAX_GRAPH_BATCH, DecodeGraphRunner, batch_buckets
from lmprog_runtime.forward_worker import ForwardWorker

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time in a small village by the sea, there lived",
    "Dear customer, thank you for writing",
    "def add(a, b):",
    '{"name": "Alice", "age":',
    "The weather report for Monday says",
]


def test_buckets_cover_every_batch_size_up_to_the_cap():
    assert batch_buckets(1) == [1]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(10_000)[-1] == MAX_GRAPH_BATCH
    for max_batch in (1, 5, 48, 300):
        buckets = batch_buckets(max_batch)
        assert buckets == sorted(set(buckets))
        assert buckets[-1] == min(max_batch, MAX_GRAPH_BATCH)


# Batch sizes per backend, and the buckets they run at (Triton is interpreted: fewer).
# A graph batch plans its attention for any length up to the context (the tiny model's
# 2048: 8 key splits); Triton's engines here take a context of 512 (2 splits, the second
# empty for these prompts), a quarter of the interpreted programs.
TRITON = {"attention_backend": "triton", "context_len": 512}
CASES = {
    "torch": ((1, 3, 5, 7), {1, 4, 8}),
    "native": ((1, 3, 5, 7), {1, 4, 8}),
    "triton": ((3,), {4}),
}


@pytest.mark.parametrize("backend", sorted(CASES))
def test_padded_decode_equals_the_plain_forward(tiny_path, backend):
    """Every decode step of a workload (most batches padded) runs both ways on the same
    inputs: the K/V each writes are the same values in the same slots."""
    sizes, buckets = CASES[backend]
    config = TRITON if backend == "triton" else {"attention_backend": backend}
    with Engine(tiny_path, max_running_requests=12, **config) as engine:
        runner = engine.runner
        graphs = DecodeGraphRunner(runner, capture=False)
        plain_run = runner.run
        seen: list[tuple[int, int]] = []

        def run_both(fb):
            logits = plain_run(fb)
            if graphs.can_run(fb):
                padded = graphs.run(fb)
                torch.testing.assert_close(padded, logits, atol=1e-5, rtol=1e-5)
                seen.append((fb.batch_size, graphs.bucket(fb.batch_size)))
            return logits

        runner.run = run_both
        try:
            for n in sizes:
                engine.generate(PROMPTS[:n], {"max_new_tokens": 4, "temperature": 0})
        finally:
            del runner.run
        assert {size for size, _ in seen} == set(sizes)
        assert {bucket for _, bucket in seen} == buckets


def test_a_graph_forward_reads_only_its_static_buffers_and_never_syncs(tiny_path):
    """What a capture needs of the Triton backend with the fused Triton ops (the CUDA set):
    each bucket's batch carries capture's placeholder lengths (the step lives in the static
    buffers alone), and its forward neither reads a device value on the host nor builds a
    tensor from Python data (`forbid_host_syncs`). Its logits equal the plain forward's."""
    from lmprog_runtime.models.triton_ops import TritonOps

    with Engine(tiny_path, max_running_requests=12, **TRITON) as engine:
        runner = engine.runner
        runner.model.ops = TritonOps()  # as the runner sets them on CUDA
        graphs = DecodeGraphRunner(runner, capture=False)
        forward = graphs._forward
        plain_run = runner.run
        seen: list[int] = []

        def guarded_forward(fb):
            assert fb.seq_lens == [1] * fb.batch_size  # capture's placeholders
            with forbid_host_syncs():
                return forward(fb)

        def run_both(fb):
            logits = plain_run(fb)
            if graphs.can_run(fb):
                torch.testing.assert_close(graphs.run(fb), logits, atol=1e-5, rtol=1e-5)
                seen.append(fb.batch_size)
            return logits

        graphs._forward = guarded_forward
        runner.run = run_both
        try:
            engine.generate(PROMPTS[:3], {"max_new_tokens": 3, "temperature": 0})
        finally:
            del runner.run
        assert seen and set(seen) <= {1, 2, 3}


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_engines_decoding_through_the_graph_path_give_the_same_tokens(tiny_path, backend):
    params = [
        {"max_new_tokens": 10, "temperature": 0},
        {"max_new_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 3},
    ]
    config = dict(attention_backend=backend, max_running_requests=12)
    with Engine(tiny_path, **config) as plain:
        expected = [plain.generate(PROMPTS, p) for p in params]
    with Engine(tiny_path, **config) as engine:
        engine.runner.graphs = DecodeGraphRunner(engine.runner, capture=False)
        got = [engine.generate(PROMPTS, p) for p in params]
    assert [[o["output_ids"] for o in r] for r in got] == [
        [o["output_ids"] for o in r] for r in expected
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_forward_leaves_the_static_batch_reading_the_static_buffers(tiny_path, backend):
    """A capture warms up and then captures on one batch object (`_capture_all`), so a
    forward must leave that batch's tensors the static buffers' views: a graph captured on
    a tensor the warm-up made reads freed memory at every replay (an H200 run aborted on
    such a device-side index assert when a forward rebound `input_ids`)."""
    config = TRITON if backend == "triton" else {"attention_backend": backend}
    with Engine(tiny_path, max_running_requests=4, **config) as engine:
        graphs = DecodeGraphRunner(engine.runner, capture=False)
        fb = graphs._static_batch(4, [1] * 4)
        fields = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens_device")
        before = {name: getattr(fb, name) for name in fields}
        for _ in range(3):  # two warm-ups and the capture
            graphs._forward(fb)
        for name, tensor in before.items():
            assert getattr(fb, name) is tensor, name
            storage = tensor.untyped_storage().data_ptr()
            assert storage == graphs._inputs.untyped_storage().data_ptr(), name


def test_the_graph_resolves_the_overlapped_loops_placeholders(tiny_path):
    """The overlapped loop hands decode steps their ids as placeholders for tokens still on
    the device; a graph batch takes its inputs as the runner sent them (one packed block)
    and resolves the placeholders inside the graph (no eager ops for them). The tokens
    equal the synchronous loop's; placeholders did reach the graph, every batch came
    packed, and neither did a graph forward fail (the loop would recover, hiding it) nor
    did the runner resolve a batch itself."""
    params = [
        {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 9, "temperature": 0.8, "top_p": 0.9, "seed": 3},
    ]
    config = dict(attention_backend="torch", max_running_requests=12)
    with Engine(tiny_path, overlap_schedule=False, **config) as plain:
        expected = [[o["output_ids"] for o in plain.generate(PROMPTS, p)] for p in params]
    with Engine(tiny_path, overlap_schedule=True, **config) as engine:
        runner = engine.runner
        graphs = runner.graphs = DecodeGraphRunner(runner, capture=False)
        graph_run = graphs.run
        placeholders, packed, failures, tails = [], [], [], []

        def run(fb):
            placeholders.append(int((fb.input_ids < 0).sum()))
            packed.append(fb.packed_inputs() is not None)
            tails.append(fb.future_tail)  # (not marked: the graph resolves them itself)
            try:
                return graph_run(fb)
            except Exception as error:
                failures.append(error)
                raise

        def resolve(ids_or_batch):
            failures.append("a batch resolved on the host")
            raise AssertionError(failures[-1])

        graphs.run, runner.resolve_future_ids, runner.resolved_ids = run, resolve, resolve
        got = [[o["output_ids"] for o in engine.generate(PROMPTS, p)] for p in params]
        del graphs.run, runner.resolve_future_ids, runner.resolved_ids
        state = engine.memory_state()
        assert state["num_running"] == 0 and state["req_slots_free"] == state["req_slots_total"]
    assert failures == [] and got == expected
    assert sum(placeholders) > 0 and packed and all(packed)
    assert not any(tails)


def test_a_batch_whose_ids_were_replaced_is_no_longer_packed(engine):
    """A decode run replaces a step's ids by the tokens drawn before it: the graph must
    then take the fields, not the packed block they were sent in."""
    from lmprog_runtime.forward_batch import ForwardMode
    from lmprog_runtime.scheduled_batch import ScheduledBatch

    runner = engine.runner
    row = runner.req_to_token.alloc()
    try:
        req = type("Req", (), {"req_pool_idx": row, "output_ids": [7]})()
        slots = torch.tensor([3], dtype=torch.int64)
        batch = ScheduledBatch(ForwardMode.DECODE, [req], slots, [5], [1])
        fb, _ = runner.prepare(batch)
        assert fb.packed_inputs() is not None
        assert fb.packed_inputs()[:, 0].tolist() == [7, 5, row, 6, 3, 0]
        fb.input_ids = torch.tensor([9])
        assert fb.packed_inputs() is None
    finally:
        runner.req_to_token.free(row)


def test_capture_needs_cuda_and_a_capturable_backend(engine):
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphRunner(engine.runner, capture=True)
    assert engine.runner.graphs is None  # CPU engines decode eagerly


# The overlapped loop's forward worker both ways (`ForwardWorker`'s `threaded`), and the
# synchronous loop.
LOOPS = {"synchronous": None, "worker_thread": True, "loop_thread": False}


def _graph_engine(tiny_path: str, loop: str) -> Engine:
    engine = Engine(
        tiny_path,
        attention_backend="torch",
        max_running_requests=12,
        overlap_schedule=LOOPS[loop] is not None,
    )
    if LOOPS[loop] is not None:
        engine._worker.close()
        engine._worker = ForwardWorker(engine.runner, threaded=LOOPS[loop])
    engine.runner.graphs = DecodeGraphRunner(engine.runner, capture=False)
    return engine


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_plain_greedy_batch_takes_the_tokens_the_graph_drew(tiny_path, loop):
    """A decode batch of plain greedy rows drawn whole takes the graph's argmax, which the
    graph also stored as the rows' future tokens: no eager draw or store. Every decode step
    here is such a batch (all requests decode together to the end); the tokens equal the
    plain engine's, so the overlapped loop's next forwards read the right future tokens,
    and so do their logprobs (read from the graph's logits as they are drawn)."""
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    asks = {"return_logprob": True, "top_logprobs_num": 2}
    with Engine(tiny_path, attention_backend="torch", max_running_requests=12) as plain:
        want = plain.generate(PROMPTS, params, **asks)
        expected = [o["output_ids"] for o in want]
    with _graph_engine(tiny_path, loop) as engine:
        runner, graphs = engine.runner, engine.runner.graphs
        graph_run, greedy, store = graphs.run, runner.greedy_tokens, runner.store_future_tokens
        counts = {"graph runs": 0, "graph draws": 0, "eager stores": 0}

        def counted_run(fb):
            counts["graph runs"] += 1
            return graph_run(fb)

        def counted_greedy(logits, index, rows):
            tokens = greedy(logits, index, rows)
            if tokens is not None:
                torch.testing.assert_close(tokens, logits.argmax(dim=-1), rtol=0, atol=0)
                counts["graph draws"] += 1
            return tokens

        def counted_store(rows, token_ids):
            counts["eager stores"] += 1
            return store(rows, token_ids)

        graphs.run, runner.greedy_tokens = counted_run, counted_greedy
        runner.store_future_tokens = counted_store
        outs = engine.generate(PROMPTS, params, **asks)
        got = [o["output_ids"] for o in outs]
        state = engine.memory_state()
    assert got == expected
    for g, w in zip(outs, want):
        for name in ("output_token_logprobs", "output_top_logprobs"):
            g_lps, w_lps = _logprobs(g["meta_info"][name]), _logprobs(w["meta_info"][name])
            assert len(g_lps) == len(w_lps) >= 10
            torch.testing.assert_close(g_lps, w_lps, atol=1e-4, rtol=0)
    assert counts["graph runs"] == 9 and counts["graph draws"] == 9  # (10 tokens: 1 prefill)
    # The overlapped loop stores the prefill's tokens alone; the synchronous loop none.
    assert counts["eager stores"] == (0 if loop == "synchronous" else 1)
    assert state["num_running"] == 0 and state["req_slots_free"] == state["req_slots_total"]


def _logprobs(entries: list) -> torch.Tensor:
    """The logprobs of `output_token_logprobs` entries, or of each step's top list."""
    flat = [e for step in entries for e in step] if isinstance(entries[0], list) else entries
    return torch.tensor([logprob for logprob, *_ in flat])


@pytest.mark.parametrize("loop", ["worker_thread", "loop_thread"])
def test_a_batch_with_other_rows_draws_itself_and_its_store_wins(tiny_path, loop):
    """A decode batch with a sampled or penalised row is drawn as before, after the graph
    stored its argmax as every row's future token: the draw's own store must be what the
    next forward reads. Tokens equal the synchronous plain engine's, and no draw took the
    graph's tokens."""
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    params = [dict(greedy) for _ in PROMPTS]
    params[1] = {**greedy, "temperature": 0.9, "top_k": 20, "seed": 5}
    params[4] = {**greedy, "frequency_penalty": 1.5}
    with Engine(tiny_path, attention_backend="torch", max_running_requests=12) as plain:
        expected = [o["output_ids"] for o in plain.generate(PROMPTS, params)]
    with _graph_engine(tiny_path, loop) as engine:
        runner = engine.runner
        greedy_tokens, taken = runner.greedy_tokens, []

        def counted_greedy(logits, index, rows):
            tokens = greedy_tokens(logits, index, rows)
            taken.append(tokens is not None)
            return tokens

        runner.greedy_tokens = counted_greedy
        got = [o["output_ids"] for o in engine.generate(PROMPTS, params)]
    assert got == expected
    assert taken and not any(taken)
    # the argmax differs from the sampled request's tokens: a lost store would show
    assert got[1] != plain_greedy_tokens(tiny_path, PROMPTS[1], greedy)


def plain_greedy_tokens(tiny_path: str, prompt: str, params: dict) -> list[int]:
    with Engine(tiny_path, attention_backend="torch") as engine:
        return engine.generate(prompt, params)["output_ids"]


def test_the_graphs_tokens_are_the_last_runs_alone(tiny_path):
    """`greedy_tokens` answers for the logits of the last graph run only (a later run
    overwrites the graph's output), for all of their rows in order, and for plain rows."""
    from lmprog_runtime.sampling import SampleRows

    with _graph_engine(tiny_path, "synchronous") as engine:
        runner, graphs = engine.runner, engine.runner.graphs
        graph_run, checked = graphs.run, []

        def run_twice(fb):
            first, second = graph_run(fb), graph_run(fb)  # (same inputs: same K/V written)
            n = second.shape[0]
            plain = SampleRows([None] * n)
            plain.plain = True
            assert graphs.greedy_tokens(first) is None
            assert runner.greedy_tokens(first, list(range(n)), plain) is None
            tokens = runner.greedy_tokens(second, list(range(n)), plain)
            assert tokens.tolist() == second.argmax(dim=-1).tolist()
            assert runner.future_tokens[fb.req_pool_indices].tolist() == tokens.tolist()
            assert runner.greedy_tokens(second, list(range(n)), SampleRows([None] * n)) is None
            assert runner.greedy_tokens(second, list(range(n))[::-1], plain) is None
            checked.append(n)
            return second

        graphs.run = run_twice
        engine.generate(PROMPTS[:3], {"max_new_tokens": 3, "temperature": 0})
    assert checked and set(checked) == {3}


@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_decode_runs_through_the_graphs(tiny_path, overlap, logprobs):
    """Decode runs of 4 (launched ahead, as on a GPU) through the graph path. A run of
    plain greedy steps that asks for no logprobs is one replay of the run's graph
    (`run_greedy`: each step's argmax the next one's input), a shorter one replays of the
    graphs of 2 and 1 steps, each from the tokens the one before drew; a run that asks for
    logprobs runs step by step, each step's tokens the graph's, the next step's inputs as
    they are (but at the run's last step: its tokens, the first inputs of a run launched
    after it, are drawn apart from the graph's outputs, which the next replay overwrites;
    the eager runner keeps them where a replay would, `_as_replayed`). Tokens (and
    logprobs) equal the plain engine's; lengths differ, so runs stop and continue."""
    # (the longest's 23 tokens after the first: runs of 4, then one of 3)
    params = [
        {"max_new_tokens": 24 - 3 * i, "temperature": 0, "ignore_eos": True}
        for i in range(len(PROMPTS))
    ]
    asks = {"return_logprob": True, "top_logprobs_num": 2} if logprobs else {}
    config = dict(attention_backend="torch", max_running_requests=12)
    with Engine(tiny_path, **config) as plain:
        want = plain.generate(PROMPTS, params, **asks)
    with Engine(tiny_path, overlap_schedule=overlap, decode_steps=4, **config) as engine:
        engine._launches_ahead = True
        if overlap:
            engine._worker.close()
            engine._worker = ForwardWorker(engine.runner, threaded=False)
        runner = engine.runner
        graphs = runner.graphs = DecodeGraphRunner(runner, capture=False)
        greedy, run_greedy, taken, replays = runner.greedy_tokens, graphs.run_greedy, [], []

        def counted_greedy(logits, index, rows):
            tokens = greedy(logits, index, rows)
            taken.append(tokens is not None)
            return tokens

        def counted_run_greedy(*args):
            replays.append(args[1].shape[0] + 1)  # (the run's steps)
            return run_greedy(*args)

        runner.greedy_tokens, graphs.run_greedy = counted_greedy, counted_run_greedy
        outs = engine.generate(PROMPTS, params, **asks)
        runs = engine.stats()["decode_runs"]
        state = engine.memory_state()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in want]
    if logprobs:
        for g, w in zip(outs, want):
            for name in ("output_token_logprobs", "output_top_logprobs"):
                g_lps, w_lps = _logprobs(g["meta_info"][name]), _logprobs(w["meta_info"][name])
                torch.testing.assert_close(g_lps, w_lps, atol=1e-4, rtol=0)
        assert replays == [] and sum(taken) >= 2 * runs
    else:
        assert len(replays) == runs and not any(taken)  # (every run through run graphs)
        assert 4 in replays and 3 in replays, replays  # (a shorter one in pieces: [2, 1])
    assert state["num_running"] == 0 and state["req_slots_free"] == state["req_slots_total"]


def test_a_decode_step_run_request_by_request_keeps_each_requests_logits(tiny_path):
    """A decode forward that raises is run again one request at a time (`_forward_alone`),
    each through the graph (bucket 1), whose next run overwrites the logits it handed out:
    the loop keeps a copy of each. The request that raises fails; the others' tokens are
    the plain engine's."""
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, attention_backend="torch", max_running_requests=12) as plain:
        expected = [o["output_ids"] for o in plain.generate(PROMPTS[:4], params)]
    with _graph_engine(tiny_path, "synchronous") as engine:
        culprit = engine.encode(PROMPTS[2])

        def hook(at, req):  # (decode steps only: the prompt's forward goes through)
            if at == "forward" and req.input_ids == culprit and len(req.output_ids) >= 3:
                raise RuntimeError("injected at a decode step")

        engine.fault_hook = hook
        futures = engine.submit(PROMPTS[:4], params)
        with pytest.raises(RuntimeError, match="injected at a decode step"):
            futures[2].result(timeout=60)
        got = {i: futures[i].result(timeout=60)["output_ids"] for i in (0, 1, 3)}
        engine.fault_hook = None
    assert got == {i: expected[i] for i in (0, 1, 3)}


def test_a_run_graph_on_the_capturable_backend_reads_each_steps_buffers(tiny_path):
    """The run graph on the Triton backend with the fused Triton ops (the CUDA set,
    interpreted here): each step plans from its own rows of the run's static buffer alone
    (capture's placeholder lengths), so every step's positions, lengths and slots must be
    there, and the run's forward reads no device value on the host nor builds a tensor
    from Python data (`forbid_host_syncs`), as a capture needs. Tokens equal the plain
    engine's."""
    from lmprog_runtime.models.triton_ops import TritonOps

    params = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
    config = dict(TRITON, max_running_requests=4)
    with Engine(tiny_path, **config) as plain:
        plain.runner.model.ops = TritonOps()
        expected = [o["output_ids"] for o in plain.generate(PROMPTS[:3], params)]
    with Engine(tiny_path, decode_steps=4, **config) as engine:
        engine.runner.model.ops = TritonOps()  # as the runner sets them on CUDA
        graphs = engine.runner.graphs = DecodeGraphRunner(engine.runner, capture=False)
        run_greedy, forward_run, replays = graphs.run_greedy, graphs._forward_run, []

        def counted_run_greedy(*args):
            replays.append(args[0].shape[1])
            return run_greedy(*args)

        def guarded_forward_run(steps):
            assert all(fb.seq_lens == [1] * fb.batch_size for fb in steps)
            with forbid_host_syncs():
                return forward_run(steps)

        graphs.run_greedy, graphs._forward_run = counted_run_greedy, guarded_forward_run
        got = [o["output_ids"] for o in engine.generate(PROMPTS[:3], params)]
    assert got == expected
    assert replays == [3, 3]  # (8 decode steps: two runs of 4)


def test_a_shorter_run_replays_the_graphs_of_its_pieces(tiny_path):
    """Runs of 8: a run of 7 (the requests' last tokens) replays the graphs of 4, 2 and 1
    steps, in that order, each from the tokens the one before drew (on the device); the
    tokens equal the plain engine's. Requests of different lengths, so the run is padded
    past the shorter ones' last tokens."""
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (8, 5, 8, 2, 6)]
    config = dict(attention_backend="torch", max_running_requests=8)
    with Engine(tiny_path, **config) as plain:
        want = [o["output_ids"] for o in plain.generate(PROMPTS[:5], params)]
    with Engine(tiny_path, decode_steps=8, **config) as engine:
        engine._launches_ahead = True
        graphs = engine.runner.graphs = DecodeGraphRunner(engine.runner, capture=False)
        forward_run, pieces = graphs._forward_run, []

        def counted_forward_run(steps):
            pieces.append(len(steps))
            return forward_run(steps)

        graphs._forward_run = counted_forward_run
        got = [o["output_ids"] for o in engine.generate(PROMPTS[:5], params)]
    assert got == want
    assert pieces == [4, 2, 1]  # (7 steps after the prefill's token)


def test_a_run_goes_step_by_step_when_its_pieces_have_no_graphs(engine):
    """If capturing one length of run graphs failed (dropped from `run_lengths`), the runs
    that the lengths left cannot make exactly go step by step; the others still run as
    graphs."""
    with Engine(engine.config.model_path, attention_backend="torch", decode_steps=8) as runs:
        graphs = DecodeGraphRunner(runs.runner, capture=False)
        assert graphs.run_lengths == [8, 4, 2, 1]
        assert all(graphs.can_run_greedy(3, steps) for steps in range(2, 9))
        assert not graphs.can_run_greedy(3, 1) and not graphs.can_run_greedy(3, 9)
        graphs.run_lengths = [8, 4, 2]  # (the 1-step graphs failed)
        assert [s for s in range(2, 9) if graphs.can_run_greedy(3, s)] == [2, 4, 6, 8]


def test_a_capture_checks_its_own_thread_and_gives_the_stream_back_when_it_fails(monkeypatch):
    """torch's graph context ends the capture before it restores the stream: a capture
    that failed at its end left the thread on the side stream (its later syncs waited on
    that one). And the default "global" error mode failed any other engine's step that
    allocated pinned memory or read a result during the capture. (torch.cuda stands in
    for CUDA here: what `capturing` asks of it is what is checked.)"""
    from lmprog_runtime.run_graphs import capturing

    current, seen = [object()], []

    class EndFails:
        def __init__(self, graph, pool=None, stream=None, capture_error_mode="global"):
            seen.append(capture_error_mode)
            self.stream = stream

        def __enter__(self):
            current[0] = self.stream  # (torch makes the side stream current)

        def __exit__(self, *exc):
            raise RuntimeError("operation not permitted when stream is capturing")

    main = current[0]
    monkeypatch.setattr(torch.cuda, "graph", EndFails)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.__setitem__(0, stream))
    with pytest.raises(RuntimeError, match="capturing"), capturing(None, None, "side"):
        assert current[0] == "side"
    assert current[0] is main and seen == ["thread_local"]
