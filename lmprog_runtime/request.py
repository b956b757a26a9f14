"""A request's life inside the engine: tokens, stop conditions (`req_stops.py`), text
(`req_text.py`) and results.

The engine loop is the only writer of a `Req` after submission; the caller's thread only
waits on `done` (or reads `stream_queue`) and then reads the finished fields. A request
submitted without waiting (`Engine.submit`) gets `on_chunk` / `on_done` callbacks instead,
called on the loop thread: they must only hand the result on, never block.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from lmprog_runtime.req_stops import ReqStops
from lmprog_runtime.req_text import ReqText
from lmprog_runtime.results import DoneFlag
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.stop_regex import StopRegexScanner
from lmprog_runtime.token_healing import Heal

_ARRIVALS = itertools.count()  # (`Req.arrival`: the order requests were made in)

logger = logging.getLogger(__name__)

# A logprob entry: (logprob, token_id, the token's text or None); a prompt's first token
# has no logprob.
LogprobEntry = tuple[float | None, int, str | None]
# Shared by every request without EOS or stop tokens (a request's objects are walked by
# the cyclic collector's full passes while it is in flight: `gc_freeze.py`).
NO_TOKEN_IDS: frozenset[int] = frozenset()


class Req(ReqStops, ReqText):
    """One generation request: prompt ids in, output ids, text and meta info out."""

    def __init__(
        self,
        rid: int,
        input_ids: list[int],
        params: SamplingParams,
        *,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        context_len: int,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        seed: int = 0,
        matcher: Any = None,
        grammar_eos: int | None = None,
        grammar: Any = None,
        char_fsm: Any = None,
        heal: Heal | None = None,
        detok_context: tuple[list[int], int] | None = None,
        context_free_decode: bool = False,
        byte_pieces: Mapping[int, int] = MappingProxyType({}),
        stop_token_texts: dict[int, str] | None = None,
        on_chunk: Callable[[dict[str, Any]], None] | None = None,
        on_done: Callable[[Req], None] | None = None,
    ) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = NO_TOKEN_IDS if params.ignore_eos else eos_token_ids
        stop_ids = params.stop_token_ids
        self.stop_token_ids = frozenset(stop_ids) if stop_ids else NO_TOKEN_IDS
        # The tokens that end it once min_new_tokens is reached, banned until then (read at
        # every token)
        self.ends_on = (
            (self.eos_token_ids | self.stop_token_ids) if stop_ids else self.eos_token_ids
        )
        # Stop strings that are a special token's text end on it (`RequestMaker._special_stops`)
        self._stop_token_texts = stop_token_texts or {}
        if stop_token_texts:
            self.ends_on = self.ends_on | frozenset(stop_token_texts)
        # Generation ends at the context length even if max_new_tokens allows more. A healed
        # prompt's backed-up token is generated again on top of max_ and min_new_tokens.
        healed = 1 if heal is not None else 0
        self.max_new_tokens = min(params.max_new_tokens + healed, context_len - len(input_ids))
        self.min_new_tokens = params.min_new_tokens + healed if params.min_new_tokens else 0
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len if return_logprob else -1
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.return_text_in_logprobs = return_text_in_logprobs
        # Its draws on a CPU come from its generator, on an accelerator from its seed
        # (`sampling.draw`).
        self.seed = params.seed if params.seed is not None else seed
        self._generator: torch.Generator | None = None  # (`generator`, made when first asked)
        self.matcher = matcher  # constrained decoding: which tokens may come next
        self.grammar_eos = grammar_eos
        self.grammar = grammar  # the compiled constraint (a new matcher after a jump)
        # end_outside_pattern: the tokens the pattern took at the last draw, which was
        # unmasked (the output was a full match); None when it was masked or unconstrained.
        self.end_words: torch.Tensor | None = None
        # `sampling.sample_rows`' row for it, once nothing in it changes from draw to draw
        # (greedy, unconstrained, no penalties, min_new_tokens reached); None until then.
        self.plain_sample_row: Any = None
        self.char_fsm = char_fsm  # jump-forward: None when off or not applicable
        # Token healing: the prompt's last token was backed up (`input_ids` ends before it)
        # and the output's text starts after its text; None when not healed.
        self.heal = heal

        self.output_ids: list[int] = []
        # Penalties (`penalties.PenaltyCounts`): its row of counts on the device, and how
        # many of its tokens the draws queued so far will have counted there (None: count
        # them again at the next draw).
        self.penalty_row: int | None = None
        self.penalty_counted: int | None = None
        self.req_pool_idx: int | None = None
        self.kv_len = 0  # tokens whose K/V are in the pool
        self.tree_len = 0  # leading tokens of the row owned by the radix tree
        self.last_node: Any = None  # radix node locked for those tokens
        self.match: Any = None  # the latest prefix match, claimed at admission
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self.arrival = next(_ARRIVALS)
        self.overtaken = 0  # later requests admitted while it waited (`first_in_line`)
        self.was_admitted = False  # (its prefill began once: `note_overtakes`)
        # Tokens it held when it last gave its K/V back to wait again (retracted): claimed
        # back from the cache they are its own, not served (they counted as cached twice).
        self.held_len = 0
        self.group: Any = None  # the RequestGroup this request is admitted with, if any
        self.input_logprobs_done = False
        self.finished_reason: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.text = ""
        # Logprob entries are SGLang's (logprob, token_id, token text or None) triples. A
        # request that asks for none shares empty tuples (four objects fewer to collect).
        self.input_token_logprobs: list[LogprobEntry] | tuple[()] = ()
        self.input_top_logprobs: list[list[LogprobEntry] | None] | tuple[()] = ()
        self.output_token_logprobs: list[LogprobEntry] | tuple[()] = ()
        self.output_top_logprobs: list[list[LogprobEntry]] | tuple[()] = ()
        if return_logprob:
            self.input_token_logprobs, self.input_top_logprobs = [], []
            self.output_token_logprobs, self.output_top_logprobs = [], []

        self.done = DoneFlag()
        # Set as the loop finishes the request (`EngineLoop._finish`; `done` is set at its
        # end): the loop's checks each step read this attribute, not the event.
        self.released = False
        timeout = params.timeout_s
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.stream_queue: queue.Queue[dict[str, Any] | None] | None = (
            queue.Queue() if stream else None
        )
        self.on_chunk = on_chunk  # streamed deltas, without a queue
        self.on_done = on_done
        self._streamed_text = ""
        self._num_streamed_ids = 0
        # Incremental detokenization: the output decoded so far, and the token window
        # [prefix_offset, read_offset) decoded last (the context for the next tokens), over
        # some prompt tokens and the output. The prompt tokens (a healed prompt's, or
        # `detok_context`: (tokens, characters of their decode)) make a SentencePiece
        # word's leading space come out as after the prompt; the output's text starts
        # `_detok_cut` characters into their decode with the output, and `_detok_skip`
        # characters into the text decoded after them (the healed text).
        if heal is not None:
            self._detok_context, self._detok_cut = heal.context, heal.cut
            self._detok_skip = len(heal.text)
        else:
            self._detok_context, self._detok_cut = detok_context or ([], 0)
            self._detok_skip = 0
        self._decoded_text = ""
        self._pending_text = ""  # complete characters of tokens held back (`decoded_text`)
        self._prefix_offset = 0
        self._read_offset = len(self._detok_context)
        self._tried = self._read_offset  # tokens tried as the end of a decode with the window
        # The tokenizer decodes tokens that start at a character alone as after the tokens
        # before them (byte-level BPE), and nothing comes before the output's text (no
        # prompt tokens, no healed text): each window of new tokens is decoded alone,
        # without the window before it (`decoded_text`).
        before_output = self._detok_context or self._detok_cut or self._detok_skip
        self._decodes_alone = context_free_decode and not before_output
        self._byte_pieces = byte_pieces  # (text decoded after one may change: `byte_pieces`)
        self._scanned = 0  # characters of the decoded text searched for stop strings
        self._min_text = 0  # characters of it before the min_new_tokens-th token's
        self._stop_regex = StopRegexScanner(params.stop_regex) if params.stop_regex else None
        self._has_stops = bool(params.stop or params.stop_regex)  # (read at every token)
        self._longest_stop = params.stop_strings.longest
        # Jump-forward: characters of the decoded text the char FSM has read, and its state
        # (healed: after the backed-up text its pattern starts with, which is not in the text).
        self.fsm_position: tuple[int, Any] = (0, None)
        if char_fsm is not None:
            start = char_fsm.initial if heal is None else char_fsm.walk(heal.text)
            self.fsm_position = (0, start)

    # ---- lengths -------------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def generator(self) -> torch.Generator:
        """The generator its draws on a CPU come from, seeded with `seed`; made at its first
        use (a greedy request never draws from one, and making one costs microseconds a
        request)."""
        if self._generator is None:
            self._generator = torch.Generator(device="cpu").manual_seed(self.seed)
        return self._generator

    @property
    def is_streamed(self) -> bool:
        return self.stream_queue is not None or self.on_chunk is not None

    def emit_chunk(self, chunk: dict[str, Any]) -> None:
        if self.stream_queue is not None:
            self.stream_queue.put(chunk)
        if self.on_chunk is not None:
            try:
                self.on_chunk(chunk)
            except BaseException:  # a caller's callback (sys.exit() too) must not fail
                logger.exception("on_chunk callback of request %d failed", self.rid)

    @property
    def is_finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def can_stop(self) -> bool:
        """min_new_tokens is reached, so EOS, stop tokens and stop strings may end it now."""
        return len(self.output_ids) >= self.min_new_tokens

    @property
    def fill_ids(self) -> list[int]:
        """Every token that has or will get K/V: prompt plus output so far."""
        return self.input_ids + self.output_ids

    def fill_ids_between(self, start: int, end: int) -> list[int]:
        """`fill_ids[start:end]`, without building all of `fill_ids` (the prefix cache
        reads a request's new tokens: O(them), not O(its prompt))."""
        prompt = self.input_ids
        m = len(prompt)
        if start >= m:
            return self.output_ids[start - m : end - m]
        if end <= m:
            return prompt[start:end]
        return prompt[start:] + self.output_ids[: end - m]

    def max_prefix_len(self) -> int:
        """Longest prefix that may come from the cache: the last token is always computed
        (its logits are needed), and so is every position whose prompt logprob is asked."""
        limit = len(self.input_ids) + len(self.output_ids) - 1
        if self.logprob_start_len >= 0 and not self.input_logprobs_done:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    # ---- results -----------------------------------------------------------------------
    def logprob_entry(self, logprob: float | None, token: int) -> LogprobEntry:
        """`(logprob, token_id, text)`: the token's text with `return_text_in_logprobs`,
        else None (SGLang's entries)."""
        if not self.return_text_in_logprobs:
            return (logprob, token, None)
        return (logprob, token, self.tokenizer.decode([token], skip_special_tokens=False))

    def logprob_entries(self, pairs: list[tuple[float, int]]) -> list[LogprobEntry]:
        return [self.logprob_entry(logprob, token) for logprob, token in pairs]

    def meta_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason,
        }
        if self.heal is not None:
            info["token_healing"] = {"token_id": self.heal.token_id, "text": self.heal.text}
        if self.return_logprob:  # (every key, as SGLang's: [] where none was asked for)
            info["input_token_logprobs"] = self.input_token_logprobs or []
            if self.top_logprobs_num:
                info["input_top_logprobs"] = self.input_top_logprobs or []
            info["output_token_logprobs"] = self.output_token_logprobs
            if self.top_logprobs_num:
                info["output_top_logprobs"] = self.output_top_logprobs
        return info

    def to_output(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": self.meta_info(),
        }
