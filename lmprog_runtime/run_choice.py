"""Decode runs where they pay (`decode_steps="auto"`): runs while the device waits for the
host, single steps while the host waits for the device.

A decode run spends one step's host work on several tokens (`decode_run.py`), at a price:
admissions and deadlines wait for a run's end (and aborts, where a run is committed at
once), stops and streamed chunks are checked up to a run later, and a request that
stops inside a run computes the rest of it for nothing. Where the host's work per step
is shorter than the device's, overlap scheduling hides it already (`overlap.py`), and
runs would only pay that price; where it is longer (a small model on a GPU: issue 18's
"time outside the GPU"), nothing but runs cuts it.

So with "auto" the overlapped loop probes: over `probe_steps` single decode steps it adds
up how long it waited for the device (`OverlapLoop._advance` and `_collect`: on CUDA the
event of each step's tokens) against the steps' wall time. With the next step queued
before the loop waits for one, a step's wait is about the device's time less the host's,
so a wait under `host_bound_share` of the wall time means the host's work per step is
about as long as the device's or longer: the device idles, or nearly. The loop then takes
decode runs of up to `run_steps` (where a batch can run ahead) for `turns_between_probes`
turns (a run, or a decode step that could not run ahead), and probes again, so that a load
that turns device-bound (a batch that grew, longer contexts) goes back to single steps;
otherwise single steps go on, measured `probe_steps` at a time. Once nothing runs, the
next work is probed afresh. While runs are taken, admission does not wait to admit several
requests together (`admission_wait.py`: a run's end makes it wait already). The
synchronous loop (no overlap) always takes runs: there every step's host work leaves the
device idle. This module only decides; the loops run.
"""

from __future__ import annotations

from lmprog_runtime.config import AUTO_DECODE_STEPS

# Single decode steps a probe measures, turns (runs, or decode steps that could not run
# ahead) between two probes, and the share of the probe's time spent waiting for the
# device under which the host counts as the bottleneck (the share of time issue 18 allows
# outside the GPU).
PROBE_STEPS = 8
TURNS_BETWEEN_PROBES = 32
HOST_BOUND_SHARE = 0.1


class RunChoice:
    """How many decode steps a decode batch runs now (`steps`), from what the overlapped
    loop tells it: each probed step's wait and wall time (`observe_step`), each run
    launched (`observe_run`), and that it has nothing to do (`reset`).

    Example:
        >>> choice = RunChoice(run_steps=8, probe_steps=2, turns_between_probes=1)
        >>> choice.steps
        1
        >>> choice.observe_step(waited=0.0, spent=0.001)  # the device was done: idle
        >>> choice.observe_step(waited=0.0, spent=0.001)
        >>> choice.steps
        8
        >>> choice.observe_run()  # (the turns between probes are done: a probe again)
        >>> choice.steps
        1
    """

    def __init__(
        self,
        run_steps: int = AUTO_DECODE_STEPS,
        probe_steps: int = PROBE_STEPS,
        turns_between_probes: int = TURNS_BETWEEN_PROBES,
        host_bound_share: float = HOST_BOUND_SHARE,
    ) -> None:
        if run_steps < 2 or probe_steps < 1 or turns_between_probes < 1:
            raise ValueError(
                "run_steps must be >= 2, probe_steps and turns_between_probes >= 1, got "
                f"{run_steps}, {probe_steps}, {turns_between_probes}"
            )
        self.run_steps = run_steps
        self.probe_steps = probe_steps
        self.turns_between_probes = turns_between_probes
        self.host_bound_share = host_bound_share
        self.num_probes = 0  # probes finished, and of those the ones that chose runs
        self.num_host_bound = 0
        self.reset()

    def reset(self) -> None:
        """Probe afresh (the loop has nothing to do: the next work may differ)."""
        self.is_probing = True  # single steps, measured; else runs
        self._waited = self._spent = 0.0
        self._probed = 0
        self._turns_left = 0

    @property
    def steps(self) -> int:
        """The most decode steps a decode batch runs now: 1 while probing."""
        return 1 if self.is_probing else self.run_steps

    def observe_step(self, waited: float, spent: float) -> None:
        """A decode step the overlapped loop ran alone: `waited` seconds of its `spent`
        (its iteration's wall time) went to waiting for the device. Measured while
        probing (the probe's last step decides); otherwise a turn."""
        if not self.is_probing:
            self._take_turn()
            return
        self._waited += waited
        self._spent += spent
        self._probed += 1
        if self._probed < self.probe_steps:
            return
        host_bound = self._waited < self.host_bound_share * self._spent
        self._waited = self._spent = 0.0
        self._probed = 0
        self.num_probes += 1
        if host_bound:
            self.num_host_bound += 1
            self.is_probing = False
            self._turns_left = self.turns_between_probes

    def observe_run(self) -> None:
        """A decode run was launched: a turn (after the last, no run is launched ahead of
        its commit, and the loop probes)."""
        if not self.is_probing:
            self._take_turn()

    def _take_turn(self) -> None:
        self._turns_left -= 1
        if self._turns_left <= 0:
            self.is_probing = True
