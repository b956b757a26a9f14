"""Validation and normalisation of `Engine.generate` arguments, in the caller's thread.

Everything a request could get wrong is caught here and raised as `ValueError` /
`TypeError` naming the argument, before anything reaches the engine loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from lmprog_runtime.sampling_params import SamplingParams, check_text

if TYPE_CHECKING:
    from lmprog_runtime.engine import Engine


class GenerateItem(NamedTuple):
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    grammar: Any  # a compiled constraint, or None


def normalize_generate_inputs(
    engine: Engine,
    prompt: Any,
    sampling_params: Any,
    *,
    input_ids: Any,
    return_logprob: Any,
    logprob_start_len: Any,
    top_logprobs_num: Any,
    return_text_in_logprobs: Any,
) -> tuple[list[GenerateItem], bool]:
    """Return one item per request and whether the call was for a single prompt."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompt and input_ids")
    if prompt is not None:
        is_single = isinstance(prompt, str)
        prompts = [prompt] if is_single else prompt
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompt must be a str or a list of str")
        for p in prompts:
            if p == "":
                raise ValueError("prompt is empty")
            check_text(p, "prompt")
        ids_list = [engine.encode(p) for p in prompts]  # (a token past the model: refused)
    else:
        if not isinstance(input_ids, list):
            raise TypeError("input_ids must be a list of ints or a list of lists of ints")
        is_single = not input_ids or not isinstance(input_ids[0], list)
        ids_list = [input_ids] if is_single else input_ids
        vocab = engine.runner.model_config.vocab_size
        for ids in ids_list:
            if not isinstance(ids, list) or not _all_ints(ids):
                raise TypeError("input_ids must be a list of ints or a list of lists of ints")
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                bad = [i for i in ids if not 0 <= i < vocab][:8]
                raise ValueError(
                    f"input_ids contain token ids {bad} outside the model's vocabulary [0, {vocab})"
                )
    if not ids_list:
        raise ValueError("prompt list is empty")
    num = len(ids_list)
    params = _per_request("sampling_params", sampling_params, num, dict)
    # (None: the default, as SGLang's GenerateReqInput takes it)
    logprob_flags = _per_request("return_logprob", return_logprob, num, bool, False)
    starts = _per_request("logprob_start_len", logprob_start_len, num, int, -1)
    tops = _per_request("top_logprobs_num", top_logprobs_num, num, int, 0)
    texts = _per_request("return_text_in_logprobs", return_text_in_logprobs, num, bool, False)

    items = []
    # Each distinct dict is read once (the requests of one call share what it says, which
    # nothing changes later): one dict for a whole batch is the usual case.
    parsed: dict[int, SamplingParams] = {}
    # (one grammar per constraint a call: one the cache does not keep, larger than
    # `grammar_cache_mib`, was compiled and held again for each prompt of a batch)
    grammars: dict[tuple[str, str], Any] = {}
    for ids, raw, want_lp, start, top, text in zip(
        ids_list, params, logprob_flags, starts, tops, texts
    ):
        sp = parsed.get(id(raw))
        if sp is None:
            sp = parsed[id(raw)] = SamplingParams.from_dict(raw)
            _check_stop_token_ids(sp.stop_token_ids, engine.runner.model_config.vocab_size)
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if start < -1:
            raise ValueError(f"logprob_start_len must be >= -1, got {start}")
        if want_lp and start >= len(ids):  # (as SGLang refuses it: no prompt logprob there)
            raise ValueError(
                f"logprob_start_len ({start}) must be below the prompt's {len(ids)} tokens"
            )
        if top < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top}")
        context = engine.context_len
        if sp.max_new_tokens == 0 and len(ids) > context:
            raise ValueError(
                f"prompt of {len(ids)} tokens is longer than the context length ({context})"
            )
        if sp.max_new_tokens > 0 and len(ids) >= context:
            raise ValueError(
                f"prompt of {len(ids)} tokens is longer than the context length "
                f"({context} tokens, one kept free for generation)"
            )
        if len(ids) + sp.min_new_tokens > context:  # (max_new_tokens is cut to what is left)
            raise ValueError(
                f"min_new_tokens = {sp.min_new_tokens} after a prompt of {len(ids)} tokens "
                f"goes past the context length ({context})"
            )
        need = len(ids) + min(sp.max_new_tokens, context - len(ids))
        page = engine.config.page_size
        slots = -(-need // page) * page + page  # whole pages, and one to start it on
        if slots > engine.runner.num_kv_slots:
            pages = f" in pages of {page} (and one page more)" if page > 1 else ""
            what = "prompt_tokens + max_new_tokens" if sp.max_new_tokens > 0 else "prompt"
            raise ValueError(
                f"{what} = {need} tokens take {slots} KV slots{pages}, more than the "
                f"pool's {engine.runner.num_kv_slots}; raise max_total_tokens"
            )
        grammar = None
        if sp.constraint is not None:
            grammar = grammars.get(sp.constraint)
            if grammar is None:
                grammar = grammars[sp.constraint] = engine.grammar(*sp.constraint)
        items.append(GenerateItem(list(ids), sp, want_lp, start, top, text, grammar))
    return items, is_single


def _check_stop_token_ids(ids: list[int], vocab: int) -> None:
    """ValueError for a stop token id outside the model's vocabulary (it could never be
    generated, so the request would silently never stop on it)."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab})")


def _all_ints(ids: list[Any]) -> bool:
    """Whether every entry is an int (not a bool); a list of plain ints is told in C."""
    if set(map(type, ids)) <= {int}:
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in ids)


def _per_request(name: str, value: Any, num: int, kind: type, default: Any = None) -> list[Any]:
    """Broadcast a scalar argument to every request, or check a per-request list's length;
    None (the argument's, or an entry's) stands for `default`."""
    if isinstance(value, list) and kind is not list:
        if len(value) != num:
            raise ValueError(f"{name} has {len(value)} entries for {num} prompts")
        values = value
    else:
        values = [value]  # (checked once, then broadcast)
    for v in values:
        if v is None:
            continue
        if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if kind is bool and not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
        if kind is dict and not isinstance(v, dict):
            raise TypeError(f"{name} must be a dict, got {type(v).__name__}")
    if values is not value:
        return [default if value is None else value] * num
    return [default if v is None else v for v in values]


def check_flags(**flags: Any) -> None:
    """TypeError naming the flag that is no bool ("no" was taken as True)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
