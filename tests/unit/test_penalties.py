"""Penalty counts kept on the device (`penalties.PenaltyCounts`) against a dense count of
each request's tokens on the host, bit for bit.

The counts are counted by the draws themselves, so they must follow every way a request's
tokens change: draws (one or a run of several, a row that draws nothing), tokens held as
placeholders while they are drawn, jump-forward rewriting an output, a draw queued and
dropped, requests leaving and their rows going to new ones.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime import penalties
from lmprog_runtime.penalties import PenaltyCounts, PenaltyRow
from lmprog_runtime.request import Req
from lmprog_runtime.run_plan import rows_ahead
from lmprog_runtime.sampling import SampleRow, _apply_penalties_and_masks, sample_each
from lmprog_runtime.sampling_params import SamplingParams


def make_req(rid: int, params: SamplingParams, output: list[int] = ()) -> Req:
    req = Req(rid, [1, 2, 3], params, tokenizer=None, eos_token_ids=frozenset(), context_len=10**6)
    req.output_ids = list(output)
    return req


def reference(logits: torch.Tensor, params: SamplingParams, tokens: list[int]) -> torch.Tensor:
    """`logits` [vocab] less the frequency and presence penalties of a bincount of `tokens`
    (those outside the vocabulary count for nothing), in float32, rounded once."""
    vocab = logits.shape[-1]
    kept = torch.tensor([t for t in tokens if 0 <= t < vocab], dtype=torch.int64)
    counts = torch.bincount(kept, minlength=vocab).float()
    penalty = params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return (logits.float() - penalty).to(logits.dtype)


def test_penalties_of_a_batch_equal_each_row_penalised_alone():
    """Every penalised row of a batch, counted from its request's output: each as the
    per-row reference, bit for bit; rows without penalties untouched; an output id past
    the vocabulary counts for nothing."""
    vocab, counts = 50, PenaltyCounts()
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    outputs = [[3, 3, 7, 49, 3], None, [0, 12, 12, 60], [5]]
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.2),
        SamplingParams(),
        SamplingParams(frequency_penalty=-0.4, presence_penalty=1.5),
        SamplingParams(presence_penalty=0.9),
    ]
    rows = [
        SampleRow(i, p, None, 0, None if ids is None else PenaltyRow(counts, 3 - i, ids), [], None)
        for i, (p, ids) in enumerate(zip(params, outputs))
    ]
    got = _apply_penalties_and_masks(logits, rows)
    for i, (p, ids) in enumerate(zip(params, outputs)):
        want = logits[i] if ids is None else reference(logits[i], p, ids)
        assert torch.equal(got[i], want), i


def test_bfloat16_logits_are_penalised_in_float32_and_rounded_once():
    """A token held 300 times (past bfloat16's exact integers) with a small frequency
    penalty: the penalty is the float32 product, subtracted from the float32 logit and
    rounded to bfloat16 once."""
    vocab, counts = 16, PenaltyCounts()
    params = SamplingParams(frequency_penalty=0.013, presence_penalty=0.3)
    output = [5] * 300 + [7] * 3
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4)).bfloat16()
    rows = [SampleRow(0, params, None, 0, PenaltyRow(counts, 0, output), [], None)]
    got = _apply_penalties_and_masks(logits, rows)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[0], reference(logits[0], params, output))


def test_a_draw_counts_the_tokens_of_its_penalised_rows_that_did_not_fail():
    """`sample_each` on a batch mixing penalised and other rows, one penalised row failing
    (a grammar mask too short for the vocabulary: the batch raises, each row is drawn
    alone): each other penalised row counts its token in its own row, the failing one
    none; the greedy tokens are the argmax of the penalised logits."""
    vocab, counts = 40, PenaltyCounts()
    short = torch.zeros(1, dtype=torch.int32)  # (32 tokens' bits for 40)
    greedy = SamplingParams(temperature=0)
    penalised = SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=1.0)
    outputs = {1: [3, 3, 9], 2: [5], 4: []}
    rows = [
        SampleRow(i, penalised if i in outputs else greedy, None, 0,
                  PenaltyRow(counts, 7 - i, outputs[i]) if i in outputs else None,
                  [], short if i == 2 else None)
        for i in range(5)
    ]  # fmt: skip
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(5))
    logits[1, 3] = logits[1].max() + 1.0  # (its most likely token, penalised away)
    token_ids, errors = sample_each(logits, rows)
    assert list(errors) == [2] and token_ids[2] == -1
    for i, output in outputs.items():
        tokens = output + ([] if i == 2 else [int(token_ids[i])])
        want = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab)
        assert torch.equal(counts._counts[7 - i], want.float()), i
    for i in (0, 1, 3, 4):
        params = rows[i].params
        want = logits[i] if i in (0, 3) else reference(logits[i], params, outputs[i])
        assert int(token_ids[i]) == int(want.argmax()), i
    assert int(token_ids[1]) != 3


def test_a_row_is_not_counted_again_while_a_token_of_it_is_being_drawn():
    """A request whose counts are out of step (never counted, or its draws dropped) is
    counted again from its output: refused while its last token is a placeholder or it
    holds tokens of a run not yet committed (`offset`), which would leave them out."""
    counts = PenaltyCounts()
    req = make_req(0, SamplingParams(frequency_penalty=0.5), [4, 5])
    assert counts.row_of(req).reset == [4, 5]  # (its first draw)
    req.output_ids.append(-1)  # (that draw's token: a placeholder until it is checked)
    assert counts.row_of(req).reset is None  # (a run launched from it ...)
    with pytest.raises(RuntimeError, match="out of step"):  # (... and dropped)
        counts.row_of(req)
    req.output_ids[-1] = 9
    with pytest.raises(RuntimeError, match="out of step"):
        counts.row_of(req, offset=2)
    assert counts.row_of(req).reset == [4, 5, 9]
    counts.release(req)
    assert counts.num_used == 0 and req.penalty_row is None


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.lists(st.integers(0, 21), max_size=4)),
        st.tuples(
            st.just("draw"),
            st.integers(1, 3),
            st.integers(0, 2**16),
            st.sampled_from(["plain", "placeholder", "continued", "dropped"]),
        ),
        st.tuples(st.just("jump"), st.integers(0, 5), st.lists(st.integers(0, 17), max_size=3)),
        st.tuples(st.just("finish"), st.integers(0, 7)),
    ),
    max_size=30,
)


@settings(max_examples=80, deadline=None)
@given(ops=OPS, vocab=st.integers(4, 18), row_by_row=st.booleans())
def test_counts_follow_each_requests_tokens(ops, vocab, row_by_row):
    """Requests come and go (rows reused) and draw runs of 1 to 3 steps (each step's draw
    reading the counts the steps before it counted on the device; a step drawing nothing
    for some rows, which fails its request): committed at once, launched from a
    placeholder (a draw not yet checked), continued before they are committed (a run
    launched ahead), or dropped; requests jump forward (their output rewritten). Every
    draw's penalised logits equal the dense reference of the request's tokens so far,
    the host's and those still on the device, bit for bit. At the end every row is free
    and no more rows were made than requests were ever live at once. Both ways of
    subtracting the penalties (a CPU's row by row, the batch's gather)."""
    with mock.patch.object(penalties, "_row_by_row", lambda logits: row_by_row):
        follow_requests(ops, vocab)


def follow_requests(ops: list[tuple], vocab: int) -> None:
    counts, live, rid, most = PenaltyCounts(), [], 0, 0
    weights = [(0.5, 0.25), (-1.0, 0.0), (0.0, 1.5), (0.3, -0.2)]

    def run(reqs: list[Req], steps: int, seed: int, pending: list[list[int]], offset=0):
        """A run of `steps` draws for `reqs`, each holding its `pending` tokens on the
        device only (`offset` of them past its output: a run not yet committed), checking
        each draw; the tokens drawn (-1: none)."""
        gen = torch.Generator().manual_seed(seed)
        held = [[t for t in r.output_ids if t >= 0] + p for r, p in zip(reqs, pending)]
        rows = [
            SampleRow(r.rid, r.params, None, 0, counts.row_of(r, offset, steps), [], None)
            for r in reqs
        ]
        drawn: list[list[int]] = [[] for _ in reqs]
        for k in range(steps):
            step_rows = rows_ahead(rows, reqs, offset + k)
            logits = torch.randn(len(reqs), vocab, generator=gen)
            got = _apply_penalties_and_masks(logits, step_rows)
            for i, req in enumerate(reqs):
                if -1 not in drawn[i]:
                    want = reference(logits[i], req.params, held[i] + drawn[i])
                    assert torch.equal(got[i], want)
            tokens = torch.randint(-1, vocab, (len(reqs),), generator=gen)
            counts.count_drawn([row.penalty for row in step_rows], tokens)
            for i, token in enumerate(tokens.tolist()):
                drawn[i].append(token)
        return drawn

    def finish(req: Req) -> None:
        counts.release(req)
        live.remove(req)

    def commit(reqs: list[Req], drawn: list[list[int]]) -> list[Req]:
        """Append each request's tokens, failing those a row drew none for; the others."""
        kept = []
        for req, tokens in zip(reqs, drawn):
            if -1 in tokens:
                finish(req)
            else:
                req.output_ids += tokens
                kept.append(req)
        return kept

    for op in ops:
        if op[0] == "new":
            frequency, presence = weights[rid % len(weights)]
            params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
            live.append(make_req(rid, params, op[1]))
            rid += 1
            most = max(most, len(live))
        elif op[0] == "draw" and live:
            _, steps, seed, how = op
            reqs = live[seed % len(live) :][:3]
            nothing = [[] for _ in reqs]
            if how in ("plain", "dropped"):
                drawn = run(reqs, steps, seed, nothing)
                if how == "plain":  # (dropped: never on the host, counted again next time)
                    commit(reqs, drawn)
            elif how == "placeholder":  # a draw, then a run launched before its check
                first = [tokens[0] for tokens in run(reqs, 1, seed, nothing)]
                for req, token in zip(reqs, first):
                    if token < 0:
                        finish(req)
                reqs = [req for req, token in zip(reqs, first) if token >= 0]
                first = [token for token in first if token >= 0]
                for req in reqs:
                    req.output_ids.append(-(req.rid + 1))
                drawn = run(reqs, steps, seed + 1, [[token] for token in first])
                for req, token in zip(reqs, first):
                    req.output_ids[-1] = token
                commit(reqs, drawn)
            else:  # continued: a run, and the run after it launched before its commit
                before = run(reqs, steps, seed, nothing)
                going = [i for i, tokens in enumerate(before) if -1 not in tokens]
                going_reqs = [reqs[i] for i in going]
                after = run(going_reqs, 3, seed + 1, [before[i] for i in going], steps)
                commit(reqs, before)
                commit(going_reqs, after)
        elif op[0] == "jump" and live:
            req = live[op[1] % len(live)]
            kept = min(op[1], len(req.output_ids))
            req.replace_output_tail(kept, op[2], "")
        elif op[0] == "finish" and live:
            finish(live[op[1] % len(live)])
    for req in list(live):
        run([req], 1, 0, [[]])
        finish(req)
    assert counts.num_used == 0
    assert counts._num_rows <= most


def test_the_table_grows_keeping_its_rows():
    """Rows past the table's end grow it (doubling), the rows counted before kept."""
    counts, vocab = PenaltyCounts(), 6
    logits = torch.zeros(1, vocab)
    reqs = [make_req(i, SamplingParams(frequency_penalty=1.0), [i % vocab] * 2) for i in range(20)]

    def penalised(req: Req) -> torch.Tensor:  # (read, nothing drawn: `draws` 0)
        row = SampleRow(0, req.params, None, 0, counts.row_of(req, draws=0), [], None)
        return _apply_penalties_and_masks(logits, [row])[0]

    for req in reqs:
        assert penalised(req)[req.rid % vocab] == -2.0
    assert counts._counts.shape[0] == 32
    for req in reqs:  # (every row counted already: read as it was)
        assert counts.row_of(req, draws=0).reset is None
        assert torch.equal(penalised(req), reference(logits[0], req.params, req.output_ids))
        counts.release(req)
