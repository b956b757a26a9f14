"""The memory plan's checks and pool size with no model, on both of its branches: host
memory (a CPU engine) and a GPU's free memory, the CUDA calls replaced by fakes so that
the CUDA branch, never run on a GPU yet, is checked here. The references are independent of
the plan's arithmetic: the request table is the size of what `ReqToTokenPool` allocates
(its host table; a GPU holds another), the pool `max_total_tokens` slots of
`bytes_per_token` each, and the pool sizes hand-computed cases. (`tests/runtime/test_errors.py`
checks the CPU branch through a whole engine.)"""

from __future__ import annotations

import pytest
import torch

from lmprog_runtime import memory_plan
from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.kvcache import ReqToTokenPool
from lmprog_runtime.memory_plan import DEFAULT_CPU_MAX_TOTAL_TOKENS, check_memory, num_kv_slots

GIB = 1 << 30
CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture
def gpu(monkeypatch):
    """A fake GPU: `free` bytes free to the driver, `reserved` held by torch's caching
    allocator of which `allocated` are in use (set them on the returned dict)."""
    state = {"free": 10 * GIB, "reserved": 0, "allocated": 0, "host": 64 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (state["free"], 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: state["allocated"])
    monkeypatch.setattr(memory_plan, "read_available_host_memory", lambda: state["host"])
    return state


def table_bytes(config: RuntimeConfig, context_len: int) -> int:
    """The bytes of the request table an engine with `config` allocates (on the host)."""
    pool = ReqToTokenPool(config.max_running_requests, context_len, "cpu")
    return pool.host_table.nbytes


def test_a_gpu_pool_counts_the_caching_allocators_unused_memory_as_free(gpu):
    """Free on the GPU is the driver's free memory plus what torch's allocator reserved and
    does not use (an engine built after another in the same process reuses it)."""
    per_token, context_len = 1024, 2048
    gpu.update(free=2 * GIB, reserved=3 * GIB, allocated=1 * GIB)  # 4 GiB free in all
    base = RuntimeConfig(device="cuda", max_running_requests=8)
    room = 4 * GIB - table_bytes(base, context_len)
    fits = RuntimeConfig(device="cuda", max_running_requests=8, max_total_tokens=room // per_token)
    check_memory(fits, CUDA, context_len, per_token)
    over = RuntimeConfig(
        device="cuda", max_running_requests=8, max_total_tokens=room // per_token + 1
    )
    with pytest.raises(ValueError, match=r"max_total_tokens=\d+ needs .* free on the GPU"):
        check_memory(over, CUDA, context_len, per_token)


def test_a_gpu_table_is_checked_against_the_smaller_of_host_and_gpu_memory(gpu):
    """On a GPU the request table is kept on both sides: it must fit in each."""
    context_len = 4096
    config = RuntimeConfig(device="cuda", max_running_requests=1023)  # a table of 32 MiB
    table = table_bytes(config, context_len)
    gpu.update(free=table, host=table)
    check_memory(config, CUDA, context_len, 1024)
    gpu.update(free=table - 1, host=64 * GIB)
    with pytest.raises(ValueError, match="max_running_requests=1023 rows of context_len 4096"):
        check_memory(config, CUDA, context_len, 1024)
    gpu.update(free=64 * GIB, host=table - 1)
    with pytest.raises(ValueError, match="max_running_requests=1023 rows"):
        check_memory(config, CUDA, context_len, 1024)


def test_without_a_host_reading_a_gpu_is_checked_alone(gpu):
    gpu.update(host=None, free=GIB)
    config = RuntimeConfig(device="cuda", max_running_requests=4, max_total_tokens=2**21)
    with pytest.raises(ValueError, match="free on the GPU"):
        check_memory(config, CUDA, 1024, 1024)  # 2 GiB of pool in 1 GiB
    check_memory(RuntimeConfig(device="cuda", max_running_requests=4), CUDA, 1024, 1024)
    wide = RuntimeConfig(device="cuda", max_running_requests=255)
    gpu.update(free=table_bytes(wide, 4096) - 1)  # (the host unknown: the GPU's side alone)
    with pytest.raises(ValueError, match="max_running_requests=255 rows"):
        check_memory(wide, CUDA, 4096, 1024)


@pytest.mark.parametrize(
    "free, fraction, per_token, expected",
    [
        (10 * GIB, 0.5, 1 << 20, 5120),  # 5 GiB of 1 MiB slots
        (80 * GIB, 0.3, 23040, 1118481),  # SmolLM2-135M: 30 layers x 3 KV heads x 64 x K, V x 2 B
        (GIB, 0.1, 1 << 20, 102),  # 107.4 MB: 102 whole slots
        (GIB, 0.01, 1 << 30, 16),  # none: at least 16
    ],
)
def test_a_gpu_pool_is_its_share_of_the_drivers_free_memory(
    gpu, free, fraction, per_token, expected
):
    """Without max_total_tokens the pool is `mem_fraction` of the driver's free memory, at
    least 16 slots. The caching allocator's unused reserve is not counted here (the check
    counts it as free; the pool is sized from what the driver has)."""
    gpu.update(free=free, reserved=5 * GIB, allocated=GIB)
    config = RuntimeConfig(device="cuda", mem_fraction=fraction)
    assert num_kv_slots(config, CUDA, per_token) == expected
    assert num_kv_slots(RuntimeConfig(device="cuda", max_total_tokens=64), CUDA, per_token) == 64


def test_a_cpu_pool_is_its_share_of_host_memory_up_to_the_cap(monkeypatch):
    monkeypatch.setattr(memory_plan, "read_available_host_memory", lambda: 64 * GIB)
    config = RuntimeConfig(mem_fraction=0.5)
    assert num_kv_slots(config, CPU, 1024) == DEFAULT_CPU_MAX_TOTAL_TOKENS
    assert num_kv_slots(config, CPU, 4 * GIB) == 16  # (8 slots' worth: at least 16)
    monkeypatch.setattr(memory_plan, "read_available_host_memory", lambda: None)  # 8 GiB then
    assert num_kv_slots(config, CPU, 256 * 1024) == (4 * GIB) // (256 * 1024)


def test_a_cpu_pool_shares_host_memory_with_the_table(monkeypatch):
    monkeypatch.setattr(memory_plan, "read_available_host_memory", lambda: GIB)
    base = RuntimeConfig(max_running_requests=15)
    room = GIB - table_bytes(base, 1024)
    check_memory(RuntimeConfig(max_running_requests=15, max_total_tokens=room), CPU, 1024, 1)
    over = RuntimeConfig(max_running_requests=15, max_total_tokens=room + 1)
    with pytest.raises(ValueError, match="free in host memory beside the request table"):
        check_memory(over, CPU, 1024, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_per_token_is_what_the_pool_holds_per_slot(dtype):
    """(the plan sizes the pool by it: a K/V pool twice what fits went unnoticed while
    the checks here fed it its own output)"""
    from lmprog_runtime.kvcache.kv_pool import KVPool

    layers, heads, dim, slots = 3, 2, 8, 10
    pool = KVPool(slots, layers, heads, dim, dtype, "cpu")
    held = sum(buffer.nbytes for buffer in pool.k_buffers + pool.v_buffers)
    assert held == (slots + 1) * KVPool.bytes_per_token(layers, heads, dim, dtype)
