"""Engine counters: what the runtime computed, reused and scheduled since the last reset."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from lmprog_runtime.forward_batch import ForwardMode

if TYPE_CHECKING:
    from lmprog_runtime.scheduled_batch import ScheduledBatch

COUNTERS = (
    "prefill_tokens",  # tokens computed by prefill / extend forwards
    "cached_tokens",  # prompt tokens served from the prefix cache instead
    "prompt_tokens",  # requests' prompt tokens, as they are taken in (a group's internal
    # prefill of its shared prefix included, as `cached_tokens` includes what it reuses)
    "decode_tokens",  # tokens computed by decode forwards
    "forward_passes",
    "jump_forward_tokens",
    "evicted_tokens",
    "retracted_requests",
    "decode_runs",  # decode runs launched (`decode_steps`), ahead of a commit or not
    "admission_waits",  # steps at which admission waited to admit several at once
    "max_running_requests_seen",
    "finished_requests",  # requests that completed (counted before their callers are told)
    "forward_seconds",  # wall time inside the model forward
    "step_seconds",  # wall time of whole steps (forward + sampling + bookkeeping)
)


class EngineStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._values: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def record_step(
        self,
        batch: ScheduledBatch,
        *,
        num_running: int,
        forward_seconds: float,
    ) -> None:
        """A forward's counters, recorded as its results are committed (before any of its
        requests is told, so a caller that wakes reads them)."""
        num_new = int(batch.out_cache_loc.numel())
        with self._lock:
            v = self._values
            v["forward_passes"] += 1
            if batch.mode is ForwardMode.EXTEND:
                v["prefill_tokens"] += num_new - batch.num_decodes
                v["decode_tokens"] += batch.num_decodes
            else:
                v["decode_tokens"] += num_new
            v["max_running_requests_seen"] = max(
                v["max_running_requests_seen"], num_running, len(batch.reqs)
            )
            v["forward_seconds"] += forward_seconds

    def record_decode_steps(
        self, tokens: list[int], *, num_running: int, forward_seconds: float
    ) -> None:
        """Decode forwards of `tokens[k]` requests each (a decode run's steps, committed
        together), counted as `record_step` counts each."""
        with self._lock:
            v = self._values
            v["forward_passes"] += len(tokens)
            v["decode_tokens"] += sum(tokens)
            most = max(tokens, default=0)
            v["max_running_requests_seen"] = max(v["max_running_requests_seen"], num_running, most)
            v["forward_seconds"] += forward_seconds * len(tokens)
