"""The GPU check's engine-speed sections: throughput against transformers' `generate`,
the decode step's time outside the GPU, and what the host pays per call for it."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_check_common import (
    GREEDY,
    Check,
    SkipSection,
    corpus_prompts,
    error_tail,
    free_memory,
    hf_generate,
    instruct_models,
    load_hf,
    model_path,
    timed,
)


def throughput(check: Check) -> dict[str, Any]:
    if check.smoke:
        models, scale = ["tiny"], 0.0625
    else:
        models = ["small", *instruct_models()] + (["medium"] if check.remaining() > 200 else [])
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
        free_memory()
    return out


def _race(check: Check, name: str, hf: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """Tokens per second of the engine and of transformers on the same prompts (best of 2)."""
    params = {"max_new_tokens": new, "min_new_tokens": new, **GREEDY}
    hf_generate(hf, prompts[:2], 4)  # warm-up
    hf_s = min(timed(lambda: hf_generate(hf, prompts, new)) for _ in range(2))
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
            times.append(timed(lambda: engine.generate(input_ids=prompts, sampling_params=params)))
        return min(times), engine.runner.graphs is not None


def dataset_steps(check: Check) -> dict[str, Any]:
    """A dataset's pattern: more requests than run at once, of spread lengths, so that
    requests finish and others are admitted at many steps (on a CPU, 256 such requests of
    "small" ran 142 mixed steps of 352). A mixed prefill+decode step runs eagerly on CUDA
    (the decode graphs take decode batches only): tokens per second with mixed steps,
    each request admitted as soon as there is room (`admission_wait_steps=0`, the default
    before it) or admissions waiting up to 8 steps to be made together (the default on
    CUDA now: `waiting`), without mixed steps (`disable_mixed_batches`: a prefill step,
    then graph decodes; admitted at once, as SGLang), with decode runs of 8 (admissions
    wait for the run's end) and with `decode_steps="auto"` (runs where the loop finds the
    GPU idle, `run_choice.py`), and how many forwards each ran eagerly or as a graph.
    (RESULTS.md: read, never measured.)"""
    name, n, batch, length = ("tiny", 24, 8, 16) if check.smoke else ("small", 512, 64, 64)
    prompts = corpus_prompts(name, n, length)
    lengths = [16 + (i * 37) % 113 for i in range(n)]  # 16-128 new tokens
    params = [{"max_new_tokens": m, "min_new_tokens": m, **GREEDY} for m in lengths]
    warm = {"max_new_tokens": 4, "min_new_tokens": 4, **GREEDY}
    out: dict[str, Any] = {"num_requests": n, "max_running_requests": batch}
    configs = {
        "mixed": {"admission_wait_steps": 0},
        "waiting": {"admission_wait_steps": 8},
        "no_mixed": {"disable_mixed_batches": True, "admission_wait_steps": 0},
        "decode_runs": {"decode_steps": 8},
        "auto": {"decode_steps": "auto"},
    }
    for label, config in configs.items():
        if check.remaining() < 15:  # (each run takes seconds; the sections after need time)
            out[label] = {"status": "skipped", "reason": "time budget spent"}
            continue
        with check.engine(name, max_running_requests=batch, **config) as engine:
            engine.generate(input_ids=prompts[:2], sampling_params=warm)
            engine.flush_cache()
            engine.reset_stats()
            counts = _counted_forwards(engine)
            seconds = timed(lambda: engine.generate(input_ids=prompts, sampling_params=params))
            out[label] = {"seconds": seconds, "tokens_per_s": sum(lengths) / seconds, **counts}
            out[label]["admission_waits"] = engine.stats()["admission_waits"]
    for label in ("waiting", "no_mixed", "decode_runs", "auto"):
        if "seconds" in out[label] and "seconds" in out["mixed"]:
            out[f"{label}_speedup"] = out["mixed"]["seconds"] / out[label]["seconds"]
    return out


def _counted_forwards(engine: Any) -> dict[str, int]:
    """Counts, filled as `engine` runs, of its forwards run eagerly and as decode graphs,
    those of them mixed (prefill and decode rows), and decode runs replayed as one graph
    (`graph_runs`: their steps are no forwards)."""
    from lmprog_runtime.forward_batch import ForwardMode

    counts = {"eager_forwards": 0, "graph_forwards": 0, "mixed_forwards": 0, "graph_runs": 0}
    runner = engine.runner
    run, graphs = runner.run, runner.graphs

    def counted_run(fb):
        counts["mixed_forwards"] += fb.num_decodes > 0 and fb.mode is not ForwardMode.DECODE
        counts[
            "graph_forwards" if graphs is not None and graphs.can_run(fb) else "eager_forwards"
        ] += 1
        return run(fb)

    runner.run = counted_run
    if graphs is not None:
        run_greedy = graphs.run_greedy

        def counted_run_greedy(*args):
            counts["graph_runs"] += 1
            return run_greedy(*args)

        graphs.run_greedy = counted_run_greedy
    return counts


def host_costs(check: Check) -> dict[str, Any]:
    """What the host pays per call for the device work a decode step queues (microseconds,
    the mean of 2000 calls, nothing waited for unless named): a small kernel, the ops of a
    step outside the forward, copies each way, events, a stream switch, a CUDA graph's
    replay; then the aten ops of a decode-dominated run (batch 64) ranked by host time
    (the profiler's self CPU time, per forward pass)."""
    if check.device != "cuda":
        raise SkipSection("needs CUDA")
    from lmprog_runtime.transfer import host_ints, index_tensor, to_host_async

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
        "index_tensor (64 ints to the device, staged through empty(pin_memory=True))": lambda: (
            index_tensor(rows, "cuda")
        ),
        # (what `to_device` did until 2026-12-04 evening: pin_memory() asks the driver first)
        "64 ints to the device via pin_memory()": lambda: (
            host_ints(rows).pin_memory().to("cuda", non_blocking=True)
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
    GPU runs no kernel, from the profiler's kernel times, over the profiled run's wall and
    over the wall of the same run without the profiler (whose callbacks cost the host time
    at every launch); and the engine's own split of step time into the forward call and
    the rest (from the run without the profiler)."""
    # Batch 64, issue 18's goal; "medium" too when time allows (a GPU step long enough for
    # the host's share to be small at all: "small" runs a step in a few hundred microseconds).
    n, new = (4, 8) if check.smoke else (64, 64)
    runs = [("tiny", "default", {}, 0)] if check.smoke else [("small", "default", {}, 0)]
    if check.smoke:
        runs.append(("tiny", "worker_thread", {"overlap_schedule": True, "worker_thread": True}, 0))
        runs.append(("tiny", "decode_runs", {"decode_steps": 4}, 0))
        runs.append(
            ("tiny", "decode_runs_auto", {"decode_steps": "auto", "overlap_schedule": True}, 0)
        )
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
        # Runs only where the loop finds the GPU idle, single steps elsewhere (run_choice.py;
        # the emulated 0.3 ms device of bench_host_path.py: idle 7-8% of the span, against
        # 3% with runs of 8 from the start and 31-32% with single steps).
        runs.append(("small", "decode_runs_auto", {"decode_steps": "auto"}, 15))
        runs.append(("medium", "medium", {}, 45))
        # The forward worker a thread of its own (on CUDA it runs on the loop thread); last,
        # so that a tight budget drops it before "medium".
        runs.append(("small", "worker_thread", {"worker_thread": True}, 15))
    params = {"max_new_tokens": new, "min_new_tokens": new, **GREEDY}
    out: dict[str, Any] = {"host_profile": _host_profile(check, runs[0][0], n, params)}
    return out | _overhead_runs(check, runs, n, params)


def _overhead_runs(
    check: Check,
    runs: list[tuple[str, str, dict[str, Any], float]],
    n: int,
    params: dict[str, Any],
) -> dict[str, Any]:
    """`_overhead_run` for each (model, label, config, seconds it needs) while the budget
    allows (a run needing 0 always goes), by label; a run that fails records its error."""
    out: dict[str, Any] = {}
    for name, label, config, min_s in runs:
        if check.remaining() < min_s:
            out[label] = {"status": "skipped", "reason": "time budget spent"}
            continue
        try:
            out[label] = _overhead_run(check, name, n, params, config)
        except Exception as error:  # noqa: BLE001 - keep the other runs' figures
            out[label] = {"status": "error", "error": repr(error), "traceback": error_tail()}
        free_memory()  # (the next engine's model and KV pool)
    return out


def decode_overhead_large(check: Check) -> dict[str, Any]:
    """`decode_overhead` where a GPU step is as long as a real 7B model's ("large": Llama-2-7B's
    shape, random bfloat16 weights, `gpu_check_common.LARGE_SHAPE`): whether the loop's host
    work then hides behind the GPU (overlapped) or adds to it (synchronous)."""
    n, new = (4, 8) if check.smoke else (64, 64)
    name = "tiny" if check.smoke else "large"
    start = time.perf_counter()
    model_path(name)  # (built once, on the GPU)
    out: dict[str, Any] = {"model_build_s": round(time.perf_counter() - start, 1)}
    params = {"max_new_tokens": new, "min_new_tokens": new, **GREEDY}
    runs = [
        (name, "default", {}, 0),
        (name, "overlap_off", {"overlap_schedule": False}, 25),
        (name, "decode_runs", {"decode_steps": 8}, 25),
        # (a GPU step this long should keep "auto" to single steps: `run_choice` in the entry)
        (name, "decode_runs_auto", {"decode_steps": "auto"}, 25),
    ]
    return out | _overhead_runs(check, runs, n, params)


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
        # The sampler runs when the loop thread lets go of the GIL: every torch op does, so
        # at the default 5 ms switch interval a sample can land only at an op, most likely
        # the first one after a long stretch of Python, which is then charged with it (our
        # reading of an earlier run's 28% of the samples on the argmax after the draw's
        # bookkeeping). At 10 us the loop lets go between bytecodes too.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        try:
            sampler.start()
            for _ in range(1 if check.smoke else 5):
                engine.flush_cache()
                run()
        finally:
            done.set()
            sampler.join()
            sys.setswitchinterval(interval)
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
    started = time.perf_counter()
    with check.engine(name, max_running_requests=n, **config) as engine:
        startup_s = time.perf_counter() - started  # (graph captures included)
        if threaded is not None:
            engine._worker.close()
            engine._worker = ForwardWorker(engine.runner, threaded=threaded)
        run = functools.partial(engine.generate, input_ids=prompts, sampling_params=params)
        paths = _graph_paths(engine, run)  # (the warm-up, counted)
        engine.flush_cache()
        engine.reset_stats()
        entry: dict[str, Any] = {
            "graph_paths_in_warm_up": paths,
            "model": name,
            "batch": n,
            "cuda_graphs": engine.runner.graphs is not None,
            "overlap": engine._worker is not None,
            "decode_steps": engine.config.decode_steps,
            "startup_s": startup_s,
            "run_graphs": engine.runner.graphs is not None and engine.runner.graphs.run_steps > 0,
            "worker_thread": engine._worker is not None
            and not isinstance(engine._worker._executor, InlineExecutor),
        }
        # The stats are the unprofiled run's: the profiler's callbacks cost the host time at
        # every launch, so the profiled run's wall is longer than an engine's without it.
        entry["wall_s"] = timed(run)
        stats = engine.stats()
        if check.device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            engine.flush_cache()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                wall = timed(run)
            busy_us = sum(_device_us(e) for e in prof.key_averages())
            entry["wall_s_profiled"] = wall
            entry["gpu_busy_s"] = busy_us / 1e6
            entry["gpu_idle"] = gpu_idle(_kernel_spans(prof), wall)
            entry["fraction_outside_gpu"] = 1 - busy_us / 1e6 / wall
            # The same GPU work over the wall of the run without the profiler (two runs'
            # figures: their difference is noise, so it may read a little below 0).
            entry["fraction_outside_gpu_unprofiled"] = 1 - busy_us / 1e6 / entry["wall_s"]
        entry["forward_passes"] = stats["forward_passes"]
        entry["decode_runs"] = stats["decode_runs"]
        choice = engine._run_choice
        if choice is not None:  # (over the warm-up and both timed runs)
            entry["run_choice"] = {"probes": choice.num_probes, "chose_runs": choice.num_host_bound}
        entry["ms_per_step"] = 1e3 * stats["step_seconds"] / max(1, stats["forward_passes"])
        share = 1 - stats["forward_seconds"] / max(stats["step_seconds"], 1e-9)
        timed_on_device = entry["worker_thread"] and entry["decode_steps"] == 1
        if check.device == "cuda" and not timed_on_device:
            # There the forward's time is its host call (the launches: CUDA returns before
            # the kernels end); only a threaded worker (its own stream) times the device,
            # with events.
            # `fraction_outside_gpu` (the profiler's) is the figure to compare.
            entry["fraction_of_step_outside_forward_call"] = None
            entry["forward_call_host_share"] = share
        else:
            entry["fraction_of_step_outside_forward_call"] = share
        return entry


def _graph_paths(engine: Any, run: Callable[[], Any]) -> dict[str, int] | None:
    """`run()` with the decode graphs' fast paths counted (None without graphs): draws,
    those that took the graph's own tokens, decode runs replayed as graphs (those shorter
    than `decode_steps` in pieces) and runs committed at once. (Only
    for a run that is not timed: the counting wraps calls of the loop.)"""
    runner = engine.runner
    graphs = runner.graphs
    if graphs is None:
        run()
        return None
    counts = {
        "draws_asked": 0,
        "draws_from_graph": 0,
        "runs_as_one_graph": 0,  # (a shorter run's pieces counted as one)
        "shorter_runs_in_pieces": 0,
        "runs_committed_whole": 0,
    }
    greedy_tokens, run_greedy = runner.greedy_tokens, graphs.run_greedy
    commit_whole = engine._commit_whole

    def counted_greedy_tokens(*args):
        tokens = greedy_tokens(*args)
        counts["draws_asked"] += 1
        counts["draws_from_graph"] += tokens is not None
        return tokens

    def counted_run_greedy(*args):
        counts["runs_as_one_graph"] += 1
        counts["shorter_runs_in_pieces"] += args[1].shape[0] + 1 < graphs.run_steps
        return run_greedy(*args)

    def counted_commit_whole(*args):
        done = commit_whole(*args)
        counts["runs_committed_whole"] += done
        return done

    runner.greedy_tokens, graphs.run_greedy = counted_greedy_tokens, counted_run_greedy
    engine._commit_whole = counted_commit_whole
    try:
        run()
    finally:
        del runner.greedy_tokens, graphs.run_greedy, engine._commit_whole
    return counts


def _kernel_spans(prof: Any) -> list[tuple[float, float]]:
    """(start, end) in microseconds of each device event the profiler recorded."""
    spans = []
    for event in prof.events():
        if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
            spans.append((float(event.time_range.start), float(event.time_range.end)))
    return spans


def gpu_idle(spans: list[tuple[float, float]], wall_s: float) -> dict[str, Any]:
    """Where a profiled run's GPU sat idle, from its kernels' (start, end) microseconds and
    the run's wall seconds: outside the kernels' span (the run's ends: building, admitting,
    the first forward's launch; finishing, waking the caller) or inside it (between
    kernels: steps whose host work outlasted the device's), the gaps of 100 us or more
    inside it, and the five longest with where they fall in the span (0 its start, 1 its
    end). `fraction_idle_in_span` is issue 18's "decode step time outside the GPU" without
    the run's ends: building, admitting, caching the prompts of and finishing 64 requests
    of 64 tokens took the host 3.3 ms on a 2-vCPU EPYC (`bench_admit_finish.py --tokens
    64`), which no step overlaps, against 19 ms of GPU time in 64 steps of 0.3 ms."""
    if not spans:
        return {"kernels": 0}
    spans = sorted(spans)
    first, last = spans[0][0], max(end for _, end in spans)
    busy, gaps, reach = 0.0, [], first
    for start, end in spans:
        if start > reach:
            gaps.append((start - reach, reach))
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = last - first
    long = sorted((g for g in gaps if g[0] >= 100), reverse=True)
    return {
        "kernels": len(spans),
        "span_s": span / 1e6,
        "busy_s": busy / 1e6,
        "idle_in_span_s": (span - busy) / 1e6,
        "fraction_idle_in_span": (span - busy) / span if span else 0.0,
        "idle_outside_span_s": max(0.0, wall_s - span / 1e6),
        "gaps_of_100us_or_more": len(long),
        "their_seconds": sum(g for g, _ in long) / 1e6,
        "longest_gaps": [
            {"us": round(g, 1), "at": round((at - first) / span, 3) if span else 0.0}
            for g, at in long[:5]
        ],
    }


def _device_us(event: Any) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value:
            return float(value)
    return 0.0
