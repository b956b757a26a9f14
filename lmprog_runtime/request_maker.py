"""Callers' inputs into requests, on the callers' threads: validated and tokenized
(`engine_inputs.py`), token-healed, given their grammars (compiled once and cached) and
seeds, tied into a group behind their common prefix; and the tokenizer that callers and
the loop share (`encode`, `decode`: its table for byte-level BPE, the Rust decode for a
stock fast tokenizer).

`RequestMaker` holds these methods of `Engine` (a mixin: `Engine.__init__` sets every
attribute used here). Nothing here touches the scheduler, except a jump forward the loop
makes (`_jump_forward`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lmprog_runtime.byte_decode import ends_inside_a_character
from lmprog_runtime.constrained.jump_forward import jump_forward
from lmprog_runtime.engine_inputs import normalize_generate_inputs
from lmprog_runtime.request import Req
from lmprog_runtime.sampling_params import SamplingParams, check_text
from lmprog_runtime.scheduled_batch import RequestGroup
from lmprog_runtime.token_healing import CONTEXT_TOKENS, Heal, HealMatcher, healed_pattern


class RequestMaker:
    """The request-making half of `Engine`'s caller side, and its tokenizer access."""

    def _make_reqs(
        self,
        prompt,
        sampling_params,
        input_ids,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        return_text_in_logprobs,
        *,
        stream: bool,
    ) -> tuple[list[Req], bool]:
        """Validate and tokenize the inputs into requests (ValueError / TypeError here)."""
        self._check_process()
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
            return_text_in_logprobs=return_text_in_logprobs,
        )
        with self._seeds_lock:
            seeds = [self._seeds.getrandbits(62) for _ in items]
        heals = [self._heal(item) for item in items]
        # A healed constraint's pattern starts with the backed-up text; one compile per
        # distinct healed pattern a call (a grammar the cache does not keep was compiled for
        # every prompt).
        healed: dict[str, Any] = {}
        for i, (item, heal) in enumerate(zip(items, heals)):
            if heal is not None and item.grammar is not None:
                pattern = healed_pattern(heal.text, item.grammar.regex)
                if pattern not in healed:
                    healed[pattern] = self.grammar("regex", pattern, size_checked=True)
                items[i] = item._replace(grammar=healed[pattern])
        reqs = [
            Req(
                next(self._rids),
                item.input_ids if heal is None else item.input_ids[:-1],
                item.params,
                tokenizer=self,
                eos_token_ids=self.eos_token_ids,
                context_len=self.context_len,
                return_logprob=item.return_logprob,
                logprob_start_len=item.logprob_start_len,
                top_logprobs_num=item.top_logprobs_num,
                return_text_in_logprobs=item.return_text_in_logprobs,
                stream=stream,
                seed=seed,
                matcher=self._matcher(item, heal),
                grammar_eos=self._grammar_eos if item.grammar is not None else None,
                grammar=item.grammar,
                char_fsm=self._char_fsm(item),
                heal=heal,
                detok_context=self._detok_context(item) if heal is None else None,
                context_free_decode=self._byte_table is not None,
                byte_pieces=self._byte_pieces,
                stop_token_texts=self._special_stops(item.params),
            )
            for item, seed, heal in zip(items, seeds, heals)
        ]
        for req in reqs:
            if req.char_fsm is not None and req.heal is None:  # (healed: the model goes first)
                self._jump_forward(req, at_start=True)
        return reqs, is_single

    def _heal(self, item: Any) -> Heal | None:
        """How to heal `item`'s prompt, if it asks for token healing and there is anything
        to heal."""
        if not item.params.token_healing or item.params.max_new_tokens == 0:
            return None  # (a prompt-only request keeps its whole prompt)
        return self._healer.plan(item.input_ids, item.params.skip_special_tokens)

    def _detok_context(self, item: Any) -> tuple[list[int], int] | None:
        """The prompt tokens an output is decoded after, and the characters of their
        decode: a tokenizer whose decode strips the text's first space (SentencePiece's
        `▁`) would otherwise drop an output's leading space ("Answer:" + "Paris"). None for
        byte-level BPE, whose pieces decode alike anywhere. Where the prompt's last tokens
        end inside a character (or in an invalid run of byte pieces), the output is decoded
        after the tokens before those byte pieces (none: it lost its leading space)."""
        if self._decode_is_context_free or item.params.max_new_tokens == 0:
            return None
        ids = item.input_ids
        context = ids[-CONTEXT_TOKENS:]
        skip = item.params.skip_special_tokens
        text = self.decode(context, skip_special_tokens=skip)
        if text.endswith("\ufffd") and ends_inside_a_character(context, self._byte_pieces):
            # (a genuine U+FFFD once dropped the context, and a leading space)
            end = len(ids)
            while end > 0 and ids[end - 1] in self._byte_pieces:
                end -= 1  # (a run may be longer than the context: a CJK character before)
            context = ids[max(0, end - CONTEXT_TOKENS) : end]
            if not context:
                return None
            text = self.decode(context, skip_special_tokens=skip)
            if text.endswith("\ufffd"):
                return None
        return context, len(text)

    def _special_stops(self, params: SamplingParams) -> dict[int, str] | None:
        """The stop strings that are a special token's whole text, by that token's id. A
        decode that skips special tokens never holds their text, so `stop="<|im_end|>"`
        never matched; it now ends the output as the token does (SGLang searches a decode
        that keeps them)."""
        if not params.stop or not params.skip_special_tokens:
            return None
        special = self._special_ids
        if len(params.stop) > len(special):  # (each request: the shorter side is read)
            stops = params.stop_strings.members
            found = {token_id: s for s, token_id in special.items() if s in stops}
        else:
            found = {special[s]: s for s in params.stop if s in special}
        return found or None

    @functools.cached_property
    def _special_ids(self) -> dict[str, int]:
        """Each special token's text -> its id (those a decode skipping them drops)."""
        tokenizer = self.tokenizer
        ids = set(tokenizer.all_special_ids)
        added = getattr(tokenizer, "added_tokens_decoder", {})
        ids |= {token_id for token_id, token in added.items() if token.special}
        return {tokenizer.convert_ids_to_tokens(token_id): token_id for token_id in ids}

    @staticmethod
    def _matcher(item: Any, heal: Heal | None) -> Any:
        if item.grammar is not None:
            return item.grammar.new_matcher()
        return HealMatcher(heal.words) if heal is not None else None

    def _make_group(self, reqs: list[Req]) -> list[Req]:
        """Tie `reqs` into a group, behind an internal prefill of their common prefix."""
        common = _common_prefix_len([r.input_ids for r in reqs])
        prefix_req = None
        if self.tree_cache is not None and common >= max(2, self.config.page_size):
            prefix_req = Req(
                next(self._rids),
                reqs[0].input_ids[:common],
                SamplingParams(max_new_tokens=0),
                tokenizer=self,
                eos_token_ids=self.eos_token_ids,
                context_len=self.context_len,
            )
        group = RequestGroup(reqs, prefix_req)
        for req in reqs:
            req.group = group
        return ([prefix_req] if prefix_req is not None else []) + reqs

    def grammar(self, kind: str, pattern: str, *, size_checked: bool = False) -> Any:
        """The compiled constraint for (kind, pattern), cached; ValueError if it is bad
        (`size_checked`: see `GrammarCache.get`)."""
        with self._grammar_lock:
            if self._stopping:  # (no compile threads started after `shutdown` stopped them)
                raise RuntimeError("the engine was shut down")
            if self._grammars is None:
                from lmprog_runtime.constrained import GrammarCache
                from lmprog_runtime.constrained.outlines_backend import OutlinesGrammarBackend

                if self._grammar_eos is None:
                    raise ValueError("constrained decoding needs a model with an EOS token")
                backend = OutlinesGrammarBackend(self.tokenizer, self._grammar_eos)
                self._grammars = GrammarCache(
                    backend,
                    self.config.grammar_compile_timeout_s,
                    self.config.grammar_cache_size,
                    jump_forward=not self.config.disable_jump_forward,
                    max_bytes=self.config.grammar_cache_mib << 20,
                )
        return self._grammars.get(kind, pattern, size_checked=size_checked)

    def may_compile(self, sampling_params: dict[str, Any]) -> bool:
        """Whether a submit of these sampling params may wait for a pattern to compile:
        a `regex` / `json_schema` not compiled and cached yet, or one token healing turns
        into another (the pattern behind the backed-up text)."""
        for kind in ("regex", "json_schema"):
            pattern = sampling_params.get(kind)
            if pattern is not None:
                grammars = self._grammars
                return (
                    bool(sampling_params.get("token_healing"))
                    or not isinstance(pattern, str)
                    or grammars is None
                    or not grammars.is_compiled(kind, pattern)
                )
        return False

    def _char_fsm(self, item: Any) -> Any:
        """Jump-forward applies to constrained requests without stops or logprobs (a forced
        token is never checked against `stop_token_ids`: it would not stop there)."""
        if item.grammar is None or self.config.disable_jump_forward:
            return None
        params = item.params
        if params.stop or params.stop_regex or params.stop_token_ids or item.return_logprob:
            return None
        return self._grammars.char_fsm(item.grammar)

    def _jump_forward(self, req: Req, at_start: bool = False) -> None:
        added = jump_forward(req, self)
        if added is None:
            return
        self._stats.add("jump_forward_tokens", added)
        if not at_start:
            self.scheduler.jump_forward(req)  # extend the forced tokens next
            self._leave_in_flight(req)

    # ---- tokenizer access (shared by caller threads and the loop) -----------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):  # (the tokenizer's errors named its own arguments)
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        check_text(text, "text")
        self._check_process()
        with self._tokenizer_lock:
            ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        vocab = self.runner.model_config.vocab_size
        token = max(ids, default=-1)
        if token >= vocab:  # (a tokenizer with more tokens than the model: a program's
            # text once got the message of input_ids it never passed)
            raise ValueError(
                f"text {text[:40]!r} has token {token} "
                f"({self.tokenizer.convert_ids_to_tokens(token)!r}), outside the "
                f"model's vocabulary [0, {vocab}): its tokenizer has more tokens than it"
            )
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._byte_table is not None and type(ids) is list:  # (read-only: no lock)
            text = self._byte_table.decode(ids, skip_special_tokens)
            if text is not None:
                return text
        _check_ids(ids, self.runner.model_config.vocab_size)  # (past the table: rare)
        self._check_process()
        with self._tokenizer_lock:
            if self._backend_decode is not None and type(ids) is list and _flat(ids):
                return self._backend_decode(ids, skip_special_tokens=skip_special_tokens)
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def backend_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's own `decode`, where the tokenizer's `decode` adds nothing to it
    for a list of ids (a stock fast tokenizer that cleans up no spaces): the same text, at
    a fifth of the cost (`decode` converts and checks each id in Python first; the loop
    decodes at every finish, and twice a token for stop strings and streams). None for any
    other tokenizer."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    stock = (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    return tokenizer._tokenizer.decode if stock else None


def _check_ids(ids: Any, vocab: int) -> None:
    """ValueError for an id outside the vocabulary, in one sequence of ids (-1 was an
    OverflowError, 10**6 decoded as '')."""
    flat = isinstance(ids, (list, tuple)) and ids and _flat(ids)
    if flat and (min(ids) < 0 or max(ids) >= vocab):  # (in C: it runs at a token's decode)
        bad = [i for i in ids if not 0 <= i < vocab]
        raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})")


def _flat(ids: list[Any]) -> bool:
    """Whether `ids` is one sequence (`tokenizer.decode` takes a batch of them too)."""
    return not ids or type(ids[0]) is int


def _common_prefix_len(seqs: list[list[int]]) -> int:
    first, n = seqs[0], min(len(s) for s in seqs)
    for other in seqs[1:]:
        i = 0
        while i < n and other[i] == first[i]:
            i += 1
        n = i
    return n
