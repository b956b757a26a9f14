"""Jump-forward: text a pattern forces is appended in one extend step, not token by token.

A character-level automaton of the constraint (`CharFSM`) follows the output text. Where the
current state has exactly one way forward, one character at a time, up to a state where
the text could end or branch, that string is forced: the model has no choice to make. The
runtime appends it at once, retokenizing the last sampled token together with it (so the
tokens are the ones a tokenizer would produce for that text), and resyncs the matcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from lmprog_runtime.constrained.base import MAX_REDONE
from lmprog_runtime.regex_nfa import FINAL, NFA, LazyDFA

if TYPE_CHECKING:
    from lmprog_runtime.request import Req


class Codec(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


# NFA states a pattern may take (a bounded repeat takes its body once per repetition); past
# it, no jump-forward for that pattern.
MAX_STATES = 100_000
# Moves kept per pattern (each grammar in the cache has its automaton): about 6 MB at most.
MAX_MOVES = 20_000
# What the automaton holds, for the grammar cache's bound (tracemalloc, on patterns of
# free text and JSON schemas: 90-110 bytes an NFA state, 260-300 a move kept).
NFA_STATE_BYTES = 110
MOVE_BYTES = 300


class CharFSM:
    """The pattern's character automaton: an NFA (`regex_nfa`) whose subset states are
    made as the text reaches them. A state is a frozenset of NFA states; the empty one is
    dead. (interegular's DFA, built whole when the grammar compiled, took 3-57 s for a
    list of up to 5-20 ints, each an exact int64 pattern, and 24 s for ten optional ints:
    `benchmarks/bench_jump_forward_fsm.py`.)"""

    def __init__(self, regex: str) -> None:
        nfa = NFA(regex, max_states=MAX_STATES)
        self._dfa = LazyDFA(nfa, max_moves=MAX_MOVES)
        self._literals = nfa.literals
        self.initial = self._dfa.initial

    def nbytes(self) -> int:
        """About what the automaton holds now (its moves are made as texts reach them)."""
        return NFA_STATE_BYTES * len(self._literals) + MOVE_BYTES * self._dfa.moves_kept()

    def walk(self, text: str, state: Any = None) -> Any:
        """The state after reading `text` from `state` (None: the start), or None if it
        leaves the pattern."""
        move = self._dfa.move
        if state is None:
            state = self.initial
        for ch in text:
            state = move(state, ch)
            if not state:
                return None
        return state

    def forced(self, state: Any, limit: int) -> str:
        """The longest string every match must continue with from `state`, up to `limit`
        characters: while the text cannot end there and every NFA state in it takes the
        same one character."""
        out: list[str] = []
        seen = set()
        literals = self._literals
        while FINAL not in state and state not in seen and len(out) < limit:
            seen.add(state)
            chars = {literals[nfa_state] for nfa_state in state}
            if len(chars) != 1 or None in chars:
                break
            (char,) = chars
            out.append(char)
            state = self._dfa.move(state, char)
        return "".join(out)


# Tokens before the last one decoded with it, as context for retokenizing it (merged
# pieces and leading spaces decode differently without what precedes them).
CONTEXT_TOKENS = 4
# Text encoded before the forced text where a tokenizer begins a text with a space: a
# character no piece merges with what follows it.
ANCHOR = "\n"
# Forced characters appended by one jump: a longer forced text is appended a piece at a
# time, one extend step each. (Encoded whole at each step, a literal of 50,000 characters
# cost O(its length) a token; and one longer than the tokens left got no jump at all.)
MAX_JUMP_CHARS = 2048


def jump_forward(req: Req, codec: Codec) -> int | None:
    """Append the text `req`'s pattern forces now, retokenizing the last sampled token with
    it (those of the last character, where its bytes took several), and resync its
    matcher. Returns how many tokens were added (None: no jump). With no output yet, the
    forced text simply becomes the first output tokens.

    O(new tokens) per call: the text comes from the request's incremental detokenizer, the
    character FSM goes on from where it stopped, only the last few tokens are decoded
    again, and the matcher steps back those tokens instead of starting over."""
    ids = req.output_ids
    text = req.text_with_held_tokens()
    if text is None or text.endswith("\ufffd"):
        return None  # an incomplete UTF-8 sequence: wait for the next token
    walked, state = req.fsm_position
    if state is not None and len(text) > walked:
        state = req.char_fsm.walk(text[walked:], state)
    req.fsm_position = (len(text), state)
    if state is None:
        return None
    forced = req.char_fsm.forced(state, MAX_JUMP_CHARS)
    if len(forced) < 2:
        return None
    found = _last_character_tokens(req, codec, text)
    if found is None:
        return None
    redone, context, window_kept, last_text = found
    try:
        tail = _retokenized(codec, context, window_kept, last_text + forced)
    except ValueError:  # (a token past the model's vocabulary: decoding goes on instead)
        return None
    if tail is None:
        return None
    kept_len = len(ids) - redone
    room = req.max_new_tokens - 1 - kept_len  # (the request draws its last token itself)
    if len(tail) > room:
        forced = _fitting_text(codec, context, window_kept, tail[:room], last_text, forced)
        if forced is None:
            return None
        tail = tail[:room]
    if redone > 1 and tail[: redone - 1] != ids[kept_len:-1]:
        return None  # (the tokens before the last have K/V in the pool: only it may change)
    matcher = req.matcher
    if redone:
        matcher.rollback(redone)
    if not matcher.accepts(tail):
        for token in ids[kept_len:]:
            matcher.advance(token)  # undo the rollback
        return None
    for token in tail:
        matcher.advance(token)
    req.replace_output_tail(kept_len, tail, text + forced)
    req.fsm_position = (len(text) + len(forced), req.char_fsm.walk(forced, state))
    return kept_len + len(tail) - len(ids)


def _fitting_text(
    codec: Codec, context: list[int], before: str, tail: list[int], last_text: str, forced: str
) -> str | None:
    """The part of `forced` that `tail`, the first tokens of its retokenization that fit in
    the tokens left, spells after `last_text`; None if they add no whole character."""
    text = codec.decode(context + tail)
    if not text.startswith(before) or text.endswith("\ufffd"):
        return None
    text = text[len(before) :]
    if len(text) <= len(last_text) or not (last_text + forced).startswith(text):
        return None
    return text[len(last_text) :]


def _last_character_tokens(
    req: Req, codec: Codec, text: str
) -> tuple[int, list[int], str, str] | None:
    """The last tokens of the output to retokenize with the forced text: the last one, or
    as many as the last character's bytes took (an emoji drawn as three byte tokens: the
    text before the last one ends inside it, so no jump was made there). Returns (how many,
    the tokens before them, their text, the text of the retokenized ones); None if no
    window of up to `MAX_REDONE` tokens decodes as the text's end."""
    ids = req.output_ids
    tries = range(1, min(MAX_REDONE, len(ids)) + 1) if ids else (0,)  # (0: no output yet)
    for redone in tries:
        # (the prompt tokens the output is decoded after come before a short output's)
        if len(ids) >= redone + CONTEXT_TOKENS:
            context = ids[-redone - CONTEXT_TOKENS : -redone]
        else:
            context = (req.decode_context() + ids[: len(ids) - redone])[-CONTEXT_TOKENS:]
        window = codec.decode(context + ids[len(ids) - redone :])
        window_kept = codec.decode(context)
        if window.startswith(window_kept) and text.endswith(window[len(window_kept) :]):
            return redone, context, window_kept, window[len(window_kept) :]
    return None


def _retokenized(codec: Codec, context: list[int], before: str, text: str) -> list[int] | None:
    """The tokens of `text` after `context` (whose text is `before`), as the tokenizer has
    them inside a text: its plain encode, or, for a tokenizer that begins each text with a
    space (SentencePiece's `▁`, which made every jump's text start with a space the
    pattern refused), its encode after an anchor, the anchor's tokens dropped. None if
    neither decodes after `context` as `before + text`."""
    for anchor in ("", ANCHOR):
        ids = codec.encode(anchor + text, add_special_tokens=False)
        if anchor:
            head = codec.encode(anchor, add_special_tokens=False)
            if ids[: len(head)] != head:
                continue
            ids = ids[len(head) :]
        if codec.decode(context + ids) == before + text:
            return ids
    return None
