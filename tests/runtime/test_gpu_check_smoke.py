"""`benchmarks/gpu_check.py --cpu-smoke`: the GPU check's plumbing on the CPU, tiny sizes.

The GPU run is one shot on a lent machine; a section that breaks there loses its figures.
Here every section runs (or is skipped for want of CUDA), the JSON is written, and the
CPU figures it records are the correctness anchors (float32 logprobs against transformers,
greedy equality with the cache on and off).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_gpu_check_cpu_smoke_writes_every_section(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gpu_check.json"

    gpu_check.main(["--cpu-smoke", "--out", str(out)])

    report = json.loads(out.read_text())
    names = [name for name, _, _ in gpu_check.SECTIONS]
    statuses = {name: report[name]["status"] for name in names}
    skipped = {
        name: "skipped"
        for name in ("decode_bandwidth", "fused_ops", "attention_error", "host_costs")
    }
    assert statuses == {name: "ok" for name in names} | skipped
    assert report["decode_bandwidth"]["reason"] == "needs CUDA"
    correctness = report["correctness"]["tiny/torch/float32"]
    assert correctness["within_tolerance"] and correctness["greedy_identical_prompts"] == "4/4"
    assert report["keyed_race"]["rows_equal_to_torch_ops"] == "4/4"  # (Triton interpreted)
    assert report["keyed_race"]["top_p_rows_keeping_the_sorted_tokens"] == "4/4"
    equality = report["greedy_equality"]
    assert equality["identical_cache_off_vs_cache_on"] == "8/8"
    assert equality["identical_cache_on_warm_vs_cache_on"] == "8/8"
    assert equality["identical_decode_runs_vs_cache_on"] == "8/8"
    assert equality["identical_decode_runs_synchronous_vs_cache_on"] == "8/8"
    assert equality["decode_runs_runs"] > 0 and equality["decode_runs_synchronous_runs"] > 0
    assert equality["cached_tokens_warm"] > 0
    overlap = report["overlap_equality"]
    same, total = overlap["decode_runs_identical_outputs"].split("/")
    assert overlap["problems"] == [] and same == total != "0" and overlap["decode_runs"] > 0
    for prefix in ("", "decode_runs_"):
        same, total = overlap[f"{prefix}top_logprob_tokens_identical"].split("/")
        assert same == total != "0" and overlap[f"{prefix}max_logprob_diff_on_identical"] < 1e-4
    for workload in ("tiny/no_sharing", "tiny/shared_prefix"):
        assert report["throughput"][workload]["engine_tokens_per_s"] > 0
        assert report["throughput"][workload]["engine_decode_runs_tokens_per_s"] > 0
    dataset = report["dataset_steps"]
    assert dataset["mixed"]["mixed_forwards"] > 0 and dataset["no_mixed"]["mixed_forwards"] == 0
    for config in ("mixed", "waiting", "no_mixed", "decode_runs", "auto"):
        assert dataset[config]["eager_forwards"] > 0 and dataset[config]["tokens_per_s"] > 0
    assert report["decode_overhead"]["default"]["forward_passes"] > 0
    threaded = report["decode_overhead"]["worker_thread"]
    assert threaded["worker_thread"] and threaded["forward_passes"] > 0
    runs = report["decode_overhead"]["decode_runs"]
    assert runs["decode_steps"] == 4 and not runs["overlap"] and runs["decode_runs"] > 0
    auto = report["decode_overhead"]["decode_runs_auto"]
    assert auto["decode_steps"] == "auto" and auto["overlap"] and auto["forward_passes"] > 0
    assert set(auto["run_choice"]) == {"probes", "chose_runs"}  # (8 new tokens: no probe ends)
    # the goals, read off the report, end the log (`gpu_check_goals.py`)
    printed = capsys.readouterr().out.splitlines()
    goals = printed[printed.index(f"[gpu_check] wrote {out}") + 1 :]
    assert goals[0] == (
        "[gpu_check] decode attention bandwidth (goal >= 0.70 of the HBM peak): "
        "not measured (skipped: needs CUDA)"
    )
    speedup = report["throughput"]["tiny/shared_prefix"]["speedup"]
    assert any(line.startswith(f"[gpu_check]   tiny: {speedup:.2f}x") for line in goals)


def test_an_isolated_section_that_crashes_loses_only_itself(tmp_path):
    """`--isolate`: each section in a process of its own, its entry merged; a process that
    aborts (as a device-side assert aborts it) leaves an entry that says so."""
    import sys

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gpu_check.json"
    args = ["--cpu-smoke", "--isolate", "--out", str(out), "--only", "environment"]
    gpu_check.main(args)
    assert json.loads(out.read_text())["environment"]["device"] == "cpu"

    parser_args = gpu_check.argparse.Namespace(
        cpu_smoke=True, budget_s=60.0, out=str(out), only=None
    )
    check = gpu_check.Check(parser_args)
    crash = [sys.executable, "-c", "import os, sys; print('boom', file=sys.stderr); os.abort()"]
    check.isolated_section("keyed_race", 0, crash)
    check.isolated_section("environment", 0, [sys.executable, str(SCRIPT), "--cpu-smoke"])
    report = json.loads(out.read_text())
    crashed = report["keyed_race"]
    assert crashed["status"] == "crashed" and crashed["exit_code"] != 0
    assert "boom" in crashed["error"]
    assert report["environment"]["status"] == "ok" and "exit_code" not in report["environment"]


def test_the_large_models_builder_writes_a_checkpoint_both_sides_read_alike(
    tmp_path, monkeypatch, tiny_path
):
    """`decode_overhead_large` draws its 5.7B model's weights on the GPU and writes them a
    layer to a file; here the same builder on the CPU, at a small shape: transformers (by
    the shard index) and the engine load it, and decode the same greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmprog_runtime import Engine

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gpu_check_common import build_random_bf16

    shape = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4}
    shape |= {"num_key_value_heads": 2, "intermediate_size": 256, "head_dim": 32}
    path = tmp_path / "large"
    build_random_bf16(path, Path(tiny_path), shape, "cpu")
    assert len(list(path.glob("model-*.safetensors"))) == 4  # the outer tensors, 3 layers
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 3 and hf.config.hidden_size == 128
    prompt = [5, 17, 300, 42, 7]
    expected = hf.generate(
        torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
    )[0, len(prompt) :].tolist()
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with Engine(str(path), dtype="float32") as engine:
        assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == expected


