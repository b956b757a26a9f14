"""Jump-forward's character automaton (`CharFSM`: an NFA whose subset states are made as
the text reaches them) reads every text as interegular's DFA of the same pattern does, and
finds the same forced text at each point: interegular, the reference here, built its DFA
whole when the grammar compiled (3-57 s for a list of up to 5-20 ints, each an exact int64
pattern; 24 s for ten optional ints). Texts are random walks through interegular's DFA,
with a wrong character now and then."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.constrained.json_schema import schema_to_regex
from lmprog_runtime.constrained.jump_forward import CharFSM

interegular = pytest.importorskip("interegular")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "bc"]}}},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"type": "object", "properties": {"x": {"anyOf": [{"type": "number"}, {"type": "null"}]}}},
]
PATTERNS = [
    r"The city is (Paris|London)\.",
    r'\{"id": [0-9]{1,3}\}(, \{"id": [0-9]{1,3}\})*',
    r"(yes|no|maybe) because [a-z ]{2,8}\.",
    r"a{3}b?c[xyz]{0,2}-done",
    "[éè]{2}ok",
    r'"name": "[^"]{1,5}", x',
    *(schema_to_regex(json.dumps(schema)) for schema in SCHEMAS),
]


class Reference:
    """interegular's DFA: where a text leads, and the forced text from there."""

    def __init__(self, regex: str) -> None:
        self.fsm = interegular.parse_pattern(regex).to_fsm()
        other = interegular.fsm.anything_else
        by_symbol = self.fsm.alphabet.by_transition.items()
        self.chars = {symbol: [c for c in chars if c is not other] for symbol, chars in by_symbol}

    def walk(self, text: str):
        state = self.fsm.initial
        for ch in text:
            state = self.fsm.map.get(state, {}).get(self.fsm.alphabet[ch])
            if state is None:
                return None
        return state

    def forced(self, state) -> str:
        out, seen = [], set()
        while state not in self.fsm.finals and state not in seen:
            seen.add(state)
            edges = self.fsm.map.get(state, {})
            if len(edges) != 1:
                break
            ((symbol, nxt),) = edges.items()
            if len(self.chars[symbol]) != 1 or len(self.fsm.alphabet.by_transition[symbol]) != 1:
                break
            out.append(self.chars[symbol][0])
            state = nxt
        return "".join(out)

    def next_chars(self, state) -> list[str]:
        return sorted(c for s in self.fsm.map.get(state, {}) for c in self.chars[s])


REFERENCES = {pattern: Reference(pattern) for pattern in PATTERNS}


@settings(max_examples=200, deadline=None)
@given(pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 2**32 - 1))
def test_walks_and_forced_texts_match_interegulars(pattern, seed):
    rng, ref, fsm = random.Random(seed), REFERENCES[pattern], CharFSM(pattern)
    text, state = "", fsm.initial
    for _ in range(60):
        ref_state = ref.walk(text)
        assert (fsm.walk(text) is None) == (ref_state is None), text
        if ref_state is None:
            return
        forced = ref.forced(ref_state)
        assert fsm.forced(state, limit=10_000) == forced, text
        assert fsm.forced(state, limit=3) == forced[:3], text
        choices = ref.next_chars(ref_state)
        if not choices or rng.random() < 0.05:
            char = rng.choice('x}9 "é')  # (now and then a character it may not take)
        else:
            char = rng.choice(choices)
        text += char
        state = fsm.walk(char, state)  # (step by step, as a request follows its output)
        if state is None:
            assert ref.walk(text) is None
            return


def test_a_list_of_ints_builds_at_once():
    """The exact int64 pattern in a list of up to 20: interegular's DFA took 57 s."""
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 20}
    start = time.perf_counter()
    fsm = CharFSM(schema_to_regex(json.dumps(schema)))
    state = fsm.walk("[1, 22")
    print(f"built and walked in {time.perf_counter() - start:.3f} s")
    assert state is not None and fsm.walk("[1, 22]") is not None
    assert fsm.walk("[1, 22]]") is None


def test_memory_stays_bounded_however_long_the_text():
    """A string of up to 2,000 characters has a state per position: each kept its class's
    answers per character, and 200,000 CJK characters took 91 MB more, growing. Its states
    now share one test, whose answers are bounded, as are the moves kept."""
    import tracemalloc

    schema = {"type": "object", "properties": {"t": {"type": "string", "maxLength": 2000}}}
    fsm = CharFSM(schema_to_regex(json.dumps({**schema, "required": ["t"]})))
    rng = random.Random(0)
    tracemalloc.start()
    try:
        for _ in range(75):
            state = fsm.walk('{"t": "')
            for _ in range(1999):
                state = fsm.walk(chr(rng.randrange(0x4E00, 0x9FFF)), state)
            assert fsm.walk('"}', state) is not None
        grown = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"{grown / 1e6:.1f} MB at most over 150,000 characters")
    assert grown < 30e6


@pytest.mark.parametrize("schema_or_regex", [SCHEMAS[0], SCHEMAS[2], r"[^\n]{1,150}", r"\w{1,500}"])
def test_nbytes_is_what_tracemalloc_sees_the_automaton_hold(schema_or_regex):
    """The grammar cache counts each grammar's automaton as `nbytes`, within a factor of
    two of its allocations, after texts made moves."""
    import tracemalloc

    regex = schema_or_regex
    if isinstance(regex, dict):
        regex = schema_to_regex(json.dumps(regex))
    rng = random.Random(0)
    tracemalloc.start()
    try:
        fsm = CharFSM(regex)
        state = fsm.initial
        for _ in range(20_000):
            state = fsm.walk(rng.choice('abcXYZ 019":,[]{}\n'), state)
            state = state or fsm.initial
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    print(f"{held / 1e3:.0f} kB held, nbytes {fsm.nbytes() / 1e3:.0f} kB")
    assert held / 2 <= fsm.nbytes() <= held * 2


@pytest.mark.parametrize("pattern", [r"(?i)abc", r"(?i:ab)c", r"x(?i:yz)", r"(?i)a|b"])
def test_no_text_that_case_folding_makes_optional_is_forced(pattern):
    """Every text `re.fullmatch` takes begins with the forced text, whatever its case."""
    fsm = CharFSM(pattern)
    forced = fsm.forced(fsm.initial, 100)
    texts = ["abc", "ABC", "aBc", "abC", "xyz", "xYZ", "a", "B"]
    matches = [text for text in texts if re.fullmatch(pattern, text)]
    assert matches and all(text.startswith(forced) for text in matches), (pattern, forced)
