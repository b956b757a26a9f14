"""The first stop string in a text (`stop_strings.py`), both ways it searches (each string
with `str.find`, or by length past `FIND_EACH_MAX` strings), against a naive scan of every
place of the text."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from lmprog_runtime.stop_strings import FIND_EACH_MAX, StopStrings

WORDS = st.text(alphabet="ab", min_size=1, max_size=3)


def naive_first(stops, text, start, min_end):
    """Every place from `start`, every stop string in list order: the first that fits."""
    for index in range(start, len(text)):
        for stop in stops:
            if text.startswith(stop, index) and index + len(stop) > min_end:
                return index, stop
    return len(text), None


@settings(max_examples=400)
@given(
    stops=st.lists(WORDS, min_size=1, max_size=8),
    text=st.text(alphabet="abc", max_size=30),
    start=st.integers(0, 30),
    min_end=st.integers(0, 30),
    many=st.booleans(),
)
@example(stops=["ab", "a"], text="xab", start=0, min_end=0, many=True)  # one place, two
@example(stops=["ab", "a"], text="xab", start=0, min_end=2, many=True)  # "a" ends too soon
def test_the_first_stop_is_the_naive_scans(stops, text, start, min_end, many):
    start = min(start, len(text))
    if many:  # (strings the text never holds, past the threshold: searched by length)
        stops = stops + ["e" * n for n in range(1, FIND_EACH_MAX + 1)]
    found = StopStrings(stops)
    expected = naive_first(stops, text, start, min_end)
    assert found.first(text, start, min_end) == expected  # (whichever way it chose)
    assert found.find_each(text, start, min_end) == expected
    if many:
        assert found.first_by_length(text, start, min_end) == expected


def test_the_way_chosen_is_the_cheaper_for_the_window_searched(monkeypatch):
    """Many stop strings of few lengths over a token's few new places: by length; a few of
    many lengths, or the whole output at the final scan: `str.find` (by length over 8,000
    characters took 100x longer with 20 strings)."""
    calls = []
    for way in ("find_each", "first_by_length"):
        original = getattr(StopStrings, way)
        monkeypatch.setattr(
            StopStrings, way, lambda self, *a, w=way, f=original: calls.append(w) or f(self, *a)
        )
    few, many = StopStrings(["x"] * FIND_EACH_MAX), StopStrings(["x"] * (FIND_EACH_MAX + 1))
    assert few._by_length is None and many._by_length == [(1, {"x": 0})]
    stops = [f"zq{i}xw" for i in range(50_000)] + ["end"]
    text = "the zq49999xw end"
    assert StopStrings(stops).first(text, 5, 0) == (14, "end")
    twenty = StopStrings(["<" + "s" * i + ">" for i in range(20)])  # (20 lengths)
    assert twenty.first("y" * 8000, 0, 0) == (8000, None)
    assert twenty.first("y" * 8000, 7990, 0) == (8000, None)
    assert calls == ["first_by_length", "find_each", "find_each"]
