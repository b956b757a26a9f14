"""A request's output as text: decoded incrementally (only the new tokens, after a window
of the tokens before them as context), searched for stop strings and stop regexes in
O(new text), cut before the first stop for the final text, and handed out as stream
deltas that never take back what was streamed.

`ReqText` holds these methods of `Req` (a mixin: `Req.__init__` sets every attribute used
here). The loop thread calls them; so does the caller's thread before a request is
submitted, for a jump forward at its start (`RequestMaker._jump_forward`).
"""

from __future__ import annotations

from typing import Any


class ReqText:
    """The text half of `Req`."""

    def decoded_text(self) -> str:
        """The output decoded so far, incrementally: only the new tokens are decoded, after
        the previous window as context (so merged pieces and leading spaces come out as in
        a full decode); an incomplete UTF-8 sequence waits for the token that completes it,
        and a run of byte-fallback pieces for a piece of another kind.
        The new tokens are taken one at a time, so the text is the same however many
        tokens came since the last call. A token whose bytes end inside a character
        (byte-level BPE has `' ' + 2 of an emoji's 4 bytes`) holds back only that
        character: the complete ones before it are text at once (`_pending_text`), so a
        stop string they complete ends the output at that token, not at the next."""
        skip = self.params.skip_special_tokens
        if self._decodes_alone:
            return self._decoded_text_alone(skip)
        start, read, before = self._prefix_offset, self._read_offset, None
        # (an end tried with this window gives what it gave: tried once only)
        for end in range(max(read, self._tried) + 1, self._detok_len() + 1):
            if before is None:
                before = self.tokenizer.decode(
                    self._detok_ids(start, read), skip_special_tokens=skip
                )
            after = self.tokenizer.decode(self._detok_ids(start, end), skip_special_tokens=skip)
            self._tried = end
            if self._byte_pieces and self._detok_ids(end - 1, end)[0] in self._byte_pieces:
                continue  # (a byte piece's run may go on, and change its text)
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self._decoded_text += after[len(before) :]
                self._pending_text = ""
                start, read, before = read, end, None
                self._prefix_offset, self._read_offset = start, read
            else:
                self._pending_text = _complete_part(after[len(before) :])
        return self._output_text()

    def _decoded_text_alone(self, skip: bool) -> str:
        """`decoded_text` for a tokenizer whose windows decode alone: the window read so
        far ends at a character (its text does not end in an incomplete one), so the text
        of the tokens after it is their decode alone, one decode per token, not two."""
        read = self._read_offset
        for end in range(max(read, self._tried) + 1, self._detok_len() + 1):
            new = self.tokenizer.decode(self._detok_ids(read, end), skip_special_tokens=skip)
            self._tried = end
            if new and not new.endswith("\ufffd"):
                self._decoded_text += new
                self._pending_text = ""
                read = end
            else:
                self._pending_text = _complete_part(new)
        self._prefix_offset = self._read_offset = read
        return self._output_text()

    def _output_text(self) -> str:
        """The text read so far and the complete characters of the tokens held back."""
        text = self._decoded_text + self._pending_text if self._pending_text else self._decoded_text
        if self._detok_skip:  # (the first token's text begins with the healed text)
            return text[self._detok_skip :]
        return text

    def decode_context(self) -> list[int]:
        """The prompt tokens the output is decoded after (none for byte-level BPE)."""
        return self._detok_context

    def _detok_len(self) -> int:
        return len(self._detok_context) + len(self.output_ids)

    def _detok_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the context tokens followed by the output, copying only
        those (the window, not the whole output)."""
        n = len(self._detok_context)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self._detok_context[start:end] + self.output_ids[: max(0, end - n)]

    def has_undecoded_tokens(self) -> bool:
        """The last tokens wait for the rest of a UTF-8 sequence (call after decoded_text)."""
        return self._detok_len() > self._read_offset

    def text_with_held_tokens(self) -> str | None:
        """`decoded_text` with the tokens it holds back, where they decode as whole
        characters; None where they end inside one. (A run of byte-fallback pieces is held
        back whole, since a byte that is not UTF-8 turns all of it into U+FFFD: for
        jump-forward, whose forced text then ends the run, it is text.)"""
        text = self.decoded_text()
        if not self.has_undecoded_tokens():
            return text
        skip = self.params.skip_special_tokens
        start, read = self._prefix_offset, self._read_offset
        before = self.tokenizer.decode(self._detok_ids(start, read), skip_special_tokens=skip)
        after = self.tokenizer.decode(
            self._detok_ids(start, self._detok_len()), skip_special_tokens=skip
        )
        if not after.startswith(before) or after.endswith("\ufffd"):
            return None
        text = self._decoded_text + after[len(before) :]
        return text[self._detok_skip :] if self._detok_skip else text

    def replace_output_tail(self, kept: int, tail: list[int], text: str) -> None:
        """Jump-forward: the output becomes its first `kept` tokens plus `tail`, whose text
        is `text`; the detokenizer goes on from there without decoding it all again."""
        self.output_ids = self.output_ids[:kept] + tail
        self.penalty_counted = None  # (its penalty counts are of the old tail)
        context = len(self._detok_context)
        self._decoded_text = (self.heal.text if self.heal is not None else "") + text
        self._pending_text = ""
        self._prefix_offset, self._read_offset = context + kept, context + len(self.output_ids)
        self._tried = self._read_offset

    def _skip_stops(self) -> None:
        """min_new_tokens is not reached: no stop matches in the text so far. A stop string
        may still end in the text of the tokens to come (as vLLM's min_tokens has it), a
        stop regex match only begin there. Tokens held back (a run of byte pieces going
        on) have text before them too: at the last token before them, read whole."""
        self._scanned = self._min_text = len(self.decoded_text())
        if len(self.output_ids) + 1 >= self.min_new_tokens and self.has_undecoded_tokens():
            whole = self._whole_text(self.output_ids)
            self._min_text = max(self._min_text, len(whole.rstrip("\ufffd")))
        if self._stop_regex is not None:
            self._stop_regex.restart(self._min_text)

    def _scan_stops(self) -> str | None:
        """The stop string or stop regex match the output now contains, if any, in
        O(new text): stop strings are searched only where a new match can be, stop regexes
        by their incremental scanner (the whole text only once one has matched)."""
        text = self.decoded_text()
        start = max(0, self._scanned - self._longest_stop + 1)
        self._scanned = len(text)
        regex = self._stop_regex is not None and self._stop_regex.feed(text)
        return self._first_stop(text, start, regex)[1]

    def _first_stop(self, text: str, start: int, regex: bool = True) -> tuple[int, str | None]:
        """Where the first stop string (found from `start`, ending past the text before
        min_new_tokens) or stop regex match (if `regex`; beginning past that text) begins in
        `text`, and what it matched; (len(text), None) if none."""
        cut, matched = self.params.stop_strings.first(text, start, self._min_text)
        scanner = self._stop_regex if regex else None
        found = None
        if scanner is not None and scanner.may_match(text):  # (no scan of text it has read)
            found = scanner.first_match(text, self._min_text)
        if found is not None and found[0] < cut:
            cut, matched = found
        return cut, matched

    def _visible_text(self) -> tuple[str, str | None]:
        """The output text so far, cut before the first stop string; and that stop string."""
        ids = self.output_ids
        reason = self.finished_reason
        if reason is not None and reason["type"] == "stop" and isinstance(reason["matched"], int):
            ids = ids[:-1]  # a matched stop token is not part of the text
        text = self._whole_text(ids)
        if not self.can_stop:
            return text, None
        # Stops are looked for in the text the scan saw: not in a trailing incomplete UTF-8
        # sequence (U+FFFD here), which the scan waits on (`decoded_text`). A stop that
        # only it completes ended nothing, so it cuts nothing.
        scanned = len(text)
        while scanned > 0 and text[scanned - 1] == "\ufffd":
            scanned -= 1
        cut, matched = self._first_stop(text[:scanned], 0)
        return (text, None) if matched is None else (text[:cut], matched)

    def _whole_text(self, ids: list[int]) -> str:
        """The text of output tokens `ids`, decoded at once after the context tokens."""
        skip = self.params.skip_special_tokens
        text = self.tokenizer.decode(self._detok_context + ids, skip_special_tokens=skip)
        return text[self._detok_cut :]

    def finalize_text(self) -> None:
        """The final text; none for a failed request, except one that timed out: its
        error's `partial_output` holds what it generated before its deadline."""
        keep = self.error is None or isinstance(self.error, TimeoutError)
        self.text = self._visible_text()[0] if keep else ""

    def stream_delta(self) -> dict[str, Any] | None:
        """The not-yet-streamed part of the text; holds back what a stop string may still cut."""
        if self.is_finished:
            text, _ = self._visible_text()  # the final text: one full decode
        else:
            text = self.decoded_text()  # no stop has matched yet
            hold = self._longest_stop - 1 if self.params.stop else 0
            if self._stop_regex is not None:  # a match may still begin at its earliest start
                self._stop_regex.feed(text)
                hold = max(hold, len(text) - self._stop_regex.stable_len())
            stable = len(text) - hold
            while stable > 0 and text[stable - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                stable -= 1
            text = text[: max(stable, len(self._streamed_text))]
        if not text.startswith(self._streamed_text):
            text = self._streamed_text  # never take back text already streamed
        delta = text[len(self._streamed_text) :]
        new_ids = self.output_ids[self._num_streamed_ids :]
        if not delta and not new_ids and not self.is_finished:
            return None
        self._streamed_text = text
        self._num_streamed_ids = len(self.output_ids)
        meta = self.meta_info()
        if self.return_logprob:  # (the request's own lists grow on: each chunk its snapshot)
            # (the last chunk has them whole: a prefill-only request's top logprobs are of
            # the token after its prompt, and a cut to its 0 tokens dropped them)
            end = None if self.is_finished else self._num_streamed_ids
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if key in meta:
                    meta[key] = meta[key][:end]
        return {"text": delta, "output_ids": new_ids, "meta_info": meta}


def _complete_part(new: str) -> str:
    """The text of tokens held back, without the incomplete UTF-8 sequence they end in
    (U+FFFD): its complete characters, which the tokens that complete it keep."""
    return new.rstrip("\ufffd")
