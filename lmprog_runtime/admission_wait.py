"""Admission that waits, so that several requests are admitted in one step.

On CUDA a step that admits (a prompt's, or a mixed prefill+decode one) runs eagerly,
dozens of launches a layer, where a decode step replays one graph; a dataset run, which
admits a request whenever one finishes, would run most of its steps eagerly. While
requests decode, admission may wait up to `admission_wait_steps` steps (SGLang has no such
setting; text-generation-inference's `max_waiting_tokens` is the same idea), unless the
room already takes a group. This module only decides whether to wait; the scheduler
admits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmprog_runtime.request import Req

# A group is `max_running_requests` divided by this: an eighth of it (or every waiting
# request, if fewer wait).
ADMISSION_GROUP_DIVISOR = 8
# `admission_wait_steps` where decode steps replay CUDA graphs (None there, no decode runs).
GRAPHED_ADMISSION_WAIT_STEPS = 8


class AdmissionWait:
    """Whether admission waits this step (`holds`), and how many steps it has waited.

    Example (the requests' fields are all it reads):
        >>> from types import SimpleNamespace as R
        >>> wait = AdmissionWait(max_steps=2, max_running_requests=16, max_prefill_tokens=64)
        >>> new = [R(output_ids=[], kv_len=0, seq_len=8, max_new_tokens=8)] * 3
        >>> [wait.holds(new, room=1, available=1000, new_token_ratio=0.5) for _ in range(3)]
        [True, True, False]
        >>> wait.reset()  # (it admitted)
        >>> wait.holds(new, room=2, available=1000, new_token_ratio=0.5)  # a group has room
        False
    """

    def __init__(self, max_steps: int, max_running_requests: int, max_prefill_tokens: int):
        self.max_steps = max_steps
        self.group_size = max(1, max_running_requests // ADMISSION_GROUP_DIVISOR)
        self.max_prefill_tokens = max_prefill_tokens
        self.num_held = 0  # steps waited since admission last admitted

    @property
    def can_hold(self) -> bool:
        """Whether `holds` may say to wait (it has waited fewer than `max_steps`)."""
        return self.num_held < self.max_steps

    def holds(
        self, waiting: Sequence[Req], room: int, available: float, new_token_ratio: float
    ) -> bool:
        """Whether to admit nothing this step (counted as a step waited), given the waiting
        requests admission may consider, in arrival order (`waiting`: the group looked at
        may differ from the one a cache-aware policy admits), the requests that may run
        beside the running ones (`room`) and the pool's tokens not set aside (`available`).
        Call only while requests decode: the step is theirs.

        It waits unless the room and the pool take a group (its prompts and
        `new_token_ratio` of its outputs, counted as if nothing were cached: an estimate,
        on the side of waiting). It never holds back a request that was running (retracted,
        or jumped forward: it resumes), nor a group whose prompts together exceed one step's
        `max_prefill_tokens` (they would not go in one step anyway, and there the prefill
        outweighs the launches)."""
        if not self.can_hold:
            return False
        group = waiting[: self.group_size]
        if any(r.output_ids or r.kv_len for r in group):
            return False
        prompts = sum(r.seq_len for r in group)
        if prompts > self.max_prefill_tokens:
            return False
        if room >= len(group):
            outputs = sum(r.max_new_tokens for r in group) * new_token_ratio
            if prompts + outputs <= available:
                return False
        self.num_held += 1
        return True

    def reset(self) -> None:
        """Admission admitted, or nothing waits: the next wait starts from none."""
        self.num_held = 0
