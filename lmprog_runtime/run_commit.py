"""A launched decode run (`Run`) and its commit (`decode_run.py` launches runs).

Each step's tokens are committed and checked as a synchronous step's would be, as soon as
they reach the host (`_commit_steps`; a caller's abort is taken between steps).

A run whose steps' tokens reach the host together (a graph's run; any run on a CPU), whose
requests are all checked by their last token alone (`Req.checks_last_token_alone`:
no stop strings; not streamed) and that asks for no logprobs is committed at once
(`_commit_whole`): each request takes its tokens up to the one that finishes it
(`Req.append_run`) and is checked once, a request's work per run instead of per token.
Its outputs and counters are the step-by-step commit's (the counters of all its steps are
recorded before any of its requests is told).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmprog_runtime.logprobs import LogprobAsk
from lmprog_runtime.run_plan import RunSlots, step_ahead
from lmprog_runtime.sampling import NO_MASS
from lmprog_runtime.scheduled_batch import ScheduledBatch

# A step's drawn tokens on their way to the host: the copy, and (CUDA) when it is there.
HostTokens = tuple[torch.Tensor, "torch.cuda.Event | None"]


@dataclass
class Run:
    """A launched decode run: its first step's batch and the slots of its steps ahead,
    each step's tokens (and the logprobs `ask` wants, `LogprobAsk.gather`'s table, None
    if none) on their way to the host and failed rows, the last step's tokens on the
    device, its `RunSlots`, and the seconds its launch took per step."""

    batch: ScheduledBatch
    ahead: list[torch.Tensor]
    drawn: list[HostTokens]
    logprobs: list[torch.Tensor | None]
    ask: LogprobAsk
    errors: list[dict[int, Exception]]
    last_tokens: torch.Tensor  # [n] on the device
    slots: RunSlots
    seconds: float

    @property
    def steps(self) -> int:
        return len(self.ahead) + 1


class RunCommit:
    """The commit of `DecodeRunLoop`'s runs (a mixin: `Engine` sets every attribute used
    here)."""

    @staticmethod
    def _read_step(tokens: HostTokens) -> list[int]:
        """One step's tokens on the host, once they are there (on a GPU, for a run queued
        step by step, the later steps of the run still compute meanwhile; a run's graph
        hands all its steps over at once)."""
        host, ready = tokens
        if ready is not None:
            ready.synchronize()
        return host.tolist()

    def _commit_run(self, run: Run) -> None:
        """Each step in turn, as a synchronous step commits and checks it, as soon as its
        tokens reach the host; or the whole run at once where that commits the same
        (`_commit_whole`). The counters count what single steps would: the tokens of the
        requests still running at each step, the steps up to the last one's finish."""
        run.batch.kv_committed = True  # (kv_len grows below)
        read = None
        if self._checks_whole(run):
            read = [self._read_step(tokens) for tokens in run.drawn]
            if self._commit_whole(run, read):
                return
        self._commit_steps(run, read)

    @staticmethod
    def _checks_whole(run: Run) -> bool:
        """Whether `run` may be committed at once: its steps' tokens reach the host
        together (a graph's run; on a CPU, where a run computes as it is launched: else
        each step is checked as soon as it is there), no step asked for logprobs or failed
        a row, and each request still in it is checked by its last token and length alone
        (`Req.checks_last_token_alone`) and not streamed (a stream gets a chunk a step)."""
        ready = run.drawn[-1][1]
        if any(other is not ready for _, other in run.drawn):
            return False
        if run.ask.rows or any(run.errors):
            return False
        return all(
            req.done.is_set() or (req.checks_last_token_alone and not req.is_streamed)
            for req in run.batch.reqs
        )

    def _commit_whole(self, run: Run, read: list[list[int]]) -> bool:
        """Commit `run` at once from each step's tokens (`read`): each request takes its
        tokens up to the one that finishes it (`Req.append_run`) and is checked once,
        after the counters of all the steps are recorded. Its tokens, K/V, slots and
        counters are what committing step by step gives; only the order in which its
        requests finish differs. False, with nothing done, if a row drew none (-1: its
        request fails at that step, step by step)."""
        reqs = run.batch.reqs
        live = [i for i, req in enumerate(reqs) if not req.done.is_set()]
        if not live:
            return True
        columns = list(zip(*read))  # [n][K]: each request's tokens
        if any(min(columns[i]) < 0 for i in live):
            return False
        taken = []
        for i in live:
            req = reqs[i]
            took = req.append_run(columns[i])
            req.kv_len += took
            run.slots.used[i] += took
            taken.append(took)
        still = [0] * max(taken)  # requests still running at each step up to the last finish
        for took in taken:
            still[took - 1] += 1
        for k in range(len(still) - 2, -1, -1):
            still[k] += still[k + 1]
        self._stats.record_decode_steps(
            still, num_running=len(self.scheduler.running), forward_seconds=run.seconds
        )
        self._check([reqs[i] for i in live])
        return True

    def _commit_steps(self, run: Run, read: list[list[int]] | None) -> None:
        """`_commit_run` step by step (`read`: each step's tokens, if read already)."""
        batch, reqs = run.batch, run.batch.reqs
        for k, tokens in enumerate(run.drawn):
            if self._aborts:  # (read without the lock: a hint)
                self._cancel_aborted()
            live = [i for i, req in enumerate(reqs) if not req.done.is_set()]
            if not live:
                break
            step_ids = read[k] if read is not None else self._read_step(tokens)
            logprobs = run.ask.unpack(run.logprobs[k])
            for i in live:
                reqs[i].kv_len += 1
                run.slots.used[i] += 1
            step = step_ahead(batch, run.slots.slots[k], k)
            if len(live) < len(reqs):
                step.narrow(live)
            self._stats.record_step(
                step, num_running=len(self.scheduler.running), forward_seconds=run.seconds
            )
            appended = []
            for i in live:
                req, token = reqs[i], step_ids[i]
                error = run.errors[k].get(i)
                if error is None and token < 0:
                    error = ValueError(f"request {req.rid}: {NO_MASS}")
                if error is not None:
                    self._finish(req, error)
                    continue
                req.output_ids.append(token)
                if logprobs[i] is None or self._record_token_logprob(req, token, logprobs[i]):
                    appended.append(req)
            self._check(appended)
