"""The KV pool on a CPU: zeros, in memory the OS maps as it is first written, so a pool
takes the memory of the tokens it has held (`torch.zeros` wrote every page: 3 GB of
resident memory for SmolLM2-135M's default pool, before any request). Reference: the
process's resident set, from /proc."""

from __future__ import annotations

import sys

import pytest
import torch

from lmprog_runtime.kvcache.kv_pool import KVPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _resident_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_a_pool_takes_the_memory_of_the_slots_written_not_its_size():
    before = _resident_mib()
    pool = KVPool(1 << 20, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                  device="cpu")  # fmt: skip
    size_mib = 4 * pool.k_buffers[0].numel() * 4 / 2**20  # 2 GiB: k and v, two layers
    assert _resident_mib() - before < size_mib / 20
    slots = torch.tensor([1, 7, 1 << 19])
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    pool.set_kv(1, slots, k, v)
    assert torch.equal(pool.k_buffers[1][slots], k) and torch.equal(pool.v_buffers[1][slots], v)
    assert not pool.k_buffers[0][:4096].any() and not pool.v_buffers[1][2:7].any()  # zeros
    assert pool.k_buffers[1].dtype == torch.float32 and pool.k_buffers[1].shape == (
        (1 << 20) + 1,
        2,
        64,
    )
    assert _resident_mib() - before < size_mib / 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8])
def test_each_dtype_reads_back_what_was_written(dtype):
    pool = KVPool(64, num_layers=1, num_kv_heads=1, head_dim=8, dtype=dtype, device="cpu")
    value = torch.arange(8).to(dtype).view(1, 1, 8)
    pool.set_kv(0, torch.tensor([5]), value, value)
    assert torch.equal(pool.k_buffers[0][5:6], value) and not pool.k_buffers[0][6:].any()
