"""Programs with mixed-length generations: the lazy executor against a94fbee's two executors.

Workloads (issue 12), 64 programs each, greedy, float32. Every generation has a stop string
and its own `max_tokens`, drawn per program from a spread where most are short (2-8 tokens)
and about one in six runs 40+, so generations of very different lengths run side by side:
- tree of thought: 3 ideas, each checked 3 times in a nested fork, then a final answer;
- skeleton of thought: a 3-point outline, each point expanded in a fork, then a summary;
- ReAct: up to 4 steps of thought, `select` of an action (`finish` offered from a step that
  depends on the program), Python branching on that action and a tool call whose
  observation is appended, then an answer.

Three executors run the same programs on the same runtime code and engine settings:
- `new`: this working tree's `Function.run_batch` (lazy: the body runs once, ready nodes of
  every program are submitted at once);
- `waves`: `run_batch` of commit a94fbee (traced, run as waves in lockstep; what the tracer
  cannot see runs eagerly, the body a second time);
- `eager`: a94fbee's `run_batch(eager=True)` (one executor thread per program state).
The old frontend has the same package name, so each executor runs in its own subprocess:
a94fbee's `lmprog` package (from a git worktree at /tmp/lmprog-a94fbee, copied alone to
/tmp/lmprog-old-front) is put first on PYTHONPATH, with this tree's `lmprog_runtime`
(`--old-runtime a94fbee` runs the old frontend on the old runtime instead). A worker loads
the engine, warms it and every workload on inputs the timed run does not use (untimed),
then times each workload with the cache flushed and counters reset before it, and prints
JSON: seconds, `engine.stats()`, and every program's text, variables and return value.
Rounds alternate the executors' order (ABC, CBA, ...); a fresh worker runs each executor
in each round. Outputs are compared program by program with the eager executor's; a
mismatch is reported, never fatal.

    .venv/bin/python benchmarks/bench_programs.py [--model small,smollm2-135m-instruct]
        [--programs 64] [--repeats 2] [--quick]
    .venv/bin/python benchmarks/bench_programs.py --worker waves --model small --workload react
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import harness

ROOT = Path(__file__).resolve().parent.parent
OLD_COMMIT = "a94fbee"
OLD_WORKTREE = Path("/tmp/lmprog-a94fbee")
OLD_FRONT = Path("/tmp/lmprog-old-front")  # a94fbee's `lmprog` alone, on the current runtime
EXECUTORS = ("new", "waves", "eager")
EXECUTOR_NAMES = {
    "new": "lazy (this tree)",
    "waves": f"waves ({OLD_COMMIT})",
    "eager": f"thread per program ({OLD_COMMIT})",
}
WORKLOAD_NAMES = {
    "tot": "tree of thought (3 ideas x 3 checks + answer)",
    "sot": "skeleton of thought (3-point outline, 3 forks, summary)",
    "react": "ReAct (up to 4 thought/select/tool steps + answer)",
}
DEFAULT_MODELS = "small,smollm2-135m-instruct"
RUNTIMES = {
    "current": "all on this tree's runtime",
    OLD_COMMIT: f"the lazy one on this tree's runtime, the old ones on {OLD_COMMIT}'s own",
}
ENGINE_KW = {"max_total_tokens": 65536, "max_running_requests": 256}
# max_tokens spread: mostly short, one in six long, so lockstep waves wait on the long ones.
LENGTHS = (2, 3, 4, 6, 8, 44)
LENGTH_WEIGHTS = (2, 2, 2, 2, 2, 2)


# ---- programs: written for both frontends (a94fbee's and the new one) ----------------------
# Only what a94fbee accepts: positional `fork(n)`, `join()`, gens with stop and max_tokens,
# `select`, roles; no `forks[i] += ...`, no `dtype` (a94fbee returned an int).


def lengths_for(workload: str, i: int, n: int) -> list[int]:
    rng = random.Random(f"{workload}-{i}")
    return rng.choices(LENGTHS, weights=LENGTH_WEIGHTS, k=n)


def build_programs(lp: Any) -> dict[str, Any]:
    @lp.function
    def tree_of_thought(s, question, lengths):
        s += lp.user(f"Solve step by step: {question}")
        s += lp.assistant_begin()
        s += "Let us consider three ideas."
        ideas = s.fork(3)
        for i, idea in enumerate(ideas):
            idea += f"\nIdea {i + 1}:" + lp.gen("idea", max_tokens=lengths[i], stop="\n")
            checks = idea.fork(3)
            for j, check in enumerate(checks):
                check += f"\nCheck {j + 1}:" + lp.gen(
                    "check", max_tokens=lengths[3 + 3 * i + j], stop="\n"
                )
            checks.join()
        ideas.join()
        s += "\nFinal answer:" + lp.gen("answer", max_tokens=lengths[12], stop="\n")
        s += lp.assistant_end()

    @lp.function
    def skeleton_of_thought(s, topic, lengths):
        s += lp.system("You write short, structured answers.")
        s += lp.user(f"Give 3 key points about {topic}.")
        with s.assistant():
            for i in range(3):
                s += f"{i + 1}." + lp.gen(f"point_{i}", max_tokens=lengths[i], stop="\n") + "\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += lp.user(f"Expand point {i + 1} in one sentence.")
            f += lp.assistant(lp.gen("detail", max_tokens=lengths[3 + i], stop="\n"))
        forks.join()
        s += lp.user("Summarize all of it in one line.")
        s += lp.assistant(lp.gen("summary", max_tokens=lengths[6], stop="\n"))

    @lp.function
    def react(s, question, lengths, min_steps, max_steps=4):
        s += lp.system("Answer by thinking, then acting. Actions: search, lookup, finish.")
        s += lp.user(question)
        s += lp.assistant_begin()
        steps = 0
        for step in range(max_steps):
            steps += 1
            s += f"Thought {step + 1}:" + lp.gen(
                f"thought_{step}", max_tokens=lengths[3 * step], stop="\n"
            )
            can_finish = ["finish"] if step + 1 >= min_steps else []
            s += f"\nAction {step + 1}: " + lp.select(
                f"action_{step}", choices=["search", "lookup", *can_finish]
            )
            action = s[f"action_{step}"]  # Python branches on a generated value
            if action == "finish":
                break
            s += "[" + lp.gen(f"arg_{step}", max_tokens=lengths[3 * step + 1], stop="]") + "]"
            s += f"\nObservation {step + 1}: {tool(action, s[f'arg_{step}'])}\n"
        s += "\nAnswer:" + lp.gen("answer", max_tokens=lengths[12], stop="\n")
        s += lp.assistant_end()
        return steps

    return {"tot": tree_of_thought, "sot": skeleton_of_thought, "react": react}


TOOL_CALLS = [0]
_TOOL_LOCK = threading.Lock()


def tool(action: str, arg: str) -> str:
    """A deterministic stand-in for a search or lookup API; counts its calls."""
    with _TOOL_LOCK:
        TOOL_CALLS[0] += 1
    h = zlib.crc32(f"{action}:{arg}".encode())
    if action == "search":
        return f"{h % 1000} pages mention it; the first says {h % 7} things."
    return f"entry {h % 97}: see also entry {h % 13}."


def make_inputs(workload: str, i: int) -> dict[str, Any]:
    lengths = lengths_for(workload, i, 13)
    if workload == "tot":
        question = f"How many ways can {i + 2} people share {i + 5} apples?"
        return {"question": question, "lengths": lengths}
    if workload == "sot":
        return {"topic": f"topic number {i}", "lengths": lengths}
    question = f"Who wrote the book with catalog number {1000 + 7 * i}?"
    return {"question": question, "lengths": lengths, "min_steps": 1 + i % 4}


VARIABLES = {
    "tot": ("idea", "check", "answer"),
    "sot": ("point_0", "point_1", "point_2", "detail", "summary"),
    "react": tuple(f"{k}_{n}" for n in range(4) for k in ("thought", "action", "arg"))
    + ("answer",),
}


def snapshot(state: Any, workload: str) -> dict[str, Any]:
    """What a program produced: text, variables (gathered lists after joins), return value."""
    error = state.error()
    if error is not None:
        return {"error": f"{type(error).__name__}: {error}"}
    variables = {n: state[n] for n in VARIABLES[workload] if n in state}
    ret = state.ret_value
    return {"text": state.text(), "vars": variables, "ret": ret if ret is None else str(ret)}


# ---- worker: one executor, one model, in its own process ------------------------------------


def worker(args: argparse.Namespace) -> None:
    import lmprog as lp
    import lmprog_runtime

    programs = build_programs(lp)
    extra = {"eager": True} if args.worker == "eager" else {}
    path = harness.resolve_model(args.model)
    start = time.perf_counter()
    engine = lp.Engine(path, dtype=args.dtype, **ENGINE_KW)
    load_s = time.perf_counter() - start
    harness.warm_engine(engine)
    workloads = args.workload.split(",")
    steps = count_steps(engine)

    def run(workload: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        states = programs[workload].run_batch(items, backend=engine, temperature=0, **extra)
        return [snapshot(s, workload) for s in states]

    for workload in workloads:  # warm every path, on inputs the timed runs do not use
        run(workload, [make_inputs(workload, 10_000 + k) for k in range(3)])
    harness.flush(engine)

    out: dict[str, Any] = {
        "executor": args.worker,
        "lmprog": lp.__file__,
        "lmprog_runtime": lmprog_runtime.__file__,
        "load_s": load_s,
        "param_dtype": harness.param_dtype(engine.runner.model),
        "workloads": {},
    }
    for workload in workloads:
        items = [make_inputs(workload, i) for i in range(args.programs)]
        harness.flush(engine)
        TOOL_CALLS[0] = 0
        gc.collect()
        threads_before = threading.active_count()
        steps.clear()
        start = time.perf_counter()
        snaps = run(workload, items)
        seconds = time.perf_counter() - start
        stats = {k: round(v, 3) for k, v in engine.stats().items() if isinstance(v, (int, float))}
        stats.update(steps)
        out["workloads"][workload] = {
            "seconds": seconds,
            "forward_passes": stats.get("forward_passes"),
            "stats": stats,
            "tool_calls": TOOL_CALLS[0],
            "threads_before": threads_before,
            "threads_after": threading.active_count(),
            "digest": hashlib.sha1(json.dumps(snaps, sort_keys=True).encode()).hexdigest(),
            "errors": sum("error" in s for s in snaps),
            "outputs": snaps,
        }
        print(f"  [{args.worker}] {workload}: {seconds:.2f} s", file=sys.stderr, flush=True)
    engine.shutdown()
    Path(args.out).write_text(json.dumps(out), encoding="utf-8")


def count_steps(engine: Any) -> dict[str, int]:
    """Counts extend (prefill) forwards and the requests in them, besides the engine's own
    counters, by wrapping its stats recorder (the same on both runtimes; nothing else
    changes). Empty if the engine has no such recorder."""
    counts: dict[str, int] = {}
    recorder = getattr(engine, "_stats", None)
    record = getattr(recorder, "record_step", None)
    if record is None:
        return counts

    def record_step(batch: Any, **kw: Any) -> Any:
        if getattr(batch.mode, "name", "") == "EXTEND":
            counts["extend_forwards"] = counts.get("extend_forwards", 0) + 1
            counts["extend_requests"] = counts.get("extend_requests", 0) + len(batch.reqs)
        return record(batch, **kw)

    recorder.record_step = record_step
    return counts


# ---- driver ---------------------------------------------------------------------------------


def prepare_old(old_runtime: str) -> str:
    """PYTHONPATH for a94fbee's frontend: its `lmprog` first, the chosen runtime after it."""
    if not (OLD_WORKTREE / "lmprog").is_dir():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(OLD_WORKTREE), OLD_COMMIT],
            check=True,
        )
    head = subprocess.run(
        ["git", "-C", str(OLD_WORKTREE), "rev-parse", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    want = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", OLD_COMMIT],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if head != want:
        raise RuntimeError(f"{OLD_WORKTREE} is at {head}, not {OLD_COMMIT}")
    if old_runtime == OLD_COMMIT:
        return str(OLD_WORKTREE)
    shutil.rmtree(OLD_FRONT, ignore_errors=True)
    shutil.copytree(OLD_WORKTREE / "lmprog", OLD_FRONT / "lmprog")
    adapt_old_front(OLD_FRONT / "lmprog" / "interpreter.py")
    return f"{OLD_FRONT}{os.pathsep}{ROOT}"


def adapt_old_front(interpreter: Path) -> None:
    """The one change a94fbee's frontend needs on this runtime: its select read logprob
    entries as (logprob, token) pairs, which became SGLang's (logprob, token, text)
    triples in 930802d (every select then failed, and the failures compared equal)."""
    text = interpreter.read_text(encoding="utf-8")
    pair = "[lp for lp, _ in o["
    if text.count(pair) != 2:
        raise RuntimeError(f"{interpreter}: a94fbee's select is not as expected")
    interpreter.write_text(text.replace(pair, "[lp for lp, *_ in o["), encoding="utf-8")


def runtime_changed() -> bool:
    diff = subprocess.run(
        ["git", "-C", str(ROOT), "diff", "--stat", OLD_COMMIT, "--", "lmprog_runtime"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return bool(diff)


def run_worker(
    executor: str, model: str, args: argparse.Namespace, paths: dict[str, str], tmp: Path
) -> dict[str, Any]:
    out = tmp / f"{executor}-{time.monotonic_ns()}.json"
    env = {**os.environ, "PYTHONPATH": paths[executor]}
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        executor,
        "--model",
        model,
        "--workload",
        ",".join(args.workloads),
        "--programs",
        str(args.programs),
        "--dtype",
        args.dtype,
        "--out",
        str(out),
    ]
    subprocess.run(cmd, env=env, check=True, cwd=str(ROOT / "benchmarks"))
    result = json.loads(out.read_text(encoding="utf-8"))
    out.unlink()
    expect = OLD_FRONT if executor != "new" and args.old_runtime != OLD_COMMIT else None
    expect = expect or (ROOT if executor == "new" else OLD_WORKTREE)
    if not Path(result["lmprog"]).resolve().is_relative_to(expect):
        raise RuntimeError(f"{executor} imported lmprog from {result['lmprog']}, not {expect}")
    runtime = OLD_WORKTREE if executor != "new" and args.old_runtime == OLD_COMMIT else ROOT
    if not Path(result["lmprog_runtime"]).resolve().is_relative_to(runtime):
        raise RuntimeError(f"{executor} imported {result['lmprog_runtime']}, not {runtime}'s")
    return result


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
                return f"{key}.{first_difference(a[key], b[key])}"
            return key
    return "?"


def compare(outputs: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """Programs equal to the reference's; a failed program is never equal (two failures
    once compared equal, and a run where every select failed read as matching)."""
    pairs = list(zip(outputs, reference, strict=True))
    differ = [i for i, (a, b) in enumerate(pairs) if a != b or "error" in a]
    return {
        "num": len(reference),
        "num_equal": len(reference) - len(differ),
        "differ": differ,
        "first_difference": {
            i: outputs[i]["error"] if "error" in outputs[i] else first_difference(*pairs[i])
            for i in differ[:8]
        },
    }


def extends(results: list[dict[str, Any]]) -> str:
    """` (N extend)`: the median number of extend forwards, when the worker counted them."""
    counts = [w["stats"].get("extend_forwards") for w in results]
    if None in counts:
        return ""
    return f" ({statistics.median_low(counts)} extend)"


def ratio_cell(base: list[float], ours: list[float]) -> str:
    """`base / ours` of best and of median, and the range of the per-round ratios."""
    per_round = [b / o for b, o in zip(base, ours)]
    text = (
        f"{min(base) / min(ours):.2f}x / {statistics.median(base) / statistics.median(ours):.2f}x"
    )
    if len(per_round) > 1:
        text += f" ({min(per_round):.2f}-{max(per_round):.2f})"
    return text


def summarize(
    model: str, args: argparse.Namespace, rounds: list[dict[str, dict[str, Any]]]
) -> dict[str, Any]:
    rows, checks, timings, notes = [], {}, {}, []
    for workload in args.workloads:
        per = {
            ex: [r[ex]["workloads"][workload] for r in rounds] for ex in args.executors
        }  # executor -> its result in each round
        secs = {ex: [w["seconds"] for w in per[ex]] for ex in per}
        fwd = {ex: [w["forward_passes"] for w in per[ex]] for ex in per}
        ref_ex = "eager" if "eager" in per else args.executors[0]
        reference = per[ref_ex][0]["outputs"]
        checks[workload] = {}
        for ex in args.executors:
            cmp = [compare(w["outputs"], reference) for w in per[ex]]
            worst = min(cmp, key=lambda c: c["num_equal"])
            checks[workload][ex] = worst
            if ex == ref_ex:
                same = all(c["num_equal"] == c["num"] for c in cmp)
                outputs = "reference" + ("" if same else f" (rounds differ: {worst['differ']})")
            else:
                outputs = f"{worst['num_equal']}/{worst['num']} equal to {ref_ex}"
                if worst["differ"]:
                    outputs += f" (differ: {worst['differ'][:8]})"
                    notes.append(
                        f"{WORKLOAD_NAMES[workload]}: {ex} differs from {ref_ex} in programs "
                        f"{worst['differ']}; first differing field: {worst['first_difference']}"
                    )
            fw = statistics.median_low(fwd[ex])
            spread = "" if min(fwd[ex]) == max(fwd[ex]) else f" ({min(fwd[ex])}-{max(fwd[ex])})"
            row = {
                "workload": WORKLOAD_NAMES[workload],
                "executor": EXECUTOR_NAMES[ex],
                "time (s, best / median)": f"{min(secs[ex]):.2f} / {statistics.median(secs[ex]):.2f}",
                "forward passes (of them extend)": f"{fw}{spread}{extends(per[ex])}",
            }
            if "new" in per:
                if ex == "new":
                    row["new's speedup (best / median, per-round range)"] = "1.00x"
                    row["new's forward passes"] = "1.00x"
                else:
                    row["new's speedup (best / median, per-round range)"] = ratio_cell(
                        secs[ex], secs["new"]
                    )
                    row["new's forward passes"] = f"{statistics.median_low(fwd['new']) / fw:.2f}x"
            row["outputs"] = outputs
            rows.append(row)
            w0 = per[ex][0]
            timings[f"{workload}: {ex}"] = {
                "all_s": secs[ex],
                "forwards": fwd[ex],
                "extend_forwards": [w["stats"].get("extend_forwards") for w in per[ex]],
                "extend_requests": [w["stats"].get("extend_requests") for w in per[ex]],
                "engine_step_seconds": [w["stats"].get("step_seconds") for w in per[ex]],
                "decode_tokens": [w["stats"].get("decode_tokens") for w in per[ex]],
                "prefill_tokens": [w["stats"].get("prefill_tokens") for w in per[ex]],
                "cached_tokens": [w["stats"].get("cached_tokens") for w in per[ex]],
                "max_running_requests_seen": [
                    w["stats"].get("max_running_requests_seen") for w in per[ex]
                ],
                "tool_calls": [w["tool_calls"] for w in per[ex]],
                "threads_after_minus_before": [
                    w["threads_after"] - w["threads_before"] for w in per[ex]
                ],
                "errors": [w["errors"] for w in per[ex]],
                "digest": w0["digest"],
            }
        calls = {ex: sorted({w["tool_calls"] for w in per[ex]}) for ex in per}
        left = {
            ex: sorted({w["threads_after"] - w["threads_before"] for w in per[ex]}) for ex in per
        }
        extra = ""
        if any(c != [0] for c in calls.values()):
            extra = "tool calls " + ", ".join(f"{ex} {calls[ex]}" for ex in per) + "; "
        notes.append(
            f"{WORKLOAD_NAMES[workload]}: {extra}threads left running after run_batch "
            + ", ".join(f"{ex} {left[ex]}" for ex in per)
            + "."
        )
    return {"rows": rows, "checks": checks, "timings": timings, "notes": notes}


def without_model(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--model":
            skip = True
        elif not a.startswith("--model="):
            out.append(a)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"comma-separated (default {DEFAULT_MODELS})")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=2, help="rounds, order alternating")
    parser.add_argument(
        "--results-dir", default=None, help="benchmarks/results (--quick: a folder under /tmp)"
    )
    parser.add_argument("--programs", type=int, default=None, help="programs per workload (64)")
    parser.add_argument("--workload", default="tot,sot,react")
    parser.add_argument("--executors", default=",".join(EXECUTORS))
    parser.add_argument(
        "--old-runtime",
        default="current",
        choices=["current", OLD_COMMIT],
        help="runtime under a94fbee's frontend: this tree's (default) or a94fbee's own",
    )
    parser.add_argument("--quick", action="store_true", help="16 programs, small model only")
    parser.add_argument("--worker", choices=EXECUTORS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.programs = args.programs or (16 if args.quick else 64)
    args.model = args.model or ("small" if args.quick else DEFAULT_MODELS)
    quick_dir = Path(tempfile.gettempdir()) / "bench_programs-quick"
    args.results_dir = args.results_dir or str(quick_dir if args.quick else harness.RESULTS_DIR)
    if args.worker:
        return worker(args)

    args.workloads = args.workload.split(",")
    args.executors = args.executors.split(",")
    old_path = prepare_old(args.old_runtime)
    paths = {"new": str(ROOT), "waves": old_path, "eager": old_path}
    changed = runtime_changed()
    print(
        f"old frontend from {old_path.split(os.pathsep)[0]}; runtime under it: "
        f"{'a94fbee' if args.old_runtime == OLD_COMMIT else 'this tree'} "
        f"(lmprog_runtime {'changed' if changed else 'unchanged'} since {OLD_COMMIT})"
    )
    with tempfile.TemporaryDirectory(prefix="bench_programs-") as tmpdir:
        for model in args.model.split(","):
            print(f"model={model} programs={args.programs} workloads={args.workloads}")
            rounds: list[dict[str, dict[str, Any]]] = []
            for r in range(args.repeats):
                order = args.executors if r % 2 == 0 else args.executors[::-1]
                results = {}
                for ex in order:
                    results[ex] = res = run_worker(ex, model, args, paths, Path(tmpdir))
                    times = ", ".join(
                        f"{w}: {res['workloads'][w]['seconds']:.2f} s "
                        f"({res['workloads'][w]['forward_passes']} fwd)"
                        for w in args.workloads
                    )
                    print(f"  round {r + 1}: {ex}: {times}", flush=True)
                rounds.append(results)
            summary = summarize(model, args, rounds)
            first = rounds[0]
            run_args = argparse.Namespace(
                model=model, dtype=args.dtype, repeats=args.repeats, results_dir=args.results_dir
            )
            # On a94fbee's own runtime the result is the system as it was: kept apart.
            bench = "programs" if args.old_runtime != OLD_COMMIT else "programs_a94fbee"
            argv, sys.argv = sys.argv, [*without_model(sys.argv), "--model", model]
            harness.write_result(  # the command recorded is this model's alone
                run_args,
                bench,
                {
                    "title": "Lazy executor vs a94fbee's waves and thread-per-program executors"
                    + (" (each on its own runtime)" if args.old_runtime == OLD_COMMIT else ""),
                    "workload": (
                        f"{args.programs} programs per workload, greedy; every gen has a stop "
                        f"string and a max_tokens drawn from {list(LENGTHS)} (1 in 6 long); "
                        f"each executor in its own process, {RUNTIMES[args.old_runtime]}, "
                        f"engine settings {ENGINE_KW}; {args.repeats} rounds alternating the "
                        "executors' order, each warmed on other inputs, the cache flushed "
                        "before each workload; speedup = executor's time / new's time"
                    ),
                    "columns": list(summary["rows"][0]),
                    "rows": summary["rows"],
                    "notes": summary["notes"],
                    "param_dtypes": {ex: first[ex]["param_dtype"] for ex in args.executors},
                    "imports": {
                        ex: [first[ex]["lmprog"], first[ex]["lmprog_runtime"]]
                        for ex in args.executors
                    },
                    "load_s": {ex: first[ex]["load_s"] for ex in args.executors},
                    "timings": summary["timings"],
                    "checks": summary["checks"],
                },
            )
            sys.argv = argv


if __name__ == "__main__":
    main()
