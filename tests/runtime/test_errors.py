"""Bad input gets a clear, early ValueError / TypeError, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lmprog_runtime import Engine
from lmprog_runtime.sampling_params import FLOAT_PARAMS

OK = {"max_new_tokens": 3, "temperature": 0}
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": []}, "empty"),
        ({"input_ids": []}, "empty"),
        ({"prompt": "x" * 20000}, "longer than the context"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"prompt": "hi", "sampling_params": {"min_p": 2.0}}, "min_p"),
        # Non-finite numbers: nan passes every range comparison and would fail in the sampler.
        *[
            ({"prompt": "hi", "sampling_params": {name: value}}, f"{name} must be a finite")
            for name in FLOAT_PARAMS
            for value in (NAN, INF, -INF)
        ],
        ({"prompt": "hi", "sampling_params": {"temperature": 10**400}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"max_tokens": 5}}, "unknown sampling parameter"),
        (
            {"prompt": "hi", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}},
            "min_new_tokens",
        ),
        ({"prompt": "hi", "sampling_params": {"stop": [""]}}, "stop"),
        # (once: accepted, and never matched)
        ({"prompt": "hi", "sampling_params": {"stop_token_ids": [-1]}}, "stop_token_ids"),
        ({"prompt": "hi", "sampling_params": {"stop_token_ids": [1, 10**9]}}, "stop_token_ids"),
        ({"prompt": ["a", "b"], "sampling_params": [OK]}, "sampling_params has 1 entries"),
        ({"input_ids": [1, 2, 10**6]}, "outside"),
        ({"input_ids": [[1, 2], [3, -1]]}, "outside"),
        ({"prompt": "hi", "input_ids": [1]}, "exactly one"),
        ({"prompt": "hi", "logprob_start_len": -2}, "logprob_start_len"),
        # (as SGLang refuses it; it returned no prompt logprobs, saying nothing)
        (
            {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3},
            r"logprob_start_len \(3\) must be below the prompt's 3 tokens",
        ),
    ],
)
def test_bad_input_is_a_value_error_and_the_engine_keeps_serving(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    assert len(engine.generate("still serving", OK)["output_ids"]) == 3


def test_none_stands_for_the_default_of_the_logprob_arguments(engine):
    """As in SGLang's GenerateReqInput, None (for all prompts, or one entry) is the default:
    no logprobs, none of the prompt's, no alternatives."""
    params = {"max_new_tokens": 3, "temperature": 0}
    want = engine.generate(["a b", "c d"], params, return_logprob=True)
    got = engine.generate(
        ["a b", "c d"],
        params,
        return_logprob=[True, True],
        logprob_start_len=None,
        top_logprobs_num=[None, 0],
    )
    for mine, theirs in zip(got, want):
        assert mine["meta_info"].keys() == theirs["meta_info"].keys()
        # The prompt's: none asked for, but the key is there, as in SGLang (it was missing).
        assert mine["meta_info"]["input_token_logprobs"] == []
        pairs = mine["meta_info"]["output_token_logprobs"]
        reference = theirs["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in pairs] == [t for _, t, _ in reference] == mine["output_ids"]
        assert [v for v, *_ in pairs] == pytest.approx([v for v, *_ in reference], abs=1e-5)
    plain = engine.generate("a b", params, return_logprob=None)
    assert "output_token_logprobs" not in plain["meta_info"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt": 3},
        {"prompt": "hi", "sampling_params": {"max_new_tokens": 2.5}},
        {"prompt": "hi", "sampling_params": "greedy"},
        {"input_ids": ["a"]},
        {"input_ids": [1, True]},  # (a bool is an int to Python, never a token)
        {"input_ids": [[1, 2], [3, 2.0]]},
        {"prompt": ["a", "b"], "return_logprob": "yes"},
        {"prompt": ["a", "b"], "top_logprobs_num": [1, "2"]},
        {"prompt": ["a", "b"], "sampling_params": [OK, "greedy"]},
    ],
)
def test_wrong_types_are_type_errors(engine, kwargs):
    with pytest.raises(TypeError):
        engine.generate(**kwargs)


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"temperature": NAN}, {"top_p": NAN}])
def test_a_bad_request_in_a_list_fails_before_any_is_sent(engine, bad):
    engine.reset_stats()
    with pytest.raises(ValueError, match=next(iter(bad))):
        engine.generate(["a", "b"], [OK, bad])
    assert engine.stats()["forward_passes"] == 0


def test_the_context_cuts_max_new_tokens_and_refuses_min_new_tokens_past_it(engine):
    """max_new_tokens is cut to what the context leaves after the prompt; a min_new_tokens
    that cannot fit is refused (once: silently not met)."""
    ids = [5] * (engine.context_len - 4)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 10, "temperature": 0})
    assert len(out["output_ids"]) <= 4
    if len(out["output_ids"]) == 4:
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    params = {"max_new_tokens": 10, "min_new_tokens": 4, "ignore_eos": True}
    assert len(engine.generate(input_ids=ids, sampling_params=params)["output_ids"]) == 4
    with pytest.raises(ValueError, match="min_new_tokens = 5 after a prompt of"):
        engine.generate(input_ids=ids, sampling_params={**params, "min_new_tokens": 5})
    assert len(engine.generate("still serving", OK)["output_ids"]) == 3


