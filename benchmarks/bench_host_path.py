"""The host's share of a decode step against an emulated GPU: what a CPU can say of issue
18's "time outside the GPU" before a GPU runs it.

The model forward is replaced by an emulated device: launching it holds the GIL for
`--launch-ms` (Python queueing kernels), then `--device-ms` of device time is queued on a
device clock (each forward starts when the one before it has ended, or when it is
queued), and its logits are fixed rows of a table. Everything else of a step runs for
real: sampling, appending tokens, stop checks, scheduling, preparing the inputs, and with
overlap scheduling the hand-offs to the forward worker and back. Results are waited for as
on a GPU: the synchronous loop reads each forward's logits at once (it sleeps until the
device clock has passed the forward); the overlapped loop reads only the drawn tokens,
when it collects them (`ForwardWorker.sampled` sleeps until then), so its next forward may
be queued while the device is still busy.

The loop "step graphs" runs each single decode step as a CUDA graph's replay, as on
CUDA: its greedy tokens are drawn and stored with the forward
(`emulated_device.EmulatedRunGraphs.single`), and the loop takes them instead of drawing
(the other loops draw on the CPU after each forward, which a GPU's graph does not). Its
forward still gathers the logits rows from the table on the host (48 us at 64 x 2048 by
`timeit`) and resolves the placeholders there (~11 us), device work on a GPU.

Decode runs (`decode_steps`) queue their forwards without waiting and read each step's
tokens when the device clock has passed its forward (`_read_step`), as on a GPU; with
overlap on, the batches that cannot run ahead take the overlapped loop meanwhile. The
loops "one graph each" launch a run of plain greedy steps as one graph, as on CUDA
(`EmulatedRunGraphs`: one launch, every step's tokens on the host at the run's end).
The loop "auto runs, ..." sets `decode_steps="auto"` (`run_choice.py`): its probes of
single steps (graph replays) time the loop's waits for the emulated device, and it takes
runs of 8 (one graph each) where the device was done before the loop asked.
`--device-table` keeps the request table twice, as on a GPU: the scheduler's writes are
logged and sent with each forward's inputs (to a mirror here, which nothing reads).

Eight workloads: "plain"; "penalties half the time" (every fourth request has a
frequency penalty and stops halfway; these run ahead, their counts kept on the device);
"a grammar half the time" (the same with a regex instead: those cannot run ahead, so
half the steps cannot run as decode runs); "logprobs" (every request asks for its
tokens' logprobs and their top 5; gathered with each draw, on the CPU here, where a GPU
would run it as kernels); "stops" (every request has a stop string it never meets: its
text is decoded and scanned at each token); "arrivals" (four times the batch, of lengths
spread over a quarter of `--tokens` to all of it, `batch` at a time: a request finishes,
and another is admitted, at nearly every step, so the loop goes from an overlapped prompt
step to runs again and again; the loop "held" then waits for the check of that step
before it launches the run, as on a CPU); "shared" (the same, every prompt 1,024 tokens of
a system prompt and 8 of its own: each step with room orders the waiting requests by
their cached prefix, matching each again); "queue" (sixteen times the batch, submitted at
once, as a dataset's rows are: `batch` run while the rest wait, and each step must not
pay for the waiting ones); "dataset" (64 times the batch submitted at once, of spread
lengths as "arrivals": a request leaves and another is admitted at nearly every step, so
that admission must not read the whole queue each time).

With `--eager-launch-ms`, a forward no decode graph takes (a prompt's, or a mixed
step's) launches for that long instead (on CUDA such a step runs eagerly: about 90
launches for "small", 8 layers, counted on the CPU, against one replay), and
`--admission-wait-steps` sets the engine's `admission_wait_steps`; each loop then also
reports the generate's wall time and its forwards (with prompts: the eager ones), which
waiting admissions change in number.

Per step, wall time minus the device time is the host's critical path: what a GPU would
sit idle for. It is measured for the synchronous loop and the overlapped one, in one run,
best of `--repeats`. The overlapped loop runs both ways: with the forward worker a thread
(as on a CPU) and on the loop thread (as on CUDA, where queuing a forward returns at once).
The wall time per step counts the generate's ends (making, admitting and finishing the
requests, which no step overlaps); "device idle" leaves them out: the share of the time
from the first forward's start to the last one's end with no forward on the device (of
the fastest repeat), as `fraction_idle_in_span` (`gpu_check_speed.gpu_idle`) on a GPU.

Next to it, the CPU time each part of the host's work took per step (each thread's own CPU
time, which other processes on the machine barely move): the loop's (the loop thread's
whole CPU time over the generate: scheduling, preparing inputs, stop checks, finishing;
without the forward and the draw where the loop thread runs them), the forward's launch
(emulated: the busy `--launch-ms` and the logits lookup) and the draw (sampling). Threads take turns holding the GIL, so an overlapped step is no
shorter than the sum; two threads hand it over at every torch op, which costs CPU time of
its own.

    .venv/bin/python benchmarks/bench_host_path.py [--batch 64] [--device-ms 1] [--tokens 128]
        [--baseline COMMIT [--rounds 3]] [--loop synchronous --loop "decode runs of 8"]
        [--device-table]

`--baseline COMMIT` runs each loop on that commit's runtime too (a git worktree under /tmp,
its own model cache), each run in its own process, the two sides alternated `--rounds`
times; it reports each side's best step and loop CPU time and their ratios.

(`time.sleep` overshoots by some tens of microseconds each time it waits.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402
import torch  # noqa: E402
from emulated_device import CpuClock, EmulatedDevice, EmulatedRunGraphs, StepEvent  # noqa: E402


def host_path(
    batch: int,
    device_s: float,
    launch_s: float,
    tokens: int,
    repeats: int,
    overlap: bool,
    threaded: bool = True,
    decode_steps: int | str = 1,
    workload: str = "plain",
    hold: bool = False,
    graph_runs: bool = False,
    eager_launch_s: float | None = None,
    admission_wait_steps: int | None = None,
    graph_steps: bool = False,
    device_table: bool = False,
) -> dict:
    """`threaded`: with overlap, the forward worker is a thread (as on a CPU), or it runs
    its jobs on the loop thread (as on CUDA, where queuing them returns at once).
    `decode_steps`: decode runs of that many steps ("auto": as the engine's `RunChoice`
    finds the emulated device idle or busy, runs of 8 emulated). `workload`: a key of
    `WORKLOADS`. `hold`: overlapped runs wait for the check of the step before them (as on a
    CPU) instead of being launched before it. `graph_runs`: a run of plain greedy steps is
    one launch of a graph of the whole run, as on CUDA (`EmulatedRunGraphs`).
    `eager_launch_s`: the launch of a forward no decode graph takes (a prompt's or a mixed
    step's: on CUDA it runs eagerly), if not `launch_s`. `admission_wait_steps`: the
    engine's setting (None: its default, 0 on a CPU, also for the "(CUDA)" loops: CUDA's 8
    is resolved when the engine is built; a runtime without the setting admits at once, as
    0). `graph_steps`: a decode step is a graph's replay, as on CUDA (`EmulatedRunGraphs`):
    its greedy tokens drawn and stored as future tokens with the forward (device work there,
    a table lookup and a store here), not drawn after it. Its placeholders are resolved on
    the host by `resolve_future_ids`' six ops (~11 us for 64; inside the graph on a GPU).
    `device_table`: the request table kept twice, as on a GPU (`ReqToTokenPool`): its writes
    logged on the host and sent with each forward's inputs, to a mirror here."""
    from lmprog_runtime import Engine, decode_run, default_model_path
    from lmprog_runtime.config import RuntimeConfig
    from lmprog_runtime.forward_batch import ForwardMode
    from lmprog_runtime.forward_worker import ForwardWorker

    wait_config = {}
    if admission_wait_steps is not None and "admission_wait_steps" in RuntimeConfig.field_names():
        wait_config["admission_wait_steps"] = admission_wait_steps
    with Engine(
        default_model_path("tiny"),
        max_running_requests=batch,
        overlap_schedule=overlap,
        decode_steps=decode_steps,
        **wait_config,
    ) as engine:
        if overlap and not threaded:
            engine._worker.close()
            engine._worker = ForwardWorker(engine.runner, threaded=False)
        runner, worker = engine.runner, engine._worker
        if device_table:  # (nothing has run yet: the mirror starts equal)
            runner.req_to_token.table = runner.req_to_token.host_table.clone()
        if graph_steps and not hasattr(runner, "greedy_tokens"):
            raise SystemExit("--loop ... step graphs: this runtime's draw takes no graph tokens")
        vocab = runner.model_config.vocab_size
        table = torch.randn(4096, vocab, generator=torch.Generator().manual_seed(0))
        device = EmulatedDevice()
        ends: list[float] = []  # each forward's end, in launch order
        extends = [0]  # forwards of prompts (mixed or not): eager on CUDA
        # Forwards not waited for: a decode run's (its step reads are), the worker's.
        queued = threading.local()

        resolve = getattr(runner, "resolved_ids", None)  # (a baseline's may predate it)
        if resolve is None:
            resolve = lambda fb: runner.resolve_future_ids(fb.input_ids)  # noqa: E731

        graphs = None  # (set below where graphs are emulated)

        def emulated_forward(fb):
            extends[0] += fb.mode is ForwardMode.EXTEND
            eager = eager_launch_s is not None and fb.mode is ForwardMode.EXTEND
            end = time.perf_counter() + (eager_launch_s if eager else launch_s)
            while time.perf_counter() < end:  # launching: Python holding the GIL
                pass
            ends.append(device.queue(device_s))
            if not getattr(queued, "on", False):
                device.wait(ends[-1])  # a synchronous step reads the logits now
            ids = resolve(fb)  # (the ids as `ModelRunner.run` resolves them)
            # [logits rows, vocab], one row per `logits_indices` as the real forward
            picked = ids[fb.logits_indices] % table.shape[0]
            logits = table[picked]
            if graphs is not None and graphs.can_run_size(fb.mode, len(fb.seq_lens)):
                tokens = graphs.argmax[picked]  # (drawn in the graph, and stored)
                runner.store_future_tokens(fb.req_pool_indices, tokens)
                graphs.last = (logits, tokens)
            return logits

        runner.run = emulated_forward
        cpu = CpuClock()
        cpu.loop_thread = engine._thread.ident
        runner.run = cpu.timed("forward", runner.run)
        engine._draw = cpu.timed("draw", engine._draw)
        if graph_runs or graph_steps:
            graphs = EmulatedRunGraphs(runner, table, device, ends, launch_s, device_s)
            steps = 8 if decode_steps == "auto" else decode_steps  # (AUTO_DECODE_STEPS)
            graphs.steps = steps if graph_runs else 0
            graphs.single = graph_steps
            graphs.run_greedy = cpu.timed("forward", graphs.run_greedy)
            runner.graphs = graphs
        run_sample_each = decode_run.sample_each
        decode_run.sample_each = cpu.timed("draw", run_sample_each)
        engine._launches_ahead = True  # (as on a GPU: launching only queues)
        launch_run, read_step = engine._launch_run, engine._read_step
        ready_at: dict[int, float] = {}  # id(a step's tokens) -> when its forward ends

        def launching_run(*args, **kwargs):
            queued.on, first = True, len(ends)
            try:
                run = launch_run(*args, **kwargs)
            finally:
                queued.on = False
            if len(set(ends[first:])) > 1:  # queued step by step: an event a step, as on CUDA
                run.drawn = [(host, StepEvent()) for host, _ in run.drawn]
            ready_at.update((id(t), end) for t, end in zip(run.drawn, ends[first:]))
            return run

        def waiting_read(tokens):
            device.wait(ready_at.pop(id(tokens)))  # this step's tokens reach the host
            return read_step(tokens)

        engine._launch_run, engine._read_step = launching_run, waiting_read
        if worker is not None:
            worker._sample = cpu.timed("draw", worker._sample)
            worker_forward = worker._forward

            def queued_forward(*args):
                queued.on = True
                try:
                    return worker_forward(*args)
                finally:
                    queued.on = False

            worker._forward = queued_forward
            launch, sample, sampled = worker.launch, worker.sample, worker.sampled
            order = itertools.count()
            launched_as: dict[int, int] = {}  # id(launch future) -> its forward's index
            due: dict[int, float] = {}  # id(draw future) -> when its forward ends

            def counted_launch(fb):
                future = launch(fb)
                launched_as[id(future)] = next(order)
                return future

            def timed_sample(launched, *args):
                future = sample(launched, *args)  # (its forward has run: `ends` has it)
                due[id(future)] = ends[launched_as[id(launched)]]
                return future

            def waiting_sampled(future, ask):
                out = sampled(future, ask)
                device.wait(due.pop(id(future)))
                return out

            worker.launch, worker.sample, worker.sampled = (
                counted_launch,
                timed_sample,
                waiting_sampled,
            )
        if hold:
            engine._launch_before_check = lambda batch, steps: None
        num = {"arrivals": 4, "shared": 4, "queue": 16, "dataset": 64}.get(workload, 1) * batch
        prompts = [[5 + (i * 7 + j) % 1000 for j in range(8)] for i in range(num)]
        if workload == "shared":  # (a system prompt's 1,024 tokens before each)
            prompts = [[6 + j % 997 for j in range(1024)] + prompt for prompt in prompts]
        plain = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        half = {**plain, "max_new_tokens": tokens // 2}
        quarter = {  # every fourth request's, for half the tokens
            "penalties": {**half, "frequency_penalty": 0.5},
            "grammar": {**half, "regex": "[a-z]+( [a-z]+)*"},
        }.get(workload)
        params = [quarter if quarter and i % 4 == 0 else plain for i in range(num)]
        if workload == "stops":  # (its text decoded and scanned at every token)
            params = [{**plain, "stop": ["<never met>"]}] * num
        if workload in ("arrivals", "shared", "dataset"):  # (lengths from a quarter to all)
            params = [{**plain, "max_new_tokens": _length(i, tokens)} for i in range(num)]
        asks = {"return_logprob": True, "top_logprobs_num": 5} if workload == "logprobs" else {}
        engine.generate(input_ids=prompts, sampling_params=params, **asks)  # warm-up
        best, best_cpu, best_run = float("inf"), {}, float("inf")
        loop_clock = time.pthread_getcpuclockid(engine._thread.ident)  # the loop thread's
        for _ in range(repeats):
            engine.flush_cache()  # (a command: the loop is between iterations when it returns)
            engine.reset_stats()
            cpu.reset()
            extends[0] = 0
            device.reset_span()
            loop_start = time.clock_gettime(loop_clock)
            start = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params=params, **asks)
            wall = time.perf_counter() - start
            # A command returns once the loop has finished the generate's last iteration;
            # this one costs the loop next to nothing (the flush, out of the count, does).
            engine._command("radix_snapshot", 0)
            cpu.seconds["loop"] = time.clock_gettime(loop_clock) - loop_start
            steps = engine.stats()["forward_passes"]
            best = min(best, wall / steps)
            if wall < best_run:  # (the same tokens however many steps they take)
                best_run, counts = wall, (steps, extends[0])
                idle = device.idle_in_span()
            per_step = {k: v / steps for k, v in cpu.seconds.items()}
            per_step["loop"] -= per_step.pop("on_loop")  # the forwards and draws it ran
            best_cpu = min(best_cpu, per_step, key=lambda d: sum(d.values()) if d else 1e9)
        del runner.run
        runner.graphs = None
        decode_run.sample_each = run_sample_each
    out = {"step_ms": 1e3 * best, "host_ms": 1e3 * (best - device_s), "run_ms": 1e3 * best_run}
    out["forwards"], out["prompt_forwards"] = counts
    out["idle_in_span"] = idle
    out.update({f"{k}_cpu_us": 1e6 * v for k, v in best_cpu.items()})
    return out


