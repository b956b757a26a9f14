"""Independent references for constrained decoding on the tiny model: each token's bytes
read through GPT-2's byte table of `transformers`, and a greedy decode under a pattern
with transformers' forward and the `regex` module's partial matching (shared by
test_token_healing.py and test_end_outside_pattern.py)."""

from __future__ import annotations

import regex
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode


def vocab_bytes(tokenizer) -> dict[int, bytes]:
    """Each ordinary token's bytes, read from its piece through GPT-2's byte table."""
    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    out = {}
    for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(range(len(tokenizer)))):
        if token_id not in special and piece is not None and all(c in to_byte for c in piece):
            out[token_id] = bytes(to_byte[c] for c in piece)
    return out


def extends(table: dict[int, bytes], token: int) -> set[int]:
    return {t for t, data in table.items() if data.startswith(table[token])}


def constrained_reference(
    hf_tiny, table, ids, pattern, new, *, heal: bool = True, end_outside: bool = False
) -> list[int]:
    """transformers' greedy decode under `pattern`: each token the argmax of those whose
    text keeps the output a prefix of a full match (the `regex` module's partial
    matching), EOS once it is a full match. `heal`: from the prompt less its last token,
    that token's text in front of the pattern. `end_outside`: where the output is a full
    match, the argmax of every token, a token the pattern cannot take ending it (kept as
    the last id, as EOS is)."""
    model, tokenizer = hf_tiny
    prompt = ids[:-1] if heal else ids
    front = regex.escape(table[ids[-1]].decode()) if heal else ""
    full = regex.compile(front + f"(?:{pattern})")
    texts = {}
    for t, data in table.items():
        try:
            texts[t] = data.decode()
        except UnicodeDecodeError:
            continue  # part of a character: no ASCII pattern takes it
    out, text = [], ""
    for _ in range(new):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        allowed = [t for t, piece in texts.items() if full.fullmatch(text + piece, partial=True)]
        complete = full.fullmatch(text) is not None
        if complete:
            allowed.append(tokenizer.eos_token_id)
        if complete and end_outside:
            best = int(logits.argmax())
            out.append(best)
            if best == tokenizer.eos_token_id or best not in allowed:
                break
        else:
            best = max(allowed, key=lambda t: logits[t].item())
            out.append(best)
            if best == tokenizer.eos_token_id:
                break
        text += texts[best]
    return out
