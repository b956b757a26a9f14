"""Whole decode runs as CUDA graphs (`decode_steps` = K > 1), beside the single steps'
graphs of `cuda_graph.py`.

Each bucket also gets a graph of a whole run of plain greedy steps (`run_greedy`): K
forwards, each step's argmax the next one's input, on a `[K, 6, max_batch]` static buffer
(each step's rows those of a single step's buffer, `cuda_graph.py`). A run of K steps is
then one input copy, one replay and one copy of its `[K, batch]` tokens to the host, where
the step-by-step path queues some six eager ops a step (`decode_run.py` takes it when every
row is plain greedy and none asks for logprobs). A shorter run (the last of its requests'
tokens) replays graphs of the powers of two below K (`run_lengths`: 8 = [8], 7 = [4, 2,
1]), captured too, each piece's first ids the last tokens of the piece before, on the
device. On a CPU an eager run keeps its outputs where a replay would (`_as_replayed_run`),
so the tests see what outlives a replay.

`RunGraphs` holds these methods of `DecodeGraphRunner` (a mixin: its `__init__` sets the
run buffers used here, and the run graphs share the single steps' memory pool).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import torch

from lmprog_runtime.forward_batch import PACKED_IDS, ForwardBatch, resolve_future_ids
from lmprog_runtime.sampling import argmax_rows

logger = logging.getLogger("lmprog_runtime.cuda_graph")


def run_lengths(steps: int) -> list[int]:
    """The run lengths with a graph when runs are `steps` long (0: none): `steps` and the
    powers of two below it, longest first, so that any shorter run is a few of them.

    Example:
        >>> run_lengths(8), run_lengths(6), run_lengths(0)
        ([8, 4, 2, 1], [6, 4, 2, 1], [])
    """
    if steps < 2:
        return []
    return [steps] + [1 << j for j in range((steps - 1).bit_length() - 1, -1, -1)]


def pieces(steps: int, lengths: list[int]) -> list[int]:
    """A run of `steps` cut into the fewest `lengths` (longest first, ending in 1).

    Example:
        >>> pieces(8, [8, 4, 2, 1]), pieces(7, [8, 4, 2, 1]), pieces(5, [6, 4, 2, 1])
        ([8], [4, 2, 1], [4, 1])
    """
    out = []
    for length in lengths:
        while steps >= length:
            out.append(length)
            steps -= length
    return out


@contextlib.contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None, stream: torch.cuda.Stream
) -> Iterator[None]:
    """`torch.cuda.graph` on `stream`, with two differences:

    - only this thread's calls are checked during the capture (`thread_local`): another
      engine's loop serving in the same process may allocate pinned memory or read a
      result meanwhile, which the default ("global") fails, with that engine's step;
    - the caller's stream is current again afterwards even where the capture fails
      (torch ends the capture before it restores the stream, and a failed end skipped
      the restore: the thread went on on the side stream, which its syncs then waited on).
    """
    current = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield
    finally:
        torch.cuda.set_stream(current)


class RunGraphs:
    """The decode runs of `DecodeGraphRunner`."""

    def can_run_greedy(self, batch_size: int, steps: int) -> bool:
        """Whether a run of `steps` plain greedy steps of `batch_size` requests runs as
        graphs (`run_greedy`)."""
        if not 1 < steps <= self.run_steps or batch_size > self.max_batch:
            return False
        return sum(pieces(steps, self.run_lengths)) == steps  # (lengths whose capture failed)

    @torch.inference_mode()
    def run_greedy(
        self,
        first: torch.Tensor,
        ahead: torch.Tensor,
        first_ids: torch.Tensor | None,
        seq_lens: list[int],
    ) -> torch.Tensor:
        """A decode run of plain greedy steps: `first` [6, n] the first step's inputs (a
        batch's packed block; its ids may be placeholders), `ahead` [steps - 1, 6, n] the
        steps' after it (their ids unused: each step takes the tokens the step before
        drew), `first_ids` [n] the first step's ids when they are on the device already
        (else None), `seq_lens` the first step's lengths (an eager run's, for a backend
        that plans from them). Returns each step's argmax tokens [steps, n], valid until
        the next run (a view of the graph's output, or of the pieces' put together).

        A run of K = `run_steps` steps is one replay; a shorter one (its requests' last
        tokens) is cut into pieces of the lengths captured (`run_lengths`: K and the powers
        of two below it), each piece's first ids the tokens the piece before drew."""
        num_reqs, steps = first.shape[1], ahead.shape[0] + 1
        size = self.bucket(num_reqs)
        self._last = None  # (the replay overwrites the single steps' outputs too)
        inputs, tokens = self._run_inputs, self._run_tokens
        start, cut = 0, pieces(steps, self.run_lengths)
        for length in cut:
            inputs[0, :, :num_reqs] = first if start == 0 else ahead[start - 1]
            inputs[1:length, :, :num_reqs] = ahead[start : start + length - 1]
            if first_ids is not None:
                inputs[0, PACKED_IDS, :num_reqs] = first_ids
            if size > num_reqs:
                inputs[:length, :, num_reqs:size] = self._padding[:, num_reqs:size]
            if self.is_captured:
                self._run_graphs[size, length].replay()
                drawn = self._run_outputs[size, length]
            else:
                lens = [n + start for n in seq_lens]
                drawn = self._forward_run(self._eager_run_batches(size, lens, length))
                drawn = self._as_replayed_run(drawn)
                if self._eager_outputs is not None:  # (one pool: a single step's are gone)
                    self._eager_outputs[0].fill_(float("nan"))
                    self._eager_outputs[1].fill_(-1)
            if len(cut) == 1:  # (a whole run: its graph's tokens, no copy)
                return drawn[:, :num_reqs]
            tokens[start : start + length, :num_reqs] = drawn[:, :num_reqs]
            first_ids = tokens[start + length - 1, :num_reqs]
            start += length
        return tokens[:steps, :num_reqs]

    def _as_replayed_run(self, tokens: torch.Tensor) -> torch.Tensor:
        """`_as_replayed` for a run's tokens [K, size]: kept in one buffer, which the next
        run overwrites. The graphs share one memory pool, so a run's replay may overwrite
        a single step's outputs and the other way round: an eager run of one kind spoils
        the other's outputs (NaN, -1), so that the CPU tests see a read across them."""
        kept = self._eager_run_tokens
        if kept is None:
            kept = self._eager_run_tokens = torch.empty(
                self.run_steps, self.max_batch, dtype=tokens.dtype, device=tokens.device
            )
        kept[:, : tokens.shape[1]].fill_(-1)  # (a piece's other rows: as a replay's, unknown)
        kept[: tokens.shape[0], : tokens.shape[1]].copy_(tokens)
        return kept[: tokens.shape[0], : tokens.shape[1]]

    def _eager_run_batches(self, size: int, seq_lens: list[int], steps: int) -> list[ForwardBatch]:
        """What an eager run of `steps` steps forwards (see `_eager_batch`): a capturable
        backend gets capture's placeholder lengths, others the requests' lengths at each
        step (`seq_lens` the first step's, one more each step; padded rows' 1)."""
        padded = [1] * (size - len(seq_lens))
        if self.attention.supports_cuda_graph:
            lens = [[1] * size] * steps
        else:
            lens = [[n + k for n in seq_lens] + padded for k in range(steps)]
        return [self._static_batch(size, lens[k], self._run_inputs[k]) for k in range(steps)]

    def _forward_run(self, steps: list[ForwardBatch]) -> torch.Tensor:
        """A run's K forwards on its static batches (`steps`), each step's ids the argmax
        of the one before (the first step's resolved from placeholders), as `_forward`
        does one. Returns the tokens [K, size]. (No future tokens stored: after a run the
        requests hold its tokens, and a run launched after it takes its last ones.)"""
        ids = resolve_future_ids(steps[0].input_ids, self._future_tokens)
        drawn = []
        for fb in steps:
            step = dataclasses.replace(fb, input_ids=ids)
            self.attention.init_forward_metadata(step)
            ids = argmax_rows(self.model(step, self.attention))
            drawn.append(ids)
        return torch.stack(drawn)

    def _capture_runs(self, stream: torch.cuda.Stream, pool: tuple[int, int]) -> None:
        """One graph of a run of each of `run_lengths` greedy steps per bucket, in the
        single steps' memory pool (after them: a failure here leaves them be). A length
        whose capture fails is dropped, its graphs with it, and the others are kept: a run
        that the lengths left cannot make goes step by step (`can_run_greedy`)."""
        captured = []
        for length in self.run_lengths:
            try:
                for size in reversed(self.buckets):
                    steps = [
                        self._static_batch(size, [1] * size, self._run_inputs[k])
                        for k in range(length)
                    ]
                    # Warm up the first length only: a shorter run launches the same kernels
                    # at the same sizes, compiled by then (a launch that depended on the
                    # length would compile inside its capture, and that capture fail).
                    if not captured:
                        with torch.cuda.stream(stream):
                            self._forward_run(steps)
                        stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with capturing(graph, pool, stream):
                        self._run_outputs[size, length] = self._forward_run(steps)
                    self._run_graphs[size, length] = graph
            except Exception as error:  # noqa: BLE001 - those runs then go step by step
                logger.warning("capturing decode-run graphs of %d steps failed: %r", length, error)
                for size in self.buckets:
                    self._run_graphs.pop((size, length), None)
                    self._run_outputs.pop((size, length), None)
                continue
            captured.append(length)
        self.run_lengths = captured
        if not captured:
            self.run_steps = 0
