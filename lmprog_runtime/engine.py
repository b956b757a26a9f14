"""The in-process engine: a public `generate` API over a background scheduling loop.

Callers' threads validate and tokenize their input, hand `Req`s to the loop and wait. The
loop thread alone owns the scheduler, the model runner and every KV slot: each step it
admits or decodes, runs one forward, samples, and finishes requests the moment they stop.
An exception in one step fails only the requests of that step; the loop keeps serving.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.engine_inputs import normalize_generate_inputs
from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.model_runner import ModelRunner
from lmprog_runtime.models.default_model import default_model_path
from lmprog_runtime.request import Req
from lmprog_runtime.sampling import sample, top_logprobs
from lmprog_runtime.scheduler import ScheduledBatch, Scheduler
from lmprog_runtime.stats import EngineStats

logger = logging.getLogger(__name__)


class Engine:
    """Runs a Llama-family checkpoint in this process with continuous batching.

    Example:
        >>> with Engine() as engine:  # the embedded tiny default model, on CPU
        ...     out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
        >>> sorted(out)
        ['meta_info', 'output_ids', 'text']
    """

    def __init__(self, model_path: str | None = None, **config_fields: Any) -> None:
        unknown = sorted(set(config_fields) - RuntimeConfig.field_names())
        if unknown:
            raise TypeError(f"unknown Engine argument(s) {unknown}")
        if model_path is None:
            model_path = default_model_path("tiny")
        self.config = RuntimeConfig(model_path=str(model_path), **config_fields)
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        from lmprog_runtime.models import ModelConfig

        ModelConfig.from_path(model_path)  # fail fast on a bad directory or architecture
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        self._tokenizer_lock = threading.Lock()
        self.runner = ModelRunner(self.config, str(model_path))
        self.context_len = self.runner.context_len
        self.eos_token_ids = frozenset(self.runner.model_config.eos_token_ids)
        self.scheduler = Scheduler(self.config, self.runner.allocator, self.runner.req_to_token)
        self._stats = EngineStats()
        self._rids = itertools.count()
        self._seeds = torch.Generator().manual_seed(self.config.random_seed)
        self._inbox: list[Req] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="lmprog-engine", daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] = -1,
        top_logprobs_num: int | list[int] = 0,
        stream: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (a list of dicts).

        Each result is `{"text", "output_ids", "meta_info"}`; `meta_info` has
        `prompt_tokens`, `completion_tokens`, `cached_tokens`, `finish_reason` and, with
        `return_logprob`, `output_token_logprobs` (and `input_token_logprobs` for prompt
        positions from `logprob_start_len` on) as `(logprob, token_id)` pairs.
        `max_new_tokens=0` only prefills. With `stream=True` (one prompt), returns an
        iterator of chunks whose `text` fields concatenate to the final text.

        Example:
            >>> engine.generate(["a", "b"], {"max_new_tokens": 4})  # doctest: +SKIP
        """
        if self._stopping:
            raise RuntimeError("the engine has been shut down")
        items, is_single = normalize_generate_inputs(
            self,
            prompt,
            sampling_params,
            input_ids=input_ids,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        if stream and not is_single:
            raise ValueError("stream=True takes a single prompt")
        reqs = [
            Req(
                next(self._rids),
                item.input_ids,
                item.params,
                tokenizer=self,
                eos_token_ids=self.eos_token_ids,
                context_len=self.context_len,
                return_logprob=item.return_logprob,
                logprob_start_len=item.logprob_start_len,
                top_logprobs_num=item.top_logprobs_num,
                stream=stream,
                seed=int(torch.randint(0, 2**62, (1,), generator=self._seeds)),
            )
            for item in items
        ]
        self._submit(reqs)
        if stream:
            return self._stream(reqs[0])
        outputs = [self._wait(req) for req in reqs]
        return outputs[0] if is_single else outputs

    def stats(self) -> dict[str, float]:
        """Counters since start or the last `reset_stats()` (see DESIGN.md for the keys)."""
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()

    def memory_state(self) -> dict[str, int]:
        """KV and request slots in use; all free when the engine is idle."""
        runner = self.runner
        return {
            "kv_slots_total": runner.allocator.num_slots,
            "kv_slots_free": runner.allocator.num_free,
            "req_slots_total": runner.req_to_token.num_reqs,
            "req_slots_free": runner.req_to_token.num_free,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + len(self._inbox),
        }

    def flush_cache(self) -> None:
        """Drop cached prefixes (a no-op until the radix cache holds any)."""

    def shutdown(self) -> None:
        with self._cv:
            if self._stopping:
                return
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()
        error = RuntimeError("the engine was shut down before this request finished")
        for req in self._inbox + self.scheduler.abort_waiting() + list(self.scheduler.running):
            self._finish(req, error)
        self._inbox.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None and not self._stopping:
            self._stopping = True
            with self._cv:
                self._cv.notify_all()

    # ---- tokenizer access (shared by caller threads and the loop) -----------------------
    def encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return list(self.tokenizer(text).input_ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- caller side --------------------------------------------------------------------
    def _submit(self, reqs: list[Req]) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine has been shut down")
            self._inbox.extend(reqs)
            self._cv.notify_all()

    def _wait(self, req: Req) -> dict[str, Any]:
        while not req.done.wait(0.5):
            if not self._thread.is_alive():
                raise RuntimeError("the engine loop has stopped")
        if req.error is not None:
            raise RuntimeError(f"request {req.rid} failed: {req.error}") from req.error
        return req.to_output()

    def _stream(self, req: Req) -> Iterator[dict[str, Any]]:
        assert req.stream_queue is not None
        while True:
            chunk = req.stream_queue.get()
            if chunk is None:
                break
            yield chunk
        if req.error is not None:
            raise RuntimeError(f"request {req.rid} failed: {req.error}") from req.error

    # ---- the loop -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._inbox and not self.scheduler.has_work:
                    self._cv.wait()
                if self._stopping:
                    return
                new, self._inbox = self._inbox, []
            for req in new:
                self.scheduler.add(req)
            batch = None
            try:
                batch = self.scheduler.next_batch()
                if batch is None:
                    self._fail_unschedulable()
                    continue
                self._step(batch)
            except Exception as error:  # one bad step must not take the loop down
                logger.exception("engine step failed")
                for req in batch.reqs if batch is not None else []:
                    if not req.done.is_set():
                        self._finish(req, error)

    def _fail_unschedulable(self) -> None:
        """Nothing runs and the head of the queue cannot be admitted: fail it, never hang."""
        if self.scheduler.running or not self.scheduler.waiting:
            return
        req = self.scheduler.waiting.popleft()
        self._finish(req, ValueError("the request does not fit in the KV pool"))

    def _step(self, batch: ScheduledBatch) -> None:
        start = time.perf_counter()
        logits, rows = self.runner.forward(batch)
        forward_seconds = time.perf_counter() - start
        self.scheduler.on_forward_done(batch)
        is_extend = batch.mode is ForwardMode.EXTEND
        if is_extend:
            self._record_prompt_logprobs(batch.reqs, logits, rows)
        to_sample = [i for i, r in enumerate(batch.reqs) if r.max_new_tokens > 0]
        if to_sample:
            last = torch.tensor([rows[i][-1] for i in to_sample])
            reqs = [batch.reqs[i] for i in to_sample]
            out = sample(logits.index_select(0, last), reqs)
            for req, token, logprob in zip(reqs, out.token_ids, out.logprobs):
                if logprob is not None:
                    req.output_token_logprobs.append((logprob[0], token))
                    if req.top_logprobs_num:
                        req.output_top_logprobs.append(logprob[1])
                req.append_token(token)
        for req in batch.reqs:
            if req.max_new_tokens == 0:
                req.finish_prefill_only()
            if req.is_finished:
                self._finish(req)
            elif req.stream_queue is not None:
                chunk = req.stream_delta()
                if chunk is not None:
                    req.stream_queue.put(chunk)
        self._stats.record_step(
            batch,
            num_sampled=len(to_sample),
            num_running=len(self.scheduler.running),
            forward_seconds=forward_seconds,
            step_seconds=time.perf_counter() - start,
        )

    def _record_prompt_logprobs(
        self, reqs: list[Req], logits: torch.Tensor, rows: list[list[int]]
    ) -> None:
        for req, req_rows in zip(reqs, rows):
            if req.logprob_start_len < 0:
                continue
            first = req.prompt_len - len(req_rows)  # position of the first logits row
            targets = req.input_ids[first + 1 :]
            if req.logprob_start_len == 0:
                req.input_token_logprobs.append((None, req.input_ids[0]))
                req.input_top_logprobs.append(None)
            if not targets:
                continue
            rows_t = torch.tensor(req_rows[:-1])
            scored = torch.log_softmax(logits.index_select(0, rows_t), dim=-1)
            chosen = scored.gather(1, torch.tensor(targets)[:, None]).squeeze(1).tolist()
            for j, token in enumerate(targets):
                req.input_token_logprobs.append((chosen[j], token))
                if req.top_logprobs_num:
                    req.input_top_logprobs.append(top_logprobs(scored[j], req.top_logprobs_num))

    def _finish(self, req: Req, error: BaseException | None = None) -> None:
        if error is not None:
            req.abort(error)
        self.scheduler.release(req)
        req.finalize_text()
        if req.stream_queue is not None:
            chunk = req.stream_delta() if error is None else None
            if chunk is not None:
                req.stream_queue.put(chunk)
            req.stream_queue.put(None)
        req.done.set()
