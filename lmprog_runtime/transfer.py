"""Host-to-device copies that never wait for the device.

A plain copy from pageable host memory to a GPU returns only once everything queued on
the stream before it has run: on the forward worker's stream, a draw's first small copy
would wait for the whole forward. From pinned memory, with `non_blocking`, the copy is
queued like a kernel (the pinned block is not reused before it has run).
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, the copy queued on the current stream.

    Example:
        >>> to_device(torch.tensor([1, 2]), "cpu").tolist()
        [1, 2]
    """
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def index_tensor(values: list[int], device: torch.device | str) -> torch.Tensor:
    """`values` as an int64 tensor on `device` (see `to_device`)."""
    return to_device(torch.tensor(values, dtype=torch.int64, device="cpu"), device)
