"""Engine.generate on the tiny built-in model against transformers as the reference."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, hf_greedy


def test_greedy_matches_transformers_for_eight_prompts_together(engine, hf_tiny):
    outs = engine.generate(PROMPTS, {"max_new_tokens": 24, "temperature": 0})
    assert len({len(engine.encode(p)) for p in PROMPTS}) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        assert out["output_ids"] == hf_greedy(hf_tiny, prompt, 24), prompt
        assert out["text"] == hf_tiny[1].decode(out["output_ids"], skip_special_tokens=True)
        info = out["meta_info"]
        assert info["prompt_tokens"] == len(engine.encode(prompt))
        assert info["completion_tokens"] == len(out["output_ids"])
        assert info["finish_reason"] == {"type": "length", "length": 24}


def test_single_prompt_and_input_ids_agree(engine):
    params = {"max_new_tokens": 10, "temperature": 0}
    by_text = engine.generate(PROMPTS[1], params)
    by_ids = engine.generate(input_ids=engine.encode(PROMPTS[1]), sampling_params=params)
    assert isinstance(by_text, dict) and by_text["output_ids"] == by_ids["output_ids"]


def test_seeded_sampling_reproduces_whatever_the_batch(engine):
    params = {"max_new_tokens": 20, "temperature": 1.0, "seed": 42}
    alone = engine.generate(PROMPTS[3], params)
    batch = engine.generate(
        PROMPTS[:5],
        [{"max_new_tokens": 20, "temperature": 0.9, "seed": i} for i in range(3)]
        + [params, {"max_new_tokens": 7, "temperature": 1.3}],
    )
    assert batch[3]["output_ids"] == alone["output_ids"]
    other_seed = engine.generate(PROMPTS[3], {**params, "seed": 7})
    assert other_seed["output_ids"] != alone["output_ids"]


def test_top_k_one_and_tiny_top_p_equal_greedy(engine):
    greedy = engine.generate(PROMPTS[4], {"max_new_tokens": 16, "temperature": 0})
    for extra in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        out = engine.generate(PROMPTS[4], {"max_new_tokens": 16, "temperature": 1.5, **extra})
        assert out["output_ids"] == greedy["output_ids"], extra


@pytest.mark.parametrize(
    ("prompt", "freq", "pres"), [(5, 0.7, 1.1), (0, -1.5, 0.0), (2, 0.0, -2.0)]
)
def test_penalties_match_a_reference_decoding_loop(engine, hf_tiny, prompt, freq, pres):
    """Greedy with penalties: transformers' forward, penalised from a bincount of the
    tokens so far, token for token; penalties that change the output (so the counts
    each draw reads matter)."""
    model, tokenizer = hf_tiny
    params = {"max_new_tokens": 16, "temperature": 0}
    out = engine.generate(
        PROMPTS[prompt], {**params, "frequency_penalty": freq, "presence_penalty": pres}
    )
    ids = tokenizer(PROMPTS[prompt], return_tensors="pt").input_ids
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(16):
            tokens = torch.cat([ids, torch.tensor([generated], dtype=torch.long)], 1)
            logits = model(tokens).logits[0, -1]
            counts = torch.bincount(
                torch.tensor(generated, dtype=torch.long), minlength=logits.numel()
            )
            logits = logits - (freq * counts + pres * (counts > 0).float())
            generated.append(int(logits.argmax()))
    assert out["output_ids"] == generated
    assert generated != engine.generate(PROMPTS[prompt], params)["output_ids"]


def test_stop_string_spanning_tokens_is_cut(engine, hf_tiny):
    tokenizer = hf_tiny[1]
    base = engine.generate(PROMPTS[5], {"max_new_tokens": 24, "temperature": 0})
    ids = base["output_ids"]
    # A stop string from the middle of token 3 into token 4: it spans a token boundary.
    before = tokenizer.decode(ids[:3])
    tok3, tok4 = tokenizer.decode(ids[3:4]), tokenizer.decode(ids[4:5])
    assert len(tok3) >= 2 and len(tok4) >= 1
    stop = tok3[1:] + tok4[:1]
    start = base["text"].find(stop)
    out = engine.generate(PROMPTS[5], {"max_new_tokens": 24, "temperature": 0, "stop": [stop]})
    assert start <= len(before) + 1
    assert out["text"] == base["text"][:start]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[: len(out["output_ids"])]


def test_stop_token_ids_end_generation_and_are_not_in_text(engine, hf_tiny):
    base = engine.generate(PROMPTS[6], {"max_new_tokens": 20, "temperature": 0})
    target = base["output_ids"][5]
    first = base["output_ids"].index(target)
    out = engine.generate(
        PROMPTS[6], {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [target]}
    )
    assert out["output_ids"] == base["output_ids"][: first + 1]
    assert out["text"] == hf_tiny[1].decode(base["output_ids"][:first])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    # min_new_tokens holds the stop token back until enough tokens exist.
    held = engine.generate(
        PROMPTS[6],
        {
            "max_new_tokens": 20,
            "temperature": 0,
            "stop_token_ids": [target],
            "min_new_tokens": first + 2,
        },
    )
    assert len(held["output_ids"]) >= first + 2
    assert target not in held["output_ids"][: first + 2]


def test_min_new_tokens_bans_each_rows_own_stop_tokens_in_one_batch(engine, hf_tiny):
    """One batch, each row banning a different token (its own greedy first token, made a
    stop token held back by min_new_tokens) and one row banning nothing: each row's first
    token is transformers' argmax with that row's ban, and the others are untouched."""
    model, tokenizer = hf_tiny
    prompts = PROMPTS[:5]
    greedy = {"max_new_tokens": 1, "temperature": 0}
    firsts = [o["output_ids"][0] for o in engine.generate(prompts, greedy)]
    # Row 0 also bans the last row's token: a ban leaking into other rows would show there.
    params = [
        {**greedy, "stop_token_ids": [first], "min_new_tokens": 1} for first in firsts[:-1]
    ] + [greedy]
    params[0]["stop_token_ids"].append(firsts[-1])
    got = [o["output_ids"][0] for o in engine.generate(prompts, params)]
    for prompt, first, token, p in zip(prompts, firsts, got, params):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            logits = model(ids).logits[0, -1].clone()
            if "stop_token_ids" in p:  # held back too: the EOS token
                logits[[*p["stop_token_ids"], tokenizer.eos_token_id]] = float("-inf")
        assert token == int(logits.argmax())
        assert (token != first) == ("stop_token_ids" in p)


def test_prefill_only_returns_prompt_logprobs(engine, hf_tiny):
    model, tokenizer = hf_tiny
    prompt = PROMPTS[3]
    out = engine.generate(
        prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0, top_logprobs_num=3
    )
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = torch.log_softmax(model(ids).logits[0], dim=-1)
    got = out["meta_info"]["input_token_logprobs"]
    assert got[0] == (None, ids[0, 0].item(), None)
    expected = [ref[i - 1, ids[0, i]].item() for i in range(1, ids.shape[1])]
    assert [tok for _, tok, _ in got] == ids[0].tolist()
    assert [lp for lp, *_ in got[1:]] == pytest.approx(expected, abs=1e-4)
    tops = out["meta_info"]["input_top_logprobs"]
    assert tops[0] is None and len(tops[1]) == 3
    assert tops[1][0][1] == int(ref[0].argmax())


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_only_gives_the_next_tokens_alternatives(tiny_path, hf_tiny, overlap):
    """SGLang returns a `max_new_tokens=0` request's next-token alternatives as
    `output_top_logprobs[0]` (its CoT-decoding example branches on them): the top of the
    last prompt position's distribution, from transformers' forward; no token drawn."""
    from lmprog_runtime import Engine

    model, tokenizer = hf_tiny
    prompt = PROMPTS[2]
    with Engine(tiny_path, overlap_schedule=overlap) as engine:
        out = engine.generate(
            prompt,
            {"max_new_tokens": 0},
            return_logprob=True,
            top_logprobs_num=5,
            return_text_in_logprobs=True,
        )
        plain = engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = torch.log_softmax(model(ids).logits[0, -1], dim=-1).topk(5)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
    (alternatives,) = meta["output_top_logprobs"]
    assert [token for _, token, _ in alternatives] == ref.indices.tolist()
    assert [value for value, _, _ in alternatives] == pytest.approx(ref.values.tolist(), abs=1e-4)
    assert [text for *_, text in alternatives] == [tokenizer.decode([t]) for t in ref.indices]
    assert "output_top_logprobs" not in plain["meta_info"]  # (none asked for)


def test_output_logprobs_and_logprob_start_len(engine, hf_tiny):
    model, tokenizer = hf_tiny
    prompt = PROMPTS[1]
    out = engine.generate(
        prompt,
        {"max_new_tokens": 5, "temperature": 0},
        return_logprob=True,
        logprob_start_len=2,
        top_logprobs_num=2,
    )
    ids = tokenizer(prompt).input_ids
    full = torch.tensor([ids + out["output_ids"]])
    with torch.inference_mode():
        ref = torch.log_softmax(model(full).logits[0], dim=-1)
    info = out["meta_info"]
    assert [t for _, t, _ in info["input_token_logprobs"]] == ids[2:]
    for (lp, tok, _), pos in zip(
        info["output_token_logprobs"], range(len(ids) - 1, full.shape[1] - 1)
    ):
        assert lp == pytest.approx(ref[pos, tok].item(), abs=1e-4)
    for (lp, tok, _), top in zip(info["output_token_logprobs"], info["output_top_logprobs"]):
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp)


def test_stream_chunks_concatenate_to_the_final_text(engine):
    params = {"max_new_tokens": 30, "temperature": 0, "stop": ["\n\n"]}
    final = engine.generate(PROMPTS[0], params)
    chunks = list(engine.generate(PROMPTS[0], params, stream=True))
    assert "".join(c["text"] for c in chunks) == final["text"]
    assert sum((c["output_ids"] for c in chunks), []) == final["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == final["meta_info"]["finish_reason"]
    assert len(chunks) > 1


def test_a_request_joins_a_running_decode_batch(engine, monkeypatch):
    """A request submitted while another decodes is admitted at once, then decodes in the
    same batches as the running one and finishes while that one still runs; both outputs
    equal their runs alone.

    The scheduler's batches are recorded. Once the long request has `long_at` tokens, the
    engine loop is held (a condition wait, not a sleep) until the short request has reached
    the engine, so the short one arrives mid-decode however the threads are scheduled. An
    engine that served the requests one after another would show no batch with both and
    `short_new - 1` more forward passes."""
    long_at, long_new, short_new = 4, 48, 6
    long_params = {"max_new_tokens": long_new, "temperature": 0, "ignore_eos": True}
    short_params = {"max_new_tokens": short_new, "temperature": 0, "ignore_eos": True}
    long_alone = engine.generate(PROMPTS[7], long_params)["output_ids"]
    short_alone = engine.generate(PROMPTS[2], short_params)["output_ids"]
    long_len, short_len = len(engine.encode(PROMPTS[7])), len(engine.encode(PROMPTS[2]))
    assert long_len != short_len  # batches name their requests by prompt length

    batches = []  # per step: (mode, [(prompt length, tokens so far) per request])
    held = []
    next_batch = engine.scheduler.next_batch

    def recording_next_batch():
        running = [(r.prompt_len, len(r.output_ids)) for r in engine.scheduler.running]
        if not held and running == [(long_len, long_at)]:
            held.append(True)
            with engine._cv:  # until the caller's short request has reached the engine
                engine._cv.wait_for(lambda: engine._inbox or engine.scheduler.waiting, 60)
        batch = next_batch()
        if batch is not None:
            reqs = [(r.prompt_len, len(r.output_ids)) for r in batch.reqs]
            batches.append((batch.mode.name, reqs))
        return batch

    monkeypatch.setattr(engine.scheduler, "next_batch", recording_next_batch)
    engine.reset_stats()
    stream = engine.generate(PROMPTS[7], long_params, stream=True)
    long_ids = []
    while len(long_ids) < long_at:  # every step that adds a token sends a chunk
        long_ids += next(stream)["output_ids"]
    short = engine.generate(PROMPTS[2], short_params)
    long_ids += sum((chunk["output_ids"] for chunk in stream), [])
    monkeypatch.undo()

    assert long_ids == long_alone and short["output_ids"] == short_alone
    # The short request's prefill ran once the long one had `long_at` tokens or more, with
    # the long one's next decode token in the same forward (a mixed batch).
    short_extend = next(
        i for i, (mode, reqs) in enumerate(batches) if mode == "EXTEND" and reqs[0][0] == short_len
    )
    mode, [(prompt_len, num_long)] = batches[short_extend - 1]
    assert (mode, prompt_len) == ("DECODE", long_len) and num_long + 1 >= long_at
    assert batches[short_extend] == ("EXTEND", [(short_len, 0), (long_len, num_long + 1)])
    # Every later step until the short one finished decoded both requests together ...
    together = [
        ("DECODE", [(long_len, num_long + 2 + i), (short_len, 1 + i)]) for i in range(short_new - 1)
    ]
    assert batches[short_extend + 1 : short_extend + short_new] == together
    # ... and the long one went on decoding after the short one had finished.
    assert batches[short_extend + short_new] == ("DECODE", [(long_len, num_long + 1 + short_new)])
    assert batches[-1] == ("DECODE", [(long_len, long_new - 1)])
    stats = engine.stats()
    assert stats["max_running_requests_seen"] == 2
    assert stats["decode_tokens"] == (long_new - 1) + (short_new - 1)
    # One forward per token of the long request: the short one's prefill and decodes shared them.
    assert stats["forward_passes"] == 1 + (long_new - 1)


def test_generation_stops_at_the_context_length(tiny_path):
    from lmprog_runtime import Engine

    with Engine(tiny_path, context_len=32, max_total_tokens=256) as small_ctx:
        prompt_ids = small_ctx.encode(PROMPTS[7])[:20]
        out = small_ctx.generate(
            input_ids=prompt_ids, sampling_params={"max_new_tokens": 100, "ignore_eos": True}
        )
        assert len(out["output_ids"]) == 12
        assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_max_new_tokens_none_generates_up_to_the_context_length(tiny_path):
    """As SGLang reads it (None dropped, the default of 128 stood in for it)."""
    from lmprog_runtime import Engine

    with Engine(tiny_path, context_len=160, max_total_tokens=512) as small_ctx:
        prompt_ids = small_ctx.encode(PROMPTS[7])[:20]
        params = {"max_new_tokens": None, "ignore_eos": True, "temperature": 0}
        out = small_ctx.generate(input_ids=prompt_ids, sampling_params=params)
        assert len(out["output_ids"]) == 140
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 140}


def test_one_sampling_dict_for_a_batch_draws_as_one_dict_per_request(engine):
    """The requests of one call read a shared dict once; each still draws from its own
    seed (a seeded one as the same dict alone), and a greedy request makes no generator."""
    sampled = {"max_new_tokens": 6, "temperature": 0.9, "seed": 5}
    together = engine.generate(PROMPTS[:3], sampled)
    alone = [engine.generate(p, dict(sampled)) for p in PROMPTS[:3]]
    assert [o["output_ids"] for o in together] == [o["output_ids"] for o in alone]
    unseeded = {"max_new_tokens": 6, "temperature": 0.9}
    reqs, _ = engine._make_reqs(None, unseeded, [[5, 6], [5, 6]], False, -1, 0, False, stream=False)
    assert reqs[0].params is reqs[1].params and reqs[0].seed != reqs[1].seed
    greedy = {"max_new_tokens": 4, "temperature": 0}
    (req,), _ = engine._make_reqs(None, greedy, [5, 6, 7], False, -1, 0, False, stream=False)
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=greedy)["output_ids"]
    from lmprog_runtime.sampling import sample_rows

    rows = sample_rows([req, *reqs], engine.runner.model_config.vocab_size, engine.penalty_counts)
    assert rows[0].generator is None and req._generator is None  # greedy: none made
    state = torch.Generator().manual_seed(reqs[0].seed).get_state()
    assert torch.equal(rows[1].generator.get_state(), state)


def test_a_full_batch_does_not_read_the_queue(tiny_path):
    """While `max_running_requests` run, scheduling does not order (prefix-match) the
    waiting requests: a dataset's queue costs the steps nothing. The outputs are the
    same as each request's alone."""
    from lmprog_runtime import Engine

    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, max_running_requests=2) as engine:
        sched = engine.scheduler
        order, room_when_ordered = sched.policy.order, []

        def watched(waiting, first=None):
            room_when_ordered.append(sched.config.max_running_requests - len(sched.running))
            return order(waiting, first)

        sched.policy.order = watched
        outs = engine.generate(PROMPTS[:6], params)
        passes = engine.stats()["forward_passes"]
        alone = [engine.generate(p, params)["output_ids"] for p in PROMPTS[:6]]
    assert [o["output_ids"] for o in outs] == alone
    assert room_when_ordered and min(room_when_ordered) > 0
    assert len(room_when_ordered) < passes  # (not at every step)


