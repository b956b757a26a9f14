"""The compiled-grammar cache is bounded: the `grammar_cache_size` grammars used last are
kept, older ones dropped (a schema's grammar over a 49k-token vocabulary takes ~14 MiB; a
dataset run with a pattern per row would otherwise grow without bound). Checked against a naive
least-recently-used list on real outlines-core compiles over the tiny model's vocabulary.
"""

from __future__ import annotations

import pickle
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime import Engine
from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.constrained import GrammarCache
from lmprog_runtime.constrained.outlines_backend import OutlinesGrammarBackend

PATTERNS = ["[a-c]{1,2}", "(yes|no)", "[0-9]{2}", "x+y?", "(ab|cd)e"]


class CountingBackend(OutlinesGrammarBackend):
    """The real backend, counting its compiles."""

    def __init__(self, tokenizer, eos_token_id):
        super().__init__(tokenizer, eos_token_id)
        self.compiled: list[str] = []

    def compile_regex(self, regex):
        self.compiled.append(regex)
        return super().compile_regex(regex)


@pytest.fixture(scope="module")
def backend(tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    return CountingBackend(tokenizer, tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def sizes(backend):
    """Each pattern's index size, as its pickle (the compile process sends it back in a
    frame of a few bytes more; in memory it holds about twice that)."""
    return {p: len(pickle.dumps(backend.compile_regex(p)._index, protocol=5)) for p in PATTERNS}


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 3),
    st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=25),
    st.one_of(st.none(), st.floats(0, 3.5)),
)
def test_the_cache_keeps_the_grammars_used_last(backend, sizes, max_entries, uses, budget):
    """... as many as `max_entries` allows, fewer where they would hold more than
    `max_bytes` (here 0 to 3.5 times the largest grammar's size)."""
    max_bytes = None if budget is None else int(budget * 2 * max(sizes.values()))
    held = {}
    cache = GrammarCache(backend, timeout_s=60, max_entries=max_entries, max_bytes=max_bytes)
    backend.compiled.clear()
    reference: list[str] = []  # least recently used first
    misses = []
    try:
        for pattern in uses:
            grammar = cache.get("regex", pattern)
            assert grammar.regex == pattern
            assert 2 * sizes[pattern] <= grammar.nbytes <= 2 * (sizes[pattern] + 64)
            held[pattern] = grammar.nbytes
            if pattern in reference:
                reference.remove(pattern)
            else:
                misses.append(pattern)
            reference.append(pattern)
            if max_bytes is not None:  # (one larger alone is not kept)
                reference = [p for p in reference if held[p] <= max_bytes]
            del reference[: max(0, len(reference) - max_entries)]
            while max_bytes is not None and sum(held[p] for p in reference) > max_bytes:
                del reference[0]  # (the least recently used first)
            assert cache.keys() == [("regex", p) for p in reference]
    finally:
        cache._pool.shutdown()  # (one compile thread per example otherwise stays idle)
    assert backend.compiled == misses


def test_the_bound_counts_jump_forwards_automaton_too(backend):
    """With jump-forward, a grammar holds its character automaton as well as its index
    (90-110 bytes an NFA state, up to 6 MB of moves): the bound counts both."""
    pattern = "(ab|cd){400}"  # (its index is small, its automaton 1,600 NFA states)
    alone = backend.compile_regex(pattern).nbytes
    for jump_forward, kept in ((False, 1), (True, 0)):
        cache = GrammarCache(backend, jump_forward=jump_forward, max_bytes=alone + 50_000)
        try:
            cache.get("regex", pattern)
            assert len(cache.keys()) == kept
        finally:
            cache._pool.shutdown()  # (close would shut the shared backend's compiles down)


def test_an_engine_with_a_cache_of_one_serves_every_pattern_and_keeps_the_last(tiny_path):
    """Requests keep their own grammar when the cache drops it: patterns taking turns
    through a cache of one, several at once, each output matching its own pattern."""
    regexes = ["[a-c]{2,4}", "(yes|no)", "[0-9]{2,3}"]
    with Engine(tiny_path, grammar_cache_size=1, max_total_tokens=4096) as engine:
        for _ in range(2):
            params = [
                {"max_new_tokens": 8, "temperature": 0.8, "seed": 1, "regex": r} for r in regexes
            ]
            outputs = engine.generate(["Answer:"] * len(regexes), params)
            for output, regex in zip(outputs, regexes):
                assert re.fullmatch(regex, output["text"]), (regex, output["text"])
        assert len(engine._grammars.keys()) == 1


