"""Issue 18's goals, read off a GPU check's JSON: one line per figure, met or not.

The goals: the decode attention kernel at 70% of the HBM bandwidth or more, under 10% of
decode step time outside the GPU at batch 64, and at least 3x transformers' `generate`
on the shared-prefix workload. Beside them, what the run says of making
`decode_steps="auto"` CUDA's default: it should take decode runs on "small" and come under
the 10% there, and on the 7B-shaped model ("large") probe, keep single steps and take no
longer than the default (its speed-up on the dataset's pattern is printed beside). A
figure the run did not measure (a skipped or failed section or entry, an older check's
JSON) says so; nothing a run can leave behind makes it raise.

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
    cases = {k: v for k, v in _dict(section).items() if isinstance(v, dict) and "gbs" in v}
    if not cases:
        return [f"{title}: not measured ({_why(section)})"]
    lines = [f"{title}:"]
    for name, case in cases.items():
        fraction = _number(case.get("fraction_of_nominal_peak"))
        copy = _number(case.get("fraction_of_copy_bandwidth"))
        of_copy = f", {copy:.3f} of a measured copy" if copy is not None else ""
        splits = f" (splits {case.get('num_splits', '?')})"
        if fraction is None:  # (a GPU without a known nominal peak)
            lines.append(f"  {name}: no nominal peak for this GPU{of_copy}{splits}: not judged")
            continue
        verdict = _verdict(fraction >= BANDWIDTH_GOAL)
        lines.append(f"  {name}: {fraction:.3f}{of_copy}{splits}: {verdict}")
    return lines


def outside_gpu(entry: dict[str, Any]) -> tuple[float, str] | None:
    """The decode step time outside the GPU of one `decode_overhead` entry, and which figure
    it is: the GPU's idle share between its first and last kernel (`gpu_idle`), else (a
    check before it was recorded) the profiled run's share of wall time outside kernels;
    None if neither was measured (on a CPU, or the entry failed)."""
    idle = entry.get("gpu_idle")
    if isinstance(idle, dict):  # (no fraction: the profiler saw no kernel)
        value = _number(idle.get("fraction_idle_in_span"))
        return None if value is None else (value, "idle in the kernels' span")
    value = _number(entry.get("fraction_outside_gpu"))
    return None if value is None else (value, "outside kernels, whole run")


def _outside(report: dict[str, Any]) -> list[str]:
    title = f"decode step time outside the GPU at batch 64 (goal < {OUTSIDE_GOAL:.2f})"
    lines = []
    for section in ("decode_overhead", "decode_overhead_large"):
        entries = report.get(section)
        model = "large" if section.endswith("large") else "small"
        if not isinstance(entries, dict) or entries.get("status") != "ok":
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
            whole = _number(entry.get("fraction_outside_gpu"))
            in_span = kind.startswith("idle")
            also = f"; {whole:.3f} outside kernels, whole run" if in_span and whole else ""
            ms = _number(entry.get("ms_per_step"))
            steps = f", {ms:.2f} ms a step" if ms is not None else ""
            lines.append(
                f"  {name}: {value:.3f} ({kind}{also}{steps}){_choice(entry)}: "
                f"{_verdict(value < OUTSIDE_GOAL)}"
            )
    return [f"{title}:", *lines]


def _shared_prefix(report: dict[str, Any]) -> list[str]:
    title = f"shared-prefix throughput against transformers (goal >= {SHARED_PREFIX_GOAL:g}x)"
    section = report.get("throughput")
    cases = {
        k: v
        for k, v in _dict(section).items()
        if k.endswith("/shared_prefix") and isinstance(v, dict) and _number(v.get("speedup"))
    }
    if not cases:
        return [f"{title}: not measured ({_why(section)})"]
    lines = [f"{title}:"]
    for name, case in cases.items():
        runs = _number(case.get("speedup_decode_runs"))
        with_runs = f" (decode runs of 8: {runs:.2f}x)" if runs is not None else ""
        lines.append(
            f"  {name.split('/')[0]}: {case['speedup']:.2f}x{with_runs}: "
            f"{_verdict(case['speedup'] >= SHARED_PREFIX_GOAL)}"
        )
    return lines


def _auto(report: dict[str, Any]) -> list[str]:
    """Whether the run supports `decode_steps="auto"` as CUDA's default: on "small" it took
    decode runs and came under the goal; on the large model it probed and kept single
    steps, and its run took no longer than 1.05x the default's (the probes cost nothing
    to speak of); with what it did on the dataset's pattern beside it."""
    title = 'decode_steps="auto" as the CUDA default'
    sections = [_dict(report.get(name)) for name in ("decode_overhead", "decode_overhead_large")]
    small, large = (_dict(section.get("decode_runs_auto")) for section in sections)
    large_default = _dict(sections[1].get("default"))
    small_out, large_out = outside_gpu(small), outside_gpu(large)
    small_choice, large_choice = _dict(small.get("run_choice")), _dict(large.get("run_choice"))
    missing = [
        what
        for what, figure in (
            ("small's profile", small_out),
            ("large's profile", large_out),
            ("small's run choice", small_choice.get("chose_runs")),
            ("large's run choice", large_choice.get("chose_runs")),
        )
        if figure is None
    ]
    if missing:
        return [f"{title}: not measured (missing: {', '.join(missing)})"]
    reasons = []
    if not small_choice["chose_runs"]:
        reasons.append("it kept single steps on small")
    if small_out[0] >= OUTSIDE_GOAL:
        reasons.append(f"small's {small_out[0]:.3f} is not under {OUTSIDE_GOAL:.2f}")
    if not large_choice.get("probes"):
        reasons.append("no probe ended on large")
    elif large_choice["chose_runs"]:
        reasons.append(f"it took runs on large ({large_choice['chose_runs']} times)")
    slower = _ratio(large.get("wall_s"), large_default.get("wall_s"))
    if slower is not None and slower > 1.05:
        reasons.append(f"on large it took {slower:.2f}x the default's time")
    dataset = _number(_dict(report.get("dataset_steps")).get("auto_speedup"))
    beside = f"; on the dataset's pattern {dataset:.2f}x the default" if dataset else ""
    if not reasons:
        return [
            f"{title}: supported (runs on small, under the goal; single steps on large){beside}"
        ]
    return [f"{title}: not supported ({'; '.join(reasons)}){beside}"]


