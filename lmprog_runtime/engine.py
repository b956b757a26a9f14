"""The in-process engine: a public `generate` / `submit` API over a background loop.

Callers' threads validate and tokenize their input into `Req`s (`request_maker.py`), hand
them to the loop and wait (or, with `submit`, get futures; `results.py`: errors, streams,
futures). The loop thread (`loop_thread.py`, running the steps of `engine_loop.py`) alone
owns the scheduler, the model runner and every KV slot.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmprog_runtime import process_guard
from lmprog_runtime.admission_wait import GRAPHED_ADMISSION_WAIT_STEPS
from lmprog_runtime.byte_decode import ByteLevelTable, byte_pieces
from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.constrained.outlines_backend import is_byte_level
from lmprog_runtime.engine_async import EngineAsync
from lmprog_runtime.engine_calls import EngineCalls
from lmprog_runtime.engine_generate import EngineGenerate
from lmprog_runtime.engine_loop import EngineLoop
from lmprog_runtime.engine_view import EngineView
from lmprog_runtime.forward_worker import ForwardWorker
from lmprog_runtime.gc_freeze import BusyFreeze
from lmprog_runtime.kvcache.radix_cache import RadixCache
from lmprog_runtime.kvcache.req_cache import ReqCache
from lmprog_runtime.loop_thread import serve, wake
from lmprog_runtime.model_runner import ModelRunner
from lmprog_runtime.models.registry import local_model_dir, resolve_model_path
from lmprog_runtime.overlap import InFlight
from lmprog_runtime.penalties import PenaltyCounts
from lmprog_runtime.request import Req
from lmprog_runtime.request_maker import RequestMaker, backend_decode
from lmprog_runtime.results import (
    DoneFlag,
    QueueFull,  # noqa: F401 - importable from here, as it was
    RequestAborted,
)
from lmprog_runtime.run_choice import RunChoice
from lmprog_runtime.run_plan import RunSlots
from lmprog_runtime.scheduler import Scheduler
from lmprog_runtime.server_args import from_sglang, named_as_given
from lmprog_runtime.stats import EngineStats
from lmprog_runtime.steady_check import SteadyCheck
from lmprog_runtime.token_healing import TokenHealer
from lmprog_runtime.transfer import device_scope, require_device

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class Engine(RequestMaker, EngineGenerate, EngineCalls, EngineAsync, EngineLoop, EngineView):
    """Runs a Llama-family checkpoint in this process with continuous batching.

    `model_path` is a named model (`"smollm2-135m-instruct"`, `"tiny"`, ...), a Hugging Face
    directory, a `.gguf` file or a Hub id; `None` is the embedded tiny model. The settings
    are `RuntimeConfig`'s fields, or SGLang's server-argument names (`server_args.py`).

    Example:
        >>> with Engine() as engine:  # the embedded tiny default model, on CPU
        ...     out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
        >>> sorted(out)
        ['meta_info', 'output_ids', 'text']
    """

    def __init__(
        self, model_path: str | os.PathLike[str] | None = None, **config_fields: Any
    ) -> None:
        given = list(config_fields)
        config_fields = from_sglang(model_path, config_fields)  # (SGLang's server args)
        unknown = sorted(set(config_fields) - RuntimeConfig.field_names())
        if unknown:
            raise TypeError(f"unknown Engine argument(s) {unknown}")
        # A name, a Hub id, a directory or a .gguf file; config.model_path records where
        # the model lives, model_dir the checkpoint directory read (a GGUF's conversion).
        with named_as_given(given):
            self.config = RuntimeConfig(model_path=resolve_model_path(model_path), **config_fields)
        require_device(torch.device(self.config.device))
        model_dir = local_model_dir(self.config.model_path)
        self._threads_found = torch.get_num_threads()  # (shutdown gives it back)
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)  # (process-wide, as torch has it)
        process_guard.check_thread_pool_after_fork(self.config.device)
        from lmprog_runtime.models import ModelConfig

        ModelConfig.from_path(model_dir)  # fail fast on a bad directory or architecture
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # A GGUF's tokenizer is the tokenizer.json built from its metadata, exactly as
        # transformers' own GGUF loading builds it; AutoTokenizer would rebuild some model
        # types' pipelines from the vocabulary instead (and is slower to import).
        is_gguf = Path(self.config.model_path).is_file()
        loader = PreTrainedTokenizerFast if is_gguf else AutoTokenizer
        self.tokenizer: PreTrainedTokenizerBase = loader.from_pretrained(
            model_dir, local_files_only=True
        )
        self._tokenizer_lock = threading.Lock()
        self._backend_decode = backend_decode(self.tokenizer)
        # A byte-level tokenizer's decode, by table (None: the tokenizer's own decode)
        self._byte_table = (
            ByteLevelTable.of(self.tokenizer._tokenizer) if self._backend_decode else None
        )
        self._byte_pieces = byte_pieces(self.tokenizer)  # (decoded as runs: held back)
        with device_scope(torch.device(self.config.device)), named_as_given(given):
            self.runner = ModelRunner(self.config, model_dir, self.tokenizer)  # (graphs too)
        self.context_len = self.runner.context_len
        self.eos_token_ids = frozenset(self.runner.model_config.eos_token_ids)
        self._stats = EngineStats()
        runner = self.runner
        tree = None
        if not self.config.disable_radix_cache:
            tree = RadixCache(runner.allocator, self.config.page_size, self.config.eviction_policy)
        self.tree_cache = tree
        req_cache = ReqCache(tree, runner.allocator, runner.req_to_token)
        # decode_steps="auto": runs or single steps, as the overlapped loop finds the device
        # idle or busy (the synchronous loop always runs runs: `config.run_steps`)
        auto = self.config.decode_steps == "auto" and self.config.is_overlapped
        self._run_choice = RunChoice(self.config.run_steps) if auto else None
        wait = self.config.admission_wait_steps
        if wait is None:  # (where admitting costs an eager step against a graph's replay;
            # decode runs wait for a run's end already, "auto"'s single steps do not)
            single = self.config.decode_steps == 1 or self._run_choice is not None
            graphed = runner.graphs is not None and single
            wait = GRAPHED_ADMISSION_WAIT_STEPS if graphed else 0
        self.scheduler = Scheduler(
            self.config,
            runner.allocator,
            runner.req_to_token,
            req_cache,
            self._stats,
            wait,
            self._run_choice,
        )
        # Overlap scheduling (overlap.py): the forward of a step runs on the worker while the
        # loop checks the previous step; the launched forward waits in `_in_flight`.
        self._worker = ForwardWorker(runner) if self.config.is_overlapped else None
        self._in_flight: InFlight | None = None
        self._runs: list[RunSlots] = []  # the decode runs launched and not yet committed
        self._released = 0  # requests the loop has finished (`_finish`), counted
        self._steady: SteadyCheck | None = None  # the last check's batch, if it may settle
        self.penalty_counts = PenaltyCounts()  # penalised requests' token counts
        # Decode runs are launched ahead of the commit before them where launching queues
        # work and returns (off a CPU; the tests and bench_host_path.py turn it on there).
        self._launches_ahead = runner.device.type != "cpu"
        self._commands: list[tuple[str, tuple, threading.Event, list[Any]]] = []
        self._grammars: Any = None  # GrammarCache, built on the first constrained request
        self._grammar_lock = threading.Lock()
        # (its vocabulary table is built on the first request that heals)
        vocab = self.runner.model_config.vocab_size
        self._healer = TokenHealer(self.tokenizer, self._tokenizer_lock, vocab)
        self._decode_is_context_free = is_byte_level(self.tokenizer)
        self._grammar_eos = self.tokenizer.eos_token_id
        if self._grammar_eos is None and self.eos_token_ids:
            self._grammar_eos = min(self.eos_token_ids)
        self._rids = itertools.count()
        # Per-request seeds for requests that give none (a Python generator: drawing one
        # costs ~1 us, a torch one ~0.5 ms on the submitting thread).
        self._seeds = random.Random(self.config.random_seed)
        self._seeds_lock = threading.Lock()
        self._inbox: list[Req] = []
        self._aborts: list[tuple[int, BaseException]] = []
        self._num_unfinished = 0  # submitted and not finished (guarded by `_cv`)
        # Loop thread only: every submitted request not yet finished, by id; a heap of the
        # deadlines (deadline, id; a finished one's is dropped when it comes up, or in bulk
        # when they outnumber the live requests); how many scheduling attempts in a row
        # have raised.
        self._live: dict[int, Req] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._schedule_failures = 0
        self._fault_hook: Callable[[str, Req], None] | None = None
        # Reentrant: the finalizer may run on the loop thread inside `cv`. Callers take it as
        # `with self._lock:` (C's `__enter__`: a Ctrl-C in `Condition.__enter__` kept it held).
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._stopping = False  # shutdown() asked the loop to stop
        self._is_shut_down = False  # and found it stopped: the rest is done, or being done
        self._exited = DoneFlag()  # set by the loop thread as it exits
        self._pid = os.getpid()  # (a child forked from this process has no loop thread)
        # The thread gets a weak reference and the condition variable, never `self` (a bound
        # method would keep the engine alive as long as the thread runs, i.e. forever).
        self._thread = threading.Thread(
            target=serve,
            args=(weakref.ref(self), self._cv, BusyFreeze(self.config.gc_freeze), self._exited),
            name="lmprog-engine",
            daemon=True,
        )
        weakref.finalize(self, wake, self._cv)
        process_guard.register(self)
        self._thread.start()

    # ---- public API (generate and submit: engine_generate.py) -----------------------
    def abort(self, request_id: int) -> None:
        """Cancel a request (`meta_info["id"]`, or a future's `request_id`) before its next
        step: it fails with `RequestAborted`, its slots are freed and what it computed stays
        in the prefix cache. An id that has already finished (or never existed) is ignored."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise TypeError(f"request_id must be an int, got {type(request_id).__name__}")
        if self._in_forked_child():  # its requests run in the parent
            return
        with self._lock:
            self._aborts.append((request_id, RequestAborted(f"request {request_id} was aborted")))
            self._cv.notify_all()

    def flush_cache(self) -> bool:
        """Drop every cached prefix. Returns False (and drops nothing) while requests run."""
        return bool(self._command("flush_cache"))

    def shutdown(self) -> None:
        if threading.current_thread() is self._thread:  # (a callback: it cannot join itself)
            raise RuntimeError("shutdown() cannot run on the engine's own loop thread (a callback)")
        if self._in_forked_child():  # (its exit): the engine is not its own
            return
        with self._lock:
            if self._is_shut_down:
                return
            self._stopping = True
            self._cv.notify_all()
        # A Ctrl-C while this waits for the loop's step leaves the rest to the next call
        # (the at-exit one): it once returned at once, and the loop ran on into the
        # interpreter's exit (SIGABRT), its requests' slots never freed.
        if self._thread.ident is not None:  # (never started: its start failed)
            self._exited.wait()
        self._thread.join()  # (it has left the loop: only its last lines are left)
        with self._lock:
            if self._is_shut_down:  # (another thread's call did the rest)
                return
            self._is_shut_down = True
        if torch.get_num_threads() == self.config.num_threads:  # (unless changed since)
            torch.set_num_threads(self._threads_found)
        error = RuntimeError("the engine was shut down before this request finished")
        self._abandon_in_flight(error)
        if self._worker is not None:
            self._worker.close()
        with self._grammar_lock:
            if self._grammars is not None:
                self._grammars.close()
        for req in self._inbox + self.scheduler.abort_all():
            self._finish(req, error)
        self._inbox.clear()

    def __reduce__(self) -> Any:
        raise TypeError(
            "an Engine cannot be pickled (it holds the model, its KV pool and its loop "
            "thread): make one in each worker process, e.g. in the initializer of a "
            "multiprocessing pool started with 'spawn'"
        )

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def Runtime(model_path: str | os.PathLike[str] | None = None, **server_args: Any) -> Engine:  # noqa: N802
    """SGLang's `sgl.Runtime(model_path=..., **server_args)`, which starts a server: here the
    same in-process `Engine` (no server, no port), so a program's backend line ports as it
    is; `shutdown()` stops it.

    Example:
        >>> runtime = Runtime(model_path="tiny", mem_fraction_static=0.5)  # doctest: +SKIP
        >>> runtime.shutdown()  # doctest: +SKIP
    """
    return Engine(model_path, **server_args)
