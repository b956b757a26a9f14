"""What one model forward computes: the flat token batch and its per-request layout.

Tokens of all requests are concatenated (no padding) in request order. For request b the
new tokens sit at positions `prefix_lens[b] .. seq_lens[b] - 1`; its keys and values for
positions `0 .. seq_lens[b] - 1` are found through `req_to_token[req_pool_indices[b]]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

import torch


class ForwardMode(Enum):
    EXTEND = auto()  # prefill: several new tokens per request, after a (possibly empty) prefix
    DECODE = auto()  # one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot written for each new token
    req_pool_indices: torch.Tensor  # [batch] int64, rows of the request-to-token table
    seq_lens: list[int]  # [batch] total length after this forward
    prefix_lens: list[int]  # [batch] tokens whose KV was already in the pool
    # Rows of the flat token batch whose logits are needed, in output order.
    logits_indices: torch.Tensor

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def extend_lens(self) -> list[int]:
        return [s - p for s, p in zip(self.seq_lens, self.prefix_lens)]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())
