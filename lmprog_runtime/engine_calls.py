"""The caller side of `Engine` (a mixin): commands run on the loop thread between steps,
requests handed to the loop, and the check that the caller is in the engine's process.

The loop thread alone owns the scheduler and the KV slots; a caller's thread reaches them
only through the inbox and the command list below, under the engine's lock.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lmprog_runtime.results import DoneFlag, QueueFull, check_off_loop, wait_for

if TYPE_CHECKING:
    from lmprog_runtime.request import Req


class EngineCalls:
    """What a caller's thread does to reach the loop."""

    # ---- caller side --------------------------------------------------------------------
    def _command(self, name: str, *args: Any) -> Any:
        """Run `name` on the loop thread, between steps, and return its result (or raise
        its exception here)."""
        self._check_process()
        check_off_loop(self, f"{name}()")  # (before it is queued: it would run later)
        done, result = DoneFlag(), []  # (not an Event: see `DoneFlag`)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine has been shut down")
            self._commands.append((name, args, done, result))
            self._cv.notify_all()
        wait_for(self, done)
        if isinstance(result[0], Exception):
            raise result[0]
        return result[0]

    def _in_forked_child(self) -> bool:
        return os.getpid() != self._pid

    def _check_process(self) -> None:
        """RuntimeError in a child forked from the engine's process: it has no loop thread,
        and the engine's locks may have been copied held by the parent's threads (a call
        that took one hung)."""
        if self._in_forked_child():
            raise RuntimeError(
                "this engine belongs to the process it was made in: a child forked from it "
                "has no loop thread (make engines in the child, started with "
                "multiprocessing's 'spawn' method)"
            )

    def _submit(self, reqs: list[Req]) -> None:
        self._check_process()
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine has been shut down")
            if not self._thread.is_alive():  # (its futures would never resolve)
                raise RuntimeError("the engine loop is not running")
            limit = self.config.max_queued_requests
            queued = self._num_unfinished - len(self.scheduler.running)
            # (a group's internal prefill of its shared prefix is not the caller's request)
            group = reqs[-1].group if reqs else None
            asked = len(reqs) - (group is not None and group.prefix_req is not None)
            if limit is not None and queued + asked > limit:
                raise QueueFull(
                    f"the engine's queue is full: {queued} requests wait and "
                    f"max_queued_requests={limit}; submit fewer at a time or raise the limit"
                )
            self._num_unfinished += len(reqs)
            self._inbox.extend(reqs)
            self._cv.notify_all()
