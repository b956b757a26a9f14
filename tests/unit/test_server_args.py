"""SGLang's server-argument names for the in-process engine (`server_args.from_sglang`)."""

from __future__ import annotations

import pytest

from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.server_args import NO_EFFECT, RENAMED, from_sglang


def test_renamed_arguments_become_lmprogs_and_shared_names_pass():
    got = from_sglang(
        "m",
        {
            "context_length": 512,
            "mem_fraction_static": 0.8,
            "num_continuous_decode_steps": 4,
            "max_running_requests": 16,
            "disable_radix_cache": True,
        },
    )
    assert got == {
        "context_len": 512,
        "mem_fraction": 0.8,
        "decode_steps": 4,
        "max_running_requests": 16,
        "disable_radix_cache": True,
    }
    # Every renamed argument lands on a field the engine has.
    assert set(RENAMED.values()) <= RuntimeConfig.field_names()
    assert not (NO_EFFECT & RuntimeConfig.field_names())


def test_server_only_settings_are_accepted_and_do_nothing():
    fields = {"host": "0.0.0.0", "port": 30000, "log_level": "error", "trust_remote_code": True}
    assert from_sglang("m", fields | {"tp_size": 1, "dp_size": 1, "tokenizer_path": "m"}) == {}


def test_overlap_off_is_the_only_way_disable_overlap_schedule_changes_anything():
    assert from_sglang("m", {"disable_overlap_schedule": True}) == {"overlap_schedule": False}
    assert from_sglang("m", {"disable_overlap_schedule": False}) == {}


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"tp_size": 2}, ValueError, "tp_size=2: an lmprog engine runs on one device"),
        ({"dp_size": 4}, ValueError, "dp_size=4"),
        ({"tokenizer_path": "other"}, ValueError, "tokenizer_path='other'"),
        ({"context_length": 64, "context_len": 64}, TypeError, "context_length and context_len"),
        ({"mem_fraction": 0.5, "mem_fraction_static": 0.5}, TypeError, "mem_fraction"),
    ],
)
def test_what_one_in_process_engine_cannot_honour_is_refused(fields, error, match):
    with pytest.raises(error, match=match):
        from_sglang("m", fields)
