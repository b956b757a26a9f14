"""A catalogue of bad inputs across the public API (issue 14): each is a ValueError or
TypeError that names the parameter at fault, raised before anything runs, and the engine
serves the next request as if nothing happened."""

from __future__ import annotations

import pytest

import lmprog as lp
from lmprog_runtime import Engine

NAN, INF = float("nan"), float("inf")
TWELVE_OPTIONAL_INTS = {
    "type": "object",
    "properties": {f"n{i}": {"type": "integer"} for i in range(12)},
}


@lp.function
def _one_gen(s, topic):
    s += "About " + topic + ":" + lp.gen("out", max_tokens=4)


def _program_with(**gen_kwargs):
    @lp.function
    def program(s):
        s += "Say:" + lp.gen("x", **gen_kwargs)

    return program


GENERATE = [  # (kwargs of engine.generate, error type, text the message must contain)
    ({"prompt": None}, ValueError, "prompt"),
    ({"prompt": 3}, TypeError, "prompt"),
    ({"prompt": ""}, ValueError, "prompt"),
    ({"input_ids": [[]]}, ValueError, "empty"),
    ({"prompt": "x" * 20000}, ValueError, "context"),
    ({"prompt": "hi", "sampling_params": {"temperature": NAN}}, ValueError, "temperature"),
    ({"prompt": "hi", "sampling_params": {"top_p": INF}}, ValueError, "top_p"),
    ({"prompt": "hi", "sampling_params": {"max_new_tokens": "8"}}, TypeError, "max_new_tokens"),
    ({"prompt": "hi", "sampling_params": {"seed": 1.5}}, TypeError, "seed"),
    ({"prompt": "hi", "sampling_params": {"seed": 2**64}}, ValueError, "seed"),
    ({"prompt": "hi", "sampling_params": {"seed": -(2**63) - 1}}, ValueError, "seed"),
    ({"prompt": "hi", "sampling_params": {"timeout_s": -1}}, ValueError, "timeout_s"),
    ({"prompt": "hi", "sampling_params": {"regex": "("}}, ValueError, "regex"),
    ({"prompt": "hi", "sampling_params": {"json_schema": "{"}}, ValueError, "json_schema"),
    ({"prompt": "hi", "sampling_params": {"stop_regex": "["}}, ValueError, "stop_regex"),
    ({"prompt": "hi", "sampling_params": {"bogus": 1}}, ValueError, "bogus"),
    ({"prompt": "hi", "top_logprobs_num": -1}, ValueError, "top_logprobs_num"),
    ({"prompt": "hi", "stream": "yes"}, TypeError, "stream must be a bool"),  # (was True)
    ({"prompt": ["a", "b"], "group": "x"}, TypeError, "group must be a bool"),
    ({"prompt": "hi", "sampling_params": {"stop_token_ids": iter([1])}}, TypeError, "stop_token"),
    ({"prompt": "hi", "sampling_params": {"stop_regex": "a\ud800"}}, ValueError, "surrogate"),
    ({"prompt": "hi", "sampling_params": {"ignore_eos": "no"}}, TypeError, "ignore_eos"),
    (
        {"prompt": "hi", "sampling_params": {"skip_special_tokens": "no"}},
        TypeError,
        "skip_special_tokens",
    ),
]

GEN = [  # (kwargs of lp.gen, error type, message)
    ({"max_tokens": -1}, ValueError, "max_tokens"),
    ({"max_tokens": "4"}, TypeError, "max_tokens"),
    ({"temperature": NAN}, ValueError, "temperature"),
    ({"temperature": -1}, ValueError, "temperature"),
    ({"temperature": "0.5"}, TypeError, "temperature"),
    ({"top_p": 2.0}, ValueError, "top_p"),
    ({"top_k": 0}, ValueError, "top_k"),
    ({"stop": 3}, TypeError, "stop"),
    ({"regex": "(unclosed"}, ValueError, "regex"),
    ({"json_schema": "{not json"}, ValueError, "JSON schema"),
    ({"dtype": list}, ValueError, "dtype"),
    ({"name": 3}, TypeError, "name"),
    # One constraint a gen (the others were once dropped without a word).
    ({"regex": "[a-z]+", "json_schema": {"type": "integer"}}, ValueError, "at most one"),
    ({"regex": "[a-z]+", "dtype": int}, ValueError, "at most one"),
    ({"json_schema": {"type": "integer"}, "dtype": "int"}, ValueError, "at most one"),
    ({"choices": ["a", "b"], "regex": "a"}, ValueError, "at most one"),
    ({"regex": 123}, TypeError, "regex"),
    ({"json_schema": [1, 2]}, TypeError, "json_schema"),
    ({"ignore_eos": "no"}, TypeError, "ignore_eos"),  # ("no" once meant True)
    ({"return_logprob": 1}, TypeError, "return_logprob"),
    ({"top_logprobs_num": "5"}, TypeError, "top_logprobs_num"),
    # With choices the other arguments do not apply, but a bad one was dropped unchecked.
    ({"choices": ["a", "b"], "max_tokens": "bad"}, TypeError, "max_tokens"),
    # Refused when compiled, at submit: the message named neither the gen nor its variable.
    ({"regex": "a" * 60_000}, ValueError, "^gen 'x': regex is too large"),
    ({"json_schema": TWELVE_OPTIONAL_INTS}, ValueError, "^gen 'x': the json_schema expands"),
]

