"""W8A8 smoothing of the output projection's input: one scale per KV head's channel, from
the largest activation range over the query heads that share it (module docstring of
models/smoothing.py). The existing tests check only that smoothing leaves the float model
bit for bit, which any consistent choice of power-of-two scales does."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import TINY_ARCH_CONFIG, random_hf_model  # noqa: E402

from lmprog_runtime.models import load_model  # noqa: E402
from lmprog_runtime.models.smoothing import smooth_for_w8a8  # noqa: E402


def _pow2(raw):
    return torch.pow(2.0, torch.log2(raw).round().clamp(-16, 16))


def test_value_rows_scale_by_the_groups_largest_range(tmp_path):
    hf = random_hf_model("llama", **TINY_ARCH_CONFIG)  # 4 heads, 2 KV heads: groups of 2
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model(str(tmp_path), torch.float32, "cpu")
    attn = model.layers[0].self_attn
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    group = heads // kv_heads
    gen = torch.Generator().manual_seed(0)
    ranges = {}
    for i, layer in enumerate(model.layers):
        ranges[(i, "qkv_proj")] = torch.ones(layer.self_attn.qkv_proj.in_features)
        ranges[(i, "gate_up_proj")] = torch.ones(layer.mlp.gate_up_proj.in_features)
        ranges[(i, "down_proj")] = torch.ones(layer.mlp.down_proj.in_features)
        # the group's second query head has ranges 2^10 above its first
        o = torch.rand(heads, dim, generator=gen) + 0.5
        o.view(kv_heads, group, dim)[:, 1] *= 2.0**10
        ranges[(i, "o_proj")] = o.reshape(-1)
    o_w = attn.o_proj.weight.detach().clone()
    v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
    v_w = attn.qkv_proj.weight.detach()[v_rows].clone()
    smooth_for_w8a8(model, ranges)
    x = ranges[(0, "o_proj")].double().view(kv_heads, group, dim).amax(1).reshape(-1)
    w = o_w.abs().amax(0).double().view(kv_heads, group, dim).amax(1).reshape(-1)
    expected = _pow2(x.sqrt() / w.sqrt())
    got = v_w.double()[:, 0] / attn.qkv_proj.weight.detach()[v_rows].double()[:, 0]
    torch.testing.assert_close(got, expected)
