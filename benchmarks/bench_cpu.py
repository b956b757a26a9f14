"""CPU speed side by side (issue 17): lmprog in float32, `dtype="auto"`, int8 and int4
weights, and int8 weights with int8 activations (w8a8), against transformers `generate` (bfloat16 and float32) and, when
llama-cpp-python is installed, llama.cpp on the same GGUF.

Workloads, all greedy with the output length fixed (EOS masked):
- one stream: a 32-token prompt, 128 new tokens;
- shared prefix: 4 groups x 8 prompts (a 512-token system prompt per group + 32 tokens of
  their own), 16 new tokens each (llama.cpp runs them one at a time: in arrival order from
  an empty context each, and sorted, reusing the previous prompt's KV prefix);
- prefill: 2 x 1024 fresh tokens, 1 new token, as a share of this machine's matmul peak
  measured in the same run, the faster of bfloat16 and float32 (2 x non-embedding
  parameters x tokens FLOPs).
Every side is built and warmed first; rounds alternate (ABBA), best and median reported.

Each side runs in a worker process of its own (multiprocessing, "spawn"), built and warmed
there once and kept for the whole run; the matmul peak is measured in one more. In one
process the sides' thread pools (torch's OpenMP threads, llama.cpp's) disturbed each
other: an int4 engine alone in a process decoded 128 tokens in 2.04 s, 2.95 s beside the
others. The parent builds the workloads, sends each timed run to its side's worker and
waits; the other workers block on a pipe read (no CPU), so one side works at a time, all
with the parent's torch thread count. A worker times the work itself (not the pipe).

    .venv/bin/python benchmarks/bench_cpu.py [--model smollm2-135m-instruct] [--repeats 2]
        [--workloads "one stream,shared prefix,prefill"] [--skip "lmprog int8,llama.cpp"]

llama.cpp (optional): build llama-cpp-python from source with GGML_NATIVE=OFF and explicit
flags (a native build crashed with an illegal instruction on a machine whose CPU flags
promise more than its OS enables); the figures in the README came from

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
      .venv/bin/pip install --no-deps llama-cpp-python==0.3.36 && .venv/bin/pip install diskcache
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import multiprocessing
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import harness
import torch
from harness import Phase

SIDES = {  # name -> Engine options
    "lmprog float32": {"dtype": "float32"},
    "lmprog auto dtype": {"dtype": "auto"},
    "lmprog int8": {"dtype": "auto", "quantization": "int8"},
    "lmprog int4": {"dtype": "auto", "quantization": "int4"},
    "lmprog w8a8": {"dtype": "auto", "quantization": "w8a8_int8"},
}
HF_DTYPES = ("bfloat16", "float32")
LLAMA_CPP = "llama.cpp"  # the side's name for `--skip`
WORKLOADS = ("one stream", "shared prefix", "prefill")


def matmul_peak_gflops(repeats: int = 10) -> tuple[float, str]:
    """torch's best matmul rate on this machine (GFLOP/s) and the dtype that reached it: the
    fastest of bfloat16 and float32 over several shapes (square ones and the shapes of a
    prefill), each warmed up, best of `repeats`. A CPU without native bfloat16 (no AMX or
    AVX512-BF16) runs it emulated, dozens of times slower than float32 (a 4096^3 product
    took minutes on an AVX2-only Zen 3): there only float32 is measured."""
    from lmprog_runtime.models.cpu import cpu_has_native_bf16

    best_rate, best_dtype = 0.0, ""
    shapes = ((2048, 2048, 2048), (4096, 4096, 4096), (2048, 576, 3072), (2048, 1536, 576))
    dtypes = (torch.bfloat16, torch.float32) if cpu_has_native_bf16() else (torch.float32,)
    for dtype in dtypes:
        for m, k, n in shapes:
            a = torch.randn(m, k, dtype=dtype)
            b = torch.randn(k, n, dtype=dtype)
            for _ in range(3):
                a @ b
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                rate = 2 * m * k * n / (time.perf_counter() - start) / 1e9
                if rate > best_rate:
                    best_rate, best_dtype = rate, str(dtype).removeprefix("torch.")
    return best_rate, best_dtype


def workloads(tokenizer: Any) -> dict[str, tuple[list[list[int]], int]]:
    """name -> (prompts as token ids, new tokens per prompt)."""
    corpus = " ".join(f"word{i} and more text number {i}." for i in range(4000))
    ids = tokenizer(corpus).input_ids
    single = [ids[:32]]
    shared = []
    for g in range(4):
        system = ids[1000 + g * 600 : 1000 + g * 600 + 512]
        shared += [system + ids[5000 + 40 * (8 * g + i) :][:32] for i in range(8)]
    prefill = [ids[10000:11024], ids[12000:13024]]
    return {"one stream": (single, 128), "shared prefix": (shared, 16), "prefill": (prefill, 1)}


def prefill_params(path: str) -> int:
    """The weights every prefill token multiplies (not embeddings; the LM head runs for the
    last token only), counted on transformers' model built on the meta device (no weights
    loaded, no compute)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmprog_runtime import local_model_dir

    config = AutoConfig.from_pretrained(local_model_dir(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(
        p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n
    )


# ---- the worker processes -----------------------------------------------------------------
# A side: `run(workload, reuse)` -> (seconds, outputs), timed around the work only; `flush()`
# (untimed, before a run); `close()`.
Side = tuple[Callable[..., tuple[float, Any]], Callable[[], None], Callable[[], None]]
Loads = dict[str, tuple[list[list[int]], int]]


def build_engine(path: str, options: dict[str, Any], loads: Loads) -> Side:
    from lmprog_runtime import Engine

    engine = Engine(path, max_total_tokens=8192, **options)
    harness.warm_engine(engine)

    def run(workload: str, reuse: bool) -> tuple[float, list[list[int]]]:
        prompts, new = loads[workload]
        params = {"max_new_tokens": new, "min_new_tokens": new, "temperature": 0}
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        outs = [o["output_ids"] for o in outs]
        return time.perf_counter() - start, outs

    return run, lambda: harness.flush(engine), engine.shutdown


def build_hf(path: str, dtype: str, loads: Loads) -> Side:
    model = harness.load_hf_model(path, dtype)
    harness.warm_hf(model, harness.load_hf_tokenizer(path))

    def run(workload: str, reuse: bool) -> tuple[float, list[list[int]]]:
        prompts, new = loads[workload]
        start = time.perf_counter()
        outs = harness.hf_generate(model, prompts, new, 8)
        return time.perf_counter() - start, outs

    return run, lambda: None, lambda: None


def build_llama_cpp(gguf: str, threads: int, loads: Loads) -> Side:
    """llama.cpp runs one prompt at a time. Without `reuse` every prompt starts from an
    empty context (arrival order, nothing shared); with it the prompts go sorted, so each
    starts from the KV of the previous one and evaluates only what differs (llama-cpp-python
    keeps the longest common prefix of consecutive prompts)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=gguf,
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
    )
    # The warm-up the other sides get: a few tokens of the warm-up prompt, then a reset.
    for i, _ in enumerate(llm.generate(llm.tokenize(harness.WARMUP_TEXT.encode()), temp=0.0)):
        if i == 3:
            break
    llm.reset()

    def run(workload: str, reuse: bool) -> tuple[float, list[list[int]]]:
        prompts, new = loads[workload]
        order = sorted(range(len(prompts)), key=lambda i: prompts[i]) if reuse else None
        start = time.perf_counter()
        outs: list[list[int]] = [[] for _ in prompts]
        llm.reset()
        for i in order if reuse else range(len(prompts)):
            if not reuse:
                llm.reset()
            tokens = outs[i]
            for token in llm.generate(prompts[i], temp=0.0, reset=True):
                tokens.append(token)
                if len(tokens) == new:
                    break
        return time.perf_counter() - start, outs

    return run, llm.reset, getattr(llm, "close", lambda: None)


def build_peak() -> Side:
    def run() -> tuple[float, tuple[float, str]]:
        start = time.perf_counter()
        peak = matmul_peak_gflops()
        return time.perf_counter() - start, peak

    return run, lambda: None, lambda: None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)  # unwinds through `finally`: workers stop, sides shut down


def worker_main(conn: Any, kind: str, setup: tuple, threads: int, loads: Loads) -> None:
    """A worker process: build and warm one side, answer ("ok", info) (or ("error",
    traceback)), then serve commands until ("stop",) or until the parent is gone:
    ("flush",) -> ("ok", None); ("run", *args) -> ("ok", (seconds, outputs))."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    # Stopped with SIGTERM, exit through `finally` and atexit (shut the side down, release
    # what it holds, such as tqdm's semaphores) rather than die at once; once done serving,
    # die at once (a SystemExit in the interpreter's teardown would only print noise).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        _serve(conn, kind, setup, threads, loads)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _serve(conn: Any, kind: str, setup: tuple, threads: int, loads: Loads) -> None:
    torch.set_num_threads(threads)
    try:
        if kind == "lmprog":
            side = build_engine(*setup, loads)
        elif kind == "hf":
            side = build_hf(*setup, loads)
        elif kind == "llama.cpp":
            side = build_llama_cpp(*setup, threads, loads)
        else:
            side = build_peak()
    except BaseException:
        with contextlib.suppress(OSError):  # unless the parent is gone
            conn.send(("error", traceback.format_exc()))
        return
    run, flush, close = side
    try:
        conn.send(("ok", {"threads": torch.get_num_threads()}))
        while True:
            try:
                command = conn.recv()
            except EOFError:
                return  # the parent is gone
            if command[0] == "stop":
                return
            try:
                if command[0] == "flush":
                    reply = flush()
                elif command[0] == "run":
                    gc.collect()  # as `harness.alternate` does before a phase, untimed
                    reply = run(*command[1:])
                else:
                    raise ValueError(f"unknown command {command!r}")
            except Exception:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", reply))
    except OSError:  # BrokenPipeError: the parent is gone
        return
    finally:
        close()


class WorkerError(RuntimeError):
    pass


class Worker:
    """The parent's handle on one side's worker process."""

    def __init__(self, ctx: Any, name: str, kind: str, setup: tuple, threads: int, loads: Loads):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=worker_main,
            args=(child, kind, setup, threads, loads),
            name=f"bench_cpu: {name}",
            daemon=True,
        )
        # The worker inherits an ignored SIGINT: a Ctrl-C (sent to the whole process group)
        # reaches the parent only, which then stops every worker.
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.process.start()
        finally:
            signal.signal(signal.SIGINT, handler)
            child.close()  # the worker's end lives in the worker only: EOF when it dies
        self.started = time.perf_counter()

    def wait_ready(self) -> dict[str, Any]:
        info = self._reply("start")
        print(
            f"{self.name}: ready in {time.perf_counter() - self.started:.1f} s "
            f"(pid {self.process.pid}, {info['threads']} threads)",
            flush=True,
        )
        return info

    def call(self, *command: Any) -> Any:
        try:
            self.conn.send(command)
        except OSError:
            raise self._died(command[0]) from None
        return self._reply(command[0])

    def _reply(self, what: str) -> Any:
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise self._died(what) from None
        if status == "error":
            raise WorkerError(f"{self.name}: {what} failed in its worker:\n{payload}")
        return payload

    def _died(self, what: str) -> WorkerError:
        self.process.join(5)
        code = self.process.exitcode
        return WorkerError(f"{self.name}: its worker died during {what} (exit code {code})")

    def stop(self, graceful: bool) -> None:
        """Ask the worker to shut its side down and exit (`graceful`, when it is idle),
        else (or if it does not exit) terminate it, kill it if need be."""
        if graceful and self.process.is_alive():
            try:
                self.conn.send(("stop",))
                self.process.join(60)
            except OSError:
                pass
        for end in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                end()
                self.process.join(10)
        self.conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=2)
    parser.set_defaults(model="smollm2-135m-instruct")
    sides = [*SIDES, *(f"transformers generate {dtype}" for dtype in HF_DTYPES), LLAMA_CPP]
    parser.add_argument(
        "--skip", default="", help=f"comma-separated side names to leave out, of {sides}"
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated workloads to run, of {list(WORKLOADS)} (default: all)",
    )
    args = parser.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    selected = {s.strip() for s in args.workloads.split(",") if s.strip()}
    if skip - set(sides):
        parser.error(f"--skip: unknown side(s) {sorted(skip - set(sides))}; sides: {sides}")
    if not selected or selected - set(WORKLOADS):
        parser.error(f"--workloads: {sorted(selected - set(WORKLOADS))}; of {list(WORKLOADS)}")

    from lmprog_runtime.models.cpu import cpu_has_native_bf16

    path = harness.resolve_model(args.model)
    threads = torch.get_num_threads()
    loads = {k: v for k, v in workloads(harness.load_hf_tokenizer(path)).items() if k in selected}
    # (name, kind, setup) of every worker, in phase order; llama.cpp last (the baseline).
    plan: list[tuple[str, str, tuple]] = [
        (name, "lmprog", (path, options)) for name, options in SIDES.items()
    ]
    plan += [(f"transformers generate {dtype}", "hf", (path, dtype)) for dtype in HF_DTYPES]
    if importlib.util.find_spec("llama_cpp") is not None and path.endswith(".gguf"):
        plan.append((LLAMA_CPP, "llama.cpp", (path,)))
    plan = [entry for entry in plan if entry[0] not in skip]
    if "prefill" in loads:
        plan.append(("matmul peak", "peak", ()))
    ctx = multiprocessing.get_context("spawn")  # torch after fork is unsafe
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    workers: dict[str, Worker] = {}
    graceful = False
    try:
        for name, kind, setup in plan:  # one at a time: each builds and warms alone
            workers[name] = Worker(ctx, name, kind, setup, threads, loads)
            try:
                workers[name].wait_ready()
            except WorkerError as e:
                if kind != "llama.cpp":
                    raise
                print(f"llama.cpp skipped, its worker failed to start: {e}", flush=True)
                workers.pop(name).stop(graceful=False)
        has_llama_cpp = LLAMA_CPP in workers
        peak, peak_dtype = workers["matmul peak"].call("run")[1] if "prefill" in loads else (0, "")
        rows, raw = run_workloads(workers, loads, args.repeats)
        if "prefill" in loads:  # measured again at the end: the higher one counts
            peak, peak_dtype = max((peak, peak_dtype), workers["matmul peak"].call("run")[1])
        graceful = True
    finally:
        for worker in workers.values():
            worker.stop(graceful)
    if "prefill" in loads:
        params = prefill_params(path)
        for row in rows:  # the prefill rows' FLOP rate as a share of the peak
            if row["workload"] == "prefill":
                prompts, _ = loads["prefill"]
                seconds, best = row.pop("_seconds"), row.pop("_best")
                gflops = 2 * params * sum(len(p) for p in prompts) / best / 1e9
                row["best / median (s)"] = f"{seconds} ({gflops / peak:.0%} of peak)"
    args.dtype = (
        "per row: float32, auto (bfloat16 here), int8 / int4 with bfloat16 activations, w8a8"
        " (int8 activations; its prefill share counts the same FLOPs against the bfloat16 peak)"
    )
    if not cpu_has_native_bf16():
        args.dtype = "per row: float32 (auto and the quantized engines too: no native bfloat16)"
    described = {
        "one stream": "one stream (32-token prompt, 128 new tokens)",
        "shared prefix": "4 groups x 8 prompts with a 512-token shared system prompt + 32 "
        "tokens, 16 new each",
        "prefill": "prefill of 2 x 1024 fresh tokens",
    }
    workload = "; ".join(described[w] for w in WORKLOADS if w in loads) + ". "
    if "prefill" in loads:
        workload += f"Matmul peak measured here: {peak:.0f} GFLOP/s ({peak_dtype}). "
    workload += f"{args.repeats} rounds, alternating order, each side in a process of its own."
    if has_llama_cpp:
        workload += (
            " Baseline llama.cpp: sorted by prefix (reusing the previous prompt's KV) on the "
            "shared-prefix workload, one prompt at a time from an empty context elsewhere"
        )
    harness.write_result(
        args,
        # Each kind of machine (AMX, AVX512-BF16 only, neither) gets a table of its own.
        "cpu" if harness.bf16_kind() == "amx" else f"cpu_{harness.bf16_kind()}",
        {
            "title": "CPU speed: lmprog dtypes and quantization against transformers"
            + (" and llama.cpp" if has_llama_cpp else ""),
            "workload": workload,
            "columns": list(rows[0]),
            "rows": rows,
            "raw": raw,
        },
    )


