"""What one model forward computes: the flat token batch and its per-request layout.

Tokens of all requests are concatenated (no padding) in request order. For request b the
new tokens sit at positions `prefix_lens[b] .. seq_lens[b] - 1`; its keys and values for
positions `0 .. seq_lens[b] - 1` are found through `req_to_token[req_pool_indices[b]]`.
Tensors live on the model's device; the `list[int]` fields are host copies of the same
lengths, for backends that plan on the host.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch


class ForwardMode(Enum):
    EXTEND = auto()  # prefill: several new tokens per request, after a (possibly empty) prefix
    DECODE = auto()  # one new token per request


# The rows of a decode batch's packed inputs (`ForwardBatch.packed`), in order; a decode
# graph's static input buffer has the same rows.
NUM_PACKED_ROWS = 6
PACKED_IDS, PACKED_POSITIONS, PACKED_ROWS, PACKED_LENS, PACKED_SLOTS, PACKED_LOGITS = range(
    NUM_PACKED_ROWS
)


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
    # An extend's last `num_decodes` requests are running ones decoding one token each.
    num_decodes: int = 0
    # [batch] int64 on the model's device: `seq_lens` for kernels, sent with the other
    # inputs (a backend needs no copy of its own).
    seq_lens_device: torch.Tensor | None = None
    # A CUDA-graph batch (`cuda_graph.py`): the tensors are the graph's static buffers, and
    # launch shapes may depend on the batch size only, never on lengths read on the host.
    # Backends without `supports_cuda_graph` are never captured, and ignore it.
    is_cuda_graph: bool = False
    # Overlap scheduling: some `input_ids` are placeholders `-(row + 1)`, the token drawn
    # for table row `row` by the step before, still on the device; `ModelRunner.run`
    # puts the tokens in their place before the model runs.
    has_future_ids: bool = False
    # The last `future_tail` ids are placeholders, one for each of the last `future_tail`
    # requests (its own row's), and no other id is one: resolved by one gather of those
    # requests' rows (`ModelRunner.resolved_ids`). 0: resolved id by id.
    future_tail: int = 0
    # A decode batch's inputs as `ModelRunner.prepare` sent them, one [6, batch] int64
    # block on the device: ids, positions, table rows, lengths, KV slots, logits rows (the
    # fields above are its rows), for a decode graph to take in one copy (`packed_inputs`).
    packed: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def extend_lens(self) -> list[int]:
        return [s - p for s, p in zip(self.seq_lens, self.prefix_lens)]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def packed_inputs(self) -> torch.Tensor | None:
        """`packed`, if the fields are still its rows (None once `input_ids` was replaced,
        as a decode run replaces a step's ids by the tokens drawn before it)."""
        packed = self.packed
        if packed is None or self.input_ids.data_ptr() != packed.data_ptr():
            return None
        return packed

    def split_decodes(self) -> tuple[ForwardBatch, ForwardBatch]:
        """A mixed extend as (its extend part, its decode part), for backends that attend
        the two differently. Both share this batch's tensors (views, no copies)."""
        n_reqs = self.batch_size - self.num_decodes
        n_tokens = self.num_tokens - self.num_decodes

        def part(mode: ForwardMode, reqs: slice, tokens: slice) -> ForwardBatch:
            return ForwardBatch(
                mode=mode,
                input_ids=self.input_ids[tokens],
                positions=self.positions[tokens],
                out_cache_loc=self.out_cache_loc[tokens],
                req_pool_indices=self.req_pool_indices[reqs],
                seq_lens=self.seq_lens[reqs],
                prefix_lens=self.prefix_lens[reqs],
                logits_indices=self.logits_indices[:0],  # not used by attention
                seq_lens_device=(
                    self.seq_lens_device[reqs] if self.seq_lens_device is not None else None
                ),
            )

        return (
            part(ForwardMode.EXTEND, slice(0, n_reqs), slice(0, n_tokens)),
            part(ForwardMode.DECODE, slice(n_reqs, None), slice(n_tokens, None)),
        )


def resolve_future_ids(input_ids: torch.Tensor, future_tokens: torch.Tensor) -> torch.Tensor:
    """`input_ids` with each placeholder `-(row + 1)` replaced by `future_tokens[row]`: a few
    small kernels, nothing read back (a decode graph runs them inside its replay, where they
    cost the host nothing; run eagerly they cost it ~110 us a step on an H200 machine).

    Example:
        >>> resolve_future_ids(torch.tensor([5, -2, 7]), torch.tensor([0, 9])).tolist()
        [5, 9, 7]
    """
    rows = (-input_ids - 1).clamp_(min=0)
    return torch.where(input_ids < 0, future_tokens[rows], input_ids)


class OneRowEach(Sequence[list[int]]):
    """A decode forward's logits rows by request: request i's is row i alone, as the list
    `[[0], [1], ...]` reads, without building it (a decode step would, every step)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # (an int; a slice gives a list)
        if isinstance(i, slice):
            return [[j] for j in range(self.n)[i]]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return [i % self.n]


class RowsOf:
    """A forward's logits rows of each of its requests (`rows[i]` request i's, in the
    batch's order), by `id(request)`. The dict by id is built only when a request is asked
    for out of that order: a decode step reads its batch's last rows in order
    (`last_rows`), which costs a pass over the rows and no dict."""

    __slots__ = ("reqs", "rows", "_by_id")

    def __init__(self, reqs: Sequence[Any], rows: Sequence[list[int]]) -> None:
        self.reqs, self.rows = reqs, rows
        self._by_id: dict[int, list[int]] | None = None

    def __getitem__(self, key: int) -> list[int]:
        if self._by_id is None:
            self._by_id = {id(req): rows for req, rows in zip(self.reqs, self.rows)}
        return self._by_id[key]

    def last_rows(self, reqs: Sequence[Any]) -> list[int]:
        """Each of `reqs`' last row (the row its next token is drawn from)."""
        if len(reqs) == len(self.reqs) and all(map(operator.is_, reqs, self.reqs)):
            if type(self.rows) is OneRowEach:
                return list(range(len(reqs)))
            return [rows[-1] for rows in self.rows]
        return [self[id(req)][-1] for req in reqs]