SELECT = [  # (kwargs of lp.select, error type, message)
    ({"name": "c", "choices": []}, ValueError, "choices"),
    ({"name": "c", "choices": "ab"}, TypeError, "choices"),
    ({"name": "c", "choices": ["a", "a"]}, ValueError, "duplicate"),
    # '' has no token to score: the prompt's last token's logprob stood in, and won.
    ({"name": "c", "choices": [" Paris", ""]}, ValueError, "non-empty strings"),
    ({"name": "c", "choices": ["a", "b"], "temperature": -1}, ValueError, "temperature"),
    ({"name": "c", "choices": ["a", "b"], "temperature": NAN}, ValueError, "temperature"),
    ({"name": "c", "choices": ["a", "b"], "temperature": INF}, ValueError, "temperature"),
    ({"name": "c", "choices": ["a", "b"], "temperature": "hot"}, TypeError, "temperature"),
    ({"name": "c", "choices": 3}, TypeError, "choices"),
    ({"name": "c", "choices": {"a": 1}}, TypeError, "choices"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), GENERATE)
def test_generate(engine, kwargs, error, message):
    with pytest.raises(error, match=message):
        engine.generate(**kwargs)
    assert len(engine.generate("still serving", {"max_new_tokens": 2})["output_ids"]) == 2


@pytest.mark.parametrize(("kwargs", "error", "message"), GEN)
def test_gen(engine, kwargs, error, message):
    with pytest.raises(error, match=message):
        _program_with(**kwargs).run(backend=engine)
    assert _one_gen.run(topic="cats", backend=engine)["out"] is not None


@pytest.mark.parametrize(("kwargs", "error", "message"), SELECT)
def test_select(kwargs, error, message):
    with pytest.raises(error, match=message):
        lp.select(**kwargs)


def test_select_takes_any_iterable_of_choices_and_temperature_none():
    chosen = lp.select("c", (c for c in ["a", "b"]), temperature=None)
    assert chosen.choices == ("a", "b") and chosen.temperature == 0.0


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda e: _one_gen.run(backend=e), TypeError, "topic"),
        (lambda e: _one_gen.run(topic="x", colour="red", backend=e), TypeError, "colour"),
        (lambda e: _one_gen.run(topic="x", temperature=NAN, backend=e), ValueError, "temperature"),
        (
            lambda e: _one_gen.run_batch([{"topic": "x"}], num_threads=0, backend=e),
            ValueError,
            "num_threads",
        ),
        (lambda e: _one_gen.run_batch(["x"], backend=e), TypeError, "run_batch"),
        (lambda e: _one_gen.run_batch([{"topic": "x"}], bogus=1, backend=e), TypeError, "bogus"),
        (lambda e: _one_gen.run(topic="x", backend="not an engine"), TypeError, "backend"),
        (lambda e: _one_gen.run(topic="x", stream="yes", backend=e), TypeError, "stream must"),
        (lambda e: _one_gen.run(topic="x", live="x", backend=e), TypeError, "live must be"),
        (
            lambda e: _one_gen.run_batch([{"topic": "x"}], progress_bar="no", backend=e),
            TypeError,
            "progress_bar must be a bool",
        ),
        (lambda e: _one_gen.run_batch(None, backend=e), TypeError, "run_batch takes a list"),
        # Request options were converted, not checked ("no" turned logprobs on, 2.7 was 2).
        (lambda e: _one_gen.run(topic="x", return_logprob="no", backend=e), TypeError, "return_"),
        (lambda e: _one_gen.run(topic="x", top_logprobs_num=2.7, backend=e), TypeError, "top_"),
        (
            lambda e: _one_gen.run_batch([{"topic": "x"}], max_new_tokens=-1, backend=e),
            ValueError,
            "max_new_tokens must be >= 0",
        ),
        (  # (named as given, not as gen's arguments)
            lambda e: _one_gen.run(topic="x", min_new_tokens=5, max_new_tokens=2, backend=e),
            ValueError,
            r"min_new_tokens \(5\) must be <= max_new_tokens \(2\)",
        ),
        # An iterator was used up by the check: nothing was left to stop on.
        (
            lambda e: _one_gen.run(topic="x", stop_token_ids=iter([1, 2]), backend=e),
            TypeError,
            "stop_token_ids",
        ),
    ],
)
def test_run_and_run_batch(engine, call, error, message):
    with pytest.raises(error, match=message):
        result = call(engine)
        if isinstance(result, list):  # a program's own error stays in its state
            result[0]._raise_error()
    assert _one_gen.run(topic="cats", backend=engine)["out"] is not None


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"model_path": "/no/such/model"}, (ValueError, FileNotFoundError), "no/such/model"),
        ({"max_total_tokens": 4}, ValueError, "max_total_tokens"),
        ({"max_running_requests": 0}, ValueError, "max_running_requests"),
        ({"mem_fraction": 1.5}, ValueError, "mem_fraction"),
        ({"dtype": "float8"}, ValueError, "dtype"),
        ({"attention_backend": "magic"}, ValueError, "attention_backend"),
        ({"schedule_policy": "random"}, ValueError, "schedule_policy"),
        ({"max_queued_requests": 0}, ValueError, "max_queued_requests"),
        ({"page_sise": 4}, TypeError, "page_sise"),
        # Wrong types once failed inside torch, or ("no") turned a flag on.
        ({"max_total_tokens": 1000.5}, TypeError, "max_total_tokens"),
        ({"max_running_requests": "8"}, TypeError, "max_running_requests"),
        ({"page_size": 2.0}, TypeError, "page_size"),
        ({"num_threads": 1.5}, TypeError, "num_threads"),
        ({"mem_fraction": "0.3"}, TypeError, "mem_fraction"),
        ({"disable_radix_cache": "no"}, TypeError, "disable_radix_cache"),
        # Accepted, then every request (or torch) failed on them.
        ({"model_path": 5}, TypeError, "model_path must be a model name or a path"),
        ({"grammar_compile_timeout_s": 1e12}, ValueError, "grammar_compile_timeout_s"),
        ({"grammar_cache_mib": -1}, ValueError, "grammar_cache_mib"),
        ({"grammar_cache_mib": 1.5}, TypeError, "grammar_cache_mib"),
        ({"schedule_conservativeness": 1e308}, ValueError, "schedule_conservativeness"),
        ({"num_threads": 10**30}, ValueError, "num_threads"),
    ],
)
def test_engine_arguments(tiny_path, kwargs, error, message):
    kwargs = {"model_path": tiny_path, **kwargs}
    with pytest.raises(error, match=message):
        Engine(**kwargs)


