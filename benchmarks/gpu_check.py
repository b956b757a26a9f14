"""The GPU check (issue 18): one prepared run of what a CPU cannot show, in under 6 minutes.

Sections, each recorded on its own (an error or a skip is written down, the rest goes on):

- `environment`: versions, the GPU, optional modules missing (their sections are skipped);
- `fused_ops`: the Triton RMSNorm, SiLU-and-mul and RoPE against the torch reference;
- `keyed_race`: the sampler's Triton draw against its torch ops, and its time against a
  generator per row; top-p's floor search (the sampler's) against a full sort and the
  CPU's window that reads back, and whether the search keeps the sorted tokens;
- `correctness`: per model and attention backend, prompt and output logprobs against
  transformers' forward on the same GPU (float32 strictly; in bfloat16 each side's distance
  from transformers' float32 forward), greedy tokens against transformers' `generate`;
- `attention_error`: the Triton decode and extend kernels and torch's SDPA, bfloat16,
  against a float32 reference on the same inputs;
- `greedy_equality`: greedy tokens with the prefix cache on (cold and warm) and off, and
  with CUDA graphs on and off;
- `overlap_equality`: the overlapped loop (next tokens on the device) against the
  synchronous one: greedy, seeded, penalties, min_new_tokens, stops, logprobs, regexes;
  and overlapped decode runs (`decode_steps=4`) against it on requests of the same kinds;
- `decode_bandwidth`: the Triton decode kernel's bytes moved per second, as a fraction of
  the HBM peak (nominal, and a measured device-to-device copy), at the split count the
  runtime chooses and, beside it, at the counts around it;
- `throughput`: engine against transformers' `generate`, no-sharing and shared-prefix (and
  with decode runs of 8 steps, while the budget allows);
- `dataset_steps`: a dataset's pattern (512 requests of 16-128 new tokens, 64 running:
  a mixed step at about two of five on a CPU), with mixed prefill+decode steps (eager on
  CUDA) admitted at once or waiting up to 8 steps to be admitted together, without mixed
  steps, and with decode runs; tokens per second and forwards eager or as graphs.
- `decode_overhead`: the fraction of decode time the GPU sits idle (kernel time from the
  profiler against wall time), with CUDA graphs on and off, overlap off, decode runs of
  8 steps, a worker thread, and a larger model; when the GPU sits idle (`gpu_idle`:
  before the first kernel and after the last, a generate's ends, or between kernels,
  with the longest gaps and where they fall); and where the engine loop's thread spends
  that time (its stack sampled every 0.5 ms);
- `host_costs`: the host's microseconds per call of what a decode step queues, and the
  aten ops of a decode run ranked by host time;
- `decode_overhead_large`: the same fraction where a GPU step is as long as a real 7B
  model's (a random 5.7B bfloat16 Llama, drawn on the GPU): overlapped, synchronous,
  decode runs of 8.

The sections live in `gpu_check_correctness.py`, `gpu_check_kernels.py` and
`gpu_check_speed.py`, what they share (the run's settings, models, prompts, timers) in
`gpu_check_common.py`.

The figures go to one JSON file, rewritten after each section: `$OUT/gpu_check.json` when
`OUT` is set, else `benchmarks/results/gpu_check.json` (or `--out`). Record them in
`benchmarks/RESULTS.md`. The run ends by printing issue 18's goals read off it, met or not
(`gpu_check_goals.py`, which reads a saved JSON too). Needs only torch, transformers (and
triton); runs from the repo root without installing anything:

    python3 benchmarks/gpu_check.py             # CUDA
    python3 benchmarks/gpu_check.py --cpu-smoke # the plumbing on a CPU, tiny sizes

`--isolate` runs each section in a process of its own (`gpu_run.sh` does): a device-side
assert aborts the process it happens in, and one did (a change since reverted), losing
every section after it.

On the device machine, whose image lacks outlines-core, interegular and gguf, run it as
`bash benchmarks/gpu_run.sh` with their wheels carried (`bash benchmarks/gpu_run.sh
--fetch` here first, then the device tool's `run` with carry [".whl"]), so that the regex
requests' grammar masks run on the device too.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from gpu_check_common import OPTIONAL_MODULES, Check  # noqa: E402
from gpu_check_correctness import correctness, greedy_equality, overlap_equality  # noqa: E402
from gpu_check_goals import goal_lines  # noqa: E402
from gpu_check_kernels import (  # noqa: E402
    attention_error,
    decode_bandwidth,
    fused_ops,
    keyed_race,
)
from gpu_check_speed import (  # noqa: E402
    dataset_steps,
    decode_overhead,
    decode_overhead_large,
    host_costs,
    throughput,
)

__all__ = ["Check", "main"]


def environment(check: Check) -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "missing_modules": [m for m in OPTIONAL_MODULES if importlib.util.find_spec(m) is None],
        "device": check.device,
        "dtype": check.dtype,
    }
    if check.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name, sms=props.multi_processor_count, memory_gb=props.total_memory / 2**30
        )
        import triton

        info["triton"] = triton.__version__
    return info


# In order of what a short run must not lose: correctness, then the goals' figures (the
# decode time outside the GPU, throughput against transformers), then the rest.
SECTIONS = [
    ("environment", environment, 0),
    ("correctness", correctness, 30),
    ("decode_overhead", decode_overhead, 20),
    ("throughput", throughput, 60),
    ("greedy_equality", greedy_equality, 20),
    ("overlap_equality", overlap_equality, 20),
    # (the figure the last run left open: whether a real model's step hides the host's work)
    ("decode_overhead_large", decode_overhead_large, 60),
    ("dataset_steps", dataset_steps, 30),
    ("decode_bandwidth", decode_bandwidth, 15),
    ("fused_ops", fused_ops, 10),
    ("keyed_race", keyed_race, 10),
    ("attention_error", attention_error, 5),
    ("host_costs", host_costs, 10),
]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--budget-s", type=float, default=320.0, help="sections' time budget")
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT or results/)")
    parser.add_argument("--only", default=None, help="comma-separated section names")
    parser.add_argument(
        "--isolate", action="store_true", help="each section in a process of its own"
    )
    # (`--isolate`'s own section processes: their parent prints the goals)
    parser.add_argument("--as-section", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check = Check(args)
    if not check.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu-smoke to check the plumbing")
    if check.device == "cuda" and not args.isolate:  # (an isolated section's process does)
        # Kineto must be set up before any CUDA graph is captured, or the kernels of graphs
        # captured earlier may be missing from `decode_overhead`'s profiles.
        import torch.profiler._utils as profiler_utils

        init = getattr(profiler_utils, "_init_for_cuda_graphs", None)
        if init is not None:
            init()
    command = [sys.executable, str(Path(__file__).resolve()), "--as-section"]
    command += ["--cpu-smoke"] * check.smoke
    for name, fn, min_s in SECTIONS:
        if not args.isolate:
            check.section(name, fn, min_s)
        elif check.only is None or name in check.only:
            check.isolated_section(name, min_s, command)
    print(f"[gpu_check] wrote {check.out}", flush=True)
    if not args.as_section:  # (in the log, should the JSON not come back)
        try:
            lines = goal_lines(check.report)
        except Exception as error:  # noqa: BLE001 - the figures are written already
            lines = [f"goals: could not be read off the report ({error!r})"]
        for line in lines:
            print(f"[gpu_check] {line}", flush=True)
    return check.report


if __name__ == "__main__":
    main()