def test_the_graph_paths_count_what_a_decode_run_took(tiny_path):
    """`decode_overhead`'s `graph_paths_in_warm_up` on the eager graph path: every decode
    run replayed as graphs (the last, of 2 steps after runs of 4, in pieces) and committed
    at once; the plain engine's draws never took a graph's tokens."""
    import sys

    from lmprog_runtime import Engine
    from lmprog_runtime.cuda_graph import DecodeGraphRunner

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check_speed
    finally:
        sys.path.remove(str(SCRIPT.parent))
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, attention_backend="torch", decode_steps=4) as engine:
        engine._launches_ahead = True  # (as on a GPU)
        engine.runner.graphs = DecodeGraphRunner(engine.runner, capture=False)
        counts = gpu_check_speed._graph_paths(
            engine, lambda: engine.generate(["Hi", "Once upon a time"], params)
        )
        runs = engine.stats()["decode_runs"]
    assert counts["runs_as_one_graph"] == counts["runs_committed_whole"] == runs == 3
    assert counts["shorter_runs_in_pieces"] == 1  # (11 tokens after the first: 4, 4, 3)
    assert counts["draws_from_graph"] == 0


def test_gpu_idle_splits_a_runs_ends_from_the_gaps_between_kernels():
    """`decode_overhead`'s `gpu_idle` from kernels' (start, end) microseconds: overlapping
    kernels count once, the idle time inside their span is the gaps, the rest of the wall
    is the run's ends, and the longest gaps are placed in the span."""
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_check_speed import gpu_idle
    finally:
        sys.path.remove(str(SCRIPT.parent))
    spans = [(1000, 1300), (1200, 1400), (1450, 1500), (2500, 2600), (1400, 1450)]
    got = gpu_idle(spans, wall_s=0.004)
    assert got["kernels"] == 5 and got["span_s"] == 1600e-6
    assert abs(got["busy_s"] - 600e-6) < 1e-12 and abs(got["idle_in_span_s"] - 1000e-6) < 1e-12
    assert abs(got["idle_outside_span_s"] - 2400e-6) < 1e-12
    assert abs(got["fraction_idle_in_span"] - 1000 / 1600) < 1e-12
    assert got["gaps_of_100us_or_more"] == 1 and len(got["longest_gaps"]) == 1
    gap = got["longest_gaps"][0]  # (1500 -> 2500: 500 us into the 1600 us span)
    assert gap["us"] == 1000 and abs(gap["at"] - 500 / 1600) < 1e-3
    assert gpu_idle([], 1.0) == {"kernels": 0}


def test_dataset_steps_stops_at_the_budget_and_keeps_what_it_ran(monkeypatch):
    """`dataset_steps` ran its five engines whatever the budget said: on the GPU it could
    push the sections after it, the 7B-shaped model's among them, past the time given."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    from gpu_check_speed import dataset_steps

    args = gpu_check.argparse.Namespace(cpu_smoke=True, budget_s=320.0, out="unused", only=None)
    check = gpu_check.Check(args)
    left = iter([300.0, 300.0, 10.0, 10.0, 10.0])
    monkeypatch.setattr(check, "remaining", lambda: next(left))
    out = dataset_steps(check)
    assert out["mixed"]["tokens_per_s"] > 0 and out["waiting"]["tokens_per_s"] > 0
    assert out["waiting_speedup"] > 0 and "no_mixed_speedup" not in out
    for label in ("no_mixed", "decode_runs", "auto"):
        assert out[label] == {"status": "skipped", "reason": "time budget spent"}
