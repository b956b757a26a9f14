"""A padded decode batch's padding rows write their K/V to the padding slot 0 only, also
when the bucket's previous run filled those rows with a real request (a batch that shrank
within its bucket). The existing graph test runs growing batch sizes only, where the rows
past the batch never held a request."""

from __future__ import annotations

import dataclasses

import torch

from lmprog_runtime import Engine
from lmprog_runtime.cuda_graph import DecodeGraphRunner
from lmprog_runtime.forward_batch import ForwardMode

PROMPTS = ["Hi", "The capital of France is", "def add(a, b):", '{"name": "Alice", "age":']


def test_padding_rows_write_only_the_padding_slot_after_a_larger_batch(tiny_path):
    with Engine(tiny_path, max_running_requests=12, attention_backend="torch") as engine:
        runner = engine.runner
        graphs = DecodeGraphRunner(runner, capture=False)
        pool = runner.kv_pool
        plain_run = runner.run
        written: list[torch.Tensor] = []
        set_kv = pool.set_kv

        def recording_set_kv(layer_id, loc, k, v):
            if layer_id == 0:
                written.append(loc.clone())
            return set_kv(layer_id, loc, k, v)

        checked = []

        def run_both(fb):
            logits = plain_run(fb)
            n = fb.batch_size
            if fb.mode is ForwardMode.DECODE and n == 4:
                graphs.run(fb)  # fills rows 0..3 of the static buffers (bucket 4)
                fewer = dataclasses.replace(
                    fb,
                    input_ids=fb.input_ids[:3],
                    positions=fb.positions[:3],
                    out_cache_loc=fb.out_cache_loc[:3],
                    req_pool_indices=fb.req_pool_indices[:3],
                    seq_lens=fb.seq_lens[:3],
                    prefix_lens=fb.prefix_lens[:3],
                    logits_indices=fb.logits_indices[:3],
                    seq_lens_device=fb.seq_lens_device[:3],
                    packed=None,
                )
                assert graphs.bucket(3) == 4
                written.clear()
                pool.set_kv = recording_set_kv
                try:
                    padded = graphs.run(fewer)
                finally:
                    del pool.set_kv
                # (checked after the run: an assertion here would fail the requests only)
                checked.append(
                    (
                        padded.clone(),
                        logits[:3].clone(),
                        list(written),
                        fb.out_cache_loc[:3].clone(),
                    )
                )
            return logits

        runner.run = run_both
        try:
            engine.generate(PROMPTS, {"max_new_tokens": 3, "temperature": 0})
        finally:
            del runner.run
        assert checked
        for padded, logits, written_locs, request_locs in checked:
            torch.testing.assert_close(padded, logits, atol=1e-5, rtol=1e-5)
            (locs,) = written_locs
            assert locs[:3].tolist() == request_locs.tolist()
            assert locs[3:].tolist() == [0], "a padding row wrote a request's KV slot"
