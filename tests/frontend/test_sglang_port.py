"""SGLang programs that port by changing the import: the parts of SGLang's frontend
contract a real program leans on beyond the shapes of `test_sglang_programs.py`.

- `run(...)` keywords: a program's own parameter named like a sampling option
  (`max_tokens`) is the program's (SGLang's `run` takes only its own option names).
- Logprob entries are `(logprob, token_id, text)` triples everywhere (SGLang's
  `detokenize_logprob_tokens`), the text None unless `return_text_in_logprobs`.
- `run(stream=True)` returns at once, its body running on a thread of its own.
- Choices methods written against SGLang's `ChoicesSamplingMethod.__call__`, and the
  built-ins called that way.
- `s.user(expr)` method form, `gen_int(name, max_tokens)`, `str(state)`.

References are independent of the code under test: the tokenizer's own `decode`, the
generated token counts, thread events, hand-computed scores.
"""

from __future__ import annotations

import threading

import pytest

import lmprog as sgl
import lmprog.backend
from lmprog.choices import ChoicesDecision, ChoicesSamplingMethod
from lmprog_runtime import results

GREEDY = {"temperature": 0, "ignore_eos": True}


# ---- the backend line ------------------------------------------------------------------
def test_sglangs_runtime_line_ports_as_it_is(tiny_path):
    """`sgl.Runtime(model_path=..., **server_args)` (SGLang's server process) is the
    in-process engine here, SGLang's argument names translated, server-only ones taking no
    effect; a setting one engine cannot honour is refused at once."""

    @sgl.function
    def hello(s):
        s += "Hello," + sgl.gen("a", max_tokens=3, **GREEDY)

    runtime = sgl.Runtime(
        model_path=tiny_path,
        context_length=256,
        mem_fraction_static=0.2,
        max_running_requests=8,
        port=30000,
        log_level="error",
    )
    try:
        assert runtime.config.context_len == 256 and runtime.config.mem_fraction == 0.2
        assert runtime.config.max_running_requests == 8
        state = hello.run(backend=runtime)
        assert state.get_meta_info("a")["completion_tokens"] == 3
        assert runtime.get_tokenizer() is runtime.tokenizer  # (an AttributeError once)
    finally:
        runtime.shutdown()
    with pytest.raises(ValueError, match="tp_size=2"):
        sgl.Runtime(model_path=tiny_path, tp_size=2)
    with pytest.raises(TypeError, match="unknown Engine argument"):
        sgl.Engine(model_path=tiny_path, not_an_argument=1)
    # A renamed setting's error names it as given (it said `mem_fraction`, which the
    # program never wrote); lmprog's own name keeps its own.
    with pytest.raises(ValueError, match=r"^mem_fraction_static must be in \(0, 1\), got 1.5"):
        sgl.Runtime(model_path=tiny_path, mem_fraction_static=1.5)
    with pytest.raises(TypeError, match=r"^context_length must be an int"):
        sgl.Runtime(model_path=tiny_path, context_length="long")
    with pytest.raises(ValueError, match=r"^mem_fraction must be in"):
        sgl.Runtime(model_path=tiny_path, mem_fraction=1.5)
    with pytest.raises(ValueError, match=r"^context_length 100000 exceeds the model's"):
        sgl.Runtime(model_path=tiny_path, context_length=100_000)  # (the model runner's)
    assert sgl.RequestAborted is results.RequestAborted and sgl.QueueFull is results.QueueFull
    assert {"RequestAborted", "QueueFull"} <= set(sgl.__all__)


