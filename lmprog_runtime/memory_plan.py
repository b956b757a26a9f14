"""What the engine's memory will hold, decided before any of it is allocated: the dtype it
serves in, how many KV slots its pool gets, and a clear error naming the setting when a
setting asks for more memory than is free (not the allocator's error from deep inside the
set-up, nor a pool that fails only once it fills).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.models.cpu import cpu_has_native_bf16
from lmprog_runtime.models.loader import read_torch_dtype

# A CPU pool is sized by this cap unless max_total_tokens says otherwise: host memory is
# shared with everything else, and tests should not reserve gigabytes they never touch.
DEFAULT_CPU_MAX_TOTAL_TOKENS = 65536


def serving_dtype(config: RuntimeConfig, model_path: str) -> torch.dtype:
    """The dtype the model is loaded and served in: `config.dtype`, or for "auto" what the
    device serves the checkpoint's dtype (`model_path`'s config.json) best in.

    Example:
        >>> serving_dtype(RuntimeConfig(dtype="float32"), "unused")
        torch.float32
    """
    if config.dtype != "auto":
        return read_torch_dtype(config.dtype)
    raw = json.loads((Path(model_path) / "config.json").read_text())
    name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    device_type = torch.device(config.device).type
    if device_type == "cpu":
        # 16-bit weights compute in bfloat16 where the CPU does so natively; float32
        # checkpoints (the built-in test models) stay float32.
        is_16_bit = name in ("bfloat16", "float16")
        return torch.bfloat16 if is_16_bit and cpu_has_native_bf16() else torch.float32
    if device_type == "cuda":
        # Serving precision on GPUs, float32 checkpoints included (half the memory
        # traffic of decode, tensor cores); dtype="float32" keeps full precision.
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32 if name == "float32" else read_torch_dtype(name)


def check_memory(
    config: RuntimeConfig, device: torch.device, context_len: int, bytes_per_token: int
) -> None:
    """A ValueError naming the setting when the KV pool asked for (`max_total_tokens`, of
    `bytes_per_token` each) or the request table (`max_running_requests` rows of
    `context_len` slots, on the host and on the device) needs more memory than is
    available."""
    table = (config.max_running_requests + 1) * context_len * 8  # int64 slots
    host_free = read_available_host_memory()
    if device.type == "cuda":
        # (free to the driver, and what torch's caching allocator holds unused: an
        # engine built after another in the same process may reuse that)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        device_free = torch.cuda.mem_get_info(device)[0] + cached
    else:
        device_free = host_free  # (the table and the pool share it)
    # (on a GPU a table on each side; host memory unknown without /proc/meminfo)
    known = [free for free in (host_free, device_free) if free is not None]
    if known and table > min(known):
        raise ValueError(
            f"max_running_requests={config.max_running_requests} rows of context_len "
            f"{context_len} make a request table of {table / 2**30:.1f} GiB, more "
            f"than this machine has free; lower max_running_requests or context_len"
        )
    if config.max_total_tokens is None or device_free is None:
        return  # (sized from what is free; or nothing known to compare with)
    pool = config.max_total_tokens * bytes_per_token
    room = device_free - table
    if pool > room:
        where = "on the GPU" if device.type == "cuda" else "in host memory"
        raise ValueError(
            f"max_total_tokens={config.max_total_tokens} needs {pool / 2**30:.1f} GiB of "
            f"KV cache, more than the {max(0, room) / 2**30:.1f} GiB free {where} beside "
            f"the request table; lower it, or leave it None to size the pool by "
            f"mem_fraction"
        )


def num_kv_slots(config: RuntimeConfig, device: torch.device, bytes_per_token: int) -> int:
    """The KV pool's slots: `max_total_tokens`, else `mem_fraction` of the memory free on
    the device (on a CPU, of the available host memory, at most
    `DEFAULT_CPU_MAX_TOTAL_TOKENS`), at least 16."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(16, int(free * config.mem_fraction) // bytes_per_token)
    budget = int(available_host_memory() * config.mem_fraction) // bytes_per_token
    return max(16, min(budget, DEFAULT_CPU_MAX_TOTAL_TOKENS))


def available_host_memory() -> int:
    """The host memory available now (8 GiB where the system does not say)."""
    available = read_available_host_memory()
    return 8 << 30 if available is None else available


def read_available_host_memory() -> int | None:
    """`MemAvailable` of /proc/meminfo, in bytes; None without it (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
