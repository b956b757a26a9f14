"""Owns the model, the KV memory and the attention backend; runs one forward per step.

Turns a `ScheduledBatch` (requests + their new KV slots) into the flat tensors of a
`ForwardBatch`, runs the model, and returns the logits rows the engine asked for.

`prepare` is where host bookkeeping meets the device, once per forward: the batch's layout
is built as Python lists and sent as one int64 tensor, with the request table's host writes
(`ReqToTokenPool.take_writes`): one host-to-device copy. `run` reads only those tensors; on
CUDA it replays a captured graph for decode steps (`cuda_graph.py`).

With overlap scheduling a request's last token may still be on the device when the next
forward is prepared: its input is then the placeholder `-(row + 1)`, and `run` takes the
token from `future_tokens[row]`, where the draw stored it (`store_future_tokens`); a
decode graph does so inside its replay.
"""

from __future__ import annotations

import array
import logging
from collections.abc import Sequence

import torch

from lmprog_runtime.attention import create_attention_backend
from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.cuda_graph import DecodeGraphRunner
from lmprog_runtime.forward_batch import ForwardBatch, ForwardMode, OneRowEach, resolve_future_ids
from lmprog_runtime.kvcache import KVPool, ReqToTokenPool, TokenSlotAllocator
from lmprog_runtime.memory_plan import (
    available_host_memory,
    check_memory,
    num_kv_slots,
    serving_dtype,
)
from lmprog_runtime.models import load_model
from lmprog_runtime.models.quantization import quantize_linears
from lmprog_runtime.request import Req
from lmprog_runtime.sampling import SampleRow
from lmprog_runtime.scheduled_batch import ScheduledBatch
from lmprog_runtime.transfer import device_with_index, host_ints, index_tensor, to_device

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: RuntimeConfig, model_path: str, tokenizer=None) -> None:
        """`tokenizer` (the engine's; else loaded from `model_path` when needed) tokenizes
        W8A8's calibration text."""
        self.config = config
        self.device = device_with_index(torch.device(config.device))
        dtype = serving_dtype(config, model_path)
        self.model = load_model(model_path, dtype, config.device, config.context_len)
        if config.quantization == "w8a8_int8":
            from lmprog_runtime.models.smoothing import calibrate_and_smooth

            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            calibrate_and_smooth(self.model, lambda text: tokenizer(text).input_ids)
        if config.quantization is not None:
            quantize_linears(self.model, config.quantization)
        self.model_config = self.model.config
        dtype = next(self.model.parameters()).dtype
        if dtype == torch.bfloat16 and self.device.type == "cpu" and not config.disable_amx_linears:
            from lmprog_runtime.models.amx_linear import use_amx_linears

            use_amx_linears(self.model, available_host_memory())
        if (
            dtype == torch.float32
            and self.device.type == "cpu"
            and not config.disable_input_major_weights
        ):
            from lmprog_runtime.models.weight_layout import use_input_major_weights

            use_input_major_weights(self.model, available_host_memory())
        self.attention_backend = _resolve_backend(config.attention_backend, self.device, dtype)
        if self.attention_backend == "native":
            from lmprog_runtime.models.ops import NativeOps

            self.model.ops = NativeOps()
        elif self.attention_backend == "triton" and self.device.type == "cuda":
            from lmprog_runtime.models.triton_ops import TritonOps

            self.model.ops = TritonOps()
        self.context_len = config.context_len or self.model_config.context_len
        if self.context_len > self.model_config.context_len:
            raise ValueError(
                f"context_len {self.context_len} exceeds the model's "
                f"max_position_embeddings {self.model_config.context_len}"
            )
        mc = self.model_config
        per_token = KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
        check_memory(config, self.device, self.context_len, per_token)
        num_slots = num_kv_slots(config, self.device, per_token)
        self.allocator = TokenSlotAllocator(num_slots, config.page_size)
        self.num_kv_slots = self.allocator.num_slots  # whole pages only
        # Rows 0 .. (num_pages + 1) * page_size - 1: page 0 is the padding page.
        self.kv_pool = KVPool(
            (self.allocator.num_pages + 1) * config.page_size - 1,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            dtype,
            self.device,
        )
        self.req_to_token = ReqToTokenPool(
            config.max_running_requests, self.context_len, self.device
        )
        # Per request-table row: the token last drawn for it on the device (overlap).
        self.future_tokens = torch.zeros(
            self.req_to_token.num_reqs + 1, dtype=torch.int64, device=self.device
        )
        self.attention = create_attention_backend(
            self.attention_backend, self.model.attention_layout(), self.kv_pool, self.req_to_token
        )
        self.graphs: DecodeGraphRunner | None = None
        if (
            self.device.type == "cuda"
            and not config.disable_cuda_graph
            and self.attention.supports_cuda_graph
        ):
            try:
                self.graphs = DecodeGraphRunner(self, capture=True)
            except Exception as error:  # noqa: BLE001 - never run on a GPU yet: decode eagerly
                logger.warning("CUDA graph capture failed, decoding without graphs: %r", error)
                self.graphs = None

    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, Sequence[list[int]]]:
        """Run one forward. Returns logits [num_rows, vocab] (float32, on the model's device)
        and, per request, the logits rows that belong to it (the last one is the next-token
        distribution)."""
        fb, rows = self.prepare(batch)
        return self.run(fb), rows

    @torch.inference_mode()
    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """`forward` on prepared inputs: logits [num_rows, vocab] (float32). Reads tensors
        only, never a request: the overlap loop runs it on its forward worker. A decode
        graph's logits are valid until the next forward (`DecodeGraphRunner.run`)."""
        if self.graphs is not None and self.graphs.can_run(fb):
            return self.graphs.run(fb)  # (the graph resolves placeholder ids itself)
        if fb.has_future_ids:
            fb.input_ids = self.resolved_ids(fb)
            fb.has_future_ids = False
        self.attention.init_forward_metadata(fb)
        return self.model(fb, self.attention)

    def resolved_ids(self, fb: ForwardBatch) -> torch.Tensor:
        """`fb`'s input ids with its placeholders replaced by their future tokens (on the
        device: nothing is read back). When they are the ids of its last requests, one
        each (`future_tail`), one gather of those requests' rows, written over them; else
        `resolve_future_ids`' six kernels (which cost an eager step about 110 us of host
        time on an H200 machine; on a 2-vCPU EPYC, 10.7 us against the gather's 3.1 for
        64 ids, by `timeit`)."""
        tail = fb.future_tail
        if not tail:
            return self.resolve_future_ids(fb.input_ids)
        ids = fb.input_ids
        torch.index_select(self.future_tokens, 0, fb.req_pool_indices[-tail:], out=ids[-tail:])
        return ids

    def resolve_future_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` with each placeholder `-(row + 1)` replaced by `future_tokens[row]`
        (on the device: nothing is read back)."""
        return resolve_future_ids(input_ids, self.future_tokens)

    def greedy_tokens(
        self, logits: torch.Tensor, index: list[int], rows: list[SampleRow]
    ) -> torch.Tensor | None:
        """The tokens of a draw the decode graph has made already: when `rows` are all plain
        greedy ones (`SampleRows.plain`) drawn from all of `logits`' rows in order (`index`),
        the argmax the graph run that returned `logits` drew, and stored as its rows' future
        tokens (`DecodeGraphRunner.greedy_tokens`: read them before the next forward);
        else None, and the draw runs as usual."""
        if self.graphs is None or not getattr(rows, "plain", False):
            return None
        tokens = self.graphs.greedy_tokens(logits)
        if tokens is None or index != list(range(logits.shape[0])):
            return None
        return tokens

    def store_future_tokens(self, rows: list[int] | torch.Tensor, token_ids: torch.Tensor) -> None:
        """`future_tokens[rows[i]] = token_ids[i]`: drawn tokens, for the placeholders of
        the forwards queued after this (on the stream the draw ran on). `rows` may be on the
        device already (a batch's `req_pool_indices`: no copy). A row that drew no token
        (-1) stores 0: its request fails, and what is computed for it is dropped."""
        if isinstance(rows, list):
            if not rows:
                return
            rows = index_tensor(rows, self.device)
        elif not rows.numel():  # (a tensor's len() costs a Python call)
            return
        self.future_tokens.index_copy_(0, rows, token_ids.clamp(min=0))

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardBatch, Sequence[list[int]]]:
        """`forward`'s inputs, read from the requests now (on the thread that owns them),
        and each request's logits rows."""
        if batch.mode is ForwardMode.DECODE:
            return self._prepare_decode(batch)
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        rows_per_req: list[list[int]] = []
        seq_lens: list[int] = []
        num_extends = len(batch.reqs) - batch.num_decodes
        for req, prefix, n in zip(
            batch.reqs[:num_extends], batch.prefix_lens, batch.extend_lens[:num_extends]
        ):
            end = prefix + n
            new_ids = req.fill_ids_between(prefix, end)
            start_row = len(ids)
            ids.extend(new_ids)
            positions.extend(range(prefix, end))
            seq_lens.append(end)
            first = _first_logits_position(req, prefix, end, batch.mode)
            mine = list(range(len(logits_rows), len(logits_rows) + end - first))
            logits_rows.extend(range(start_row + first - prefix, start_row + end - prefix))
            rows_per_req.append(mine)
        if batch.num_decodes:
            # A mixed batch's running requests (its last ones): one token each, its last,
            # and one logits row each, as `_prepare_decode` reads them (a mixed step of 64
            # running paid the loop about 2 us a request in the loop above).
            decoding = batch.reqs[num_extends:]
            at = batch.prefix_lens[num_extends:]
            start_row, first_row = len(ids), len(logits_rows)
            ids.extend([req.output_ids[-1] for req in decoding])
            positions.extend(at)
            seq_lens.extend([p + 1 for p in at])
            logits_rows.extend(range(start_row, start_row + len(decoding)))
            rows_per_req.extend([[first_row + i] for i in range(len(decoding))])
        return self._send(batch, ids, positions, seq_lens, logits_rows), rows_per_req

    def _prepare_decode(self, batch: ScheduledBatch) -> tuple[ForwardBatch, Sequence[list[int]]]:
        """`prepare` for a decode batch: one token per request, its logits row its own."""
        ids = [req.output_ids[-1] for req in batch.reqs]
        positions = batch.prefix_lens
        logits_rows = list(range(len(ids)))
        fb = self._send(batch, ids, positions, [p + 1 for p in positions], logits_rows)
        return fb, OneRowEach(len(ids))

    def prepare_run(self, batch: ScheduledBatch, ahead: list[torch.Tensor]) -> list[ForwardBatch]:
        """The inputs of a decode run (`decode_run.py`): `batch`'s step, then one step per
        `ahead` (each request's slots of that step, [n] host tensors), one position further
        each. The slots of the steps ahead go to the device in one copy; their positions
        and lengths are computed there from the first step's. A step ahead's `input_ids`
        are the tokens the step before drew: the caller sets them before running it."""
        first, _ = self.prepare(batch)
        slots = to_device(torch.stack(ahead), self.device)
        offsets = torch.arange(1, len(ahead) + 1, dtype=torch.int64, device=self.device)[:, None]
        positions = first.positions + offsets
        seq_lens = first.seq_lens_device + offsets
        steps = [first]
        for k in range(1, len(ahead) + 1):
            steps.append(
                ForwardBatch(
                    mode=ForwardMode.DECODE,
                    input_ids=first.input_ids,  # (replaced by the tokens drawn before it)
                    positions=positions[k - 1],
                    out_cache_loc=slots[k - 1],
                    req_pool_indices=first.req_pool_indices,
                    seq_lens=[n + k for n in first.seq_lens],
                    prefix_lens=[n + k for n in first.prefix_lens],
                    logits_indices=first.logits_indices,
                    seq_lens_device=seq_lens[k - 1],
                )
            )
        return steps

    def run_greedy(
        self, batch: ScheduledBatch, ahead: list[torch.Tensor], first_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """A decode run of plain greedy steps as graph replays (`DecodeGraphRunner.
        run_greedy`; the caller checked `can_run_greedy`): `batch`'s step and one step per
        `ahead` (as `prepare_run`), `first_ids` the first step's ids when they are on the
        device (else the requests' last tokens). The first step's inputs go as `prepare`
        sends them, the steps ahead's as one block built on the host. Returns each step's
        tokens [steps, n] on the device (valid until the next forward)."""
        assert self.graphs is not None
        first, _ = self.prepare(batch)
        packed = first.packed_inputs()
        assert packed is not None, "a decode batch's inputs come packed"
        n = len(batch.reqs)
        steps = torch.arange(1, len(ahead) + 1, dtype=torch.int64, device="cpu")[:, None]
        positions = host_ints(batch.prefix_lens) + steps  # [K - 1, n]
        rows = host_ints([req.req_pool_idx for req in batch.reqs]).expand_as(positions)
        logits_rows = torch.arange(n, dtype=torch.int64, device="cpu").expand_as(positions)
        fields = [torch.zeros_like(positions), positions, rows, positions + 1]
        block = torch.stack([*fields, torch.stack(ahead), logits_rows], dim=1)  # [K - 1, 6, n]
        if first_ids is not None:
            first_ids = first_ids.clamp(min=0)  # (a row that drew none: its request fails)
        return self.graphs.run_greedy(
            packed, to_device(block, self.device), first_ids, first.seq_lens
        )

    def _send(
        self,
        batch: ScheduledBatch,
        ids: list[int],
        positions: list[int],
        seq_lens: list[int],
        logits_rows: list[int],
    ) -> ForwardBatch:
        """The batch's inputs on the device, as one copy, and its `ForwardBatch`."""
        req_rows = [req.req_pool_idx for req in batch.reqs]
        # [ids; positions; table rows; seq_lens; KV slots; logits rows; the request table's
        # writes]: one int64 tensor, one copy to the device, split into views there.
        fields = (ids, positions, req_rows, seq_lens)
        values = array.array("q")
        for field in fields:
            # (from lists: 2-3x as fast as reading the fields as one iterator)
            values.fromlist(field if isinstance(field, list) else list(field))
        parts = [host_ints(values), batch.out_cache_loc, host_ints(logits_rows)]
        sizes = [len(field) for field in fields] + [batch.out_cache_loc.numel(), len(logits_rows)]
        table_writes = self.req_to_token.take_writes()
        if table_writes is not None:
            parts.append(table_writes.view(-1))
            sizes.append(table_writes.numel())
        try:
            block = to_device(torch.cat(parts), self.device)
            on_device = block.split_with_sizes(sizes)
            if table_writes is not None:
                self.req_to_token.apply_writes(on_device[6].view(2, -1))
        except BaseException:
            if table_writes is not None:  # (the forwards that retry this batch need them)
                self.req_to_token.restore_writes(table_writes)
            raise
        packed = None
        if batch.mode is ForwardMode.DECODE:  # every field one per request: [6, batch]
            packed = block[: 6 * len(ids)].view(6, len(ids))
        has_future_ids = bool(ids) and min(ids) < 0
        # (a decode batch a graph takes: the graph resolves them itself, nothing to mark)
        graphed = self.graphs is not None and self.graphs.can_run_size(batch.mode, len(ids))
        return ForwardBatch(
            mode=batch.mode,
            input_ids=on_device[0],
            positions=on_device[1],
            out_cache_loc=on_device[4],
            req_pool_indices=on_device[2],
            seq_lens=seq_lens,
            prefix_lens=list(batch.prefix_lens),
            logits_indices=on_device[5],
            num_decodes=batch.num_decodes,
            seq_lens_device=on_device[3],
            has_future_ids=has_future_ids,
            future_tail=(
                _future_tail(batch, ids, req_rows) if has_future_ids and not graphed else 0
            ),
            packed=packed,
        )


def _future_tail(batch: ScheduledBatch, ids: list[int], req_rows: list[int]) -> int:
    """How many of `ids` (a batch's input ids, some placeholders) are its decoding
    requests' own placeholders `-(row + 1)`, one each at the end, when no other id is a
    placeholder (the usual case with overlap scheduling: every running request's last
    token is still being drawn); else 0. Checked id by id against the requests' table
    rows (`req_rows`), so that the gather reads what the op-by-op resolve would."""
    n = len(ids) if batch.mode is ForwardMode.DECODE else batch.num_decodes
    if not n or ids[-n:] != [-(row + 1) for row in req_rows[-n:]]:
        return 0
    return n if n == len(ids) or min(ids[:-n]) >= 0 else 0


def _resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        import importlib.util

        return "triton" if importlib.util.find_spec("triton") is not None else "torch"
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return "torch"
    from lmprog_runtime.native import load_native

    try:
        load_native()
    except RuntimeError as error:
        logger.warning("native CPU kernels unavailable, using the torch backend: %s", error)
        return "torch"
    return "native"


def _first_logits_position(req: Req, prefix: int, end: int, mode: ForwardMode) -> int:
    """First position whose logits are needed: the last one, or earlier for prompt logprobs."""
    if mode is ForwardMode.EXTEND and req.logprob_start_len >= 0 and not req.input_logprobs_done:
        # Logits at position p score token p + 1; token 0 has no logprob.
        return min(max(req.logprob_start_len - 1, prefix, 0), end - 1)
    return end - 1
