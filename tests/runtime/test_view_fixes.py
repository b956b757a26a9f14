"""What an engine shows of itself: the radix cache as text with each control character
escaped once, and a shut-down engine that says so instead of looking idle.
"""

from __future__ import annotations

import threading

from lmprog_runtime import Engine


def test_radix_tree_text_escapes_a_newline_once(engine):
    """The label was escaped for the SVG and then `repr`-ed again: `\\n` showed as
    `\\\\n`. The expectation is written out by hand, not computed with `repr`."""
    engine.flush_cache()
    engine.generate("alpha\nbeta", {"max_new_tokens": 1, "temperature": 0})
    text = str(engine.radix_tree())
    (line,) = [line for line in text.splitlines() if "alpha" in line]
    # The literal characters: quote, alpha, backslash, n, beta, quote.
    assert line.endswith("'alpha" + "\\" + "n" + "beta'"), line
    assert "\\" + "\\" not in text and "\n" not in line


def test_a_shut_down_engine_says_so(tiny_path):
    """`running=0` after a shutdown read as an idle engine ready for requests."""
    engine = Engine(tiny_path, max_total_tokens=1024)
    assert "running=0, waiting=0" in repr(engine) and "shut down" not in repr(engine)
    assert "0 running" in engine._repr_html_()
    engine.shutdown()
    text, page = repr(engine), engine._repr_html_()
    assert text.startswith("Engine(model=") and text.endswith("shut down)"), text
    assert "running" not in text and "waiting" not in text
    assert "lmprog Engine (shut down)" in page and "none: shut down" in page
    assert "0 running" not in page


def test_a_request_being_prefilled_counts_as_running(engine, monkeypatch):
    """An admitted request leaves `waiting` and joins `running` after its forward: during a
    long prefill `memory_state()` (and `repr`) showed it neither running nor waiting."""
    from lmprog_runtime.forward_batch import ForwardMode

    forward, entered, release = engine.runner.forward, threading.Event(), threading.Event()

    def held_forward(batch):
        if batch.mode is ForwardMode.EXTEND and not release.is_set():
            entered.set()
            release.wait(60)
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", held_forward)
    future = engine.submit(["A prompt being prefilled"], {"max_new_tokens": 2})[0]
    try:
        assert entered.wait(60)
        state = engine.memory_state()
        assert (state["num_running"], state["num_waiting"]) == (1, 0), state
        assert "running=1, waiting=0" in repr(engine)
    finally:
        release.set()
    future.result(timeout=60)
    state = engine.memory_state()
    assert (state["num_running"], state["num_waiting"]) == (0, 0)


def test_the_notebook_view_hit_rate_is_cached_over_prompt_tokens(engine):
    """It divided by prefill + cached tokens, and prefill counts jumped-forward tokens (and
    recomputed ones) too: 14.8% shown where two thirds of the prompts came from the cache.
    Reference: the requests' own `prompt_tokens` and `cached_tokens`."""
    engine.flush_cache()
    engine.reset_stats()
    prompt = "The answer to the question is"
    outs = [
        engine.generate(prompt, {"max_new_tokens": 12, "regex": r" forty two, so [0-9]"})
        for _ in range(3)
    ]
    assert engine.stats()["jump_forward_tokens"] > 0
    metas = [out["meta_info"] for out in outs]
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    assert engine.stats()["prompt_tokens"] == prompt_tokens
    assert f"{cached / prompt_tokens:.1%} of {prompt_tokens:,} prompt tokens" in (
        engine._repr_html_()
    )
    # A fork's internal prefill of its shared text counts its prompt as its reuse counts
    # in `cached_tokens` (without it the rate passed 100%: 131% of 606 prompt tokens).
    shared = "A long shared system prompt, the common prefix of each branch. " * 4
    for _ in range(3):
        engine.generate([shared + "Q1?", shared + "Q2?"], {"max_new_tokens": 2}, group=True)
    stats = engine.stats()
    assert 0 < stats["cached_tokens"] <= stats["prompt_tokens"]


def test_a_prefix_hit_is_a_request_reusing_it(engine):
    """A waiting request is matched at every scheduling (`lpm`), and each match counted a
    hit: 16 requests served from one prefix gave it 43. Now the count is the number of
    requests that claimed it (`lfu` evicts by it)."""
    engine.flush_cache()
    prefix = "A system prompt shared by every request below, long enough to span pages."
    engine.generate(prefix, {"max_new_tokens": 1})
    prompts = [f"{prefix} Question {i}?" for i in range(16)]
    outs = [f.result(timeout=120) for f in engine.submit(prompts, {"max_new_tokens": 2})]
    (top,) = engine.tree_cache.root.children.values()
    claimed = sum(out["meta_info"]["cached_tokens"] >= top.depth for out in outs)
    assert claimed and top.hit_count == claimed


def test_a_request_that_waits_for_room_counts_no_hit(tiny_path):
    """Admission claims a waiting request's prefix before it knows the request fits; one
    that does not gives it back, and each step's claim counted a hit (317 for 3 requests
    in a tight pool). A retracted request claiming its own tokens back is one more use."""
    with Engine(tiny_path, max_total_tokens=400) as engine:
        prefix = "A system prompt shared by every request below, long enough to span pages."
        engine.generate(prefix, {"max_new_tokens": 1})
        params = {"max_new_tokens": 250, "ignore_eos": True, "temperature": 0}
        prompts = [f"{prefix} Question {i}?" for i in range(3)]
        outs = [f.result(timeout=300) for f in engine.submit(prompts, params)]
        (top,) = engine.tree_cache.root.children.values()
        claimed = sum(out["meta_info"]["cached_tokens"] >= top.depth for out in outs)
        retracted = engine.stats()["retracted_requests"]
        assert claimed <= top.hit_count <= claimed + retracted, (top.hit_count, claimed)


def test_a_streamed_prefill_only_request_keeps_its_top_logprobs(engine):
    """`max_new_tokens=0` scores the token after the prompt: its one entry of top logprobs
    comes in the streamed chunk as in the plain result (the cut to the chunk's 0 tokens
    dropped it)."""
    kwargs = {"return_logprob": True, "top_logprobs_num": 2}
    params = {"max_new_tokens": 0}
    plain = engine.generate("Hello", params, **kwargs)["meta_info"]
    chunks = list(engine.generate("Hello", params, stream=True, **kwargs))
    last = chunks[-1]["meta_info"]
    assert len(plain["output_top_logprobs"]) == 1
    assert last["output_top_logprobs"] == plain["output_top_logprobs"]
    assert last["output_token_logprobs"] == plain["output_token_logprobs"]


def test_each_streamed_chunk_keeps_its_own_logprobs(engine):
    """Every chunk's meta held the request's live lists: all of them read the final
    length, and a reader on another thread saw them change as it read."""
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    chunks = list(
        engine.generate("Hello", params, stream=True, return_logprob=True, top_logprobs_num=2)
    )
    metas = [chunk["meta_info"] for chunk in chunks]
    counts = [m["completion_tokens"] for m in metas]
    assert counts[-1] == 6 and len(set(counts)) > 1
    final = engine.generate("Hello", params, return_logprob=True, top_logprobs_num=2)
    for meta in metas:
        n = meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == n
        assert meta["output_token_logprobs"] == final["meta_info"]["output_token_logprobs"][:n]