def _length(i: int, tokens: int) -> int:
    """Request i's max_new_tokens in the "arrivals" workload: spread over
    [tokens / 4, tokens], so that requests finish at every step."""
    return tokens // 4 + (i * 37) % (tokens - tokens // 4 + 1)


WORKLOADS = {
    "plain": "plain",
    "penalties": "penalties half the time",
    "grammar": "a grammar half the time",
    "logprobs": "logprobs (each token's and its top 5)",
    "stops": "a stop string on every request (never met)",
    "arrivals": "arrivals (4 x batch requests of spread lengths, batch at a time)",
    "shared": "arrivals behind a shared prefix (1,024 tokens of 1,032 a prompt)",
    "queue": "a queue (16 x batch requests submitted at once, batch at a time)",
    "dataset": "a dataset (64 x batch requests of spread lengths at once, batch at a time)",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device-ms", type=float, default=1.0)
    parser.add_argument("--launch-ms", type=float, default=0.1, help="Python work to launch")
    parser.add_argument(
        "--eager-launch-ms",
        type=float,
        default=None,
        help="Python work to launch a prompt's or a mixed step's forward (eager on CUDA)",
    )
    parser.add_argument(
        "--admission-wait-steps", type=int, default=None, help="the engine's setting"
    )
    parser.add_argument(
        "--device-table",
        action="store_true",
        help="keep the request table twice, as on a GPU (its writes sent with the inputs)",
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, choices=range(1, 1000), metavar="N")
    parser.add_argument("--decode-steps", type=int, default=8, help="steps per decode run")
    parser.add_argument("--workload", choices=list(WORKLOADS), help="only this one")
    parser.add_argument("--baseline", default=None, help="a commit to compare against")
    parser.add_argument("--rounds", type=int, default=3, help="alternations with --baseline")
    parser.add_argument("--loop", action="append", help="only this loop (its label; repeatable)")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:  # one loop of one workload, on the runtime under `args.side`
        sys.path.insert(0, args.side)
        (label,) = args.loop
        result = _run_loop(args, args.workload, _loops(args.decode_steps)[label])
        import lmprog_runtime

        print(json.dumps({**result, "runtime": lmprog_runtime.__file__}))
        return
    eager = "" if args.eager_launch_ms is None else f" ({args.eager_launch_ms:g} ms eager)"
    waits = (
        ""
        if args.admission_wait_steps is None
        else f", admission_wait_steps {args.admission_wait_steps}"
    )
    table = ", the request table mirrored on the device" if args.device_table else ""
    print(
        f"batch {args.batch}, emulated device step {args.device_ms:g} ms after "
        f"{args.launch_ms:g} ms of launching{eager}, greedy{waits}{table}"
    )
    loops = _loops(args.decode_steps)
    if args.loop:
        unknown = [label for label in args.loop if label not in loops]
        if unknown:
            parser.error(f"--loop: unknown {unknown}; the loops are {list(loops)}")
        loops = {label: loops[label] for label in args.loop}
    for workload, title in WORKLOADS.items():
        if args.workload not in (None, workload):
            continue
        print(f"{title}:")
        for label, loop in loops.items():
            if args.baseline:
                _compare(args, workload, label)
                continue
            r = _run_loop(args, workload, loop)
            share = r["host_ms"] / r["step_ms"]
            print(
                f"  {label:36}: step {r['step_ms']:.3f} ms, host {r['host_ms']:.3f} ms "
                f"({share:.0%}; device idle {r['idle_in_span']:.0%} between its first and "
                f"last forward), the generate {r['run_ms']:.0f} ms ({r['forwards']} forwards, "
                f"{r['prompt_forwards']} with prompts); CPU per step: loop "
                f"{r['loop_cpu_us']:.0f} us, launch "
                f"{r['forward_cpu_us']:.0f} us, draw {r['draw_cpu_us']:.0f} us"
            )


def _loops(n: int) -> dict[str, tuple]:
    """label -> (overlap, threaded worker, decode_steps[, held[, a graph per run[, a graph
    per single decode step]]])"""
    return {
        "synchronous": (False, True, 1),
        "overlapped, worker thread": (True, True, 1),
        "overlapped, one thread (CUDA)": (True, False, 1),
        "overlapped, one thread, step graphs (CUDA)": (True, False, 1, False, False, True),
        f"decode runs of {n}": (False, True, n),
        f"decode runs of {n}, overlapped (CUDA)": (True, False, n),
        f"decode runs of {n}, overlapped, held": (True, False, n, True),
        f"decode runs of {n}, one graph each (CUDA)": (False, True, n, False, True),
        f"decode runs of {n}, one graph each, overlapped (CUDA)": (True, False, n, False, True),
        "auto runs, one graph each, step graphs (CUDA)": (True, False, "auto", False, True, True),
    }


def _run_loop(args: argparse.Namespace, workload: str, loop: tuple) -> dict:
    overlap, threaded, steps, *rest = loop
    hold, graph_runs, graph_steps = (*rest, False, False, False)[:3]
    device_s, launch_s = args.device_ms / 1e3, args.launch_ms / 1e3
    eager_s = None if args.eager_launch_ms is None else args.eager_launch_ms / 1e3
    return host_path(
        args.batch, device_s, launch_s, args.tokens, args.repeats, overlap, threaded, steps,
        workload, hold, graph_runs, eager_s, args.admission_wait_steps, graph_steps,
        args.device_table,
    )  # fmt: skip


def _compare(args: argparse.Namespace, workload: str, label: str) -> None:
    """`label`'s loop on this tree and on `args.baseline`, alternated, each run in a process
    of its own; each side's best step, generate and loop CPU time, and this tree's
    speed-ups (the generate's where the two sides run different numbers of forwards)."""
    baseline = harness.baseline_worktree(args.baseline)
    sides = {"this tree": (ROOT, dict(os.environ)), args.baseline: baseline}
    best: dict[str, dict] = {}
    for round_ in range(args.rounds):
        for name in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
            root, env = sides[name]
            cmd = [sys.executable, __file__, "--side", str(root), "--loop", label]
            cmd += ["--workload", workload, "--batch", str(args.batch)]
            cmd += ["--device-ms", str(args.device_ms), "--launch-ms", str(args.launch_ms)]
            cmd += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
            cmd += ["--decode-steps", str(args.decode_steps)]
            if args.eager_launch_ms is not None:
                cmd += ["--eager-launch-ms", str(args.eager_launch_ms)]
            if args.admission_wait_steps is not None:
                cmd += ["--admission-wait-steps", str(args.admission_wait_steps)]
            if args.device_table:
                cmd += ["--device-table"]
            r = harness.run_side(cmd, root, env)
            kept = best.setdefault(name, {"step_ms": 1e9, "run_ms": 1e9, "loop_cpu_us": 1e9})
            for key in kept:
                kept[key] = min(kept[key], r.get(key, 1e9))  # (an old side has no run_ms)
    ours, base = best["this tree"], best[args.baseline]
    print(
        f"  {label:36}: step {base['step_ms']:.3f} -> {ours['step_ms']:.3f} ms "
        f"({base['step_ms'] / ours['step_ms']:.2f}x); the generate {base['run_ms']:.0f} -> "
        f"{ours['run_ms']:.0f} ms ({base['run_ms'] / ours['run_ms']:.2f}x); loop CPU "
        f"{base['loop_cpu_us']:.0f} -> {ours['loop_cpu_us']:.0f} us "
        f"({base['loop_cpu_us'] / ours['loop_cpu_us']:.2f}x)"
    )


if __name__ == "__main__":
    main()
