"""The harness every benchmark runs through, so that each ratio compares equal work.

It owns what the benchmarks must do alike: resolve `--model`, load transformers' baseline
on the same weights and dtype, warm both sides the same way, time phases in alternating
order (ABBA...) with caches flushed between them, compare outputs, record the machine, and
write one JSON result per benchmark and model into `benchmarks/results/`, from which
`report.py` writes the README tables. Timings never leave this harness as assertions.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import torch

START = time.perf_counter()
RESULTS_DIR = Path(__file__).resolve().parent / "results"
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
# Warm-ups use a prompt no benchmark uses, so no cache keeps a benchmark prompt from them.
WARMUP_TEXT = "Warm-up only: a short sentence that no benchmark prompt starts with."


def add_common_args(parser: argparse.ArgumentParser, repeats: int = 3) -> None:
    parser.add_argument(
        "--model", default="small", help="named model (tiny, small, ...), HF dir or .gguf"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=repeats, help="rounds, order alternating")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument(
        "--table-suffix",
        default="",
        help="appended to the result's table name (`cpu_avx512_bf16_zen5`): a table of its "
        "own for a machine whose kind another table already holds",
    )


def resolve_model(name_or_path: str) -> str:
    """The local path of a named model, HF directory or GGUF file."""
    from lmprog_runtime import resolve_model_path

    return resolve_model_path(name_or_path)


def model_label(name_or_path: str) -> str:
    """A file-name-safe model name: `small`, `smollm2-135m-instruct`, a path's stem."""
    from lmprog_runtime.models.registry import ALIASES  # `instruct` -> its full name

    stem = ALIASES.get(name_or_path, Path(name_or_path).name)
    stem = stem[: -len(".gguf")] if stem.endswith(".gguf") else stem
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).lower() or "model"


def load_hf_model(path: str, dtype: str) -> Any:
    """transformers' own model for the baseline, on the weights the engine runs.

    A GGUF file is read from its converted checkpoint directory (dequantized once by
    lmprog_runtime; tests/runtime/test_gguf.py checks that conversion against transformers'
    own GGUF loading), which loads in seconds where `gguf_file=` takes half a minute.
    """
    from transformers import AutoModelForCausalLM

    from lmprog_runtime import local_model_dir

    return AutoModelForCausalLM.from_pretrained(
        local_model_dir(path), dtype=getattr(torch, dtype)
    ).eval()


def load_hf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    from lmprog_runtime import local_model_dir

    return AutoTokenizer.from_pretrained(local_model_dir(path))