def test_arrival_order_matches_a_waiting_request_only_when_it_comes_up(tiny_path):
    """In arrival order (`fcfs`, or a queue past `MAX_CACHE_AWARE_QUEUE`) admission stops at
    the first request that does not fit: the ones behind it are not prefix-matched that
    step. The outputs are each request's alone."""
    from lmprog_runtime import Engine

    lengths = [3, 9, 4, 8, 5, 7, 6, 2]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lengths]
    with Engine(tiny_path, max_running_requests=2, schedule_policy="fcfs") as engine:
        req_cache, matched = engine.scheduler.req_cache, []
        match = req_cache.match
        req_cache.match = lambda req: matched.append(req.rid) or match(req)
        outs = engine.generate(PROMPTS[:8], params)
        del req_cache.match
        alone = [engine.generate(p, q)["output_ids"] for p, q in zip(PROMPTS[:8], params)]
    assert [o["output_ids"] for o in outs] == alone
    # Each is matched when admitted, and at most once more (as the first that did not fit).
    assert len(set(matched)) == 8 and len(matched) <= 2 * 8


def test_a_stop_string_that_is_a_special_tokens_text_ends_on_that_token(engine):
    """Text decoded with special tokens skipped never holds `<|im_start|>`, so that stop
    string never matched (SmolLM2 with `ignore_eos` ran on into a made-up next turn); SGLang
    searches a decode that keeps them. Near-uniform draws on the tiny model write the token
    somewhere; the output with the stop string is the one without it, cut after the token,
    and reports the string. With `skip_special_tokens=False` the text holds it as before."""
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    free = [
        {"max_new_tokens": 256, "temperature": 100.0, "seed": seed, "ignore_eos": True}
        for seed in range(60)
    ]
    # (every other request: more stop strings than the tokenizer has special tokens, read
    # from the special tokens' side)
    decoys = [f"\x01\x02zz{i}\x03" for i in range(200)]  # (never in an output)
    stopped = [
        {**p, "stop": ["zzzz", "<|im_start|>", *decoys[: p["seed"] % 2 * 200]]} for p in free
    ]
    hits = 0
    for params, whole, cut in zip(
        stopped, engine.generate(["Hi"] * 60, free), engine.generate(["Hi"] * 60, stopped)
    ):
        ids = whole["output_ids"]
        if special not in ids:
            assert cut["output_ids"] == ids
            continue
        hits += 1
        end = ids.index(special) + 1
        assert cut["output_ids"] == ids[:end]
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": "<|im_start|>"}
        assert cut["text"] == engine.tokenizer.decode(ids[:end], skip_special_tokens=True)
        kept = engine.generate("Hi", {**params, "skip_special_tokens": False})
        assert kept["output_ids"] == ids[:end]
        assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": "<|im_start|>"}
        # Like EOS and stop tokens, the token is banned while min_new_tokens is unreached:
        # it was the draw at `end - 1`, which now picks another token.
        held = engine.generate("Hi", {**params, "min_new_tokens": end, "max_new_tokens": end})
        assert special not in held["output_ids"] and held["output_ids"][: end - 1] == ids[: end - 1]
    assert hits  # (about 7 of 60 expected)
