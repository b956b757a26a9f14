"""Jump-forward: text a pattern forces is appended in one extend step, not token by token.

A character-level FSM of the constraint (interegular) follows the output text. Where the
current state has exactly one way forward, one character at a time, up to a state where
the text could end or branch, that string is forced: the model has no choice to make. The
runtime appends it at once, retokenizing the last sampled token together with it (so the
tokens are the ones a tokenizer would produce for that text), and resyncs the matcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lmprog_runtime.request import Req


class Codec(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class CharFSM:
    def __init__(self, regex: str) -> None:
        import interegular

        self.fsm = interegular.parse_pattern(regex).to_fsm()
        self._anything_else = interegular.fsm.anything_else
        self._chars = {
            symbol: [c for c in chars if c is not self._anything_else]
            for symbol, chars in self.fsm.alphabet.by_transition.items()
        }

    def walk(self, text: str) -> Any:
        """The state after reading `text` from the start, or None if it leaves the pattern."""
        state, alphabet, transitions = self.fsm.initial, self.fsm.alphabet, self.fsm.map
        for ch in text:
            state = transitions.get(state, {}).get(alphabet[ch])
            if state is None:
                return None
        return state

    def forced(self, state: Any) -> str:
        """The longest string every match must continue with from `state`."""
        out: list[str] = []
        finals, transitions = self.fsm.finals, self.fsm.map
        seen = set()
        while state not in finals and state not in seen:
            seen.add(state)
            edges = transitions.get(state, {})
            if len(edges) != 1:
                break
            ((symbol, nxt),) = edges.items()
            chars = self._chars.get(symbol, [])
            if len(chars) != 1 or len(self.fsm.alphabet.by_transition[symbol]) != 1:
                break
            out.append(chars[0])
            state = nxt
        return "".join(out)


def jump_forward(req: Req, codec: Codec) -> int | None:
    """Append the text `req`'s pattern forces now, retokenizing the last sampled token with
    it, and resync its matcher. Returns how many tokens were added (None: no jump). With
    no output yet, the forced text simply becomes the first output tokens."""
    ids = req.output_ids
    text = codec.decode(ids)
    if text.endswith("\ufffd"):
        return None  # an incomplete UTF-8 sequence: wait for the next token
    state = req.char_fsm.walk(text)
    forced = req.char_fsm.forced(state) if state is not None else ""
    if len(forced) < 2:
        return None
    kept = ids[:-1] if ids else []
    kept_text = codec.decode(kept)
    if not text.startswith(kept_text):
        return None
    candidate = kept + codec.encode(text[len(kept_text) :] + forced, add_special_tokens=False)
    if len(candidate) >= req.max_new_tokens or codec.decode(candidate) != text + forced:
        return None
    matcher = req.grammar.new_matcher()
    if not matcher.accepts(candidate):
        return None
    for token in candidate:
        matcher.advance(token)
    req.output_ids, req.matcher = candidate, matcher
    return len(candidate) - len(ids)
