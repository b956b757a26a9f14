"""float32 linear weights stored input-major on a CPU whose BLAS multiplies a few rows
faster so.

`nn.Linear` keeps its weight [out, in]: `F.linear` then hands BLAS the weight transposed.
For the few rows of a decode step, MKL's sgemm runs several times slower that way than on
the same values stored [in, out] (the layer's weight becomes a transposed view of such a
tensor: the same shape and values, other strides). On a 2-core Xeon (AVX-512, no native
bfloat16), SmolLM2-135M's layers at 8 rows: 1.5-6.5x faster per layer, at 32 rows
2.2-3.0x, at one row 1.0-1.4x, and prefills of 128-512 rows within 0.94-1.08x
(`benchmarks/bench_weight_layout.py`). Other BLAS builds may differ, so a quick probe on
the model's own largest layer shape decides at load, once per process and shape.

A tied LM head (the embedding's weight) gets its own input-major copy: the embedding
reads rows, and must keep its layout. The copy costs the vocabulary's weights once more;
where that exceeds a quarter of the free memory the head stays tied.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PROBE_ROWS = 8  # a decode batch
PROBE_ROUNDS = 5
PROBE_MARGIN = 0.9  # input-major must take at most this share of the other's time


def input_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] with the same values, stored [in, out] (a transposed view)."""
    return weight.detach().t().contiguous().t()


@functools.cache
def input_major_is_faster(in_features: int, out_features: int) -> bool:
    """Whether `F.linear` of `PROBE_ROWS` rows runs clearly faster on an input-major
    weight of this shape, on this CPU (rounds alternate the layouts; medians compared)."""
    weight = torch.randn(out_features, in_features)
    layouts = {"row": weight, "input": input_major(weight)}
    x = torch.randn(PROBE_ROWS, in_features)
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
    return statistics.median(times["input"]) < PROBE_MARGIN * statistics.median(times["row"])


def use_input_major_weights(model: nn.Module, free_bytes: int) -> int:
    """Store the model's float32 CPU `nn.Linear` weights input-major, in place, if the
    probe on its largest decoder layer says so. Returns how many layers changed."""
    targets = [
        (name, child)
        for name, child in model.named_modules()
        if type(child) is nn.Linear
        and child.weight.dtype == torch.float32
        and child.weight.device.type == "cpu"
    ]
    layers = [child for name, child in targets if not name.endswith("lm_head")]
    if not layers:
        return 0
    largest = max(layers, key=lambda child: child.weight.numel())
    if not input_major_is_faster(largest.in_features, largest.out_features):
        return 0
    embed = getattr(model, "embed_tokens", None)
    changed = 0
    with torch.no_grad():
        for _, child in targets:
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
