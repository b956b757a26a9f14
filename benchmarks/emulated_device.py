"""The emulated GPU of `bench_host_path.py`: a device clock, decode graphs on it, and the
CPU time each part of the host's work takes.

`EmulatedDevice` is a queue on the CPU's clock: work queued on it ends a given time after
the work before it (nothing runs there; the host waits as it would for a GPU).
`EmulatedRunGraphs` stands in for `DecodeGraphRunner` (`cuda_graph.py`): decode runs
launched as one graph each, and with `single` every single decode step as a replay that
draws its greedy tokens. `CpuClock` times wrapped callables on the threads that run them.
It computes nothing of the model: logits are rows of a table. (It imports the runtime
only when used: `bench_host_path.py --baseline` puts another tree's first on the path.)
"""

from __future__ import annotations

import threading
import time

import torch


class EmulatedDevice:
    """A device queue on the CPU: work queued on it ends `seconds` after both the work
    before it has ended and it was queued."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.first_start: float | None = None  # (since `reset_span`)
        self.busy = 0.0

    def queue(self, seconds: float) -> float:
        """Queue `seconds` of work; returns when it ends (a `perf_counter` time)."""
        start = max(time.perf_counter(), self.free_at)
        if self.first_start is None:
            self.first_start = start
        self.busy += seconds
        self.free_at = start + seconds
        return self.free_at

    def reset_span(self) -> None:
        self.first_start, self.busy = None, 0.0

    def idle_in_span(self) -> float:
        """The share of the time from the first work's start (since `reset_span`) to the
        last one's end that the device had none: `fraction_idle_in_span` on a GPU,
        the steps' share outside the device without the generate's ends."""
        span = self.free_at - self.first_start if self.first_start is not None else 0.0
        return 1 - self.busy / span if span > 0 else 0.0

    @staticmethod
    def wait(until: float) -> None:
        remaining = until - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)  # the GIL released, as while waiting for a GPU


class StepEvent:
    """A step's "tokens are on the host" event of a run queued step by step (the clock's
    wait is `waiting_read`'s): each step its own, as on CUDA, so the loop checks each step
    as it comes (a run's steps that come together are committed at once)."""

    def synchronize(self) -> None:
        pass


class EmulatedRunGraphs:
    """A decode run's graph on the emulated device (`DecodeGraphRunner.run_greedy`'s part):
    one launch (`launch_s` of Python holding the GIL; a shorter run one per graph of its
    pieces, `run_graphs.pieces`), the run's forwards queued back to
    back on the device clock, each step's tokens the argmax of the table rows its inputs
    pick (as the emulated forward's logits and draw would give; each row's argmax found
    once: in a graph it is device work, not the host's), all K on the host when the last
    forward has ended (one event after the replay). Single steps have no graph."""

    def __init__(self, runner, table, device, ends, launch_s: float, device_s: float) -> None:
        from lmprog_runtime.forward_batch import ForwardMode
        from lmprog_runtime.sampling import argmax_rows

        self._decode = ForwardMode.DECODE
        self.runner, self.device, self.ends = runner, device, ends
        self.argmax = argmax_rows(table)  # [table rows]
        self.launch_s, self.device_s = launch_s, device_s
        self.steps = 0
        self.single = False  # single decode steps are graphs too (`graph_steps`)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (logits, its tokens)
        try:  # the graphs of shorter runs (a --baseline's runtime may have none: full only)
            from lmprog_runtime.run_graphs import pieces, run_lengths
        except ImportError:
            try:  # (where an older tree keeps them)
                from lmprog_runtime.cuda_graph import pieces, run_lengths
            except ImportError:
                pieces = run_lengths = None
        self.pieces, self.run_lengths = pieces, run_lengths

    def can_run_size(self, mode, batch_size: int) -> bool:
        """Whether a single step is a graph (`single`; it runs the emulated forward,
        which then draws and stores its greedy tokens as the graph would)."""
        return self.single and mode is self._decode

    def can_run_greedy(self, batch_size: int, steps: int) -> bool:
        if not self.steps:
            return False
        return steps == self.steps or (self.pieces is not None and 1 < steps < self.steps)

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The tokens the graph step that returned `logits` drew (`single`), else None."""
        last = self.last
        return last[1] if last is not None and last[0] is logits else None

    def run_greedy(self, first, ahead, first_ids, seq_lens) -> torch.Tensor:
        steps = ahead.shape[0] + 1
        cut = [steps] if self.pieces is None else self.pieces(steps, self.run_lengths(self.steps))
        for _ in cut:  # (a graph each)
            end = time.perf_counter() + self.launch_s
            while time.perf_counter() < end:  # launching: Python holding the GIL
                pass
        ids = self.runner.resolve_future_ids(first[0]) if first_ids is None else first_ids
        drawn = []
        for _ in range(ahead.shape[0] + 1):
            ids = self.argmax[ids % self.argmax.shape[0]]
            drawn.append(ids)
        for _ in drawn:
            last = self.device.queue(self.device_s)
        self.ends.extend([last] * len(drawn))  # (every step's tokens: at the run's end)
        return torch.stack(drawn)


class CpuClock:
    """CPU time spent in wrapped callables, per name (each thread's own CPU time), and
    their sum on the loop thread ("on_loop")."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.loop_thread: int | None = None

    def reset(self) -> None:
        self.seconds = {"loop": 0.0, "forward": 0.0, "draw": 0.0, "on_loop": 0.0}

    def timed(self, name: str, fn):
        def timed_fn(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                self.seconds[name] = self.seconds.get(name, 0.0) + spent
                if threading.get_ident() == self.loop_thread:
                    self.seconds["on_loop"] = self.seconds.get("on_loop", 0.0) + spent

        return timed_fn
