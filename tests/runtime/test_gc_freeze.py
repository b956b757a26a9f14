"""The collector's freeze (`lmprog_runtime/gc_freeze.py`): while an engine has work, the
objects alive when it took it up (the modules its start imported among them) are frozen;
once no engine has work they are unfrozen, so that nothing that became garbage meanwhile
stays uncollected (a dropped engine, an object of the caller's in a cycle holding one).

The freeze is process-wide, so these checks run in a fresh interpreter (this one holds the
session's engines). An object is frozen when it is tracked by the collector and yet in none
of its generations (`gc.get_objects()` lists the generations only). The loop thread goes
idle just after a request's caller wakes, so the script waits for that (`settled`).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time

from lmprog_runtime import gc_freeze
from lmprog_runtime.results import DoneFlag

SCRIPT = r"""
import gc, json, sys, threading, time, weakref
from lmprog_runtime import Engine, gc_freeze

path, out = sys.argv[1], {}
OK = {"max_new_tokens": 3, "temperature": 0}

def frozen(obj):
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())

def state():
    return [gc_freeze.is_frozen(), gc.get_freeze_count() > 0]

def until(condition):  # polls the loop thread's state: passing never depends on the delay
    deadline = time.monotonic() + 30
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()

def settled(want):
    until(lambda: state() == want)
    return state()

def holding(engine):  # the engine's next forward waits for `go` (its step starts first)
    go, stepping = threading.Event(), threading.Event()
    def hook(point, req):
        if point == "forward":
            stepping.set()
            go.wait(60)
    engine.fault_hook = hook
    return go, stepping

class Watch:  # what the loop thread sees in the middle of a step (the fault hook)
    def __init__(self, engine, check):
        self.seen, self.check = [], check
        engine.fault_hook = self
    def __call__(self, point, req):
        if point == "forward" and not self.seen:
            self.seen.append(self.check())

engine = Engine(path, gc_freeze=True)
out["idle"] = state()
during = Watch(engine, lambda: state() + [frozen(vars(sys.modules["torch._dynamo"])), frozen(engine)])
out["tokens"] = len(engine.generate("hello", OK)["output_ids"])
out["busy"] = during.seen[0]
out["done"] = settled([False, False])
made, make = [], engine._make_reqs  # the caller's thread making requests: frozen too
engine._make_reqs = lambda *args, **kwargs: (made.append(state()), make(*args, **kwargs))[1]
engine.generate(["a", "b"], OK)
out["making"] = made[0] + settled([False, False])
del engine._make_reqs

# No garbage is kept. Cycles made between calls, too few to set off a young pass, are
# collected before the next freeze (frozen and unfrozen, they would skip the count that
# sets off full passes, and pile up call after call)...
class Cycle:
    def __init__(self):
        self.me = self
gc.collect()
base = len(gc.get_objects())
for _ in range(500):
    for _ in range(150):
        Cycle()
    engine.generate("hi", {"max_new_tokens": 1, "temperature": 0})
settled([False, False])
out["kept"] = len(gc.get_objects()) - base
# ...and one that became garbage while frozen is freed when the work ends, if the collector
# ran a full pass meanwhile (which left it out).
held = [Cycle()]
ref = weakref.ref(held[0])
gc.collect()
def dropping(point, req):
    if point == "forward" and held:
        held.clear()
        gc.collect()  # (a full pass while frozen)
engine.fault_hook = dropping
engine.generate("hello", OK)
engine.fault_hook = None
out["freed"] = until(lambda: ref() is None)
# Calls back to back keep one freeze (the loop lingers before it goes idle), so a cycle
# that lived through a few calls is freed by a young pass, as without the freeze...
class Load:  # (a cycle holding 5,000 objects the collector does not track: heap, not count)
    def __init__(self, size):
        self.me, self.load = self, [float(i) for i in range(size)]
def dropping_after_five(size, calls):
    loads, alive = [], []
    for _ in range(calls):
        alive.append(Load(size))
        loads.append(weakref.ref(alive[-1]))
        del alive[:-5]
        engine.generate("hi", {"max_new_tokens": 1, "temperature": 0})
    settled([False, False])
    return sum(load() is not None for load in loads) - len(alive)
out["cycles_kept"] = dropping_after_five(1, 600)
# ...and without lingering (calls apart: each freeze moves the young generations to the
# oldest), such cycles are freed by a full pass once the heap grew by a quarter: each freeze
# starts the collector's own count afresh, so over short calls its full passes never come.
gc_freeze.LINGER_S = 0.0
out["loads_kept"] = dropping_after_five(5000, 600)
# A heap that grows between calls with live data a full pass does not free (here freed by
# its owner during the pass, as another thread's may be) is not passed over again at once.
def full_passes():
    return gc.get_stats()[2]["collections"]
held = []
def dropping_at_a_pass(phase, info):
    if phase == "start" and info["generation"] == 2:
        held.clear()
gc.callbacks.append(dropping_at_a_pass)
passes, size = full_passes(), sys.getallocatedblocks() // 6  # (a third more blocks)
for _ in range(20):
    engine.generate("hi", {"max_new_tokens": 1, "temperature": 0})
    held[:] = [[(j, j) for j in range(size)]]
    settled([False, False])
out["passes_for_live_growth"] = full_passes() - passes
gc.callbacks.remove(dropping_at_a_pass)
held.clear()
gc_freeze.LINGER_S = 0.1