def test_a_fork_too_large_is_refused_and_a_second_join_too(engine):
    @lp.function
    def forks(s, size, joins):
        s += "Hello"
        branches = s.fork(size)
        branches += "[A]"
        for _ in range(joins):
            branches.join("concate_and_append")

    with pytest.raises(ValueError, match="fork size must be at most 4096"):
        forks.run(size=10**30, joins=1, backend=engine)  # (it never returned)
    with pytest.raises(RuntimeError, match="joined already"):  # (the text came twice)
        forks.run(size=2, joins=2, backend=engine)
    assert forks.run(size=2, joins=1, backend=engine).text() == "Hello[A][A]"


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [  # (the tokenizer's own errors named its arguments, -1 overflowed, 10**6 gave "")
        (lambda e: e.encode(None), TypeError, "text must be a str"),
        (lambda e: e.encode("a\ud800"), ValueError, "text holds a lone surrogate"),
        (lambda e: e.decode([5, -1]), ValueError, r"\[-1\] are outside the vocabulary"),
        (lambda e: e.decode([10**6]), ValueError, "outside the vocabulary"),
    ],
)
def test_encode_and_decode(engine, call, error, message):
    with pytest.raises(error, match=message):
        call(engine)
    assert engine.decode(engine.encode("still fine", add_special_tokens=False)) == "still fine"


def test_variable_names_must_be_strings(engine):
    @lp.function
    def named(s, how):
        if how == "set":
            s[5] = 1
        else:
            with s.var_scope(["x"]):
                s += "hi"

    with pytest.raises(TypeError, match="a variable name must be a str, got int"):
        named.run(how="set", backend=engine)
    with pytest.raises(TypeError, match="var_scope's name must be a str, got list"):
        named.run(how="scope", backend=engine)


def test_values_that_stay_accepted(engine):
    """The checks of run's defaults and of stop_token_ids keep what worked: a numpy
    integer as a default, a range of ids."""
    import numpy as np

    out = _one_gen.run(topic="x", temperature=np.float64(0), backend=engine)
    assert out["out"] == _one_gen.run(topic="x", temperature=0, backend=engine)["out"]
    assert _one_gen.run(topic="x", min_new_tokens=np.int64(1), backend=engine).error() is None
    reply = engine.generate("hi", {"max_new_tokens": 4, "stop_token_ids": range(1, 3)})
    assert len(reply["output_ids"]) <= 4
