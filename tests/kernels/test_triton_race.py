"""The keyed race's Triton kernel (`triton_race.py`) against its torch ops
(`keyed_race.keyed_exponentials`): the same tokens, CPU tensors under `TRITON_INTERPRET=1`
(set by conftest.py), across block boundaries, with rows cut to a few tokens and rows
strided in a larger tensor.
"""

from __future__ import annotations

import pytest
import torch

from lmprog_runtime.keyed_race import key_words, keyed_exponentials, race_key
from lmprog_runtime.triton_race import race


def _reference(probs: torch.Tensor, words: torch.Tensor) -> list[int]:
    return (probs / keyed_exponentials(words, probs.shape[-1])).argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("vocab", "block"), [(1, 16), (7, 16), (64, 64), (1000, 256), (3001, 1024)]
)
def test_the_kernel_draws_the_torch_ops_tokens(vocab, block):
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.softmax(2 * torch.randn(12, vocab + 5, generator=gen), dim=-1)
    probs = wide[:, :vocab]  # strided rows
    probs[4:8] = torch.where(
        probs[4:8] >= probs[4:8].max(-1, keepdim=True).values / 4, probs[4:8], 0
    )
    keys = [race_key(seed, draws) for seed, draws in zip(range(12), range(100, 112))]
    words = key_words(keys, "cpu")
    got = race(probs, words, block=block).tolist()
    assert got == _reference(probs, words)
    assert all(float(probs[i, t]) > 0 for i, t in enumerate(got))


def test_empty_batch_and_bad_inputs():
    assert race(torch.ones(0, 5), torch.zeros(0, 2, dtype=torch.int64)).shape == (0,)
    with pytest.raises(ValueError, match="words"):
        race(torch.ones(2, 5), torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="probs"):
        race(torch.ones(5, 2).t(), torch.zeros(2, 2, dtype=torch.int64))
