"""`end_outside_pattern`: where a constrained output fully matches, the model draws from
every token and one the pattern cannot take ends the output (guidance's rule). Checked
against a greedy decode with transformers' forward and the `regex` module's partial
matching (`pattern_reference.py`), on both engine loops and streamed."""

from __future__ import annotations

import re

import pytest
from overlap_engines import engine_pair
from pattern_reference import constrained_reference, vocab_bytes

CASES = [
    ("Age: ", "[0-9]{1,3}"),
    ("Count:", "[0-9]+"),
    ("The answer is", "( yes| no)"),
    ("Code: ", "[A-Z]{2}[0-9]{0,4}"),
]


@pytest.fixture(scope="module")
def tiny_bytes(hf_tiny):
    return vocab_bytes(hf_tiny[1])


@pytest.mark.parametrize("prompt, pattern", CASES)
@pytest.mark.parametrize("end_outside", [True, False])
def test_greedy_matches_the_reference(engine, hf_tiny, tiny_bytes, prompt, pattern, end_outside):
    ids = engine.encode(prompt)
    params = {
        "max_new_tokens": 8,
        "temperature": 0,
        "regex": pattern,
        "end_outside_pattern": end_outside,
    }
    out = engine.generate(input_ids=ids, sampling_params=params)
    want = constrained_reference(
        hf_tiny, tiny_bytes, ids, pattern, 8, heal=False, end_outside=end_outside
    )
    assert out["output_ids"] == want
    reason = out["meta_info"]["finish_reason"]
    if reason["type"] == "stop":
        assert reason["matched"] == want[-1]
        # The ending token (EOS, or one outside the pattern) is not in the text.
        assert out["text"] == engine.decode(want[:-1])
        assert re.fullmatch(pattern, out["text"])


def test_it_ends_where_eos_alone_would_not(engine):
    """On this model the draw after a full match is almost never the pattern's: ending
    there is what the option changes (the test above could pass with it ignored only if
    no case differed)."""
    differs = 0
    for prompt, pattern in CASES:
        params = {"max_new_tokens": 8, "temperature": 0, "regex": pattern}
        eos_only = engine.generate(prompt, params)
        ended = engine.generate(prompt, {**params, "end_outside_pattern": True})
        assert eos_only["text"].startswith(ended["text"])
        differs += eos_only["text"] != ended["text"]
    assert differs >= 2


@pytest.mark.parametrize("worker", ["worker_thread", "loop_thread"])
def test_both_loops_agree_and_stream_the_text(tiny_path, worker):
    params = [
        {"max_new_tokens": 8, "temperature": 0, "regex": p, "end_outside_pattern": True}
        for _, p in CASES
    ] + [
        {
            "max_new_tokens": 6,
            "temperature": 0.9,
            "seed": 5,
            "regex": "[a-z ]+",
            "end_outside_pattern": True,
        }
    ]
    prompts = [p for p, _ in CASES] + ["Words:"]
    with engine_pair(tiny_path, worker) as (sync, overlapped):
        results = []
        for eng in (sync, overlapped):
            outs = eng.generate(prompts, params)
            streamed = [
                "".join(c["text"] for c in eng.generate(p, q, stream=True))
                for p, q in zip(prompts, params)
            ]
            results.append(([o["output_ids"] for o in outs], [o["text"] for o in outs], streamed))
        assert results[0] == results[1]
        assert results[0][1] == results[0][2]


def test_bad_end_outside_pattern_is_refused(engine):
    with pytest.raises(TypeError, match="end_outside_pattern"):
        engine.generate("Age: ", {"regex": "[0-9]+", "end_outside_pattern": 1})
