"""Every tensor the runtime creates says where it lives (issue 18, point 1).

A tensor created without `device=` lands on torch's default device, the CPU, also on a GPU
machine, where it then meets CUDA tensors and fails on the first request. No GPU is needed
to catch one: `ExplicitDeviceMode` raises on any tensor factory (`torch.tensor`, `zeros`,
`arange`, ...) called without an explicit device, and the engine workloads below run with
it active in every thread the engine computes in (the caller's, the loop's and the
overlapped forward worker's), after the model is loaded. Their tokens must equal a normal
run's. A static check covers the paths no workload reaches (CUDA-only branches).

Why not `torch.set_default_device("meta")`: it is thread-local (the engine's loop thread
never sees it), and a meta index tensor into a CPU tensor does not fail, it reads garbage.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import threading
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from lmprog_runtime import Engine

RUNTIME = Path(__file__).resolve().parents[2] / "lmprog_runtime"
# Modules that run while the engine serves (model building and loading are excluded: they
# run once, before, on the device they are given).
SERVING_MODULES = [
    "engine.py",
    "engine_generate.py",
    "engine_calls.py",
    "req_stops.py",
    "request_maker.py",
    "results.py",
    "loop_thread.py",
    "engine_loop.py",
    "loop_failures.py",
    "step_draw.py",
    "engine_inputs.py",
    "overlap.py",
    "forward_worker.py",
    "decode_run.py",
    "run_commit.py",
    "run_plan.py",
    "run_choice.py",
    "scheduler.py",
    "run_slots.py",
    "admission.py",
    "admission_wait.py",
    "scheduled_batch.py",
    "steady_check.py",
    "penalties.py",
    "model_runner.py",
    "cuda_graph.py",
    "run_graphs.py",
    "forward_batch.py",
    "sampling.py",
    "sampling_filters.py",
    "keyed_race.py",
    "triton_race.py",
    "logprobs.py",
    "transfer.py",
    "request.py",
    "req_text.py",
    "kvcache",
    "constrained",
    "attention",
    "models/ops.py",
    "models/triton_ops.py",
]
FACTORY_NAMES = {f.__name__ for f in _device_constructors()} | {"Generator"}


class ImplicitDeviceError(RuntimeError):
    pass


class ExplicitDeviceMode(TorchFunctionMode):
    """Raises `ImplicitDeviceError` for a tensor factory called without `device=` (and
    records it in `violations`, in case the runtime catches the error and goes on)."""

    def __init__(self, violations: list[str]) -> None:
        super().__init__()
        self.violations = violations

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            message = f"torch.{func.__name__} called without device="
            self.violations.append(message)
            raise ImplicitDeviceError(message)
        return func(*args, **kwargs)


@contextlib.contextmanager
def explicit_devices(engine: Engine):
    """`ExplicitDeviceMode` in the calling thread, the engine's loop thread (each step) and
    its forward worker (each forward) while the block runs; yields the violations list."""
    violations: list[str] = []

    def strict(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with ExplicitDeviceMode(violations):
                return fn(*args, **kwargs)

        return wrapped

    engine._run_once = strict(engine._run_once)
    engine.runner.run = strict(engine.runner.run)
    try:
        with ExplicitDeviceMode(violations):
            yield violations
    finally:
        del engine._run_once, engine.runner.run


def _workload(engine: Engine) -> list:
    """Greedy and seeded sampling (every sampled request has a seed: the engine's own
    seeds differ between runs) with every filter and penalty, logprobs of prompt and
    output, stops, a constrained regex and JSON schema, a fork (a group with a shared
    prefix), select-like scoring, and repeats that hit the prefix cache."""
    base = "The weather report for Monday says that the morning will be cloudy"
    prompts = [base + " with rain", base + " and cold", "Hi", "Once upon a time"]
    sampled = {
        "max_new_tokens": 10,
        "temperature": 0.9,
        "top_p": 0.9,
        "top_k": 30,
        "min_p": 0.02,
        "frequency_penalty": 0.4,
        "presence_penalty": 0.3,
        "seed": 7,
    }
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    results = [
        engine.generate(prompts, {"max_new_tokens": 12, "temperature": 0}),
        engine.generate(prompts, sampled),
        engine.generate(
            prompts[:2],
            {"max_new_tokens": 6, "temperature": 0.7, "min_new_tokens": 3, "seed": 11},
            return_logprob=True,
            logprob_start_len=2,
            top_logprobs_num=3,
        ),
        engine.generate(prompts[2], {"max_new_tokens": 20, "temperature": 0, "stop": [" the"]}),
        engine.generate(prompts[3], {"max_new_tokens": 8, "regex": r"(yes|no)[0-9]{2}", "seed": 5}),
        engine.generate(
            prompts[3], {"max_new_tokens": 24, "json_schema": json.dumps(schema), "temperature": 0}
        ),
        engine.generate(
            [base + " in Paris", base + " in Rome", base + " in Oslo"],
            {"max_new_tokens": 6, "temperature": 0},
            group=True,
        ),
        [
            out["meta_info"]["input_token_logprobs"]
            for out in engine.generate(
                [base + choice for choice in (" sunny", " windy", " grey")],
                {"max_new_tokens": 0},
                return_logprob=True,
                logprob_start_len=len(engine.encode(base)),
            )
        ],
        engine.generate(prompts, {"max_new_tokens": 12, "temperature": 0}),  # cached now
    ]
    return [_tokens(r) for r in results]


def _tokens(result):
    if isinstance(result, list):
        return [_tokens(r) for r in result]
    if isinstance(result, dict):
        return result["output_ids"]
    return result


ENGINES = {
    "default": {},
    "pages_and_pressure": dict(page_size=4, max_total_tokens=160, attention_backend="torch"),
    "overlapped": dict(overlap_schedule=True, attention_backend="torch"),
    "decode_runs": dict(decode_steps=4, page_size=4, attention_backend="torch"),
}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_engine_creates_no_tensor_without_a_device(tiny_path, name):
    with Engine(tiny_path, max_running_requests=8, **ENGINES[name]) as engine:
        expected = _workload(engine)
        engine.flush_cache()
        with explicit_devices(engine) as violations:
            got = _workload(engine)
        assert violations == []
        assert got == expected
        assert engine.stats()["cached_tokens"] > 0


def test_the_mode_catches_an_implicit_device(tiny_path):
    """The check itself: a factory without a device inside the loop's step fails the
    request and is recorded."""
    with Engine(tiny_path) as engine:
        original = engine.runner.prepare

        def prepare_with_a_bug(batch):
            torch.zeros(len(batch.reqs))  # no device: the bug the check exists to catch
            return original(batch)

        engine.runner.prepare = prepare_with_a_bug
        try:
            with (
                explicit_devices(engine) as violations,
                pytest.raises(RuntimeError, match="without device="),
            ):
                engine.generate("Hi", {"max_new_tokens": 2})
        finally:
            del engine.runner.prepare
        assert violations


def _implicit_device_calls(path: Path) -> list[str]:
    """`torch.<factory>(...)` calls in `path` with no `device=` (or `device=None`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and node.func.attr in FACTORY_NAMES
        ):
            continue
        device = next((k.value for k in node.keywords if k.arg == "device"), None)
        if device is None or (isinstance(device, ast.Constant) and device.value is None):
            found.append(f"{path.relative_to(RUNTIME.parent)}:{node.lineno} torch.{node.func.attr}")
    return found


