"""An engine's life in its process: shut down when the interpreter exits, and kept from
hanging in a child forked from its process.
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lmprog_runtime.engine import Engine

# Every engine not yet collected, shut down when the interpreter exits: a loop thread left
# running torch while Python finalizes aborted the process ("terminate called without an
# active exception", SIGABRT), as after breaking out of a stream and leaving the script.
_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()


def register(engine: Engine) -> None:
    """A new engine, to shut down at exit (and a fork's child then knows one ran here)."""
    global _made_engines
    _LIVE.add(engine)
    _made_engines = True


# Whether an engine was made in this process (its pool has run, and stays, once it is
# collected too); set in a child forked from such a process whose torch used threads.
_made_engines = False
_forked_with_pool = False


def _note_fork_in_child() -> None:
    global _forked_with_pool
    _forked_with_pool = _made_engines and torch.get_num_threads() > 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_note_fork_in_child)


def check_thread_pool_after_fork(device: str) -> None:
    """RuntimeError for an engine made on a CPU with several threads in a child forked from
    a process whose engines ran GNU OpenMP's thread pool (torch's CPU build): the pool
    does not survive the fork, and the first parallel op of the child's engine (a weight
    copy at load) waited forever."""
    if not _forked_with_pool or torch.get_num_threads() == 1 or torch.device(device).type != "cpu":
        return
    try:
        with open("/proc/self/maps") as maps:
            if "libgomp" not in maps.read():
                return  # (another OpenMP runtime: fork is its problem to handle)
    except OSError:
        return
    raise RuntimeError(
        "torch's OpenMP thread pool does not survive a fork: an engine made in a child "
        "forked from a process whose engines ran it hangs at its first parallel op. Start "
        "worker processes with multiprocessing's 'spawn' method, or pass num_threads=1"
    )


# Ctrl-Cs the exit's shutdown waits through for a loop's step to end (the next one leaves
# the loop running into the interpreter's exit, as before).
EXIT_INTERRUPTS = 3


@atexit.register
def _shut_down_at_exit() -> None:
    interrupts = 0
    for engine in list(_LIVE):
        while True:
            try:  # (the loop stops at the end of its step)
                engine.shutdown()
                break
            except KeyboardInterrupt:
                interrupts += 1
                if interrupts > EXIT_INTERRUPTS:
                    raise
