"""Short full passes of Python's cyclic garbage collector while engines have work (opt-in).

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
as soon as none is: a full pass during a run walks only what was made since it began. Both
calls move whole lists, whatever their length. The process is an application's, not ours,
so the freeze never outlasts the work, and garbage is collected as the work ends:

- the young generations are collected before each freeze (frozen and unfrozen, their
  survivors would reach the oldest generation uncounted, and cycles among them would pile
  up over thousands of calls);
- if the collector ran full passes while frozen, one full pass runs when the work ends,
  outside any step: a cycle that became garbage meanwhile (a dropped engine, an object of
  the caller's in a cycle holding one) is freed then.

Objects the process froze itself (`gc.get_freeze_count()` when a freeze would start) are
left alone, as is the collector of an engine made with `gc_freeze=False`. The state is
process-wide, as the collector is, and guarded by `_lock`.

Known limit (why `gc_freeze` is off by default): over many short calls the collector's own
full passes rarely come due while frozen, so cyclic garbage of the oldest generation stays
uncollected (400 `generate` calls, each dropping a cycle that had lived through five: all
400 alive at the end, against 47 without the freeze).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_num_busy = 0  # loops (of engines with gc_freeze) that have work, and `working` callers
_is_frozen = False  # the objects frozen now were frozen here
_full_passes = 0  # the collector's full passes before the freeze began


class BusyFreeze:
    """One engine's part in the freeze, used by its loop thread alone: `busy` when the loop
    takes up work, `idle` when it has none left or ends. The first of the busy loops and
    `working` callers freezes, the last to leave unfreezes.

    Example:
        >>> freeze = BusyFreeze(enabled=False)
        >>> freeze.busy(), freeze.is_busy, is_frozen()
        (None, False, False)
    """

    __slots__ = ("_is_enabled", "is_busy")

    def __init__(self, enabled: bool) -> None:
        self._is_enabled = enabled
        self.is_busy = False

    def busy(self) -> None:
        if not self.is_busy and self._is_enabled:
            _enter()
            self.is_busy = True

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
    global _num_busy, _is_frozen, _full_passes
    # (collections run outside `_lock`: a finalizer they run may make requests)
    with _lock:
        freezes = not _is_frozen and not gc.get_freeze_count()
    if freezes:
        # Young garbage is collected first, its survivors counted into the oldest
        # generation as usual (frozen and unfrozen, they would skip that count, and so the
        # full passes that would free them).
        gc.collect(1)
        passes = _num_full_passes()
    with _lock:
        if freezes and not _is_frozen and not gc.get_freeze_count():
            _full_passes = passes
            gc.freeze()
            _is_frozen = True
        _num_busy += 1


def _leave() -> None:
    global _num_busy, _is_frozen
    with _lock:
        _num_busy -= 1
        if _num_busy or not _is_frozen:
            return
        gc.unfreeze()
        _is_frozen = False
        before = _full_passes
    if _num_full_passes() > before:
        # The collector wanted full passes meanwhile, and they left the frozen objects out:
        # one over everything now, while nothing works (as often as it would have walked
        # them unfrozen; garbage among them is then freed).
        gc.collect()


def _num_full_passes() -> int:
    return gc.get_stats()[-1]["collections"]


def is_frozen() -> bool:
    """Whether objects are frozen by a busy engine now."""
    return _is_frozen


@atexit.register
def _unfreeze_at_exit() -> None:
    """A process that exits while an engine works: frozen objects are never finalized, and
    some bindings (triton's) report them as leaked."""
    global _is_frozen
    with _lock:
        if _is_frozen:
            gc.unfreeze()
            _is_frozen = False