def test_missing_model_path():
    """A path that is nothing loadable is a ValueError that names it."""
    with pytest.raises(ValueError, match="/nonexistent/model.*(does not exist|not a local path)"):
        Engine("/nonexistent/model")


def test_unsupported_architecture_names_the_supported_ones(tiny_path, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM|Qwen3ForCausalLM"):
        Engine(str(bad))


def test_bad_runtime_config(tiny_path):
    with pytest.raises(ValueError, match="attention_backend"):
        Engine(tiny_path, attention_backend="cuda-magic")
    with pytest.raises(TypeError, match="unknown Engine argument"):
        Engine(tiny_path, max_batch=3)
    for name in ("schedule_conservativeness", "grammar_compile_timeout_s", "mem_fraction"):
        with pytest.raises(ValueError, match=name):
            Engine(tiny_path, **{name: float("nan")})


def test_request_larger_than_the_pool_is_refused(tiny_path):
    with Engine(tiny_path, max_total_tokens=64) as small:
        with pytest.raises(ValueError, match="more than the pool's 64; raise max_total_tokens"):
            small.generate("hello " * 40, {"max_new_tokens": 40})
        assert len(small.generate("hello", OK)["output_ids"]) == 3
    # In pages, the slots the request takes are said (it said 13 "exceeds" a pool of 16).
    with Engine(tiny_path, max_total_tokens=16, page_size=4) as paged:
        prompt = list(range(10, 22))  # 12 tokens
        with pytest.raises(ValueError, match="= 13 tokens take 20 KV slots in pages of 4"):
            paged.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})


def test_shutdown_fails_new_requests(tiny_path):
    engine = Engine(tiny_path, max_total_tokens=256)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("hi", OK)


@pytest.mark.parametrize(
    "device, error, message",
    [
        ("mps", ValueError, "device must be 'cpu', 'cuda' or 'cuda:N'.*'mps'"),
        ("meta", ValueError, "device must be 'cpu', 'cuda' or 'cuda:N'.*'meta'"),
        ("cuda:", ValueError, "device must be"),
        ("CPU", ValueError, "device must be"),
        (0, TypeError, "device must be a string"),
    ],
)
def test_a_device_the_runtime_does_not_run_on_is_refused(tiny_path, device, error, message):
    with pytest.raises(error, match=message):
        Engine(tiny_path, device=device)


def test_cuda_where_torch_has_none_is_refused_before_anything_loads(tiny_path, monkeypatch):
    """Not torch's error from deep inside the model's set-up (a TypeError comparing None
    with an int was what a CPU-only torch gave), but one naming the device, before the
    tokenizer or the model is read."""
    import lmprog_runtime.engine as engine_module

    loaded = []
    monkeypatch.setattr(engine_module, "ModelRunner", lambda *args: loaded.append(args))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"device='{device}', but (this torch|torch sees)"):
            Engine(tiny_path, device=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="device='cuda:1', but this machine has 1 CUDA device"):
        Engine(tiny_path, device="cuda:1")
    assert loaded == []


def test_a_torch_device_is_taken_as_its_name():
    from lmprog_runtime import RuntimeConfig

    assert RuntimeConfig(device=torch.device("cuda", 1)).device == "cuda:1"
    assert RuntimeConfig(device=torch.device("cpu")).is_overlapped is False
    assert RuntimeConfig(device=torch.device("cpu", 0)).device == "cpu"  # (its name "cpu:0")
    assert RuntimeConfig(device="cpu:0", quantization="int8").device == "cpu"


def test_a_pool_or_table_larger_than_memory_is_refused_by_the_setting_that_asks(
    tiny_path, monkeypatch
):
    """Not torch's allocator error from inside the set-up: the setting, what it needs and
    what is free (host memory here, a GPU's free memory on CUDA)."""
    from lmprog_runtime import memory_plan

    monkeypatch.setattr(memory_plan, "read_available_host_memory", lambda: 1 << 30)  # 1 GiB
    with pytest.raises(ValueError, match=r"max_total_tokens=100000000 needs [0-9.]+ GiB"):
        Engine(tiny_path, max_total_tokens=100_000_000)
    with pytest.raises(ValueError, match="max_running_requests=1000000 rows of context_len"):
        Engine(tiny_path, max_running_requests=1_000_000, max_total_tokens=4096)
    with Engine(tiny_path, max_total_tokens=4096, max_running_requests=64) as fits:
        params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
        assert fits.generate("Hi", params)["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda e: e.generate("a\ud800b", {"max_new_tokens": 2}), "prompt"),
        (lambda e: e.generate(["ok", "x\udfff"], {"max_new_tokens": 2}), "prompt"),
        (lambda e: e.generate("ab", {"stop": ["\udc00"], "max_new_tokens": 2}), "stop string"),
    ],
)
def test_a_lone_surrogate_is_a_value_error_naming_where(engine, call, name):
    """No UTF-8 holds a lone surrogate (half an emoji from a mis-decoded file): the
    tokenizer's own error was a TypeError about its input types, and a stop string with
    one was taken and could never match."""
    with pytest.raises(ValueError, match=f"{name} holds a lone surrogate"):
        call(engine)


def test_an_engine_cannot_be_pickled_and_says_what_to_do(engine):
    """(once: "cannot pickle '_thread.RLock' object", naming none of it)"""
    import pickle

    with pytest.raises(TypeError, match="make one in each worker process"):
        pickle.dumps(engine)
