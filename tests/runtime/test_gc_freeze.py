"""The collector's freeze (`lmprog_runtime/gc_freeze.py`): the modules an engine imports are
frozen before the engine object exists, an engine's own objects never are (a dropped engine
is still collected), and the freeze is undone when the last engine ends.

The freeze is process-wide, so each check runs in a fresh interpreter (this one holds the
session's engines). An object is frozen when it is tracked by the collector and yet in none
of its generations (`gc.get_objects()` lists the generations only).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading

from lmprog_runtime.request import DoneFlag

SCRIPT = r"""
import gc, json, sys, weakref
from lmprog_runtime import Engine, gc_freeze
from lmprog_runtime import engine as engine_module

path, out = sys.argv[1], {}
OK = {"max_new_tokens": 3, "temperature": 0}

def frozen(obj):
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())

def state():
    return [gc_freeze.is_frozen(), gc.get_freeze_count() > 0]

try:
    Engine(path, no_such_field=1)
except TypeError:
    out["bad_arguments"] = ["transformers" in sys.modules, gc.get_freeze_count()]

engine = Engine(path)
out["first"] = state()
out["modules_frozen"] = [frozen(vars(sys.modules[m])) for m in ("torch._dynamo", "transformers")]
own = [engine, vars(engine), engine.runner, engine.runner.model, engine.tokenizer]
out["own_frozen"] = [frozen(obj) for obj in own]
del own
out["tokens"] = len(engine.generate("hello", OK)["output_ids"])
count = gc.get_freeze_count()
second = Engine(path)  # another engine is alive: nothing more is frozen
out["second"] = [gc.get_freeze_count() == count, frozen(second)]
engine.shutdown()
out["one_left"] = state()
second.shutdown()
out["none_left"] = state()
third = Engine(path)  # the shut-down ones are still referenced: no freeze
out["referenced"] = state()
third.shutdown()
del engine, second, third
gc.collect()

dropped = Engine(path)  # dropped without a shutdown
out["dropped_start"] = state()
ref, thread = weakref.ref(dropped), dropped._thread
del dropped
gc.collect()
thread.join(30)
out["dropped"] = [ref() is None, thread.is_alive()] + state()

off = Engine(path, gc_freeze=False)
out["off"] = state()
off.shutdown()
del off
gc.collect()

def raising(*args, **kwargs):
    raise RuntimeError("no runner")

runner, engine_module.ModelRunner = engine_module.ModelRunner, raising
try:
    Engine(path)
except RuntimeError:
    out["failed_start"] = state()
engine_module.ModelRunner = runner
gc.collect()

gc.freeze()  # the process manages its collector itself
count = gc.get_freeze_count()
mine = Engine(path)
out["user_frozen"] = [gc_freeze.is_frozen(), frozen(mine)]
mine.shutdown()
out["user_frozen"].append(gc.get_freeze_count() == count)
print(json.dumps(out))
"""


def test_the_freeze_spares_engines_and_ends_with_the_last(tiny_path):
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_path],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # Bad arguments are refused before anything is imported or frozen.
    assert out["bad_arguments"] == [False, 0]
    # The first engine froze what was alive, the modules its start imports included...
    assert out["first"] == [True, True]
    assert out["modules_frozen"] == [True, True]
    # ...but none of its own objects, and it serves.
    assert out["own_frozen"] == [False] * 5
    assert out["tokens"] == 3
    # A second engine freezes nothing more and is not frozen itself.
    assert out["second"] == [True, False]
    # The freeze lasts while an engine runs, and ends with the last.
    assert out["one_left"] == [True, True]
    assert out["none_left"] == [False, False]
    # No freeze while an engine object is alive (here shut down, and referenced).
    assert out["referenced"] == [False, False]
    # An engine dropped without a shutdown is collected, its thread ends, the freeze too.
    assert out["dropped_start"] == [True, True]
    assert out["dropped"] == [True, False, False, False]
    assert out["off"] == [False, False]
    # A start that fails gives its hold back.
    assert out["failed_start"] == [False, False]
    # Objects the process froze itself stay frozen, and no engine freezes or unfreezes.
    assert out["user_frozen"] == [False, False, True]


def test_a_waiting_request_gives_the_collector_few_objects(engine):
    """Every full pass walks the requests still waiting (a dataset's, submitted at once):
    a plain request adds 7 objects here (the prompts' lists are the caller's), where an event
    (6 objects, against 2 for `DoneFlag`), new empty sets and logprob lists made it 18."""
    prompts = [[5 + i, 6, 7, 8] for i in range(256)]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    gc.collect()
    before = len(gc.get_objects())
    reqs, _ = engine._make_reqs(None, params, prompts, False, -1, 0, False, stream=False)
    gc.collect()
    per_request = (len(gc.get_objects()) - before) / len(reqs)
    assert per_request <= 8, per_request
    asked = engine._make_reqs(None, params, prompts[:1], True, 0, 2, False, stream=False)[0]
    assert [type(asked[0].output_token_logprobs), type(asked[0].input_top_logprobs)] == [
        list,
        list,
    ]


def test_done_flag_wakes_every_waiter():
    flag = DoneFlag()
    assert not flag.wait(0) and not flag.is_set()
    woke: list[bool] = []
    waiters = [
        threading.Thread(target=lambda: woke.append(flag.wait()), daemon=True) for _ in range(4)
    ]
    for waiter in waiters:
        waiter.start()
    flag.set()
    flag.set()  # (a second set changes nothing)
    for waiter in waiters:
        waiter.join(30)
    assert woke == [True] * 4 and flag.is_set() and flag.wait(0)
