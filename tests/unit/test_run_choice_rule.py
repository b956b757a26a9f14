"""The rule of `decode_steps="auto"` (`run_choice.RunChoice`). No model.

Against a reference written from its description (probes of `probe_steps` single decode
steps, each deciding on its own sum of waits against its own sum of wall times; after a
probe that found the host the bottleneck, `turns_between_probes` turns, each a run or a
decode step observed meanwhile, then a probe again; `reset` probes afresh), and on
hand-made cases at the threshold."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.run_choice import RunChoice

# ("step", waited, spent), ("run",) or ("reset",)
event = st.one_of(
    st.tuples(
        st.just("step"),
        st.floats(0, 1e-2, allow_nan=False),
        st.floats(1e-5, 1e-2, allow_nan=False),
    ),
    st.tuples(st.just("run")),
    st.tuples(st.just("reset")),
)


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(event, max_size=80),
    probe_steps=st.integers(1, 5),
    turns=st.integers(1, 4),
    share=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
)
def test_the_choice_follows_probes_of_single_steps(events, probe_steps, turns, share):
    choice = RunChoice(8, probe_steps, turns, share)
    probing, window, turns_left = True, [], 0  # (the reference's state)
    probes = host_bound = 0
    for kind, *times in events:
        if kind == "reset":
            choice.reset()
            probing, window = True, []
        elif kind == "step":
            choice.observe_step(*times)
            if probing:
                window.append(times)
                if len(window) == probe_steps:
                    waited = sum(w for w, _ in window)
                    spent = sum(s for _, s in window)
                    probes += 1
                    if waited < share * spent:
                        probing, turns_left, host_bound = False, turns, host_bound + 1
                    window = []
            else:
                turns_left -= 1
                probing = turns_left == 0
        else:
            choice.observe_run()
            if not probing:
                turns_left -= 1
                probing = turns_left == 0
        assert choice.is_probing == probing
        assert choice.steps == (1 if probing else 8)
        assert (choice.num_probes, choice.num_host_bound) == (probes, host_bound)


def test_the_threshold_cases_by_hand():
    """Waiting exactly a tenth of the time is not host-bound; a hair under is; a share of
    0 never takes runs; the turns after a probe are runs and steps alike."""
    at = RunChoice(8, probe_steps=2, turns_between_probes=3, host_bound_share=0.1)
    at.observe_step(waited=0.1, spent=1.0)
    at.observe_step(waited=0.1, spent=1.0)
    assert at.steps == 1 and (at.num_probes, at.num_host_bound) == (1, 0)
    under = RunChoice(8, probe_steps=2, turns_between_probes=3, host_bound_share=0.1)
    under.observe_step(waited=0.2, spent=1.0)  # (a probe's sum decides, not each step)
    under.observe_step(waited=0.0, spent=1.01)
    assert under.steps == 8
    under.observe_run()
    under.observe_step(waited=0.9, spent=1.0)  # (a turn: its wait is not measured)
    assert under.steps == 8
    under.observe_run()
    assert under.steps == 1 and under.is_probing
    never = RunChoice(8, probe_steps=1, turns_between_probes=1, host_bound_share=0.0)
    for _ in range(5):
        never.observe_step(waited=0.0, spent=1.0)
    assert never.steps == 1 and never.num_probes == 5 and never.num_host_bound == 0


def test_reset_probes_afresh_and_keeps_the_counts():
    choice = RunChoice(8, probe_steps=2, turns_between_probes=32)
    choice.observe_step(waited=0.0, spent=1.0)
    choice.observe_step(waited=0.0, spent=1.0)
    assert choice.steps == 8
    choice.reset()
    assert choice.steps == 1 and (choice.num_probes, choice.num_host_bound) == (1, 1)
    choice.observe_step(waited=1.0, spent=1.0)
    choice.observe_step(waited=1.0, spent=1.0)
    assert choice.steps == 1 and choice.num_probes == 2


def test_settings_are_validated():
    for bad in [(1, 8, 32), (8, 0, 32), (8, 8, 0)]:
        with pytest.raises(ValueError, match="run_steps"):
            RunChoice(*bad)
