"""Rewrite the README's benchmark tables from the JSON results the benchmarks wrote.

Each benchmark's part of README.md sits between `<!-- bench:NAME -->` and
`<!-- /bench:NAME -->`; a part is rewritten only when `benchmarks/results/NAME-*.json`
exists, so figures no run has replaced yet stay as they are. One table per benchmark holds
the rows of every model that has a result (`small` first), each row saying what it was
compared with and whether the outputs matched; below it, the command of each run and the
machine, library versions, threads and dtype it ran with. The numbers are never edited
by hand: run a benchmark (or `make bench`), then this script.

    .venv/bin/python benchmarks/report.py [--results-dir benchmarks/results] [--readme README.md]
"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL_ORDER = ("small", "smollm2-135m-instruct")
WIDTH = 92  # the README's prose width


def load_results(results_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """bench name -> its results, one per model, in MODEL_ORDER then by name."""
    by_bench: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(results_dir.glob("*.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        if "bench" not in result:  # (not a table: e.g. the GPU check's figures)
            continue
        by_bench.setdefault(result["bench"], []).append(result)

    def rank(result: dict[str, Any]) -> tuple[int, str]:
        model = result["model"]
        return (MODEL_ORDER.index(model) if model in MODEL_ORDER else len(MODEL_ORDER), model)

    return {bench: sorted(results, key=rank) for bench, results in by_bench.items()}


def machine_line(result: dict[str, Any]) -> str:
    m = result["machine"]
    has = [f for f, present in m["cpu_flags"].items() if present]
    lacks = [f for f, present in m["cpu_flags"].items() if not present]
    flags = f"flags {' '.join(has) or 'none of interest'}"
    if lacks:
        flags += f" (no {' '.join(lacks)})"
    # The dtypes the loaded weights really had, per side (not the requested --dtype).
    dtypes = result.get("param_dtypes") or {"engine": result["dtype"]}
    sides = sorted(set(dtypes.values()))
    if len(dtypes) > 1 and len(sides) == 1:
        weights = f"{sides[0]} weights on both sides"
    else:
        weights = ", ".join(f"{side} weights {dtype}" for side, dtype in dtypes.items())
    return (
        f"{m['cpu']}, {m['logical_cpus']} logical CPUs, {flags}; torch {m['torch']} with "
        f"{m['torch_threads']} threads, transformers {m['transformers']}; {weights}; "
        f"{result['repeats']} rounds; {result['date']}"
    )


def render(results: list[dict[str, Any]]) -> str:
    """The Markdown that goes between one benchmark's markers."""
    several = len(results) > 1

    def tagged(result: dict[str, Any], text: str) -> str:
        return f"`{result['model']}`: {text}" if several else text

    def prose(paragraphs: list[str]) -> list[str]:
        """Wrapped paragraphs, each followed by a blank line."""
        out: list[str] = []
        for p in paragraphs:
            out += [textwrap.fill(p, WIDTH, break_on_hyphens=False), ""]
        return out

    lines: list[str] = []
    if len({r["workload"] for r in results}) == 1:
        lines += prose([f"Workload: {results[0]['workload']}."])
    else:
        lines += prose([tagged(r, f"workload: {r['workload']}.") for r in results])
    lines += ["```"]
    lines.extend(r["command"] for r in results)
    lines += ["```", ""]
    columns = ["model", *results[0]["columns"]]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in results:
        for row in r["rows"]:
            cells = [r["model"], *(str(row.get(c, "")) for c in columns[1:])]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    machines = {machine_line(r) for r in results}
    if len(machines) == 1:
        lines += prose([f"Ran on: {machines.pop()}."])
    else:
        lines += prose([tagged(r, f"ran on: {machine_line(r)}.") for r in results])
    lines += prose([tagged(r, note) for r in results for note in r.get("notes", [])])
    return "\n".join(lines).rstrip("\n")


def rewrite(text: str, bench: str, block: str) -> str | None:
    """`text` with the part between bench's markers replaced; None if it has no markers."""
    pattern = re.compile(
        rf"(<!-- bench:{re.escape(bench)} -->\n)(?:.*?\n)?(<!-- /bench:{re.escape(bench)} -->)",
        re.DOTALL,
    )
    if not pattern.search(text):
        return None
    return pattern.sub(lambda m: m.group(1) + block.rstrip("\n") + "\n" + m.group(2), text, count=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    args = parser.parse_args()

    readme = Path(args.readme)
    text = readme.read_text(encoding="utf-8")
    results = load_results(Path(args.results_dir))
    if not results:
        print(f"no results in {args.results_dir}; README left as it is")
        return
    for bench, bench_results in results.items():
        updated = rewrite(text, bench, render(bench_results))
        if updated is None:
            print(f"README has no <!-- bench:{bench} --> markers: {bench} left out")
            continue
        text = updated
        print(f"{bench}: {', '.join(r['model'] for r in bench_results)}")
    readme.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
