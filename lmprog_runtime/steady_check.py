"""The check of a decode batch that stays the same from step to step, as a whole.

The loop checks each request's new token every step (`Req.continues_plainly`, ~0.25 us a
request). While a decode batch stays the same and finishes none of its requests, one check
of the whole batch tells the same: no request is at its length yet, and no new token is
one that may end a request.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmprog_runtime.request import Req

_output_ids = operator.attrgetter("output_ids")
_last = operator.itemgetter(-1)


class SteadyCheck:
    """The check of a decode batch that stays the same from step to step.

    Taken after a check of `reqs` that finished none of them, when each `checks_plainly`
    (its check reads its last token and its length, nothing else). A later check of the
    same list, each request one token longer per check since, finishes none of them while
    none is at its `max_new_tokens` and none of the new tokens may end a request: then
    the loop skips the per-request check (`settles`).

    Example (the requests' fields are all it reads):
        >>> from types import SimpleNamespace as R
        >>> reqs = [R(output_ids=[5], max_new_tokens=3, min_new_tokens=0, ends_on={2})]
        >>> steady = SteadyCheck(reqs)
        >>> reqs[0].output_ids.append(7)
        >>> steady.settles(reqs)  # 2 tokens of 3, and 7 ends nothing
        True
        >>> reqs[0].output_ids.append(7)
        >>> steady.settles(reqs)  # 3 of 3: its length ends it
        False
    """

    def __init__(self, reqs: list[Req]) -> None:
        lens = [len(r.output_ids) for r in reqs]
        self.reqs = list(reqs)  # (a copy: the caller's list may change)
        self.total = sum(lens)
        self.num_checks = 0  # settled since
        # After k more tokens each, none is at its length while k < room, and none may end
        # on a token while k < quiet (each one's min_new_tokens unreached).
        self.room = min(r.max_new_tokens - n for r, n in zip(reqs, lens))
        self.quiet = min(r.min_new_tokens - n for r, n in zip(reqs, lens))
        self.ends = frozenset().union(*[r.ends_on for r in reqs])

    def settles(self, reqs: list[Req]) -> bool:
        """Whether checking `reqs` now would do nothing (see the class). Each request of a
        check got a token since its last one, so an unchanged total means one each."""
        if reqs != self.reqs:  # (a `Req` equals itself alone: the same requests in order)
            return False
        k = self.num_checks + 1
        outs = list(map(_output_ids, reqs))
        if k >= self.room or sum(map(len, outs)) != self.total + k * len(reqs):
            return False
        if k >= self.quiet and not self.ends.isdisjoint(map(_last, outs)):
            return False
        self.num_checks = k
        return True
