"""Shared by the overlap and decode-run test modules: a synchronous and an overlapped engine
on the tiny model, both with a fake slow forward, how their results are compared, and the
random request mixes (hypothesis) both loops are checked on.

The slow forward is a sleep before the real one (a device still busy, not a
synchronisation): in the overlapped engine whose forward worker is a thread, the checks of
one step then really run during the next forward. The overlapped engine comes both ways
(`WORKERS`): its worker a thread, as on a CPU, or running its jobs on the loop thread, as
on CUDA (there a forward is queued, here it runs: the bookkeeping is the same).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from conftest import engine_leak
from helpers import PROMPTS
from hypothesis import strategies as st

from lmprog_runtime import Engine
from lmprog_runtime.engine import RequestAborted
from lmprog_runtime.forward_worker import ForwardWorker
from lmprog_runtime.run_choice import RunChoice

SLOW_FORWARD_S = 0.003
POOL = {"max_total_tokens": 4096, "max_running_requests": 16}
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_name": {"type": "string", "maxLength": 6},
        "is_priority": {"type": "boolean"},
    },
    "required": ["customer_name", "is_priority"],
}


def slow_forward(engine: Engine, seconds: float = SLOW_FORWARD_S) -> None:
    run = engine.runner.run

    def slow_run(fb):
        time.sleep(seconds)  # the device is still busy (not a synchronisation)
        return run(fb)

    engine.runner.run = slow_run


def short_probes(engine: Engine, turns_between_probes: int = 2) -> RunChoice:
    """Give `engine` (overlapped, `decode_steps="auto"`) a `RunChoice` that probes 3 steps
    at a time, with `turns_between_probes` between probes, where its loop and its
    scheduler read it; returns it."""
    choice = RunChoice(probe_steps=3, turns_between_probes=turns_between_probes)
    engine._run_choice = engine.scheduler.run_choice = choice
    return choice


# How the overlapped engine's forward worker runs its jobs (`ForwardWorker`'s `threaded`).
WORKERS = {"worker_thread": True, "loop_thread": False}


def on_loop_thread(engine: Engine) -> None:
    """`engine`'s forward worker runs its jobs on the loop thread, as on CUDA (call it
    before the engine's first request)."""
    engine._worker.close()
    engine._worker = ForwardWorker(engine.runner, threaded=False)


@contextmanager
def engine_pair(tiny_path: str, worker: str = "worker_thread") -> Iterator[tuple[Engine, Engine]]:
    """(synchronous, overlapped) engines on the tiny model, both with a slow forward; the
    overlapped one's forward worker as `worker` says (a key of `WORKERS`)."""
    with (
        Engine(tiny_path, overlap_schedule=False, **POOL) as sync,
        Engine(tiny_path, overlap_schedule=True, **POOL) as overlapped,
    ):
        assert sync._worker is None and overlapped._worker is not None
        if not WORKERS[worker]:
            on_loop_thread(overlapped)
        slow_forward(sync)
        slow_forward(overlapped)
        yield sync, overlapped


def assert_stream_aborts_match(
    reference: Engine, engine: Engine, params: list[dict], aborted_after: dict[int, int]
) -> None:
    """Request i of `PROMPTS[:len(params)]` is aborted from its own stream's callback
    after `aborted_after[i]` chunks, on both engines: on `engine`, as on `reference`,
    each such request ends aborted with no chunk after it, and every other one gives
    `reference`'s result."""

    def run(engine: Engine) -> tuple[list, list]:
        counts = [0] * len(params)

        def on_chunk(i: int, chunk: dict) -> None:
            counts[i] += 1
            if counts[i] == aborted_after.get(i):
                engine.abort(chunk["meta_info"]["id"])

        futures = engine.submit(PROMPTS[: len(params)], params, on_chunk=on_chunk)
        return [f.exception(timeout=60) or f.result() for f in futures], counts

    want, _ = run(reference)
    got, counts = run(engine)
    for i, (g, w) in enumerate(zip(got, want)):
        if i in aborted_after:
            assert isinstance(g, RequestAborted) and isinstance(w, RequestAborted)
            assert counts[i] == aborted_after[i]  # no chunk after the abort was seen
        else:
            assert result_key(g) == result_key(w)


