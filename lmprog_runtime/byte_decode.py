"""Decoding a byte-level BPE tokenizer's ids by table: each id's bytes, joined, read as
UTF-8 (invalid sequences replaced, as the tokenizer's own decode replaces them).

The loop decodes at every finish, and at each token of stop strings and streams.
`Engine.decode` of 66 tokens took 6.6 us through the Rust tokenizer's `decode` (a token
string per id, then its decoder, under the engine's tokenizer lock) and takes 3.3 by the
table (read-only: no lock); of 1-2 tokens 0.94-1.03 against 0.54-0.6 (tiny, a tight
loop). Taken only where the tokenizer's decode is exactly that
(`ByteLevelTable.of`): its decoder is GPT-2's byte-level one alone. Llama-2-style
tokenizers (byte fallback, `▁` for spaces) keep the tokenizer's own decode.
"""

from __future__ import annotations

import operator
import re
from typing import Any

_BYTE_PIECE = re.compile("<0x[0-9A-Fa-f]{2}>")


def unicode_to_byte() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level table: printable bytes map to themselves, the rest
    to code points from 256 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class ByteLevelTable:
    """A byte-level tokenizer's decode (`tokenizers.Tokenizer.decode`) as a table lookup.

    Each id's token (an added token's content, or the vocabulary's piece) stands for the
    bytes its characters map to through the byte-level table; a token with a character
    outside the table stands for its own UTF-8 (as the tokenizers library decodes it).
    With `skip_special_tokens`, special added tokens stand for nothing. An id the table
    does not hold (unknown, negative) gives None: ask the tokenizer.

    Example:
        >>> from tokenizers import Tokenizer, decoders, models
        >>> backend = Tokenizer(models.BPE({"h": 0, "i": 1, "Ġ": 2}, []))
        >>> backend.decoder = decoders.ByteLevel()
        >>> table = ByteLevelTable.of(backend)
        >>> table.decode([0, 1, 2, 0]), table.decode([0, 7])
        ('hi h', None)
    """

    def __init__(self, backend: Any) -> None:
        chars = unicode_to_byte()
        as_latin1 = str.maketrans({ch: chr(b) for ch, b in chars.items()})
        mapped = frozenset(chars)
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        size = max(backend.get_vocab_size(with_added_tokens=False), max(added, default=-1) + 1)
        pieces, plain = {}, {}  # id -> bytes (plain: special tokens skipped)
        for token_id in range(size):
            token = backend.id_to_token(token_id)
            if token is None:
                continue
            if mapped.issuperset(token):
                piece = token.translate(as_latin1).encode("latin-1")
            else:
                piece = token.encode("utf-8")
            pieces[token_id] = piece
            plain[token_id] = b"" if token_id in added and added[token_id].special else piece
        # (bound lookups: a decode of a few tokens, at each token of a stop string's
        # check, costs about as much as the call around it)
        self._piece, self._plain_piece = pieces.__getitem__, plain.__getitem__

    @classmethod
    def of(cls, backend: Any) -> ByteLevelTable | None:
        """The table of `backend` (a `tokenizers.Tokenizer`), if its decoder is the
        byte-level one alone; None otherwise."""
        from tokenizers import decoders

        if type(backend.decoder) is not decoders.ByteLevel:
            return None
        return cls(backend)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str | None:
        """The text of `ids` (a flat list); None if the table does not hold one of them."""
        piece = self._plain_piece if skip_special_tokens else self._piece
        try:  # (`operator.index`: a float id is refused, as by the tokenizer)
            return b"".join(map(piece, map(operator.index, ids))).decode("utf-8", "replace")
        except (KeyError, TypeError):
            return None


def byte_pieces(tokenizer: Any) -> dict[int, int]:
    """A byte-fallback tokenizer's byte pieces (`<0xE2>`), id -> byte, where its decoder
    reads them as runs (the tokenizers library's `ByteFallback`): a run that is not valid
    UTF-8 decodes to one U+FFFD per byte, its valid characters too, so a byte piece's text
    is known only once a piece of another kind follows it. Empty for other tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteFallback" not in str(backend.decoder):
        return {}
    pieces = tokenizer.get_vocab().items()
    return {
        token_id: int(piece[3:5], 16) for piece, token_id in pieces if _BYTE_PIECE.fullmatch(piece)
    }


def ends_inside_a_character(ids: list[int], pieces: dict[int, int]) -> bool:
    """Whether `ids`, whose text ends in U+FFFD, end inside a UTF-8 sequence: for byte
    pieces, read from their bytes (a U+FFFD they spell whole is a character); otherwise
    guessed from that U+FFFD."""
    tail = []
    for token_id in reversed(ids):
        if token_id not in pieces:
            break
        tail.append(pieces[token_id])
    if not tail:
        return not pieces  # (a byte-fallback tokenizer's other pieces are whole text)
    try:
        bytes(reversed(tail)).decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
