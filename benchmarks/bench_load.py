"""Loading a checkpoint: the engine's loader against transformers' `from_pretrained`, on
the same bfloat16 checkpoint, each load in a fresh process (peak RSS is per process).

The checkpoint is a random bfloat16 Llama written a layer to a file (0.76B parameters by
default, 1.5 GB; built once under the cache directory, `--layers` and `--hidden` change
its size). Both sides load it in bfloat16 onto `--device`; the loads alternate, best of
`--repeats` each.

    .venv/bin/python benchmarks/bench_load.py [--device cpu] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CHILD = """
import json, resource, sys, time
import torch
side, path, device = sys.argv[1:4]
start = time.perf_counter()
if side == "lmprog":
    from lmprog_runtime.models.loader import load_model
    model = load_model(path, torch.bfloat16, device)
else:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
if device.startswith("cuda"):
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"seconds": seconds, "peak_rss_bytes": peak, "params": params}))
"""


def checkpoint(hidden: int, layers: int) -> Path:
    from gpu_check_common import build_random_bf16

    from lmprog_runtime import default_model_path
    from lmprog_runtime.env import cache_dir

    path = cache_dir() / f"bench-load-{hidden}x{layers}"
    if not (path / "complete").exists():
        shape = {"hidden_size": hidden, "num_hidden_layers": layers}
        heads = hidden // 128
        shape |= {"num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2)}
        shape |= {"intermediate_size": hidden * 11 // 4, "head_dim": 128}
        build_random_bf16(path, Path(default_model_path("tiny")), shape, "cpu")
    return path


def load_once(side: str, path: Path, device: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, side, str(path), device],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    path = checkpoint(args.hidden, args.layers)
    runs: dict[str, list[dict]] = {"lmprog": [], "transformers": []}
    for _ in range(args.repeats):
        for side in runs:
            runs[side].append(load_once(side, path, args.device))
    best = {side: min(r["seconds"] for r in results) for side, results in runs.items()}
    peak = {side: max(r["peak_rss_bytes"] for r in results) for side, results in runs.items()}
    params = runs["lmprog"][0]["params"] / 1e9
    print(f"{params:.2f}B parameters, bfloat16, onto {args.device}, best of {args.repeats}:")
    for side in runs:
        print(f"  {side:12s} {best[side]:6.2f} s   peak RSS {peak[side] / 2**30:5.2f} GiB")
    ratio = best["transformers"] / best["lmprog"]
    print(f"  lmprog loads {ratio:.2f}x as fast as transformers")


if __name__ == "__main__":
    main()
