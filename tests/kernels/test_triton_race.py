"""The keyed race's Triton kernel (`triton_race.py`) against its torch ops
(`keyed_race.keyed_exponentials`): the same tokens, CPU tensors under `TRITON_INTERPRET=1`
(set by conftest.py), across block boundaries, with rows cut to a few tokens and rows
strided in a larger tensor. Likewise top-p's floor search (`keyed_race.nucleus_floors`):
the same floors, on probabilities whose sums are exact.
"""

from __future__ import annotations

import pytest
import torch

from lmprog_runtime import keyed_race
from lmprog_runtime.keyed_race import key_words, keyed_exponentials, race_key
from lmprog_runtime.triton_race import nucleus_floors, race


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


@pytest.mark.parametrize(("vocab", "block"), [(1, 16), (5, 16), (300, 64), (1000, 256)])
def test_the_floor_search_kernel_finds_the_torch_ops_floors(vocab, block):
    """Multiples of 1/4096 (every sum exact in float32, as in any order), many ties; rows
    strided; a row without mass; top_p of 1 (floor 0) and close to it."""
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randint(0, 40, (8, vocab + 3), generator=gen).float() / 4096
    probs = wide[:, :vocab]
    probs[5] = 0.0
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.999, 0.9, 1.0, 0.75])
    got = nucleus_floors(probs, top_p, block=block)
    want = keyed_race.nucleus_floors(probs, top_p)
    assert torch.equal(got, want)
    assert got[5] == 0.0  # (no mass)
    assert got[6] == 0.0
    kept = probs > got[:, None]
    assert bool(kept[[0, 1, 2, 3, 4, 7]].any(dim=-1).all())  # the most likely is kept


def test_the_floor_search_rejects_bad_shapes():
    assert nucleus_floors(torch.ones(0, 5), torch.ones(0)).shape == (0,)
    with pytest.raises(ValueError, match="top_p"):
        nucleus_floors(torch.ones(2, 5), torch.ones(3))
    with pytest.raises(ValueError, match="probs"):
        nucleus_floors(torch.ones(5, 2).t(), torch.ones(2))