# ---- run() keywords --------------------------------------------------------------------
def test_a_program_parameter_named_like_a_sampling_option_is_the_programs(engine):
    @sgl.function
    def summarize(s, text, max_tokens=64):
        s += "Summarize: " + text + "\n" + sgl.gen("summary", max_tokens=max_tokens, **GREEDY)

    @sgl.function
    def required(s, text, max_tokens):
        s += text + sgl.gen("summary", max_tokens=max_tokens, **GREEDY)

    @sgl.function
    def plain(s, text):
        s += text + sgl.gen("summary", **GREEDY)

    def tokens(state):
        return state.get_meta_info("summary")["completion_tokens"]

    assert tokens(summarize.run(text="An article.", max_tokens=4, backend=engine)) == 4
    assert tokens(required.run(text="An article.", max_tokens=3, backend=engine)) == 3
    # not a parameter: still the default of every gen
    assert tokens(plain.run(text="An article.", max_tokens=5, backend=engine)) == 5


def test_run_batch_refuses_a_keyword_naming_a_program_parameter(engine):
    @sgl.function
    def summarize(s, text, max_tokens=64):
        s += text + sgl.gen("summary", max_tokens=max_tokens)

    with pytest.raises(TypeError, match=r"\['max_tokens'\].*give the program's arguments"):
        summarize.run_batch([{"text": "An article."}], max_tokens=4, backend=engine)
    with pytest.raises(TypeError, match=r"\['max_tokens'\]"):
        summarize.map([{"text": "An article."}], max_tokens=4, backend=engine)


def test_cli_set_binds_a_program_parameter_named_like_a_sampling_option():
    from lmprog.cli import _apply_settings

    @sgl.function
    def summarize(s, text, max_tokens=64):
        s += text + sgl.gen("summary", max_tokens=max_tokens)

    program, defaults = _apply_settings(summarize, ["max_tokens=4", "temperature=0"])
    assert program.bound == {"max_tokens": 4} and defaults == {"temperature": 0}


# ---- logprob entries -------------------------------------------------------------------
def _assert_entries(entries, tokenizer, with_text: bool) -> None:
    for entry in entries:
        assert len(entry) == 3, entry
        logprob, token, text = entry
        assert isinstance(token, int) and (logprob is None or logprob <= 0)
        want = tokenizer.decode([token], skip_special_tokens=False) if with_text else None
        assert text == want


@pytest.mark.parametrize("with_text", [False, True])
def test_engine_logprob_entries_are_sglang_triples(engine, hf_tiny, with_text):
    _, tokenizer = hf_tiny
    out = engine.generate(
        "The weather today is",
        {"max_new_tokens": 4, **GREEDY},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        return_text_in_logprobs=with_text,
    )
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["input_token_logprobs"][0][0] is None  # the first prompt token
    _assert_entries(meta["input_token_logprobs"], tokenizer, with_text)
    _assert_entries(meta["output_token_logprobs"], tokenizer, with_text)
    for tops in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]:
        assert len(tops) == 2
        _assert_entries(tops, tokenizer, with_text)


def test_gen_logprob_entries_carry_text_in_every_list(engine, hf_tiny):
    _, tokenizer = hf_tiny

    @sgl.function
    def prog(s):
        s += "Once upon a time" + sgl.gen(
            "a",
            max_tokens=3,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
            return_text_in_logprobs=True,
            **GREEDY,
        )
        s += sgl.gen("b", max_tokens=2, return_logprob=True, top_logprobs_num=1, **GREEDY)

    state = prog.run(backend=engine)
    meta = state.get_meta_info("a")
    for name in ("input_token_logprobs", "output_token_logprobs"):
        _assert_entries(meta[name], tokenizer, with_text=True)
    for tops in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]:
        _assert_entries(tops, tokenizer, with_text=True)
    # (SGLang's cot_decoding reads `entry[2]` of a top list)
    assert all(entry[2] is not None for entry in meta["output_top_logprobs"][0])
    other = state.get_meta_info("b")
    _assert_entries(other["output_token_logprobs"], tokenizer, with_text=False)
    _assert_entries(other["output_top_logprobs"][0], tokenizer, with_text=False)