@pytest.mark.parametrize(("mib", "kept"), [(0, 0), (1, 1)])
def test_the_engine_keeps_grammars_within_grammar_cache_mib(tiny_path, monkeypatch, mib, kept):
    """Over the tiny vocabulary an index holds a few hundred bytes: 1 MiB keeps it, 0
    keeps none (a regex of bounded free text, `[^\\n]{1,150}`, holds 170 MiB over
    SmolLM2's vocabulary: 64 of them, the count kept by default, would hold 11 GiB). One
    not kept compiles once for a batch (it compiled, and was held, once a prompt)."""
    compiled = []
    compile_regex = OutlinesGrammarBackend.compile_regex
    monkeypatch.setattr(
        OutlinesGrammarBackend,
        "compile_regex",
        lambda self, regex: compiled.append(regex) or compile_regex(self, regex),
    )
    with Engine(tiny_path, grammar_cache_mib=mib, max_total_tokens=1024) as engine:
        params = {"max_new_tokens": 4, "regex": "[a-c]{2,4}"}
        for out in engine.generate(["Answer:", "Reply:", "Say:"], params):
            assert re.fullmatch("[a-c]{2,4}", out["text"])
        assert len(engine._grammars.keys()) == kept and compiled == ["[a-c]{2,4}"]
        compiled.clear()  # (healed: the pattern behind the backed-up " ", once for the call)
        healed = engine.generate(
            ["Answer: ", "Reply: ", "Say: "], {**params, "token_healing": True}
        )
        assert all(re.fullmatch("[a-c]{2,4}", out["text"]) for out in healed)
        assert len(compiled) == 2 - kept and compiled[-1].endswith("(?:[a-c]{2,4})")


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), ("4", TypeError), (True, TypeError), (2.0, TypeError)]
)
def test_a_bad_cache_size_is_refused(value, error):
    with pytest.raises(error, match="grammar_cache_size"):
        RuntimeConfig(grammar_cache_size=value)


class _NativeStall(OutlinesGrammarBackend):
    """A compile that stays in native code past the timeout, where no interruption reaches
    (a sleep stands in for outlines-core's index build)."""

    def __init__(self, tokenizer, eos_token_id, release):
        super().__init__(tokenizer, eos_token_id)
        self.release = release

    def compile_regex(self, regex):
        if regex.startswith("stall"):
            self.release.wait(60)
        return super().compile_regex(regex)


def test_compiles_stuck_past_the_timeout_hold_a_bounded_number_of_threads(tiny_path):
    """Each timeout starts a fresh pool so that later patterns compile, but only beside
    `MAX_STUCK` stuck compiles: twelve once held twelve threads, one per stuck compile."""
    import threading

    from transformers import AutoTokenizer

    from lmprog_runtime.constrained.grammar_cache import MAX_STUCK

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    release = threading.Event()
    before = {t for t in threading.enumerate() if t.name.startswith("lmprog-grammar")}
    cache = GrammarCache(_NativeStall(tokenizer, tokenizer.eos_token_id, release), timeout_s=0.2)
    try:
        assert cache.get("regex", "(yes|no)") is not None
        for i in range(12):  # (past MAX_STUCK stuck ones, a compile waits for a thread)
            with pytest.raises(ValueError, match="longer than|no compile thread was free"):
                cache.get("regex", f"stall{i}")
        ours = {t for t in threading.enumerate() if t.name.startswith("lmprog-grammar")} - before
        assert len(ours) <= MAX_STUCK + 4  # the stuck ones, and one pool's
        release.set()  # (the stuck compiles end; their pools have nothing left queued)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(p.is_drained() for p in cache._old_pools):
            time.sleep(0.05)
        release.clear()
        with pytest.raises(ValueError, match="longer than"):
            cache.get("regex", "stall-once-more")
        assert len(cache._old_pools) == 1  # (each timeout's old pool was kept until close)
    finally:
        release.set()
        cache.close()


def test_a_native_compile_that_explodes_is_stopped_at_the_timeout(tiny_path):
    """outlines-core's compile of `(abc|def|ghi0){1,20}[a-z0-9]{3,60}x0` (native code) went
    on after its timeout at a full core and 25-100 MB/s, past `shutdown()`; with eight of
    them every later pattern timed out too, behind them. Each now runs in a child process,
    killed at the timeout: nothing of ours stays busy, and a plain pattern compiles."""
    psutil = pytest.importorskip("psutil")

    config = {"max_total_tokens": 1024, "disable_jump_forward": True}
    others = {child.pid for child in psutil.Process().children()}  # (other engines')
    with Engine(tiny_path, grammar_compile_timeout_s=1, **config) as engine:
        for i in range(8):
            exploding = f"(abc|def|ghi{i}){{1,20}}[a-z0-9]{{3,60}}x{i}"
            with pytest.raises(ValueError, match="longer than 1 s"):
                engine.generate("x", {"regex": exploding, "max_new_tokens": 2})
        out = engine.generate("x", {"regex": "[ab]{3}", "max_new_tokens": 8})
        assert re.fullmatch("[ab]{3}", out["text"])
        children = [c for c in psutil.Process().children() if c.pid not in others]
        for child in children:
            child.cpu_percent()
        time.sleep(1.0)
        assert sum(child.cpu_percent() for child in children if child.is_running()) < 50
    assert not [child for child in children if child.is_running()]  # (shut down: all gone)


