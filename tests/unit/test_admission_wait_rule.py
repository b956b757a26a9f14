"""`AdmissionWait`'s bounds, with no model: however the room and the pool go, it waits at
most `max_steps` steps in a row, and never for a request that resumes or for prompts
that would not go in one step. (The engine-level checks of the rule, step by step, are in
tests/runtime/test_admission_wait.py.)"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from lmprog_runtime.admission_wait import AdmissionWait

requests = st.builds(
    SimpleNamespace,
    output_ids=st.just([]),
    kv_len=st.just(0),
    seq_len=st.integers(1, 40),
    max_new_tokens=st.integers(0, 100),
)
steps = st.lists(
    st.tuples(
        st.lists(requests, min_size=1, max_size=6),  # waiting
        st.integers(1, 16),  # room
        st.integers(0, 2000),  # available
        st.booleans(),  # admission admitted at this step (when it did not wait)
    ),
    max_size=60,
)


@given(st.integers(0, 5), st.integers(1, 64), steps)
def test_it_waits_at_most_max_steps_in_a_row(max_steps, max_running, trace):
    wait = AdmissionWait(max_steps, max_running, max_prefill_tokens=100)
    in_a_row = 0
    for waiting, room, available, admitted in trace:
        if wait.holds(waiting, room, available, new_token_ratio=0.5):
            in_a_row += 1
            assert in_a_row <= max_steps
            assert wait.num_held == in_a_row
        elif admitted:
            wait.reset()
            in_a_row = 0


@given(st.lists(requests, min_size=1, max_size=6), st.integers(0, 5))
def test_a_resuming_request_or_a_long_group_is_never_held_back(waiting, position):
    wait = AdmissionWait(8, max_running_requests=64, max_prefill_tokens=100)
    resumed = SimpleNamespace(output_ids=[7], kv_len=0, seq_len=8, max_new_tokens=8)
    group = [*waiting[:position], resumed, *waiting[position:]]  # (7 at most: one group)
    assert not wait.holds(group, room=0, available=0, new_token_ratio=1.0)
    long = [SimpleNamespace(output_ids=[], kv_len=0, seq_len=101, max_new_tokens=1)]
    assert not wait.holds(long, room=0, available=0, new_token_ratio=1.0)
    assert wait.num_held == 0
    # (without those, a group with no room waits)
    roomy = AdmissionWait(8, max_running_requests=64, max_prefill_tokens=10**6)
    assert roomy.holds(waiting, room=0, available=0, new_token_ratio=1.0)
