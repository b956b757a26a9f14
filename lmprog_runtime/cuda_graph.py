"""Decode steps without launch overhead: CUDA graphs captured per padded batch size.

A decode forward of a small model launches a few hundred kernels of a few microseconds
each; replaying them as one captured graph removes the launch cost. A graph replays fixed
memory with fixed launch shapes, so each decode batch is padded up to a bucket size
(`BATCH_BUCKETS`, up to `max_running_requests`, at most `MAX_GRAPH_BATCH`) and its inputs
are copied into static buffers that the graph reads:

- input ids, positions, table rows, sequence lengths, KV slots written and logits rows
  (unused: a graph's are `0 .. bucket - 1`): `[6, max_batch]` int64 (one buffer, its rows
  in the order `ModelRunner.prepare` packs a decode batch's inputs, so a step's inputs go
  into it as one copy); the ids may hold the overlapped loop's placeholders, which the
  graph replaces by the drawn tokens itself (`future_tokens`: no eager ops for them);
- padded requests write their K/V to the padding slot 0, read the request table's padding
  row (every entry slot 0) with a sequence length of 1, and their logits are dropped.

The graph also draws greedily: each row's argmax, stored at `future_tokens[table row]`
(padded rows store to the padding row's, which no placeholder reads). A batch whose rows
are all plain greedy ones (`SampleRows.plain`), drawn whole, takes these tokens
(`greedy_tokens`) instead of an argmax, a clamp and a store of its own: three eager ops
fewer a step. Any other draw runs as before and stores its own tokens after the graph's,
so what the next forward reads is always the draw's.

Whole decode runs as graphs (`decode_steps` > 1): `run_graphs.py`.

The attention backend must support it (`BaseAttentionBackend.supports_cuda_graph`): given a
batch with `is_cuda_graph` set, it plans from `seq_lens_device` and `req_pool_indices` alone
with launch shapes that depend on the batch size only (e.g. a fixed split count).

On a CPU (tests) the runner works in eager mode (`capture=False`): the same padded static
buffers, run without capture, so the padding and bucketing are checked against the plain
forward where no GPU is available. With a capturable backend an eager run passes the
placeholder lengths a capture saw, so only the static buffers carry the step, as in a
replay.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from lmprog_runtime.forward_batch import (
    NUM_PACKED_ROWS,
    PACKED_IDS,
    PACKED_LENS,
    PACKED_LOGITS,
    PACKED_POSITIONS,
    PACKED_ROWS,
    PACKED_SLOTS,
    ForwardBatch,
    ForwardMode,
    resolve_future_ids,
)
from lmprog_runtime.run_graphs import RunGraphs, capturing, run_lengths
from lmprog_runtime.sampling import argmax_rows

if TYPE_CHECKING:
    from lmprog_runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)
# Padded decode batch sizes with a graph of their own.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MAX_GRAPH_BATCH = BATCH_BUCKETS[-1]


def batch_buckets(max_batch: int) -> list[int]:
    """The bucket sizes for batches of up to `max_batch` requests (capped at MAX_GRAPH_BATCH).

    Example:
        >>> batch_buckets(20)
        [1, 2, 4, 8, 16, 20]
    """
    max_batch = min(max_batch, MAX_GRAPH_BATCH)
    return [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]


class DecodeGraphRunner(RunGraphs):
    """Runs decode forwards of up to `max_batch` requests on padded static buffers, replaying
    one CUDA graph per bucket (`capture=True`, CUDA only) or eagerly (`capture=False`).

    Example:
        >>> graphs = DecodeGraphRunner(runner, capture=False)  # doctest: +SKIP
        >>> logits = graphs.run(fb) if graphs.can_run(fb) else ...  # doctest: +SKIP
    """

    def __init__(self, runner: ModelRunner, capture: bool) -> None:
        if capture and runner.device.type != "cuda":
            raise ValueError("CUDA graphs are captured on CUDA devices only")
        if capture and not runner.attention.supports_cuda_graph:
            raise ValueError(f"the {runner.attention_backend} backend cannot be captured")
        self.model = runner.model
        self.attention = runner.attention
        self.is_captured = capture
        self.buckets = batch_buckets(runner.config.max_running_requests)
        self.max_batch = self.buckets[-1]
        self._future_tokens = runner.future_tokens  # (overlap's placeholders: resolved inside)
        device = runner.device
        # [6, max_batch] int64 (rows PACKED_IDS .. PACKED_LOGITS), and what padded requests
        # hold there.
        padding = torch.zeros(NUM_PACKED_ROWS, self.max_batch, dtype=torch.int64, device="cpu")
        padding[PACKED_ROWS] = runner.req_to_token.padding_row
        padding[PACKED_LENS] = 1
        self._padding = padding.to(device)
        self._inputs = self._padding.clone()
        self._logits_indices = torch.arange(self.max_batch, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # each graph's (logits [bucket, vocab], argmax tokens [bucket])
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the last run's (logits handed out, its rows' argmax tokens: a view of the graph's
        # output, valid until the next run)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._eager_outputs: tuple[torch.Tensor, torch.Tensor] | None = None  # (`_as_replayed`)
        # Whole decode runs of plain greedy steps: K steps' inputs [K, 6, max_batch], and
        # each bucket's graph and its tokens [K, bucket].
        self.run_steps = runner.config.run_steps if runner.config.run_steps > 1 else 0
        self.run_lengths = run_lengths(self.run_steps)
        self._run_inputs = self._padding.expand(max(self.run_steps, 1), -1, -1).clone()
        # each (bucket, length)'s graph and its tokens [length, bucket]
        self._run_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._run_outputs: dict[tuple[int, int], torch.Tensor] = {}
        # a run's tokens, its pieces' put together (outside the graphs' pool)
        self._run_tokens = torch.zeros(
            max(self.run_steps, 1), self.max_batch, dtype=torch.int64, device=device
        )
        self._eager_run_tokens: torch.Tensor | None = None  # (`_as_replayed`'s, for runs)
        if capture:
            self._capture_all()

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.can_run_size(fb.mode, fb.batch_size)

    def can_run_size(self, mode: ForwardMode, batch_size: int) -> bool:
        """`can_run` of a batch of `mode` and `batch_size` requests (before it is built)."""
        return mode is ForwardMode.DECODE and batch_size <= self.max_batch

    def bucket(self, batch_size: int) -> int:
        """The padded size a batch of `batch_size` requests runs at."""
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    @torch.inference_mode()
    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """The decode forward of `fb`: logits [batch, vocab] (float32), equal to the plain
        forward's up to the rounding of a larger matmul. A view of the graph's output,
        valid until the next run (of any bucket: the graphs share one memory pool): read
        it, or queue what reads it, before the next forward (the loops draw from it at
        once; a caller that keeps logits across forwards copies them)."""
        num_reqs = fb.batch_size
        size = self.bucket(num_reqs)
        assert fb.seq_lens_device is not None, "the runner's batches carry device lengths"
        packed = fb.packed_inputs()
        if packed is not None:  # (one copy)
            self._inputs[:, :num_reqs] = packed
        else:
            self._inputs[:PACKED_LOGITS, :num_reqs] = torch.stack(
                [
                    fb.input_ids,
                    fb.positions,
                    fb.req_pool_indices,
                    fb.seq_lens_device,
                    fb.out_cache_loc,
                ]
            )
        if size > num_reqs:
            self._inputs[:, num_reqs:size] = self._padding[:, num_reqs:size]
        self._last = None
        if self.is_captured:
            self._graphs[size].replay()
            logits, tokens = self._outputs[size]
        else:
            logits, tokens = self._as_replayed(*self._forward(self._eager_batch(size, fb)))
            if self._eager_run_tokens is not None:  # (one pool: a run's tokens are gone)
                self._eager_run_tokens.fill_(-1)
        out = logits[:num_reqs]  # (no copy: a [batch, vocab] launch a step saved)
        self._last = (out, tokens[:num_reqs])
        return out

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The argmax of each row of `logits`, drawn (and stored as future tokens for the
        batch's table rows) by the graph run that returned them, while no run has followed
        it; else None. A view of the graph's output: read it (queue its copy) before the
        next run."""
        last = self._last
        return last[1] if last is not None and last[0] is logits else None

    def _as_replayed(
        self, logits: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An eager run's outputs where a replay leaves them: in buffers that every bucket
        shares (the graphs share one memory pool) and the next run overwrites, so that
        the CPU tests see what outlives a replay."""
        size, vocab = logits.shape
        kept = self._eager_outputs
        if kept is None or kept[0].shape[1] != vocab or kept[0].dtype != logits.dtype:
            kept = self._eager_outputs = (
                torch.empty(self.max_batch, vocab, dtype=logits.dtype, device=logits.device),
                torch.empty(self.max_batch, dtype=tokens.dtype, device=tokens.device),
            )
        kept[0][:size].copy_(logits)
        kept[1][:size].copy_(tokens)
        return kept[0][:size], kept[1][:size]

    def _eager_batch(self, size: int, fb: ForwardBatch) -> ForwardBatch:
        """What an eager run forwards. A capturable backend gets what a capture saw: the
        placeholder Python lengths, this step's values only in the static buffers (so the
        CPU tests show its forward reads nothing else); other backends get the step's
        lengths, and the run checks the padding alone."""
        if self.attention.supports_cuda_graph:
            return self._static_batch(size, [1] * size)
        return self._static_batch(size, fb.seq_lens + [1] * (size - fb.batch_size))

    def _static_batch(
        self, size: int, seq_lens: list[int], buffer: torch.Tensor | None = None
    ) -> ForwardBatch:
        """A decode batch of `size` requests over the static buffers (`buffer`, [6,
        max_batch]: a run step's; the single step's by default)."""
        inputs = (self._inputs if buffer is None else buffer)[:, :size]
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=inputs[PACKED_IDS],
            positions=inputs[PACKED_POSITIONS],
            out_cache_loc=inputs[PACKED_SLOTS],
            req_pool_indices=inputs[PACKED_ROWS],
            seq_lens=seq_lens,
            prefix_lens=[n - 1 for n in seq_lens],
            logits_indices=self._logits_indices[:size],
            seq_lens_device=inputs[PACKED_LENS],
            is_cuda_graph=True,  # eager runs plan as captured ones do (the CPU tests see it)
        )

    def _forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The model on `fb` (the static batch), its placeholder ids resolved first, and the
        greedy draw after it, inside the graph: (logits, argmax tokens), the tokens also
        stored as the rows' future tokens. `fb` itself is left as it is: the capture reuses
        the warm-ups' batch, and a batch rebound to a warm-up's resolved ids would have the
        graph read freed memory."""
        resolved = resolve_future_ids(fb.input_ids, self._future_tokens)
        step = dataclasses.replace(fb, input_ids=resolved)
        self.attention.init_forward_metadata(step)
        logits = self.model(step, self.attention)
        tokens = argmax_rows(logits)
        self._future_tokens.index_copy_(0, fb.req_pool_indices, tokens)
        return logits, tokens

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """One graph per bucket, the largest first, all in one memory pool (a replay uses
        the pool alone, so the graphs can share it)."""
        self._inputs.copy_(self._padding)  # capture on padded requests: valid, harmless
        self._run_inputs.copy_(self._padding.expand_as(self._run_inputs))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the buffers' writes come first
        pool = None
        for size in reversed(self.buckets):
            fb = self._static_batch(size, [1] * size)
            with torch.cuda.stream(stream):  # warm up: compile kernels, size workspaces
                for _ in range(2):
                    self._forward(fb)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool, stream):
                self._outputs[size] = self._forward(fb)
            pool = graph.pool()
            self._graphs[size] = graph
        if self.run_steps:
            self._capture_runs(stream, pool)
        torch.cuda.synchronize()
