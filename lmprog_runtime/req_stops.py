"""When a request ends: a sampled token checked against its EOS and stop tokens, its stop
strings and regexes, its pattern and its length; tokens drawn in a row appended up to the
first that ends it; and an output cut short of its pattern marked incomplete.

`ReqStops` holds these methods of `Req` (a mixin: `Req.__init__` sets every attribute used
here). Only the loop thread calls them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from lmprog_runtime.constrained.base import word_allows


class ReqStops:
    """The stop-condition half of `Req`."""

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and decide whether the request is finished."""
        self.output_ids.append(token_id)
        self.check_last_token()

    def check_last_token(self) -> None:
        """Decide whether the last output token finishes the request (`append_token`'s
        second half: the overlap loop appends a token before it launches the next forward
        and checks it while that forward runs)."""
        token_id = self.output_ids[-1]
        n = len(self.output_ids)
        ends = n >= self.min_new_tokens and token_id in self.ends_on  # EOS or a stop token
        if ends and n == 1 and self.heal is not None and token_id == self.heal.token_id:
            ends = False  # the backed-up prompt token written again: prompt text, not output
        if self.matcher is not None:
            if token_id == self.grammar_eos:  # only allowed where the pattern is complete
                self.finished_reason = {"type": "stop", "matched": token_id}
                return
            if self.end_words is not None and not word_allows(self.end_words, token_id):
                # end_outside_pattern: a token the complete match cannot take ends it
                self.finished_reason = {"type": "stop", "matched": token_id}
                return
            if not ends:  # (a stop token is not in the text: the match stays before it)
                self.matcher.advance(token_id)
                if self.grammar is None:
                    self.matcher = None  # token healing: the first token only
        if n >= self.min_new_tokens:  # (`can_stop`)
            if ends:
                is_id = token_id in self.eos_token_ids or token_id in self.stop_token_ids
                matched = token_id if is_id else self._stop_token_texts[token_id]
                self.finished_reason = {"type": "stop", "matched": matched}
                self._mark_incomplete_constraint()
                return
            if self._has_stops:
                matched = self._scan_stops()
                if matched is not None:
                    self.finished_reason = {"type": "stop", "matched": matched}
                    self._mark_incomplete_constraint(cut=True)
                    return
        elif self._has_stops:
            self._skip_stops()
        if n >= self.max_new_tokens:
            self.finished_reason = {"type": "length", "length": n}
            self._mark_incomplete_constraint()

    @property
    def checks_plainly(self) -> bool:
        """Whether its check reads its last token and its length, nothing else: it is
        checked by that token alone (`checks_last_token_alone`), jumps nowhere and is not
        streamed (`is_streamed`). Those two are spelled out here: read for every request
        at every step, the property calls would cost 1.6x as much (6.0 against 9.7 us for
        64 requests)."""
        if self.matcher is not None or self._has_stops or self.char_fsm is not None:
            return False
        return self.stream_queue is None and self.on_chunk is None

    def continues_plainly(self) -> bool:
        """Whether the last token's check has nothing to do: the request `checks_plainly`
        and the token does not finish it. (The loop's check of most requests at most
        steps: cheaper than `check_last_token`'s, which it equals there.)"""
        if not self.checks_plainly:
            return False
        out = self.output_ids
        n = len(out)
        return n < self.max_new_tokens and (n < self.min_new_tokens or out[-1] not in self.ends_on)

    @property
    def checks_last_token_alone(self) -> bool:
        """Whether `check_last_token` reads nothing but the last token and the output's
        length (no grammar, no stop strings or regexes): then tokens drawn in a row are
        checked by where they end (`append_run`)."""
        return self.matcher is None and not self._has_stops

    def append_run(self, tokens: Sequence[int]) -> int:
        """Append `tokens` (drawn one after the other) up to the first that finishes the
        request, for a request that `checks_last_token_alone`: what appending and
        checking them one by one would append. Returns how many it appended; check the
        last one (`check_last_token`) after."""
        held = len(self.output_ids)
        take = max(1, min(len(tokens), self.max_new_tokens - held))  # (the last by length)
        ends = self.ends_on
        if ends and not ends.isdisjoint(tokens[:take]):
            for k in range(max(0, self.min_new_tokens - held - 1), take):  # (`can_stop`)
                if tokens[k] in ends:
                    take = k + 1
                    break
        self.output_ids.extend(tokens[:take])
        return take

    def _mark_incomplete_constraint(self, cut: bool = False) -> None:
        """An output cut short of a full match (length, stop token or string): never
        present it as valid. `cut`: a stop string or regex cuts the text before it, text
        the match has taken: the text kept is matched afresh (`re.fullmatch` of the
        grammar's pattern; incomplete where Python cannot read that pattern)."""
        if self.matcher is None or self.grammar is None:  # (token healing's: the first token)
            return
        if cut:
            text = self.decoded_text()
            kept = text[: self._first_stop(text, 0)[0]]
            # (a healed pattern begins with the backed-up text, which the text does not)
            healed = self.heal.text if self.heal is not None else ""
            complete = _fully_matches(self.grammar.regex, healed + kept)
        else:
            complete = self.matcher.is_complete()
        if not complete:
            self.finished_reason["constraint"] = "incomplete"

    def finish_prefill_only(self) -> None:
        self.finished_reason = {"type": "length", "length": 0}
        self._mark_incomplete_constraint()  # ('' is a full match of few patterns)

    def abort(self, error: BaseException) -> None:
        """The request failed with `error` (never raises: its finish must go on)."""
        self.error = error
        try:
            message = str(error)
        except Exception:  # noqa: BLE001 - an error whose message raises: it was lost
            message = f"{type(error).__name__} (its message could not be read)"
        self.finished_reason = {"type": "abort", "message": message}


def _fully_matches(pattern: str, text: str) -> bool:
    """`re.fullmatch(pattern, text)`; False where Python's `re` cannot read the pattern."""
    try:
        return re.fullmatch(pattern, text) is not None
    except re.error:
        return False
