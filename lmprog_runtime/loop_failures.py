"""What the engine's loop fails when something fails: a step's requests (their slots
freed), the requests scheduling took up or refused, the head of a queue nothing can be
admitted from, and, as a last resort, every request it holds, so that no caller waits
for ever and the loop keeps serving.

`LoopFailures` holds these methods of `Engine` (a mixin, with `EngineLoop`: `Engine`
sets every attribute used here). Only the loop thread runs them.
"""

from __future__ import annotations

from lmprog_runtime.scheduled_batch import ScheduledBatch

# Scheduling that raises this many times in a row fails every request the loop holds.
MAX_SCHEDULE_FAILURES = 3


class LoopFailures:
    """The failure side of `EngineLoop`."""

    def _fail_all(self, error: Exception) -> None:
        """Fail every request the loop holds (its last resort: no caller waits forever)."""
        self._abandon_in_flight(error)
        for req in list(self._live.values()):
            self._finish(req, error)
        self._deadlines = []

    def _fail_refused(self) -> None:
        """Requests the scheduler gave up on one by one (an error in their own admission)."""
        for req, error in self.scheduler.take_refused():
            if not req.done.is_set():
                self._finish(req, error)

    def _recover_schedule(self, error: Exception) -> None:
        """Scheduling raised outside any one request. A request it had taken off the
        waiting list without putting it in a batch would wait forever: it fails. If it keeps
        failing, every request it holds fails (the loop cannot make progress for them)."""
        sched = self.scheduler
        held = {id(r) for r in sched.waiting + sched.running}
        if sched.chunked_req is not None:
            held.add(id(sched.chunked_req))
        for req in list(self._live.values()):
            if id(req) not in held and not req.done.is_set():
                self._finish(req, error)
        self._schedule_failures += 1
        if self._schedule_failures >= MAX_SCHEDULE_FAILURES:
            self._fail_all(error)
            self._schedule_failures = 0

    def _fail_step(self, batch: ScheduledBatch, error: BaseException) -> None:
        if not batch.kv_committed:  # the slots of this step hold no valid K/V
            for req, n in zip(batch.reqs, batch.extend_lens):
                req.kv_len += n
        for req in batch.reqs:
            if not req.done.is_set():
                self._finish(req, error)

    def _fail_unschedulable(self) -> None:
        """Nothing runs and nothing can be admitted. Evicting the whole cache must make room
        (every request was checked to fit the pool); if it does not, fail the head of the
        queue rather than spin."""
        sched = self.scheduler
        if sched.running or sched.chunked_req is not None or not sched.waiting:
            return
        if sched.give_back_held():  # (waiting ones that hold K/V: it is evictable now)
            return
        if self.tree_cache is not None and self.tree_cache.evictable_size:
            self._stats.add("evicted_tokens", self.tree_cache.evict(self.tree_cache.evictable_size))
            return
        req = sched.waiting[0]
        self._finish(req, RuntimeError("the request could not be scheduled"))
