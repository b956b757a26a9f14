"""Host-to-device copies that never wait for the device.

A plain copy from pageable host memory to a GPU returns only once everything queued on
the stream before it has run: on the forward worker's stream, a draw's first small copy
would wait for the whole forward. From pinned memory, with `non_blocking`, the copy is
queued like a kernel (the pinned block is not reused before it has run).
"""

from __future__ import annotations

import array
import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
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
    # Staged through a block of torch's pinned-memory cache (the copy records its use, so the
    # block is not handed out again before the copy has run). Not `host.pin_memory()`: that
    # first asks the driver whether `host` is pinned already (~20 us a call on an H200 host).
    staging = torch.empty(host.shape, dtype=host.dtype, device="cpu", pin_memory=True)
    staging.copy_(host)
    return staging.to(device, non_blocking=True)


def host_ints(values: Sequence[int]) -> torch.Tensor:
    """`values` as an int64 CPU tensor. Through the buffer protocol: a third of
    `torch.tensor`'s time for a list (1.7 against 6 us for 64 ints), which the loop pays
    several times a step.

    Example:
        >>> host_ints([3, -1, 2]).tolist()
        [3, -1, 2]
    """
    if len(values) == 0:
        return torch.empty(0, dtype=torch.int64, device="cpu")
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def host_slots(slots: torch.Tensor | np.ndarray) -> np.ndarray:
    """KV-slot indices (a CPU tensor or a numpy array) as an int64 numpy array, without a
    copy where they are one already (a tensor's memory is shared): the host's bookkeeping
    reads and writes a few slots at a time, where a torch op costs 2-4 us and numpy's
    0.1-0.3.

    Example:
        >>> host_slots(torch.tensor([4, 5])).tolist()
        [4, 5]
    """
    if isinstance(slots, np.ndarray):
        return slots if slots.dtype == np.int64 else slots.astype(np.int64)
    if slots.device.type != "cpu":
        raise ValueError(f"KV-slot indices are kept on the host, got a {slots.device} tensor")
    return slots.to(torch.int64).numpy()


def index_tensor(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """`values` as an int64 tensor on `device` (see `to_device`)."""
    return to_device(host_ints(values), device)


def to_host_async(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`tensor` copied to the host without waiting: on CUDA the copy (into pinned memory)
    is queued on the current stream and an event recorded after it; read the copy once
    the event has passed. Elsewhere a copy made now, and no event: either way the copy
    holds `tensor` as it is now, whatever writes it later (a decode graph's next run
    overwrites its outputs).

    Example:
        >>> to_host_async(torch.tensor([1, 2]))
        (tensor([1, 2]), None)
    """
    if tensor.device.type != "cuda":
        return tensor.to("cpu", copy=True), None
    host = tensor.to("cpu", non_blocking=True)  # pinned: the copy is queued, not waited for
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensor.device))  # the stream the copy is on
    return host, ready


def require_device(device: torch.device) -> None:
    """A ValueError naming `device` when this machine cannot run on it: CUDA asked for where
    torch has none (a CPU build, or no GPU visible), or an index past its GPUs. (An engine
    checks before it loads the tokenizer and the model; torch's own errors come later, and
    read as a failure of the runtime's.)

    Example:
        >>> require_device(torch.device("cpu"))
    """
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) is built without CUDA"
            if torch.version.cuda is None
            else "torch sees no CUDA device"
        )
        raise ValueError(f"device={str(device)!r}, but {why}; use device='cpu'")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"device={str(device)!r}, but this machine has {count} CUDA device(s)")


# The current CUDA device is per thread, and Triton launches, default-stream events and
# graph captures use it: every thread that queues work for an engine on `cuda:N` makes
# that device current first (a no-op elsewhere).


def device_with_index(device: torch.device) -> torch.device:
    """`cuda` as `cuda:N`, N the calling thread's current device (what "cuda" means there);
    other devices as they are. An engine's threads then all use the device it was made on
    (`torch.cuda.set_device` takes no device without an index)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (for a thread of the engine's own:
    the loop, the forward worker)."""
    if device.type == "cuda":
        torch.cuda.set_device(device_with_index(device))


@contextlib.contextmanager
def device_scope(device: torch.device) -> Iterator[None]:
    """`device` current for the block, the caller's current device restored after (for the
    engine's set-up on the caller's thread).

    Example:
        >>> with device_scope(torch.device("cpu")):
        ...     pass
    """
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield
