"""float32 linear weights stored input-major on a CPU whose BLAS multiplies a few rows
faster so.

`nn.Linear` keeps its weight [out, in]: `F.linear` then hands BLAS the weight transposed.
For the few rows of a decode step, MKL's sgemm runs several times slower that way than on
the same values stored [in, out] (the layer's weight becomes a transposed view of such a
tensor: the same shape and values, other strides). On a 2-core Xeon (AVX-512, no native
bfloat16), SmolLM2-135M's layers at 8 rows: 1.5-6.5x faster per layer, at 32 rows
2.2-3.0x, at one row 1.0-1.4x, and prefills of 128-512 rows within 0.94-1.08x
(`benchmarks/bench_weight_layout.py`). Not every shape gains (there, SmolLM2's MLP
gate/up projection did not), and other BLAS builds differ: so at load a quick probe on
each distinct layer shape, with the layer's own weight, decides for the layers of that
shape, once per process, shape and thread count. The products are the same up to the
rounding of a different summation order, as between batch sizes.

A tied LM head (the embedding's weight) gets its own input-major copy: the embedding
reads rows, and must keep its layout. The copy costs the vocabulary's weights once more;
where that exceeds a quarter of the free memory the head stays tied.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PROBE_ROWS = 8  # a decode batch
PROBE_ROUNDS = 7
PROBE_MARGIN = 0.9  # input-major must take at most this share of the other's time
PROBE_MAX_OUT = 4096  # output rows a probe times at most (a vocabulary's head: a slice)
_probing = threading.Lock()  # one probe at a time (each sets torch's thread count)
_decisions: dict[tuple[int, int, int], bool] = {}  # (in, out, threads) -> input-major


def input_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] with the same values, stored [in, out] (a transposed view)."""
    return weight.detach().t().contiguous().t()


def input_major_is_faster(weight: torch.Tensor, free_bytes: int) -> bool:
    """Whether `F.linear` of `PROBE_ROWS` rows runs clearly faster on `weight` stored
    input-major, on this CPU at torch's thread count (remembered per shape and count).
    No when the probe's copy of the weight would exceed a quarter of `free_bytes`."""
    out_features, in_features = weight.shape
    key = (in_features, out_features, torch.get_num_threads())
    if key not in _decisions:
        probed = min(out_features, PROBE_MAX_OUT) * in_features * weight.element_size()
        if probed > free_bytes // 4:
            return False
        _decisions[key] = _probe(weight)
    return _decisions[key]


def _probe(weight: torch.Tensor) -> bool:
    """Input-major where it is clearly faster on one thread and not clearly slower on all
    of torch's. One thread first: on a loaded machine each multi-threaded product waits a
    scheduler tick for its other threads (8 ms for either layout on 2 busy cores, against
    0.03-1 ms alone), which hid the difference, and the probe's answer was a coin toss.
    A tall weight is timed on its first `PROBE_MAX_OUT` rows (SmolLM2's head took 2.5 s
    whole). Probes run one at a time: each sets torch's thread count, then restores it
    (a thread whose first torch call falls inside a probe keeps one thread)."""
    weight = weight.detach()[:PROBE_MAX_OUT]
    with _probing:
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            alone = time_ratio(weight)
        finally:
            torch.set_num_threads(threads)
        if alone >= PROBE_MARGIN:
            return False
        return threads == 1 or time_ratio(weight) <= 1 / PROBE_MARGIN


def time_ratio(weight: torch.Tensor) -> float:
    """The median time of `F.linear` of `PROBE_ROWS` rows on `weight` input-major over
    that on `weight` as it is; rounds alternate the layouts. The input comes from a
    generator of its own: torch's global random state is the user's."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, weight.shape[1], generator=generator)
    layouts = {"row": weight.detach(), "input": input_major(weight)}
    times: dict[str, list[float]] = {"row": [], "input": []}
    with torch.no_grad():
        for layout in layouts.values():
            F.linear(x, layout)  # (warm)
        for round_ in range(PROBE_ROUNDS):
            for name in ("row", "input") if round_ % 2 else ("input", "row"):
                start = time.perf_counter()
                for _ in range(3):
                    F.linear(x, layouts[name])
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["input"]) / statistics.median(times["row"])


def use_input_major_weights(model: nn.Module, free_bytes: int) -> int:
    """Store the model's float32 CPU `nn.Linear` weights input-major, in place, for each
    shape the probe says so of. Returns how many layers changed."""
    by_shape: dict[tuple[int, int], list[nn.Linear]] = {}
    for child in model.modules():
        if (
            type(child) is nn.Linear
            and child.weight.dtype == torch.float32
            and child.weight.device.type == "cpu"
        ):
            by_shape.setdefault(tuple(child.weight.shape), []).append(child)
    embed = getattr(model, "embed_tokens", None)
    changed = 0
    with torch.no_grad():
        for layers in by_shape.values():
            if not input_major_is_faster(layers[0].weight, free_bytes):
                continue
            for child in layers:
                weight = child.weight
                if embed is not None and weight is embed.weight:  # a tied head: its own copy
                    if weight.numel() * weight.element_size() > free_bytes // 4:
                        logger.info("the tied LM head stays tied (no memory for its own copy)")
                        continue
                    child.weight = nn.Parameter(input_major(weight), requires_grad=False)
                else:
                    weight.data = input_major(weight)
                changed += 1
    return changed
