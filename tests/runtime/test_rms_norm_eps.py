"""rms_norm_eps reaches every RMSNorm. Every existing checkpoint test uses transformers'
default eps (1e-6), at which eps is invisible at 1e-4 logits tolerance: a parser that
ignores the config's value, or a norm that adds eps outside the square root, passed.
Here eps = 0.3, so it changes the logits by far more than the tolerance."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import TINY_ARCH_CONFIG, hf_greedy_ids, random_hf_model  # noqa: E402

import lmprog as lp  # noqa: E402
from lmprog_runtime.models import load_model  # noqa: E402
from lmprog_runtime.models.smoothing import forward_tokens  # noqa: E402

EPS = 0.3
IDS = [5, 17, 99, 3, 250, 42, 7, 11, 200, 31, 64, 128, 2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = random_hf_model("llama", **{**TINY_ARCH_CONFIG, "rms_norm_eps": EPS})
    path = tmp_path_factory.mktemp("eps")
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


def test_the_configs_rms_norm_eps_is_used_by_the_torch_ops(checkpoint):
    path, hf = checkpoint
    model = load_model(path, torch.float32, "cpu")
    assert model.config.rms_norm_eps == pytest.approx(EPS)
    ours = forward_tokens(model, IDS)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0, -1].float()
    # eps = 1e-6 instead of 0.3 moves these logits by ~1e-1 relative
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-4, rel


def test_native_engine_greedy_tokens_with_a_large_eps(checkpoint, tiny_path):
    path, hf = checkpoint
    tok = transformers.AutoTokenizer.from_pretrained(tiny_path)
    tok.save_pretrained(path)
    prompts = [IDS, IDS[:7]]
    hf.generation_config.eos_token_id = None  # (the engine ignores EOS here too)
    expected = hf_greedy_ids(hf, prompts, 8)
    with lp.Engine(path, dtype="float32", max_total_tokens=512, attention_backend="native") as e:
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        outs = e.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == expected
