"""Shared by the overlap test modules: a synchronous and an overlapped engine on the tiny
model, both with a fake slow forward, and how their results are compared.

The slow forward is a sleep before the real one (a device still busy, not a
synchronisation): in the overlapped engine whose forward worker is a thread, the checks of
one step then really run during the next forward. The overlapped engine comes both ways
(`WORKERS`): its worker a thread, as on a CPU, or running its jobs on the loop thread, as
on CUDA (there a forward is queued, here it runs: the bookkeeping is the same).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from lmprog_runtime import Engine
from lmprog_runtime.forward_worker import ForwardWorker

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


def slow_forward(engine: Engine) -> None:
    run = engine.runner.run

    def slow_run(fb):
        time.sleep(SLOW_FORWARD_S)  # the device is still busy (not a synchronisation)
        return run(fb)

    engine.runner.run = slow_run


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


def result_key(out: dict) -> tuple:
    """What must be identical between the two loops (not the request id)."""
    assert all(token >= 0 for token in out["output_ids"])  # no placeholder left behind
    meta = out["meta_info"]
    return out["output_ids"], out["text"], meta["finish_reason"], meta["completion_tokens"]


def stop_inside(engine: Engine, prompt: str, params: dict) -> str:
    """A stop string the unstopped output contains past its start (so it stops mid-run)."""
    text = engine.generate(prompt, params)["text"]
    assert len(text) > 8
    return text[len(text) // 2 : len(text) // 2 + 2]
