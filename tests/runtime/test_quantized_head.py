"""The LM head a quantization leaves returns float32 logits whatever the activations'
dtype (module docstring of models/quantization.py: "logits decide the tokens"). The layer
test checks a hand-built Q8Linear(float_output=True); nothing checks that
`quantize_linears` builds the model's head that way."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import TINY_ARCH_CONFIG, random_hf_model  # noqa: E402

from lmprog_runtime.models import load_model  # noqa: E402
from lmprog_runtime.models.quantization import quantize_linears  # noqa: E402


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8_int8"])
def test_the_quantized_head_gives_float32_logits_of_bfloat16_rows(tmp_path, method):
    hf = random_hf_model("llama", **TINY_ARCH_CONFIG)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(str(tmp_path), torch.bfloat16, "cpu")
    quantize_linears(model, method)
    head = model.lm_head
    assert head.float_output
    for rows in (1, 3, 40):  # the kernel's rows and the dense path's
        x = torch.randn(rows, head.in_features).bfloat16()
        with torch.no_grad():
            out = head(x)
            ref = head(x.float())  # the same layer on the same values in float32
        assert out.dtype == torch.float32
        # (a bfloat16 kernel rounds the dequantized weights to bfloat16: 2^-9 relative)
        assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-2