def result_key(out: dict) -> tuple:
    """What must be identical between the two loops (not the request id)."""
    assert all(token >= 0 for token in out["output_ids"])  # no placeholder left behind
    meta = out["meta_info"]
    return out["output_ids"], out["text"], meta["finish_reason"], meta["completion_tokens"]


def assert_same_logprobs(got: dict, want: dict) -> None:
    """`got`'s prompt and output logprobs and top lists are `want`'s: the same tokens, in
    order, their values to 1e-4 (float32: a batch's shape, which differs between the
    loops, moves a logprob by some 1e-6 to 1e-5; two alternatives that close may swap
    places in a top list)."""
    got_meta, want_meta = got["meta_info"], want["meta_info"]
    for name in ("input_token_logprobs", "output_token_logprobs"):
        assert (name in got_meta) == (name in want_meta), name
        pairs = got_meta.get(name, []), want_meta.get(name, [])
        assert [token for _, token, _ in pairs[0]] == [token for _, token, _ in pairs[1]], name
        values = [[value for value, *_ in side if value is not None] for side in pairs]
        assert values[0] == pytest.approx(values[1], abs=1e-4), name
    for name in ("input_top_logprobs", "output_top_logprobs"):
        assert (name in got_meta) == (name in want_meta), name
        for mine, theirs in zip(got_meta.get(name, []), want_meta.get(name, []), strict=True):
            if theirs is None:
                assert mine is None
                continue
            values = [value for value, *_ in mine], [value for value, *_ in theirs]
            assert values[0] == pytest.approx(values[1], abs=1e-4), name
            for j, ((_, token, _), (value, other, _)) in enumerate(zip(mine, theirs)):
                tied = [k for k, v in enumerate(values[1]) if k != j and abs(v - value) <= 1e-4]
                assert token == other or tied, name


def record_penalty_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[int, collections.Counter, int]]:
    """A list that gets, for each penalised row of each draw in a decode run, (request id,
    the counts its penalties read on the device: token -> times, the token it drew)."""
    from lmprog_runtime import decode_run
    from lmprog_runtime.penalties import PenaltyCounts

    counted: list[tuple[int, collections.Counter, int]] = []
    read: dict[int, collections.Counter] = {}  # the last draw's, by row of the table
    apply, sample_each = PenaltyCounts.apply, decode_run.sample_each

    def applying(self, logits, rows, weights, where):
        apply(self, logits, rows, weights, where)
        for row in rows:
            mine = self._counts[row.row]
            tokens = mine.nonzero().flatten().tolist()
            read[row.row] = collections.Counter(dict(zip(tokens, mine[tokens].int().tolist())))

    def recording(logits, rows):
        read.clear()
        token_ids, errors = sample_each(logits, rows)
        for row, token in zip(rows, token_ids.tolist()):
            if row.penalty is not None:
                counted.append((row.rid, read[row.penalty.row], token))
        return token_ids, errors

    monkeypatch.setattr(PenaltyCounts, "apply", applying)
    monkeypatch.setattr(decode_run, "sample_each", recording)
    return counted


def assert_each_draw_counts_its_tokens(
    counted: list[tuple[int, collections.Counter, int]], outputs: dict[int, list[int]]
) -> None:
    """Each draw `record_penalty_counts` saw counted exactly its request's tokens so far:
    the first tokens of its output, each as many times as it is there, and the token it
    drew the next one (where the output has them: a request that stopped inside a run
    drew past its end, and counted all its output then)."""
    whole = 0
    for rid, counts, token in counted:
        output = outputs[rid]
        n = counts.total()
        if n <= len(output):
            assert counts == collections.Counter(output[:n]), rid
        else:
            assert not collections.Counter(output) - counts, rid
        if n < len(output):
            assert output[n] == token, rid
            whole += 1
    assert whole > len(counted) // 2


