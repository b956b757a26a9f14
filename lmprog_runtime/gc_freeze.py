"""Short full passes of Python's cyclic garbage collector while engines run.

CPython's cyclic collector now and then runs a full pass (its oldest generation): every
thread stops while it walks every container object the process tracks. An engine's start
imports torch's compiler stack (with sympy), transformers and triton: some 350,000 objects
that are never garbage. A full pass over them took ~150-175 ms on a 2-vCPU EPYC, and
requests and the prefix cache make objects that outlive the young generations, so such
passes come every few thousand requests of a long run, each a stall of the loop (and of
the GPU behind it). vLLM and SGLang freeze their processes' start-up heap for this reason.

Before an engine object exists (`Engine.__new__`), a `FreezeHold` imports what an engine's
start imports, collects, and freezes every object alive (`gc.freeze()`: the collector walks
them no more); a full pass then walks the engines' own objects and what was made since
(2-3 ms for "tiny" or SmolLM2-135M). Where the freeze is not made:

- while another engine object is alive (running, shut down and still referenced, or
  garbage not yet collected): its objects would be frozen, and a cycle of them could no
  longer be collected;
- when something else froze objects first (`gc.get_freeze_count()`): the process manages
  its collector itself;
- with `gc_freeze=False`.

An engine's own objects are thus never frozen: a dropped engine stays collectable, and its
loop thread ends when it is. When the last hold is released (its engine's loop thread ends:
at shutdown, or once the engine is collected), the objects are unfrozen
(`gc.unfreeze()`), and cycles that became garbage meanwhile are collected as before. The
state below is process-wide, as the collector is, and guarded by `_lock`.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

_lock = threading.Lock()
_engines: weakref.WeakSet[Any] = weakref.WeakSet()  # every engine object alive
_num_holds = 0  # holds taken and not released
_is_frozen = False  # the objects frozen now were frozen here


class FreezeHold:
    """One engine's part in the freeze: taken before the engine object exists, released
    once (`release`), when its loop thread ends or its construction fails.

    Example:
        >>> hold = FreezeHold(freeze=False)
        >>> hold.release()
    """

    def __init__(self, freeze: bool) -> None:
        global _num_holds, _is_frozen
        self._is_held = True
        with _lock:
            _num_holds += 1
            if not freeze or _is_frozen or gc.get_freeze_count() or _engines:
                return
            _import_engine_modules()
            gc.collect()  # (garbage alive now would be frozen with the rest)
            gc.freeze()
            _is_frozen = True

    def register(self, engine: Any) -> None:
        """`engine` is alive: no freeze is made until it is collected."""
        _engines.add(engine)

    def release(self) -> None:
        """Give the hold back (once; later calls do nothing): the last one unfreezes."""
        global _num_holds, _is_frozen
        with _lock:
            if not self._is_held:
                return
            self._is_held = False
            _num_holds -= 1
            if _num_holds == 0 and _is_frozen:
                gc.unfreeze()
                _is_frozen = False


def is_frozen() -> bool:
    """Whether objects are frozen by an engine's hold now."""
    return _is_frozen


def _import_engine_modules() -> None:
    """Import now what an engine's start imports (so that its objects are frozen too): the
    tokenizer classes (transformers, tokenizers, jinja2), and torch's compiler stack (sympy,
    triton), which building the model under a device context imports."""
    import torch._dynamo  # noqa: F401
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