# Another engine busy keeps the freeze; the last to go idle ends it.
other = Engine(path, gc_freeze=True)
go, stepping = holding(other)
waiter = threading.Thread(target=lambda: other.generate("held", OK))
waiter.start()
stepping.wait(60)
engine.generate("hello", OK)
idle = until(lambda: gc_freeze._num_busy == 2)  # (engine idle: the held call and its loop)
out["other_busy"] = [idle] + state()
go.set()
waiter.join(60)
out["both_done"] = settled([False, False])
other.fault_hook = None

# An object of the caller's in a cycle, alive when the freeze began, holding an engine:
# dropped while the engine works, both are collected once the work is done.
class Service:
    def __init__(self):
        self.handle = self.generate  # (a cycle through a bound method)
        self.engine = Engine(path, gc_freeze=True)
    def generate(self):
        return self.engine.submit("hello", OK)[0]
service = Service()
ref, thread = weakref.ref(service.engine), service.engine._thread
go, stepping = holding(service.engine)
future = service.handle()
stepping.wait(60)
out["service_busy"] = state()
del service
go.set()
future.result(60)
del future
out["service_done"] = settled([False, False])
gc.collect()
thread.join(30)
out["service_collected"] = [ref() is None, thread.is_alive()]

# A shutdown while a request runs ends the freeze too.
running = Engine(path, gc_freeze=True)
go, stepping = holding(running)
future = running.submit("hello", {"max_new_tokens": 64, "temperature": 0})[0]
stepping.wait(60)
out["shutdown_busy"] = state()
stopping = threading.Thread(target=running.shutdown)
stopping.start()
until(lambda: running._stopping)
go.set()
stopping.join(60)
out["shutdown"] = state() + [type(future.exception(60)).__name__]

off = Engine(path, gc_freeze=False)
during = Watch(off, state)
off.generate("hello", OK)
out["off"] = during.seen[0]
out["default"] = type(off.config)().gc_freeze  # (on unless told otherwise)

# A process forked while the heap is frozen (a caller inside `generate`, a loop busy or
# lingering) runs none of them: the child starts unfrozen, with nothing counted busy.
import os
read, write = os.pipe()
with gc_freeze.working(True):
    parent = state()
    pid = os.fork()
    if pid == 0:
        os.write(write, json.dumps(state() + [gc_freeze._num_busy]).encode())
        os._exit(0)
os.waitpid(pid, 0)
out["forked"] = parent + json.loads(os.read(read, 1000))
settled([False, False])

gc.freeze()  # the process manages its collector itself
count = gc.get_freeze_count()  # (frozen objects freed since leave it: never more, or 0)
kept = lambda: 0 < gc.get_freeze_count() <= count
mine = Engine(path, gc_freeze=True)
during = Watch(mine, lambda: [gc_freeze.is_frozen(), kept()])
mine.generate("hello", OK)
# Telling the process's freeze from ours walks the frozen objects: once, not at each call.
walks, count_frozen = [], gc.get_freeze_count
def counted():
    if sys._getframe(1).f_globals["__name__"] == "lmprog_runtime.gc_freeze":
        walks.append(1)
    return count_frozen()
gc.get_freeze_count = counted
for _ in range(5):
    mine.generate("hello", OK)
gc.get_freeze_count = count_frozen
mine.shutdown()
out["user_frozen"] = during.seen[0] + [kept()]
out["freeze_walks"] = len(walks)
for e in (engine, other, off):
    e.shutdown()
print(json.dumps(out))
"""


def test_the_freeze_lasts_while_engines_have_work(tiny_path):
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_path],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["idle"] == [False, False]
    # In a step: frozen, the modules the engine's start imported and the engine itself.
    assert out["busy"] == [True, True, True, True]
    assert out["tokens"] == 3
    assert out["done"] == [False, False]
    assert out["making"] == [True, True, False, False]
    assert out["kept"] < 20_000, out["kept"]  # (75,000 cycles made)
    assert out["freed"]
    # (of 595 dropped; with the growth check, about 16 + a quarter of the heap's blocks
    # over 5,000 stay: some 100 here)
    assert out["cycles_kept"] < 300, out["cycles_kept"]
    assert out["loads_kept"] < 300, out["loads_kept"]
    assert out["passes_for_live_growth"] <= 3, out["passes_for_live_growth"]
    assert out["other_busy"] == [True, True, True]
    assert out["both_done"] == [False, False]
    assert out["service_busy"] == [True, True]
    assert out["service_done"] == [False, False]
    assert out["service_collected"] == [True, False]
    assert out["shutdown_busy"] == [True, True]
    assert out["shutdown"] == [False, False, "RuntimeError"]
    assert out["forked"] == [True, True, False, False, 0]
    assert out["off"] == [False, False]
    assert out["default"] is True
    # Objects the process froze itself stay frozen, and no engine freezes or unfreezes.
    assert out["user_frozen"] == [False, True, True]
    assert out["freeze_walks"] == 0, out["freeze_walks"]  # (the first call's was kept)


def test_a_waiting_request_gives_the_collector_few_objects(engine):
    """Every full pass walks the requests still waiting (a dataset's, submitted at once):
    a plain request adds 7 objects here (the prompts' lists are the caller's), where an event
    (6 objects, against 2 for `DoneFlag`), new empty sets and logprob lists made it 18."""
    prompts = [[5 + i, 6, 7, 8] for i in range(256)]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    deadline = time.monotonic() + 30  # (the last test's requests: their loop goes idle)
    while gc_freeze.is_frozen() and time.monotonic() < deadline:
        time.sleep(0.01)
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
    assert not flag.wait(0) and not flag.wait(-1) and not flag.is_set()
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