def stop_inside(engine: Engine, prompt: str, params: dict) -> str:
    """A stop string the unstopped output contains past its start (so it stops mid-run)."""
    text = engine.generate(prompt, params)["text"]
    assert len(text) > 8
    return text[len(text) // 2 : len(text) // 2 + 2]


def assert_slots_free(engine: Engine) -> dict:
    """At once (no waiting): every KV slot free or cached, none locked, every request slot
    and penalty row free. Returns the memory state."""
    state = engine.memory_state()
    assert state["kv_slots_free"] + state["kv_slots_cached"] == state["kv_slots_total"]
    assert state["kv_slots_locked"] == 0 and state["req_slots_free"] == state["req_slots_total"]
    assert state["penalty_rows_used"] == 0
    return state


def plans(aborted_after: list[int | None]) -> st.SearchStrategy:
    """Random mixes of requests: (prompt index, max_new_tokens, seed or None for greedy,
    the chunks after which it is aborted or None) each."""
    return st.lists(
        st.tuples(
            st.integers(0, len(PROMPTS) - 1),
            st.integers(1, 40),  # max_new_tokens
            st.sampled_from([None, 0, 11]),  # greedy or a seed
            st.sampled_from(aborted_after),  # aborted after this many chunks
        ),
        min_size=1,
        max_size=10,
    )


def check_plan(engine: Engine, reference: Engine, plan: list[tuple]) -> None:
    """Run `plan` (`plans`) on `engine`, each request aborted from its stream after its
    chunks; a request not aborted produces exactly what `reference` produces, and
    `engine` ends clean."""
    prompts = [PROMPTS[p] for p, _, _, _ in plan]
    mix = [
        {"max_new_tokens": n, "temperature": 0 if seed is None else 0.9, "seed": seed}
        for _, n, seed, _ in plan
    ]
    mix = [{**params, "ignore_eos": True} for params in mix]

    def on_chunk(i: int, chunk: dict) -> None:
        if chunk["meta_info"]["completion_tokens"] == plan[i][3]:
            engine.abort(chunk["meta_info"]["id"])

    futures = engine.submit(prompts, mix, on_chunk=on_chunk)
    results = [f.exception(timeout=120) or f.result() for f in futures]
    assert engine_leak(engine) is None
    want = reference.generate(prompts, mix)
    for (_, max_new, _, abort_after), got, out in zip(plan, results, want):
        if isinstance(got, RequestAborted):
            assert abort_after is not None and abort_after < max_new
        else:
            assert result_key(got) == result_key(out)


def count_runs(engine: Engine) -> list[int]:
    """A list that counts (by length) each run `engine` takes, by its number of steps."""
    taken: list[int] = []
    step_run = engine._step_run

    def counted(batch, steps):
        taken.append(steps)
        return step_run(batch, steps)

    engine._step_run = counted
    return taken


def count_runs_ahead(engine: Engine) -> list[int]:
    """A list that counts (by length) the runs `engine` launches ahead of the commit of
    the run before, by the tokens their requests are ahead."""
    launched: list[int] = []
    launch_run = engine._launch_run

    def counted(batch, ahead, first_ids=None, offset=0):
        if offset:
            launched.append(offset)
        return launch_run(batch, ahead, first_ids, offset)

    engine._launch_run = counted
    return launched


def count_launches_before_check(engine: Engine) -> list[bool]:
    """A list of whether each of `engine`'s attempts to launch a run before the check of
    the step before it launched one (the overlapped loop with decode runs)."""
    launched: list[bool] = []
    launch_before_check = engine._launch_before_check

    def counted(batch, steps):
        run = launch_before_check(batch, steps)
        launched.append(run is not None)
        return run

    engine._launch_before_check = counted
    return launched
