"""Short full passes of Python's cyclic garbage collector while engines have work.

CPython's cyclic collector now and then runs a full pass (its oldest generation): every
thread stops while it walks every container object the process tracks. After an engine's
start that is some 370,000 objects, nearly all of them the modules the start imported
(torch's compiler stack with sympy, transformers, triton), never garbage: a full pass took
150-300 ms on a 2-vCPU EPYC. A long run's requests, results and prefix cache make objects
that outlive the young generations, so it took such a pass every few thousand requests,
each a stall of the engine loop (and of the GPU behind it). vLLM and SGLang freeze their
processes' start-up heap for this reason.

Here the heap is frozen (`gc.freeze()`: the collector walks those objects no more) while
any engine's loop has work or a caller is inside `generate`, and unfrozen (`gc.unfreeze()`)
once none is: a full pass during a run walks only what was made since it began. Both calls
move whole lists, whatever their length. The process is an application's, not ours, so the
freeze does not outlast the work for long, and garbage is collected about as CPython's
own schedule would:

- a loop out of work keeps the freeze `LINGER_S` (0.1 s) more, so work that comes back to
  back (a program's next gen, a script's next call, a dataset's next window) runs under one
  freeze: each new one moves every young object to the oldest generation (and cycles among
  them wait there for a full pass, where young passes would have freed them);
- the young generations are collected before each freeze (frozen and unfrozen, their
  survivors would reach the oldest generation uncounted, and cycles among them would pile
  up over thousands of calls);
- one full pass over everything runs when the work ends, outside any step, if the
  collector ran full passes while frozen (they left the frozen objects out), or if the heap
  grew by a quarter since the last full pass (`sys.getallocatedblocks()`, read every 16th
  young pass: each freeze starts the collector's own count afresh, so over calls apart its
  full passes never come due). A cycle that became garbage meanwhile (a dropped engine, an
  object of the caller's in a cycle holding one, a cycle that lived through a few calls) is
  freed then: cyclic garbage of the oldest generation stays bounded by a quarter of the
  heap, as CPython bounds it (by a quarter of its long-lived objects).

A pass for the heap's growth that finds no garbage to speak of raises the mark instead
(the growth was live data, or data freed during the pass: passing again at every call
would cost 150-300 ms each). Objects the process froze itself (`gc.get_freeze_count()`
when a freeze would start; it walks them, so a yes is kept 10 s) are left alone, as is the
collector of an engine made with `gc_freeze=False`; but a `gc.freeze()` of the process's
own while an engine works, or lingers, is undone with ours (telling it apart would cost a
walk of the frozen objects: freeze after `engine.shutdown()`). A cycle alive when the work
began and dropped within the linger (an engine held by a caller's object in a cycle) waits
for the linger's end to be freed: `engine.shutdown()` ends an engine's at once. A forked
child starts unfrozen, with nothing counted busy. The state is process-wide, as the
collector is, and guarded by `_lock`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
import time
from collections.abc import Iterator

LINGER_S = 0.1  # how long a loop out of work keeps the freeze (`BusyFreeze.lingering`)
GROWTH_PER_FULL_PASS = 0.25  # (as CPython's own: a quarter more long-lived objects)
# Reading the heap's size walks its pools (some 50 us): it is read when the young
# generations were collected this many times since the last reading (once a call at least).
YOUNG_PASSES_PER_CHECK = 16
# A pass for the heap's growth that finds fewer unreachable objects than this found no
# garbage to speak of: the growth is live data.
FUTILE_PASS_OBJECTS = 100
PROCESS_FREEZE_RECHECK_S = 10.0  # (`_process_froze`)

_lock = threading.Lock()
_num_busy = 0  # loops (of engines with gc_freeze) that have work, and `working` callers
_is_frozen = False  # the objects frozen now were frozen here
_full_passes = 0  # the collector's full passes before the freeze began
# The heap's size (`sys.getallocatedblocks()`) after the last full pass seen, and that
# pass's number: a full pass is owed when the heap has grown by GROWTH_PER_FULL_PASS since.
_blocks_at_full_pass = 0
_full_pass_seen = -1
_young_passes_at_check = 0  # the young passes when the heap's size was last read
_process_froze_until = 0.0  # until when the process's own freeze is taken as still there


class BusyFreeze:
    """One engine's part in the freeze, used by its loop thread alone: `busy` when the loop
    takes up work, `idle` when it has none left or ends. The first of the busy loops and
    `working` callers freezes, the last to leave unfreezes. A loop out of work waits
    `lingering()` seconds for more before it goes idle.

    Example:
        >>> freeze = BusyFreeze(enabled=False)
        >>> freeze.busy(), freeze.is_busy, is_frozen()
        (None, False, False)
    """

    __slots__ = ("_is_enabled", "is_busy", "_idle_at")

    def __init__(self, enabled: bool) -> None:
        self._is_enabled = enabled
        self.is_busy = False
        self._idle_at = 0.0  # (while out of work: when the loop goes idle; 0: not yet out)

    def busy(self) -> None:
        self._idle_at = 0.0
        if not self.is_busy and self._is_enabled:
            _enter()
            self.is_busy = True

    def lingering(self) -> float:
        """Seconds a busy loop out of work still waits for more before going idle (0: go
        now). Work that comes back to back (a program's next gen, a script's next call, a
        dataset's next window) then keeps one freeze: each new freeze would move every
        young object to the oldest generation, where only a full pass frees it."""
        now = time.monotonic()
        if not self._idle_at:
            self._idle_at = now + LINGER_S
        return max(0.0, self._idle_at - now)

    def idle(self) -> None:
        if self.is_busy:
            self.is_busy = False
            _leave()


@contextlib.contextmanager
def working(enabled: bool) -> Iterator[None]:
    """A caller's thread making requests and waiting for them (a dataset's thousands at
    once allocate enough to set off a full pass): frozen meanwhile, as while a loop is
    busy."""
    if not enabled:
        yield
        return
    _enter()
    try:
        yield
    finally:
        _leave()


def _enter() -> None:
    global _num_busy, _is_frozen, _full_passes, _blocks_at_full_pass, _full_pass_seen
    # (collections run outside `_lock`: a finalizer they run may make requests)
    with _lock:
        freezes = not _is_frozen and not _process_froze()
    if freezes:
        # Young garbage is collected first, its survivors counted into the oldest
        # generation as usual (frozen and unfrozen, they would skip that count, and so the
        # full passes that would free them).
        gc.collect(1)
        passes = _num_full_passes()
    with _lock:
        if freezes and not _is_frozen and not gc.get_freeze_count():
            _full_passes = passes
            if passes != _full_pass_seen:  # (the collector's own, made while unfrozen)
                _full_pass_seen = passes
                _blocks_at_full_pass = sys.getallocatedblocks()
            gc.freeze()
            _is_frozen = True
        _num_busy += 1


def _process_froze() -> bool:
    """Whether the process froze objects itself. `gc.get_freeze_count()` walks the frozen
    objects (25-30 ms for 355,000), so a yes is kept PROCESS_FREEZE_RECHECK_S before it is
    asked again: a process that froze its heap (before forking workers, say) would pay the
    walk at every call."""
    global _process_froze_until
    now = time.monotonic()
    if now < _process_froze_until:
        return True
    if gc.get_freeze_count():
        _process_froze_until = now + PROCESS_FREEZE_RECHECK_S
        return True
    return False


def _leave() -> None:
    global _num_busy, _is_frozen, _blocks_at_full_pass, _full_pass_seen, _young_passes_at_check
    with _lock:
        _num_busy -= 1
        if _num_busy or not _is_frozen:
            return
        gc.unfreeze()
        _is_frozen = False
        before = _full_passes
        blocks = 0
        young_passes = gc.get_stats()[1]["collections"]
        if young_passes - _young_passes_at_check >= YOUNG_PASSES_PER_CHECK:
            _young_passes_at_check = young_passes
            blocks = sys.getallocatedblocks()
        grown = blocks > _blocks_at_full_pass * (1 + GROWTH_PER_FULL_PASS)
    if _num_full_passes() > before or grown:
        # The collector wanted full passes meanwhile, and they left the frozen objects out,
        # or the heap grew as much as would have set one off unfrozen (each freeze starts
        # the collector's own count afresh, so over short calls none comes due): one over
        # everything now, while nothing works. Garbage among the objects is then freed.
        found = gc.collect()
        with _lock:
            _full_pass_seen = _num_full_passes()
            _blocks_at_full_pass = sys.getallocatedblocks()
            if grown and found < FUTILE_PASS_OBJECTS:
                # The growth was not cyclic garbage (objects the collector does not track,
                # or ones other threads freed meanwhile, during the pass itself): the heap
                # as it was is the mark to grow from, or each call would pass again.
                _blocks_at_full_pass = max(_blocks_at_full_pass, blocks)


def _num_full_passes() -> int:
    return gc.get_stats()[-1]["collections"]


def is_frozen() -> bool:
    """Whether objects are frozen by a busy engine now."""
    return _is_frozen


def _reset_in_child() -> None:
    """A process forked while an engine worked (or lingered): none of the parent's loops
    or callers runs in it, so nothing would ever end the freeze there."""
    global _lock, _num_busy, _is_frozen
    _lock = threading.Lock()  # (another thread of the parent may have held it)
    _num_busy = 0
    if _is_frozen:
        gc.unfreeze()
        _is_frozen = False


os.register_at_fork(after_in_child=_reset_in_child)


@atexit.register
def _unfreeze_at_exit() -> None:
    """A process that exits while an engine works: frozen objects are never finalized, and
    some bindings (triton's) report them as leaked."""
    global _is_frozen
    with _lock:
        if _is_frozen:
            gc.unfreeze()
            _is_frozen = False