def param_dtype(model: torch.nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def hf_generate(
    model: Any, prompts: Sequence[list[int]], new_tokens: int, batch_size: int
) -> list[list[int]]:
    """Greedy batched `generate` over equal-length prompts (no padding); exactly `new_tokens`
    each: `min_new_tokens` masks EOS as the engine's `min_new_tokens` does."""
    outs: list[list[int]] = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = torch.tensor(prompts[i : i + batch_size], device=model.device)
            out = model.generate(
                chunk,
                attention_mask=torch.ones_like(chunk),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.extend(out[:, chunk.shape[1] :].tolist())
    return outs


def warm_hf(model: Any, tokenizer: Any) -> None:
    """A short generate on the warm-up prompt: the same warm-up the engine gets."""
    ids = tokenizer(WARMUP_TEXT).input_ids
    hf_generate(model, [ids], 4, 1)


def warm_engine(engine: Any, params: dict[str, Any] | None = None) -> None:
    """A short generate on the warm-up prompt, then a flush: nothing of it stays cached."""
    engine.generate(WARMUP_TEXT, {"temperature": 0, **(params or {}), "max_new_tokens": 4})
    flush(engine)


def flush(engine: Any) -> None:
    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused: requests still running")
    engine.reset_stats()


@dataclass
class Phase:
    """One timed side of a comparison: `before` (untimed: flush, reset) then `run`.

    With `timed_by_run`, `run` returns `(seconds, value)` and those seconds are recorded
    instead of the wall time around the call: for work timed where it runs (in a worker
    process, say, so that sending the command and the outputs is not counted)."""

    name: str
    run: Callable[[], Any]
    before: Callable[[], None] | None = None
    timed_by_run: bool = False
    seconds: list[float] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def timing(self) -> dict[str, Any]:
        return {"min_s": self.best, "median_s": self.median, "all_s": self.seconds}


def best_seconds(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """The best, over `repeats` rounds, of a round's mean seconds per call of `fn` (`iters`
    calls a round), after one call to warm up: for micro-benchmarks in one process."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def alternate(phases: Sequence[Phase], rounds: int, first_round: int = 0) -> None:
    """Run every phase once per round, forward order in even rounds and reversed in odd
    ones (ABBA...), so neither side always runs first on a machine that warms or drifts."""
    for r in range(first_round, first_round + rounds):
        order = list(phases) if r % 2 == 0 else list(reversed(phases))
        for phase in order:
            if phase.before is not None:
                phase.before()
            gc.collect()
            start = time.perf_counter()
            value = phase.run()
            seconds = time.perf_counter() - start
            if phase.timed_by_run:
                seconds, value = value
            phase.seconds.append(seconds)
            phase.values.append(value)
            print(f"  round {r + 1}: {phase.name}: {phase.seconds[-1]:.2f} s", flush=True)


def compare_tokens(ours: Sequence[list[int]], reference: Sequence[list[int]]) -> dict[str, Any]:
    """How many sequences are token-identical, and where the others first differ."""
    first_diff = []
    for a, b in zip(ours, reference, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if a != b:
            first_diff.append(n)
    return {"num": len(ours), "num_equal": len(ours) - len(first_diff), "first_diff": first_diff}


def describe_match(cmp: dict[str, Any], what: str) -> str:
    """`64/64 token-identical to transformers`, with first differences when some differ."""
    text = f"{cmp['num_equal']}/{cmp['num']} {what}"
    if cmp["first_diff"]:
        text += f" (others differ from token {min(cmp['first_diff'])})"
    return text


def machine_info() -> dict[str, Any]:
    """CPU model and the flags that decide kernels and dtypes; library versions; threads."""
    cpu, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cpu_flags": {f: f in flags for f in CPU_FLAGS},
        "logical_cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def bf16_kind() -> str:
    """How this CPU multiplies bfloat16: 'amx' (tiles), 'avx512_bf16' (dot products) or
    'no_bf16'. The CPU benchmarks write one table per kind (`cpu`, `cpu_avx512_bf16`, ...):
    the README keeps each kind of machine's figures side by side."""
    flags = machine_info()["cpu_flags"]
    if flags["amx_bf16"] and flags["amx_tile"]:
        return "amx"
    return "avx512_bf16" if flags["avx512_bf16"] else "no_bf16"


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    rel = script.relative_to(script.parent.parent) if script.parent.name == "benchmarks" else script
    return shlex.join([".venv/bin/python", str(rel), *sys.argv[1:]])


def write_result(args: argparse.Namespace, bench: str, result: dict[str, Any]) -> Path:
    """`<results-dir>/<bench>-<model>.json`: what `report.py` turns into a README table.

    `result` holds `title`, `workload`, `columns` and `rows` (dicts of display cells,
    one key per column), plus raw timings and checks for anyone who wants to look deeper.
    """
    label = model_label(args.model)
    if getattr(args, "table_suffix", ""):
        bench = f"{bench}_{args.table_suffix}"
    payload = {
        "bench": bench,
        "model": label,
        "model_path": resolve_model(args.model),
        "command": command_line(),
        "date": date.today().isoformat(),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "total_seconds": round(time.perf_counter() - START, 1),  # the whole script's run
        "machine": machine_info(),
        **result,
    }
    out = Path(args.results_dir) / f"{bench}-{label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    print_table(payload)
    print(f"wrote {out}")
    return out


def print_table(payload: dict[str, Any]) -> None:
    cols = payload["columns"]
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in payload["rows"]:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    for note in payload.get("notes", []):
        print(note)


def speedup(baseline: Phase, ours: Phase) -> str:
    """`best / median` speed relative to the baseline, each from its own rounds."""
    return f"{baseline.best / ours.best:.2f}x / {baseline.median / ours.median:.2f}x"


# The columns of a table of output throughput against transformers.
THROUGHPUT_COLUMNS = [
    "system",
    "output tok/s (best)",
    "output tok/s (median)",
    "vs transformers (best / median)",
    "outputs",
]


def throughput_row(
    system: str, phase: Phase, base: Phase, total_out: int, outputs: str
) -> dict[str, str]:
    """One row of a THROUGHPUT_COLUMNS table: `phase` against the baseline `base`."""
    return {
        "system": system,
        "output tok/s (best)": f"{total_out / phase.best:.1f}",
        "output tok/s (median)": f"{total_out / phase.median:.1f}",
        "vs transformers (best / median)": speedup(base, phase),
        "outputs": outputs,
    }


def baseline_worktree(commit: str) -> tuple[Path, dict[str, str]]:
    """A git worktree of `commit` under the temp directory (made once) and the environment
    to run it in: a model cache of its own, since the native kernels' build directory is
    keyed by their sources and a second tree's absolute paths would rebuild them at every
    switch between the trees."""
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[1]
    # (named by the commit's hash: a name such as HEAD moves, and a worktree made for it
    # once would be reused after it moved)
    rev = ["git", "-C", str(root), "rev-parse", "--short=12", f"{commit}^{{commit}}"]
    commit = subprocess.run(rev, check=True, capture_output=True, text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"lmprog-{commit}"
    if not (path / "lmprog_runtime").is_dir():
        git = ["git", "-C", str(root), "worktree", "add", "--detach", str(path), commit]
        subprocess.run(git, check=True)
    cache = Path(tempfile.gettempdir()) / f"lmprog-cache-{commit}"
    return path, {**os.environ, "LMPROG_CACHE_DIR": str(cache)}


def sides(baseline: str | None) -> dict[str, tuple[Path, dict[str, str]]]:
    """The trees a comparison runs, name -> (root, environment): `baseline`'s worktree
    (`baseline_worktree`) first when given, then this tree."""
    this = {"this tree": (Path(__file__).resolve().parents[1], dict(os.environ))}
    return {baseline: baseline_worktree(baseline), **this} if baseline else this


def run_side(cmd: list[str], root: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run one side of a comparison (`cmd`, a process of its own, printing a JSON object
    last) and return that object, checked to have run `root`'s runtime (its "runtime")."""
    import subprocess

    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:  # (the child's own error, not only its exit status)
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(result["runtime"]).resolve().is_relative_to(root):
        raise RuntimeError(f"ran {result['runtime']}, not {root}'s runtime")
    return result


def run_rounds(
    sides: dict[str, tuple[Path, dict[str, str]]],
    rounds: int,
    command: Callable[[Path], list[str]],
) -> dict[str, list[dict[str, Any]]]:
    """Each side's results over `rounds` (side name -> one `run_side` result a round): the
    sides run `command(root)` in turn, in alternating order (ABBA...)."""
    seen: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for round_ in range(rounds):
        for name in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
            root, env = sides[name]
            seen[name].append(run_side(command(root), root, env))
    return seen


def range_cells(
    seen: dict[str, list[dict[str, Any]]], pick: Callable[[dict], float], digits: int = 3
) -> str:
    """Each side's range of `pick(result)` over its rounds (`run_rounds`' results):
    "name lo-hi; name lo-hi"."""
    cells = []
    for name, results in seen.items():
        values = [pick(r) for r in results]
        cells.append(f"{name} {min(values):.{digits}f}-{max(values):.{digits}f}")
    return "; ".join(cells)


def compare_sizes(
    script: str,
    option: str,
    default: str,
    help: str,
    measure: Callable[[Path, int], float],
    runtime_module: str,
) -> tuple[list[int], dict[str, list[dict[str, Any]]]] | None:
    """The main of a benchmark timed at a list of sizes (`--OPTION 1,2,...`, `measure(root,
    size)` each), with --baseline and --rounds: each side in a process of its own, which
    runs `script` with the hidden --side, measures and prints its results (then None is
    returned); the comparing process gets the sizes and `run_rounds`' results."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.split("\n\n")[0])
    parser.add_argument(f"--{option}", default=default, help=help)
    parser.add_argument("--baseline", default=None, help="a commit to compare against")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the sides")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    listed = getattr(args, option)
    sizes = [int(n) for n in listed.split(",")]
    if args.side:
        results = {n: measure(Path(args.side), n) for n in sizes}
        import importlib

        runtime = importlib.import_module(runtime_module).__file__  # (the side's, measured)
        print(json.dumps({**results, "runtime": runtime}))
        return None
    seen = run_rounds(
        sides(args.baseline),
        args.rounds,
        lambda root: [sys.executable, script, "--side", str(root), f"--{option}", listed],
    )
    return sizes, seen


def loop_count_args(description: str, tokens: int) -> argparse.Namespace:
    """The arguments of a benchmark that counts a loop's work per iteration, each tree's
    in a process of its own (`bench_loop_opcodes.py`, `bench_eager_ops.py`): --batch,
    --tokens (`tokens` by default), --baseline, and the hidden --side and --loop that one
    side's process runs with (`run_loop_side`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=tokens, help="new tokens per request")
    parser.add_argument("--baseline", default=None, help="a commit to compare against")
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--loop", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def run_loop_side(
    script: str, root: Path, loop: str, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """`script` counting `loop` on `root`'s runtime (`run_side`), with `args`' sizes."""
    cmd = [sys.executable, str(Path(script).resolve()), "--side", str(root), "--loop", loop]
    cmd += ["--batch", str(args.batch), "--tokens", str(args.tokens)]
    return run_side(cmd, root, env)