def test_ctrl_c_while_a_pattern_compiles_stops_the_compile(tiny_path):
    """Ctrl-C while the caller waited for a compile left the compile running (its child at
    a full core, and the process unable to exit); a compile no one else waits for now
    stops, and the engine compiles other patterns."""
    import signal
    import threading

    psutil = pytest.importorskip("psutil")

    others = {child.pid for child in psutil.Process().children()}
    config = {"max_total_tokens": 1024, "disable_jump_forward": True}
    with Engine(tiny_path, grammar_compile_timeout_s=120, **config) as engine:
        main = threading.main_thread().ident
        timer = threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                exploding = "(abc|def|ghi9){1,20}[a-z0-9]{3,60}x9"
                engine.generate("x", {"regex": exploding, "max_new_tokens": 2})
        finally:
            timer.cancel()
        time.sleep(0.5)  # (the interruption lands within a poll of the child's pipe)
        children = [c for c in psutil.Process().children() if c.pid not in others]
        for child in children:
            child.cpu_percent()
        time.sleep(1.0)
        assert sum(c.cpu_percent() for c in children if c.is_running()) < 50
        out = engine.generate("x", {"regex": "[ab]{3}", "max_new_tokens": 8})
        assert re.fullmatch("[ab]{3}", out["text"])


def test_compiles_go_on_past_a_dead_child_and_past_fd_1023(backend, tmp_path):
    """An idle child that died (the OOM killer, a signal) made the next pattern "invalid"
    (Broken pipe); with over 1,023 files open, `select()` refused every compile."""
    import resource

    assert backend.compile_regex("a+b").new_matcher() is not None  # (a child is idle now)
    for child in list(backend._indexes._idle):
        child.kill()
        child.wait()
    assert backend.compile_regex("b+a").new_matcher() is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"only {hard} files may be open")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    files = [open(tmp_path / "f", "w") for _ in range(1100)]  # noqa: SIM115
    try:
        for child in list(backend._indexes._idle):  # (a new child: its pipes above 1023)
            backend._indexes._drop(child)
        assert backend.compile_regex("c+").new_matcher() is not None
    finally:
        for file in files:
            file.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_idle_compile_children_hold_max_idle_mib_together(backend, monkeypatch):
    """Four idle children, each under the bound alone, held 540 MiB after large compiles
    over SmolLM2's vocabulary: those kept idle now hold `MAX_IDLE_MIB` together."""
    from lmprog_runtime.constrained import index_process

    compiler = index_process.IndexCompiler(backend._vocabulary)
    try:
        children = [compiler._take()[0] for _ in range(4)]  # (four compiles at once)
        replies = [index_process._ask(child, "a+b") for child in children]
        mib = [reply[2] for reply in replies]  # (each child's RSS: about alike)
        monkeypatch.setattr(index_process, "MAX_IDLE_MIB", mib[0] + mib[1] + min(mib[2:]) / 2)
        for child, reply in zip(children, replies):
            assert reply[0] == "ok"
            compiler._give_back(child, reply[2])
        assert len(compiler._idle) == 2
        assert sum(compiler._idle_mib.values()) <= index_process.MAX_IDLE_MIB
        assert all(child.poll() is not None for child in children[2:])  # (stopped)
        assert compiler.compile("b+a")[0] is not None  # (on an idle one)
        assert len(compiler._idle) == 2
    finally:
        compiler.close()


def test_a_schema_too_large_to_compile_says_how_large_and_what_helps(backend):
    """Twelve optional properties: each may be left out, so the pattern spells out what may
    follow each (quadratic). The error said only "too large to compile"."""
    import json

    optional = {f"f{i}": {"anyOf": [{"type": "integer"}, {"type": "null"}]} for i in range(12)}
    schema = json.dumps({"type": "object", "properties": optional})
    cache = GrammarCache(backend, timeout_s=60)
    try:
        with pytest.raises(ValueError, match=r"of [\d,]+ characters, over the 50,000") as error:
            cache.get("json_schema", schema)
        assert "make some required" in str(error.value)
        required = json.dumps({"type": "object", "properties": optional, "required": ["f0"]})
        assert cache.get("json_schema", required)  # (what the message says helps)
        # (long only for its patterns: the hint is not about optional properties)
        words = {f"w{i}": {"type": "string", "pattern": "^\\w+$"} for i in range(240)}
        every = json.dumps({"type": "object", "properties": words, "required": list(words)})
        with pytest.raises(ValueError, match="over the 50,000") as error:
            cache.get("json_schema", every)
        assert "shorten its patterns" in str(error.value) and "required" not in str(error.value)
    finally:
        cache._pool.shutdown()
