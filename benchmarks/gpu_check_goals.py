"""Issue 18's goals, read off a GPU check's JSON: one line per figure, met or not.

The goals: the decode attention kernel at 70% of the HBM bandwidth or more, under 10% of
decode step time outside the GPU at batch 64, and at least 3x transformers' `generate`
on the shared-prefix workload. Beside them, what the run says of making
`decode_steps="auto"` CUDA's default: it should take decode runs on "small" and come under
the 10% there, and keep single steps on the 7B-shaped model ("large"). A figure the run
did not measure (a skipped or failed section or entry, an older check's JSON) says so.

`gpu_check.py` prints these lines when it ends, so a device run's log holds them even if
its JSON does not come back; on a JSON:

    python3 benchmarks/gpu_check_goals.py benchmarks/results/gpu_check-h200.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BANDWIDTH_GOAL = 0.70  # of the nominal HBM peak
OUTSIDE_GOAL = 0.10  # of decode step time
SHARED_PREFIX_GOAL = 3.0  # x transformers' generate
# `decode_overhead`'s entries, in the order they are printed ("default" first: the goal's).
OVERHEAD_ENTRIES = (
    "default",
    "decode_runs",
    "decode_runs_auto",
    "overlap_off",
    "cuda_graphs_off",
    "worker_thread",
    "medium",
)


def goal_lines(report: dict[str, Any]) -> list[str]:
    """The goals' figures in `report` (a GPU check's JSON, loaded), one line each.

    Example:
        >>> goal_lines({})[0]
        'decode attention bandwidth (goal >= 0.70 of the HBM peak): not measured (no section)'
    """
    return [*_bandwidth(report), *_outside(report), *_shared_prefix(report), *_auto(report)]


def _bandwidth(report: dict[str, Any]) -> list[str]:
    title = f"decode attention bandwidth (goal >= {BANDWIDTH_GOAL:.2f} of the HBM peak)"
    section = report.get("decode_bandwidth")
    cases = {k: v for k, v in (section or {}).items() if isinstance(v, dict) and "gbs" in v}
    if not cases:
        return [f"{title}: not measured ({_why(section)})"]
    lines = [f"{title}:"]
    for name, case in cases.items():
        fraction = case["fraction_of_nominal_peak"]
        copy = case.get("fraction_of_copy_bandwidth")
        of_copy = f", {copy:.2f} of a measured copy" if copy is not None else ""
        lines.append(
            f"  {name}: {fraction:.2f}{of_copy} (splits {case.get('num_splits', '?')}): "
            f"{_verdict(fraction >= BANDWIDTH_GOAL)}"
        )
    return lines


def outside_gpu(entry: dict[str, Any]) -> tuple[float, str] | None:
    """The decode step time outside the GPU of one `decode_overhead` entry, and which figure
    it is: the GPU's idle share between its first and last kernel (`gpu_idle`), else (a
    check before it was recorded) the profiled run's share of wall time outside kernels;
    None if neither was measured (on a CPU, or the entry failed)."""
    idle = entry.get("gpu_idle") or {}
    if "fraction_idle_in_span" in idle:
        return idle["fraction_idle_in_span"], "idle in the kernels' span"
    if "fraction_outside_gpu" in entry:
        return entry["fraction_outside_gpu"], "outside kernels, whole run"
    return None


def _outside(report: dict[str, Any]) -> list[str]:
    title = f"decode step time outside the GPU at batch 64 (goal < {OUTSIDE_GOAL:.2f})"
    lines = []
    for section in ("decode_overhead", "decode_overhead_large"):
        entries = report.get(section)
        model = "large" if section.endswith("large") else "small"
        if not isinstance(entries, dict) or entries.get("status") not in ("ok", None):
            lines.append(f"  {model}: not measured ({_why(entries)})")
            continue
        for label in OVERHEAD_ENTRIES:
            entry = entries.get(label)
            if not isinstance(entry, dict):
                continue
            figure = outside_gpu(entry)
            name = f"{entry.get('model', model)} {label}" if label != "medium" else "medium"
            if figure is None:
                lines.append(f"  {name}: not measured ({_why(entry)})")
                continue
            value, kind = figure
            whole = entry.get("fraction_outside_gpu")
            also = f"; {whole:.2f} outside kernels, whole run" if "gpu_idle" in entry else ""
            steps = f", {entry['ms_per_step']:.2f} ms a step" if "ms_per_step" in entry else ""
            lines.append(
                f"  {name}: {value:.2f} ({kind}{also}{steps}){_choice(entry)}: "
                f"{_verdict(value < OUTSIDE_GOAL)}"
            )
    return [f"{title}:", *lines]


def _shared_prefix(report: dict[str, Any]) -> list[str]:
    title = f"shared-prefix throughput against transformers (goal >= {SHARED_PREFIX_GOAL:g}x)"
    section = report.get("throughput")
    cases = {
        k: v
        for k, v in (section or {}).items()
        if k.endswith("/shared_prefix") and isinstance(v, dict) and "speedup" in v
    }
    if not cases:
        return [f"{title}: not measured ({_why(section)})"]
    lines = [f"{title}:"]
    for name, case in cases.items():
        runs = case.get("speedup_decode_runs")
        with_runs = f" (decode runs of 8: {runs:.2f}x)" if runs is not None else ""
        lines.append(
            f"  {name.split('/')[0]}: {case['speedup']:.2f}x{with_runs}: "
            f"{_verdict(case['speedup'] >= SHARED_PREFIX_GOAL)}"
        )
    return lines


def _auto(report: dict[str, Any]) -> list[str]:
    """Whether the run supports `decode_steps="auto"` as CUDA's default."""
    small = (report.get("decode_overhead") or {}).get("decode_runs_auto")
    large = (report.get("decode_overhead_large") or {}).get("decode_runs_auto")
    title = 'decode_steps="auto" as the CUDA default'
    if not isinstance(small, dict) or not isinstance(large, dict):
        return [f"{title}: not measured (its entries on small and large are not both there)"]
    reasons = []
    small_out, large_out = outside_gpu(small), outside_gpu(large)
    small_runs = (small.get("run_choice") or {}).get("chose_runs")
    large_runs = (large.get("run_choice") or {}).get("chose_runs")
    if small_out is None or large_out is None or small_runs is None or large_runs is None:
        return [f"{title}: not measured (no profile or run choice: {_why(small)}; {_why(large)})"]
    if not small_runs:
        reasons.append("it kept single steps on small")
    if small_out[0] >= OUTSIDE_GOAL:
        reasons.append(f"small's {small_out[0]:.2f} is not under {OUTSIDE_GOAL:.2f}")
    if large_runs:
        reasons.append(f"it took runs on large ({large_runs} times)")
    if not reasons:
        return [f"{title}: supported (runs on small, under the goal; single steps on large)"]
    return [f"{title}: not supported ({'; '.join(reasons)})"]


def _choice(entry: dict[str, Any]) -> str:
    choice = entry.get("run_choice")
    if not choice:
        return ""
    return f", {choice.get('chose_runs')} of {choice.get('probes')} probes chose runs"


def _why(entry: Any) -> str:
    if not isinstance(entry, dict):
        return "no section"
    status = entry.get("status", "no figure")
    reason = entry.get("reason") or entry.get("error")
    return f"{status}: {str(reason)[:80]}" if reason else status


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def main(argv: list[str] | None = None) -> None:
    paths = (argv if argv is not None else sys.argv[1:]) or ["benchmarks/results/gpu_check.json"]
    for path in paths:
        print(f"{path}:")
        for line in goal_lines(json.loads(Path(path).read_text())):
            print(f"  {line}")


if __name__ == "__main__":
    main()