def test_a_zero_token_gen_gives_the_next_tokens_alternatives_to_branch_on(engine, hf_tiny):
    """SGLang's CoT-decoding example: a `max_tokens=0` gen with `top_logprobs_num=k` reads
    the next token's k alternatives from `output_top_logprobs[0]`, and each fork continues
    from one of them. The alternatives are transformers' top k after the prompt."""
    import torch

    model, tokenizer = hf_tiny
    question = "Question: What is two plus two?\nAnswer:"

    @sgl.function
    def cot_decoding(s, question, k):
        s += question
        step_0 = s.fork(1)[0]
        forks = s.fork(k)
        step_0 += sgl.gen(
            "get_top_k",
            max_tokens=0,
            return_logprob=True,
            top_logprobs_num=k,
            return_text_in_logprobs=True,
        )
        alternatives = step_0.get_meta_info("get_top_k")["output_top_logprobs"][0]
        for f, (_, _, text) in zip(forks, alternatives):
            f += text + sgl.gen("answer", max_tokens=3, **GREEDY)
        return alternatives, [f.text() for f in forks], [f["answer"] for f in forks]

    state = cot_decoding.run(question=question, k=3, backend=engine)
    alternatives, texts, answers = state.ret_value
    ids = tokenizer(question, return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = torch.log_softmax(model(ids).logits[0, -1], dim=-1).topk(3)
    assert [token for _, token, _ in alternatives] == ref.indices.tolist()
    assert [v for v, _, _ in alternatives] == pytest.approx(ref.values.tolist(), abs=1e-4)
    _assert_entries(alternatives, tokenizer, with_text=True)
    for (_, _, text), full, answer in zip(alternatives, texts, answers):
        assert answer and full == question + text + answer


def test_the_meta_info_of_a_generation_never_made_is_none(engine):
    """SGLang's `get_meta_info` of a name the program did not generate (a branch not
    taken) is None, read inside the body or after it; a variable read that way is still a
    KeyError, as there."""

    @sgl.function
    def maybe(s, detailed):
        s += "Q: Why?\nA:"
        if detailed:
            s += sgl.gen("details", max_tokens=2, **GREEDY)
        s += sgl.gen("short", max_tokens=2, **GREEDY)
        return s.get_meta_info("details")

    state = maybe.run(detailed=False, backend=engine)
    assert state.ret_value is None and state.get_meta_info("details") is None
    assert state.get_meta_info("short")["completion_tokens"] == 2
    with pytest.raises(KeyError, match="details"):
        state["details"]
    detailed = maybe.run(detailed=True, backend=engine)
    assert detailed.ret_value["completion_tokens"] == 2


# ---- run(stream=True) ------------------------------------------------------------------
def test_stream_returns_at_once_and_reads_wait_for_the_body(engine):
    release = threading.Event()
    body_done = threading.Event()

    @sgl.function
    def steps(s):
        s += "Q: one\nA:" + sgl.gen("x", max_tokens=4, **GREEDY)
        first = s["x"]  # control flow on a generated value, as agents do
        assert release.wait(timeout=60)
        s += "\nQ: two\nA:" + sgl.gen("y", max_tokens=4, **GREEDY)
        body_done.set()
        return first

    state = steps.run(stream=True, backend=engine)
    timer = threading.Timer(0.5, release.set)
    try:
        assert not body_done.is_set()
        # A variable the body has produced can be read while the body still waits...
        x = state["x"]
        assert not release.is_set() and not body_done.is_set()
        # ...and one it has not appended yet waits for it (it is no KeyError).
        timer.start()
        y = state["y"]
        assert release.is_set()
    finally:
        timer.cancel()
        release.set()
    assert state.ret_value == x  # waits for the body to return
    assert body_done.is_set()
    assert "".join(state.text_iter()) == state.text()
    assert state.text() == f"Q: one\nA:{x}\nQ: two\nA:{y}"
    assert state.error() is None


def test_stream_body_helper_threads_read_without_waiting_for_the_body(engine):
    """A helper thread of the body reads what has been appended so far (it must not wait
    for the body, which waits for it)."""
    from concurrent.futures import ThreadPoolExecutor

    @sgl.function
    def with_helper(s):
        s += "Hello" + sgl.gen("x", max_tokens=2, **GREEDY)
        pool = ThreadPoolExecutor(1)
        try:  # (a helper waiting for the body would time out here)
            seen = pool.submit(lambda: (s.text(), s["x"])).result(timeout=10)
        finally:
            pool.shutdown(wait=False)
        s += "!"
        return seen

    state = with_helper.run(stream=True, backend=engine)
    text, x = state.ret_value
    assert text == "Hello" + x and state.text() == text + "!"


@pytest.mark.parametrize("interrupt", ["SIGINT", "SIGUSR1"])
def test_ctrl_c_while_streaming_cancels_the_body(engine, interrupt):
    """SIGUSR1: a signal handler's exception (a script's own deadline) cancels the program
    as Ctrl-C does; only Ctrl-C did (the body's requests ran on, holding their slots).
    (Not SIGALRM: pytest-timeout's.)"""
    import signal

    def times_out(signum, frame):
        raise TimeoutError("the script's own deadline")

    error = {"SIGINT": KeyboardInterrupt, "SIGUSR1": TimeoutError}[interrupt]
    number = getattr(signal, interrupt)
    previous = signal.signal(signal.SIGUSR1, times_out)
    release = threading.Event()

    @sgl.function
    def waits(s):
        s += "Hello" + sgl.gen("x", max_tokens=2, **GREEDY)
        release.wait(timeout=60)
        s += sgl.gen("y", max_tokens=2, **GREEDY)
        return s["y"]  # the cancelled program's read raises

    state = waits.run(stream=True, backend=engine)
    # (a real SIGINT to the main thread, as Ctrl-C sends: it interrupts a blocked wait)
    main = threading.main_thread().ident
    timer = threading.Timer(0.3, signal.pthread_kill, (main, number))
    timer.start()
    try:
        with pytest.raises(error):
            for _ in state.text_iter():
                pass
    finally:
        timer.cancel()
        release.set()
        signal.signal(signal.SIGUSR1, previous)
    state._body.join(timeout=60)
    assert not state._body.is_alive()
    assert isinstance(state.error(), error)
    assert "y" not in state._stream.st.variables


def test_stream_body_error_is_kept_and_raised_at_the_end_of_the_text(engine):
    @sgl.function
    def broken(s):
        s += "Hello" + sgl.gen("x", max_tokens=2, **GREEDY)
        if s["x"] is not None:
            raise RuntimeError("the body failed")

    state = broken.run(stream=True, backend=engine)
    with pytest.raises(RuntimeError, match="the body failed"):
        "".join(state.text_iter())
    assert isinstance(state.error(), RuntimeError)
    assert state.ret_value is None


# ---- choices methods -------------------------------------------------------------------
# Per-token entries of three choices ("organ", "organism", a long word), SGLang's shape.
CHOICES = ["organ", "organism", "antidisestablishmentarianism"]
LONG = [-0.4, -0.25, -0.1, -0.01, -0.01, -0.01, -0.01, -0.01]
INPUT = [
    [(-0.1, 1, None)],
    [(-0.1, 1, None), (-0.3, 2, None)],
    [(lp, 3 + i, None) for i, lp in enumerate(LONG)],
]
UNCONDITIONAL = [
    [(None, 1, None)],
    [(None, 1, None), (-1.4, 2, None)],
    [(None, 3, None)] + [(lp, 4 + i, None) for i, lp in enumerate(LONG[1:])],
]


def _call(method, normalized):
    return method(
        choices=CHOICES,
        normalized_prompt_logprobs=normalized,
        input_token_logprobs=INPUT,
        output_token_logprobs=[[] for _ in CHOICES],
        unconditional_token_logprobs=UNCONDITIONAL,
    )


def test_builtin_methods_called_the_sglang_way():
    # token_length_normalized takes the normalized logprobs it is given
    assert _call(sgl.token_length_normalized, [-0.1, -0.2, -0.05]).decision == CHOICES[2]
    assert _call(sgl.token_length_normalized, [-0.1, -0.2, -0.5]).decision == CHOICES[0]
    # greedy: the first token ties organ with organism, the second goes to organ (padded
    # with its own mean, -0.1, against organism's -0.3)
    greedy = _call(sgl.greedy_token_selection, [-0.1, -0.2, -0.1])
    assert greedy.decision == "organ"
    assert greedy.meta_info["greedy_logprob_matrix"][1] == pytest.approx([-0.1, -0.3] + [-0.2] * 6)
    # unconditional: mean of (conditional - unconditional), a missing first one counting 0
    unconditional = _call(sgl.unconditional_likelihood_normalized, [-0.1, -0.2, -0.1])
    assert unconditional.decision == "organism"
    want = [-0.1, (-0.1 + (-0.3 + 1.4)) / 2, -0.4 / 8]
    assert unconditional.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx(
        want
    )


class LastChoice(ChoicesSamplingMethod):
    """Written against SGLang's interface: `__call__` returning a ChoicesDecision."""

    def __init__(self, decision=None):
        self.seen = {}
        self.decision = decision

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        self.seen = {
            "normalized": normalized_prompt_logprobs,
            "entries": input_token_logprobs,
            "unconditional": unconditional_token_logprobs,
        }
        return ChoicesDecision(self.decision or choices[-1], {"custom": True})


def test_a_method_written_for_sglang_decides_the_select(engine):
    method = LastChoice()

    @sgl.function
    def prog(s):
        s += "Pick one: " + sgl.select("x", choices=["red", "green", "blue"], choices_method=method)

    state = prog.run(backend=engine)
    assert state["x"] == "blue" and state.error() is None
    meta = state.get_meta_info("x")
    assert meta["custom"] is True and meta["choice"] == "blue" and meta["method"] == "LastChoice"
    # it saw SGLang's arguments: triples, and the means of their logprobs
    entries = method.seen["entries"]
    assert all(len(e) == 3 for choice in entries for e in choice)
    assert method.seen["normalized"] == pytest.approx(
        [sum(e[0] for e in choice) / len(choice) for choice in entries]
    )
    assert method.seen["unconditional"] is None


def test_a_method_deciding_no_choice_fails_its_program_clearly(engine):
    @sgl.function
    def prog(s):
        s += "Pick: " + sgl.select("x", choices=["a", "b"], choices_method=LastChoice("c"))

    with pytest.raises(ValueError, match="LastChoice decided 'c', not one of its choices"):
        prog.run(backend=engine)


def test_select_meta_keeps_sglangs_unconditional_entries(engine):
    @sgl.function
    def prog(s):
        s += "The sky is " + sgl.select(
            "x", choices=["blue", "green"], choices_method=sgl.unconditional_likelihood_normalized
        )

    meta = prog.run(backend=engine).get_meta_info("x")
    entries = meta["unconditional_token_logprobs"]
    # As SGLang's: the choice's tokens alone, the first without a logprob (None; 0 in floats).
    assert all(choice[0][0] is None for choice in entries)
    floats = [[0.0, *(e[0] for e in choice[1:])] for choice in entries]
    assert floats == meta["unconditional_logprobs"]
    assert all(len(e) == 3 for choice in entries for e in choice)
    assert meta["normalized_unconditional_prompt_logprobs"] == meta["scores"]


def test_a_method_returning_no_decision_fails_clearly(engine):
    class BareString(LastChoice):
        def __call__(self, **kwargs):
            return kwargs["choices"][0]

    @sgl.function
    def prog(s):
        s += "Pick: " + sgl.select("x", choices=["a", "b"], choices_method=BareString())

    with pytest.raises(TypeError, match="returned str, not a ChoicesDecision"):
        prog.run(backend=engine)


def test_an_sglang_method_takes_temperature_zero():
    with pytest.raises(ValueError, match="takes temperature 0"):
        sgl.select("x", choices=["a", "b"], temperature=0.5, choices_method=LastChoice())


def test_a_method_implementing_nothing_is_refused_at_select():
    class Nothing(ChoicesSamplingMethod):
        pass

    with pytest.raises(TypeError, match="Nothing implements neither"):
        sgl.select("x", choices=["a", "b"], choices_method=Nothing())


# ---- smaller forms ---------------------------------------------------------------------
def test_role_method_form_equals_the_expression_form(engine):
    @sgl.function
    def methods(s):
        s.system("Be brief.")
        s.user("Hi")
        s.assistant("Hello" + sgl.gen("a", max_tokens=2, **GREEDY))

    @sgl.function
    def expressions(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hi")
        s += sgl.assistant("Hello" + sgl.gen("a", max_tokens=2, **GREEDY))

    got, want = methods.run(backend=engine), expressions.run(backend=engine)
    assert got.messages() == want.messages() and got.text() == want.text()
    assert [m["role"] for m in got.messages()] == ["system", "user", "assistant"]


def test_gen_int_takes_max_tokens_positionally(engine):
    @sgl.function
    def positional(s):
        s += "A number: " + sgl.gen_int("n", 2) + " and " + sgl.gen_int("m", 3)

    @sgl.function
    def keywords(s):
        s += "A number: " + sgl.gen_int("n", max_tokens=2) + " and "
        s += sgl.gen_int("m", max_tokens=3)

    @sgl.function
    def unbounded(s):
        s += "A number: " + sgl.gen_int("n")

    got, want = (p.run(backend=engine, **GREEDY) for p in (positional, keywords))
    assert got.text() == want.text()
    for name, limit in (("n", 2), ("m", 3)):
        meta = got.get_meta_info(name)
        healed = 1 if "token_healing" in meta else 0  # (its token comes on top: after a space)
        assert meta["completion_tokens"] == want.get_meta_info(name)["completion_tokens"]
        assert meta["completion_tokens"] <= limit + healed
    # (the bound matters: without it, ended by EOS only, this model writes a longer number)
    state = unbounded.run(backend=engine, end_outside_pattern=False, **GREEDY)
    assert state.get_meta_info("n")["completion_tokens"] > 2


def test_str_of_a_state_is_sglangs(engine):
    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("x", max_tokens=2, **GREEDY)

    state = prog.run(backend=engine)
    assert str(state)[len("ProgramState(") : -1] == state.text()


def test_an_invalid_regex_names_its_reason():
    @sgl.function
    def prog(s):
        s += sgl.gen("a", regex="(")

    with pytest.raises(ValueError, match=r"invalid regex '\(': \S"):
        prog.trace()


def test_flush_cache_drops_the_default_backends_prefixes(engine):
    @sgl.function
    def prog(s):
        s += "A prompt long enough to be cached by the radix tree. " * 4
        s += sgl.gen("x", max_tokens=2, **GREEDY)

    previous = lmprog.backend._default_backend
    sgl.set_default_backend(engine)
    try:
        prog.run()
        assert prog.run().get_meta_info("x")["cached_tokens"] > 0
        assert sgl.flush_cache() is True
        assert prog.run().get_meta_info("x")["cached_tokens"] == 0
    finally:
        lmprog.backend._default_backend = previous


def test_tuples_work_where_sglang_takes_them(engine):
    """`forks += (a, b)` (one per branch) and `stop=(...)` (SGLang's own default is `()`):
    both were TypeErrors."""

    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks += ("A:", "B:")
        forks += sgl.gen("x", max_tokens=4, stop=("\n",), **GREEDY)
        forks.join()

    state = prog.run(backend=engine, stop=())
    assert state.error() is None and len(state["x"]) == 2
    alone = engine.generate("A:", {"max_new_tokens": 4, "stop": ["\n"], **GREEDY})
    assert state["x"][0] == alone["text"]
