"""The engine's loop thread itself: it runs steps while its engine has work, and exits
once the engine is shut down or collected.

The thread holds the engine only weakly while it waits (a strong reference while it has
work), so an engine nobody references is collected with its model and KV pool once its
requests are done, and its finalizer (`wake`) wakes the thread to exit.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING

from lmprog_runtime.transfer import use_device

if TYPE_CHECKING:
    from lmprog_runtime.engine import Engine
    from lmprog_runtime.gc_freeze import BusyFreeze
    from lmprog_runtime.results import DoneFlag

logger = logging.getLogger("lmprog_runtime.engine")


def serve(
    engine_ref: weakref.ref[Engine], cv: threading.Condition, freeze: BusyFreeze, exited: DoneFlag
) -> None:
    """The loop thread: run steps while the engine has work, until it is shut down or gone;
    the collector's freeze (`gc_freeze.py`) is told when it takes up work and when it has
    none left, and `exited` once it is out of the loop (the engine's shutdown waits for
    that, not for `join`: on Python 3.11 a Ctrl-C in `join` could leave the thread looking
    stopped while it ran on, and a later `join` returned at once).

    A strong reference is held while there is work and dropped before waiting, so while
    the engine is idle only callers keep it alive. The idle check and the wait share one
    acquisition of `cv`, so a submit cannot slip between them; the engine's
    finalizer notifies `cv`, and the next check finds the reference dead.
    """
    try:
        _serve(engine_ref, cv, freeze)
    finally:
        freeze.idle()
        exited.set()


def _serve(engine_ref: weakref.ref[Engine], cv: threading.Condition, freeze: BusyFreeze) -> None:
    engine = engine_ref()
    if engine is not None:
        use_device(engine.runner.device)  # (the engine's device, for this thread's work)
    del engine
    while True:
        with cv:
            engine = engine_ref()
            if engine is None or engine._stopping:
                return
            is_idle = engine._is_idle()
            linger = freeze.lingering() if is_idle and freeze.is_busy else 0.0
            if is_idle and (linger or not freeze.is_busy):
                # Dropping the last reference runs the finalizer here (`cv` is reentrant), and
                # its notify would be lost: check again before waiting.
                del engine
                if engine_ref() is None:
                    return
                cv.wait(linger or None)  # (busy still: more work soon keeps the freeze)
                continue
        if is_idle:  # (outside `cv`: leaving may collect, and run finalizers)
            del engine
            freeze.idle()
            continue
        freeze.busy()
        try:
            engine._run_once()
        except BaseException as error:  # a bug outside any one step: fail what it held, go on
            logger.exception("engine loop iteration failed")
            engine._fail_all(error)
        # (the reference is kept while work remains: an engine its caller dropped with
        # requests unfinished serves them, then is collected once idle)


def wake(cv: threading.Condition) -> None:
    """An engine's finalizer: wake its loop thread, which then finds the engine gone."""
    with cv:
        cv.notify_all()
