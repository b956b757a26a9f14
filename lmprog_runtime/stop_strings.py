"""Finding the first of a request's stop strings in its text, at each token on the loop.

Each stop string is looked for with `str.find` (in C). With many of them that cost grows
with their number, at every token of every request, on the loop every request shares:
50,000 stop strings took 31 ms a token, and slowed a request beside them as much. Past
`FIND_EACH_MAX` of them the strings are also grouped by length, and where it is cheaper
each place of the text searched is looked up once per distinct length (a slice and a set
lookup), at a cost that follows the text searched and the lengths, not the number of
strings. Which way is cheaper depends on the window searched: a token's few new places
against the whole output at the final scan (20 stop strings of 20 lengths over 8,000
characters: 0.06 ms with `str.find`, 31 ms by length; `benchmarks/bench_stop_strings.py`).
"""

from __future__ import annotations

import functools

FIND_EACH_MAX = 16
# Rough costs (microseconds, CPython 3.11 on a 2.8 GHz Xeon) for choosing the way: a
# `str.find` call in the loop, each character it scans, and one slice-and-lookup.
FIND_CALL_US, FIND_CHAR_US, LOOKUP_US = 0.3, 0.001, 0.2


class StopStrings:
    """The stop strings of a request (shared by the requests of one `SamplingParams`).

    Example:
        >>> StopStrings(["cd", "b"]).first("abcd", 0, 0)
        (1, 'b')
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.longest = max(map(len, stops), default=1)
        self._by_length: list[tuple[int, dict[str, int]]] | None = None
        if len(stops) > FIND_EACH_MAX:
            by_length: dict[int, dict[str, int]] = {}
            for order, stop in enumerate(stops):
                by_length.setdefault(len(stop), {}).setdefault(stop, order)
            self._by_length = sorted(by_length.items())

    @functools.cached_property
    def members(self) -> frozenset[str]:
        return frozenset(self.stops)

    def first(self, text: str, start: int, min_end: int) -> tuple[int, str | None]:
        """Where the first stop string found from `start` and ending past `min_end` begins
        in `text`, and which (of two there, the one listed first); (len(text), None) if
        none."""
        if self._by_length is not None:
            window = len(text) - max(start, min_end - self.longest + 1, 0)
            by_length = window * len(self._by_length) * LOOKUP_US
            if by_length < len(self.stops) * (FIND_CALL_US + window * FIND_CHAR_US):
                return self.first_by_length(text, start, min_end)
        return self.find_each(text, start, min_end)

    def find_each(self, text: str, start: int, min_end: int) -> tuple[int, str | None]:
        """`first`, each stop string looked for with `str.find`."""
        cut, matched = len(text), None
        for stop in self.stops:
            index = text.find(stop, max(start, min_end - len(stop) + 1))
            if index != -1 and index < cut:
                cut, matched = index, stop
        return cut, matched

    def first_by_length(self, text: str, start: int, min_end: int) -> tuple[int, str | None]:
        """`first`, each place looked up once per distinct length (past `FIND_EACH_MAX`
        stop strings only)."""
        assert self._by_length is not None
        end = len(text)
        for index in range(max(start, min_end - self.longest + 1, 0), end):
            best = None
            for length, orders in self._by_length:
                if index + length > end:
                    break
                if index + length <= min_end:
                    continue
                order = orders.get(text[index : index + length])
                if order is not None and (best is None or order < best):
                    best = order
            if best is not None:
                return index, self.stops[best]
        return end, None