def remote_phase(
    name: str, worker: Worker, workload: str, reuse: bool = False, flush: bool = False
) -> Phase:
    """A phase that runs `workload` in `worker` (flushed first), timed there."""
    before = (lambda: worker.call("flush")) if flush else None
    return Phase(name, lambda: worker.call("run", workload, reuse), before, timed_by_run=True)


def run_workloads(
    workers: dict[str, Worker], loads: Loads, repeats: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every workload's phases in alternating rounds, each run in its side's worker."""
    rows, raw = [], {}
    for workload, (prompts, new) in loads.items():
        phases = []
        for name, worker in workers.items():
            if name in SIDES:
                phases.append(remote_phase(name, worker, workload, flush=True))
            elif name.startswith("transformers"):
                phases.append(remote_phase(name, worker, workload))
            elif name == LLAMA_CPP:
                for reuse in (False, True) if workload == "shared prefix" else (False,):
                    label = "llama.cpp, sorted by prefix" if reuse else "llama.cpp, one by one"
                    label += " (llama-cpp-python)"
                    phases.append(remote_phase(label, worker, workload, reuse=reuse))
        print(f"{workload}: {len(prompts)} prompts, {new} new tokens", flush=True)
        harness.alternate(phases, repeats)
        # The baseline: llama.cpp (sorted by prefix on the shared-prefix workload, where it
        # reuses KV; one by one elsewhere), or transformers in float32 without it.
        base = phases[-1]
        base_label = LLAMA_CPP if LLAMA_CPP in workers else base.name
        reference = next((p for p in phases if p.name == "lmprog float32"), None)
        for phase in phases:
            row = {
                "workload": workload,
                "system": phase.name,
                "best / median (s)": f"{phase.best:.2f} / {phase.median:.2f}",
                f"vs {base_label} (best / median)": harness.speedup(base, phase),
                "greedy tokens = lmprog float32": "n/a (skipped)"
                if reference is None
                else _agreement(phase.values[-1], reference.values[-1]),
            }
            if workload == "prefill":  # the share of the peak comes once the peak is known
                row["_seconds"], row["_best"] = row["best / median (s)"], phase.best
            rows.append(row)
        raw[workload] = {p.name: p.timing() for p in phases}
    return rows, raw


def _agreement(ours: list[list[int]], reference: list[list[int]]) -> str:
    same = sum(a == b for x, y in zip(ours, reference) for a, b in zip(x, y))
    total = sum(len(y) for y in reference)
    return f"{same}/{total}"


if __name__ == "__main__":
    try:
        main()
    except WorkerError as e:
        sys.exit(f"bench_cpu: {e}")
    except KeyboardInterrupt:
        sys.exit("bench_cpu: interrupted, all workers stopped")
