"""Decoding a byte-level BPE tokenizer's ids by table: each id's bytes, joined, read as
UTF-8 (invalid sequences replaced, as the tokenizer's own decode replaces them).

The loop decodes at every finish, and twice a token for stop strings and streams. The
Rust tokenizer's `decode` costs ~8-15 us for 64 tokens (a call, a token string per id,
then its decoder); a table of each id's bytes costs ~2 us. Taken only where the
tokenizer's decode is exactly that (`ByteLevelTable.of`): its decoder is GPT-2's
byte-level one alone. Llama-2-style tokenizers (byte fallback, `▁` for spaces) keep the
tokenizer's own decode.
"""

from __future__ import annotations

from typing import Any


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
    Ids the tokenizer does not know decode to nothing; with `skip_special_tokens`, neither
    do special added tokens. Anything else (a negative id, not a list of ints) goes to
    the tokenizer's own decode.

    Example:
        >>> from tokenizers import Tokenizer, decoders, models
        >>> backend = Tokenizer(models.BPE({"h": 0, "i": 1, "Ġ": 2}, []))
        >>> backend.decoder = decoders.ByteLevel()
        >>> ByteLevelTable.of(backend)([0, 1, 2, 0])
        'hi h'
    """

    def __init__(self, backend: Any) -> None:
        chars = unicode_to_byte()
        as_latin1 = str.maketrans({ch: chr(b) for ch, b in chars.items()})
        mapped = frozenset(chars)
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        size = max(backend.get_vocab_size(with_added_tokens=False), max(added, default=-1) + 1)
        self._backend = backend
        self._all: list[bytes] = [b""] * size
        self._plain: list[bytes] = [b""] * size  # (special tokens skipped)
        for token_id in range(size):
            token = backend.id_to_token(token_id)
            if token is None:
                continue
            if mapped.issuperset(token):
                piece = token.translate(as_latin1).encode("latin-1")
            else:
                piece = token.encode("utf-8")
            self._all[token_id] = piece
            if token_id not in added or not added[token_id].special:
                self._plain[token_id] = piece

    @classmethod
    def of(cls, backend: Any) -> ByteLevelTable | None:
        """The table of `backend` (a `tokenizers.Tokenizer`), if its decoder is the
        byte-level one alone; None otherwise."""
        from tokenizers import decoders

        if type(backend.decoder) is not decoders.ByteLevel:
            return None
        return cls(backend)

    def __call__(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        table = self._plain if skip_special_tokens else self._all
        if ids and type(ids) is list:
            try:
                if min(ids) >= 0:
                    return b"".join(map(table.__getitem__, ids)).decode("utf-8", "replace")
            except (IndexError, TypeError):  # (an id past the table: an unknown one)
                pass
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