def _choice(entry: dict[str, Any]) -> str:
    choice = _dict(entry.get("run_choice"))
    if not choice:
        return ""
    return f", {choice.get('chose_runs')} of {choice.get('probes')} probes chose runs"


def _why(entry: Any) -> str:
    """Why `entry` gives no figure: its status, and the last line of its reason or error
    (a crashed section's error is the end of its stderr)."""
    if not isinstance(entry, dict):
        return "no section"
    status = entry.get("status", "no figure")
    reason = entry.get("reason") or entry.get("error")
    lines = [line.strip() for line in str(reason or "").splitlines() if line.strip()]
    return f"{status}: {lines[-1][:80]}" if lines else str(status)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ratio(top: Any, bottom: Any) -> float | None:
    top, bottom = _number(top), _number(bottom)
    return top / bottom if top is not None and bottom else None


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def main(argv: list[str] | None = None) -> None:
    paths = (argv if argv is not None else sys.argv[1:]) or ["benchmarks/results/gpu_check.json"]
    if paths[0] in ("-h", "--help"):
        print("usage: gpu_check_goals.py [FILE.json ...]  (default: the last gpu_check run)")
        print("Issue 18's goals read off gpu_check.py's JSON: met or not, with the figures.")
        return
    for path in paths:
        print(f"{path}:")
        for line in goal_lines(json.loads(Path(path).read_text())):
            print(f"  {line}")


if __name__ == "__main__":
    main()