def test_serving_code_names_a_device_for_every_tensor_it_creates():
    # (a module or package renamed or moved: list it under its new name)
    assert [name for name in SERVING_MODULES if not (RUNTIME / name).exists()] == []
    paths = []
    for name in SERVING_MODULES:
        path = RUNTIME / name
        paths += sorted(path.glob("*.py")) if path.is_dir() else [path]
    found = [call for path in paths for call in _implicit_device_calls(path)]
    assert found == []


@pytest.mark.parametrize("has_bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
@pytest.mark.parametrize("stored", ["float32", "bfloat16", None])
def test_auto_dtype_on_cuda_is_16_bit(tmp_path, monkeypatch, has_bf16, expected, stored):
    """Serving precision on GPUs whatever the checkpoint stores (float32 included)."""
    from lmprog_runtime import RuntimeConfig
    from lmprog_runtime.memory_plan import serving_dtype

    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": stored} if stored else {}))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: has_bf16)
    assert serving_dtype(RuntimeConfig(device="cuda", dtype="auto"), str(tmp_path)) is expected
    explicit = RuntimeConfig(device="cuda", dtype="float32")
    assert serving_dtype(explicit, str(tmp_path)) is torch.float32


def test_every_engine_thread_makes_the_engines_device_current(tiny_path, monkeypatch):
    """The current CUDA device is per thread (Triton launches, events and graph captures
    use it): the set-up on the caller's thread, the loop thread and a forward worker thread
    each make the engine's device current. Recorded here by patching the helpers' CUDA
    calls; `cuda:1` itself needs a second GPU."""
    import lmprog_runtime.engine as engine_module
    import lmprog_runtime.forward_worker as forward_worker
    import lmprog_runtime.loop_thread as loop_thread
    from lmprog_runtime import transfer

    calls: list[tuple[str, str, str]] = []

    def recorder(kind):
        def record(device):
            calls.append((kind, str(device), threading.current_thread().name))

        return record

    # the helpers: CUDA devices only, through torch's per-thread calls
    monkeypatch.setattr(torch.cuda, "set_device", recorder("set_device"))
    monkeypatch.setattr(torch.cuda, "device", _recording_scope(recorder("scope")))
    transfer.use_device(torch.device("cuda:1"))
    with transfer.device_scope(torch.device("cuda:1")):
        pass
    transfer.use_device(torch.device("cpu"))
    with transfer.device_scope(torch.device("cpu")):
        pass
    main = threading.current_thread().name
    assert calls == [("set_device", "cuda:1", main), ("scope", "cuda:1", main)]

    # the engine's threads
    calls.clear()
    monkeypatch.setattr(engine_module, "device_scope", _recording_scope(recorder("setup")))
    monkeypatch.setattr(loop_thread, "use_device", recorder("loop"))
    monkeypatch.setattr(forward_worker, "use_device", recorder("worker"))
    with Engine(tiny_path, max_total_tokens=512) as engine:
        engine.generate("Hello", {"max_new_tokens": 1})
        worker = forward_worker.ForwardWorker(engine.runner, threaded=True)
        worker._executor.submit(lambda: None).result()
        worker.close()
    assert ("setup", "cpu", main) in calls
    assert ("loop", "cpu", "lmprog-engine") in calls
    assert any(kind == "worker" and name.startswith("lmprog-forward") for kind, _, name in calls)


def test_an_unindexed_cuda_device_means_the_callers_current_device(monkeypatch):
    """`cuda` (no index) is the creating thread's current device: resolved to `cuda:N` once,
    so the engine's own threads make that device current (torch's `set_device` refuses a
    device without an index: the first GPU run stopped every engine loop on it)."""
    from lmprog_runtime import transfer

    set_to: list[torch.device] = []

    def strict_set_device(device):
        if device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index, but got:{device}")
        set_to.append(device)

    monkeypatch.setattr(torch.cuda, "set_device", strict_set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert transfer.device_with_index(torch.device("cuda")) == torch.device("cuda:1")
    assert transfer.device_with_index(torch.device("cuda:0")) == torch.device("cuda:0")
    assert transfer.device_with_index(torch.device("cpu")) == torch.device("cpu")
    transfer.use_device(torch.device("cuda"))
    transfer.use_device(torch.device("cuda:0"))
    assert set_to == [torch.device("cuda:1"), torch.device("cuda:0")]


def _recording_scope(record):
    @contextlib.contextmanager
    def scope(device):
        record(device)
        yield

    return scope


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_copy_to_the_device_loses_none_of_the_request_tables_writes(
    tiny_path, monkeypatch, overlap
):
    """The request table's pending writes travel in a forward's one copy of its inputs. If
    that copy fails (an out-of-memory on a GPU), the loop runs the batch's requests one by
    one, and their forwards must still send those writes: the tokens equal an engine's
    that never failed. On a CPU the device table is the host table; here it is a copy of
    its own, as on a GPU (no prefix cache, which would write the rows again itself)."""
    import lmprog_runtime.model_runner as model_runner

    prompts = ["The quick brown fox jumps", "Hello there, how are you", "Once upon a time"]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    config = dict(attention_backend="torch", overlap_schedule=overlap, disable_radix_cache=True)

    def run(fail: bool) -> list[list[int]]:
        with Engine(tiny_path, max_total_tokens=4096, **config) as engine:
            pool = engine.runner.req_to_token
            pool.table = pool.host_table.clone()
            armed = [fail]
            copy = model_runner.to_device

            def to_device(host, device):
                if armed[0] and host.numel() > 40:  # the three prompts' one block
                    armed[0] = False
                    raise RuntimeError("out of memory (simulated)")
                return copy(host, device)

            monkeypatch.setattr(model_runner, "to_device", to_device)
            outs = engine.generate(prompts, params)
            monkeypatch.setattr(model_runner, "to_device", copy)
            assert not armed[0]  # (it did fail, when asked to)
            assert torch.equal(pool.table, pool.host_table)
        return [out["output_ids"] for out in outs]

    assert run(fail=True) == run(fail=False)
