"""Turn a batch of next-token logits into tokens, one request per row.

Order of operations per row: frequency/presence penalties, min_new_tokens masking of EOS
and stop tokens, the grammar mask of a constrained request (only tokens that keep the text
a prefix of a match; EOS only where it is a full match), then greedy argmax (temperature 0
or top_k 1) or temperature, then top-k, top-p and min-p filtering, each filter applied to
what the previous one kept (as transformers' warpers do), followed by a draw from the
request's own seeded generator, so a request samples the same tokens whatever else shares
its batch. Logprobs are reported from the model's raw distribution (log-softmax of the
unprocessed logits).

Everything runs on the logits' device: per-request parameters (one tensor) and grammar
bitmasks are built on the host and copied there; penalties count each request's tokens on
the device as they are drawn (`penalties.py`). The draw depends on that device: on the
CPU it reproduces `torch.multinomial` with the request's generator (tokens identical to
the multinomial reference); on an accelerator the whole batch is one exponential race
whose noise is hashed from each request's seed and draw number (`keyed_race.py`), so a
seed reproduces its tokens on an accelerator, whatever shares the batch, but not the
CPU's tokens (the logits differ there anyway).

What sampling reads of a request is taken first, on the engine's loop thread
(`sample_rows`); drawing from those `SampleRow`s (`sample_each`) reads no request, so the
overlap loop runs it on its forward worker, queued behind the forward, while the loop
goes on changing the requests.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

from lmprog_runtime.constrained.base import mask_words, unpack_mask_words
from lmprog_runtime.keyed_race import keyed_race, race_key
from lmprog_runtime.penalties import PenaltyCounts, PenaltyRow
from lmprog_runtime.request import Req
from lmprog_runtime.sampling_filters import top_k_top_p, top_k_top_p_unsorted
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.transfer import index_tensor, to_device

logger = logging.getLogger(__name__)

NO_MASS = (
    "its sampling distribution has no finite, positive mass (non-finite logits, or every "
    "token masked)"
)


class SampleRow(NamedTuple):
    """What sampling reads of one request, taken when its row is drawn: its parameters,
    generator (None when greedy: a greedy row draws from none) and race key
    (`keyed_race.race_key` of its seed and the tokens it has so far; 0 when greedy), its
    row of penalty counts (when it has penalties), the tokens it may not draw yet (EOS and
    stop tokens under min_new_tokens) and its grammar's allowed tokens as bits."""

    rid: int
    params: SamplingParams
    generator: torch.Generator | None
    key: int
    penalty: PenaltyRow | None
    banned: list[int]
    mask_words: torch.Tensor | None  # int32 [ceil(vocab / 32)] on the host


class SampleRows(list):
    """`sample_rows`' rows. `plain`: every row is greedy, with no penalties, no banned
    tokens and no grammar mask, so that drawing them is their argmax and nothing else
    (`sample_each` then skips the per-row work; a decode batch's usual case)."""

    plain = False


def sample_rows(
    reqs: list[Req], vocab: int, counts: PenaltyCounts, offset: int = 0, draws: int = 1
) -> SampleRows:
    """Each request's `SampleRow` now (on the thread that owns the requests), for `draws`
    draws from it when the requests have `offset` tokens more than they hold (a decode
    run's; `counts` keeps the penalised requests' counts)."""
    constrained = [req for req in reqs if req.matcher is not None]
    words = iter(mask_words([req.matcher for req in constrained], vocab)) if constrained else None
    rows = SampleRows()
    plain = True
    for req in reqs:
        row = req.plain_sample_row
        if row is not None:
            rows.append(row)
            continue
        params = req.params
        banned: list[int] = []
        if not req.can_stop:
            # A grammar decides by itself where its output may end: its EOS stays allowed.
            keep = {req.grammar_eos} if req.matcher is not None else set()
            if req.heal is not None and not req.output_ids:  # (it regenerates prompt text)
                keep.add(req.heal.token_id)
            banned = [t for t in req.ends_on - keep if 0 <= t < vocab]
        penalty = counts.row_of(req, offset, draws) if params.has_penalties else None
        mask = next(words) if req.matcher is not None else None
        # A complete match that may end on any token draws unmasked; the request keeps
        # the pattern's tokens to tell (`Req.check_last_token`).
        req.end_words = None
        ends = mask is not None and params.end_outside_pattern and req.grammar is not None
        if ends and req.matcher.is_complete():
            req.end_words, mask = mask, None
        greedy = params.is_greedy
        key, generator = 0, None
        if not greedy:
            key, generator = race_key(req.seed, len(req.output_ids)), req.generator
        row = SampleRow(req.rid, params, generator, key, penalty, banned, mask)
        row_plain = greedy and penalty is None and mask is None and not banned
        if row_plain and req.matcher is None and req.can_stop:
            # Nothing of it changes at later draws (can_stop stays reached; no grammar,
            # counts or keys): taken once, as the loop takes up to hundreds a step.
            req.plain_sample_row = row
        plain = plain and row_plain
        rows.append(row)
    rows.plain = plain
    return rows


def take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`logits[rows]` (the tensor itself when `rows` are all of its rows, in order)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, index_tensor(rows, logits.device))


def sample_token_ids(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The tokens drawn for `rows` from `logits` [len(rows), vocab], as an int64 tensor on
    the logits' device; -1 for a row whose distribution has no mass (`NO_MASS`). On an
    accelerator nothing is read back from the device (`on_accelerator`). The penalties'
    counts are read, not counted (`sample_each` counts the tokens it returns)."""
    if getattr(rows, "plain", False):
        return argmax_rows(logits)
    logits = _apply_penalties_and_masks(logits, rows)
    token_ids = argmax_rows(logits)  # [batch]
    sampled_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if sampled_rows:
        index = index_tensor(sampled_rows, logits.device)
        sampled = [rows[i] for i in sampled_rows]
        probs = _filtered_probs(logits.index_select(0, index), sampled)
        generators, rids = [r.generator for r in sampled], [r.rid for r in sampled]
        keys = [r.key for r in sampled]
        token_ids[index] = draw(probs, generators, rids, mark=True, keys=keys)
    return token_ids


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first index among equal maxima). On a CPU `max`'s
    indices: the same, without torch's unvectorised CPU argmax (2.5x as long: 2.1 ms for
    64 rows of a 49152-token vocabulary)."""
    return x.max(dim=-1).indices if x.device.type == "cpu" else x.argmax(dim=-1)


def sample_each(
    logits: torch.Tensor, rows: list[SampleRow]
) -> tuple[torch.Tensor, dict[int, Exception]]:
    """`sample_token_ids` for the batch; if it raises, each row is drawn alone (seeded
    generators rewound first, so the others draw what they would have). Returns the token
    ids (-1 where a row failed or had no mass) and each failed row's error, by row index;
    the penalised rows' counts then count their tokens."""
    plain = getattr(rows, "plain", False)  # (greedy rows only: no generator, no counts)
    seeded = (
        []
        if plain or on_accelerator(logits.device)
        else [r.generator for r in rows if not r.params.is_greedy]
    )
    states = [generator.get_state() for generator in seeded]
    errors: dict[int, Exception] = {}
    try:
        token_ids = sample_token_ids(logits, rows)
    except Exception:  # noqa: BLE001 - find the culprit below
        logger.exception("sampling failed; sampling each request alone")
        for generator, state in zip(seeded, states):
            generator.set_state(state)
        token_ids = torch.full((len(rows),), -1, dtype=torch.int64, device=logits.device)
        for i, row in enumerate(rows):
            try:
                token_ids[i : i + 1] = sample_token_ids(logits[i : i + 1], [row])
            except Exception as error:  # noqa: BLE001 - this row fails, the rest go on
                errors[i] = error
    if not plain:
        _count_drawn(rows, token_ids, errors)
    return token_ids, errors


def _count_drawn(
    rows: list[SampleRow], token_ids: torch.Tensor, errors: dict[int, Exception]
) -> None:
    """The penalised rows that did not fail count their tokens; if counting raises, they
    fail (`errors`)."""
    penalised = [i for i, row in enumerate(rows) if row.penalty is not None and i not in errors]
    if not penalised:
        return
    try:
        drawn = take_rows(token_ids, penalised)
        rows[penalised[0]].penalty.counts.count_drawn([rows[i].penalty for i in penalised], drawn)
    except Exception as error:  # noqa: BLE001 - these rows fail, the rest go on
        logger.exception("counting the penalised rows' tokens failed")
        for i in penalised:
            errors[i] = error


def on_accelerator(device: torch.device) -> bool:
    """Whether sampling on `device` takes the accelerator's path: draws are keyed races
    (`keyed_race.py`), top-k and top-p sort nothing (`sampling_filters.py`), and nothing is
    read back to the host (no launch waits for the device). Off the CPU."""
    return device.type != "cpu"


def draw(
    probs: torch.Tensor,
    generators: list[torch.Generator],
    rids: list[int],
    mark: bool = False,
    keys: list[int] | None = None,
) -> torch.Tensor:
    """One token per row of `probs` [n, vocab] (unnormalised), row i drawn with
    `generators[i]`: exactly what `torch.multinomial(probs[i], 1, generator=generators[i])`
    returns, leaving each generator in the same state, at a fraction of its cost.

    torch draws one sample as an exponential race, argmax(p / q) with q ~ Exp(1) from the
    row's generator, and its CPU exponential is float32(-log1p(-u)) of a float64 uniform u.
    Each row still draws all its uniforms (one call per row: a generator feeds one tensor
    at a time), into a row-sized buffer that stays in cache; the race itself runs only over
    the tokens top-k / top-p left, and the checks are done once for the batch. Where a
    torch build draws differently (checked once, against multinomial itself), each row
    falls back to multinomial.

    On an accelerator (`on_accelerator`) the rows race instead with noise keyed by `keys[i]`
    (`keyed_race.race_key`), one kernel for the batch; the generators are not used.

    A row without finite, positive mass raises a ValueError naming `rids[row]`; with
    `mark`, it draws -1 instead (its generator untouched on a CPU) and nothing is read
    back from the device, so the caller finds out when it reads the tokens."""
    finite = torch.isfinite(probs).all(dim=-1) & (probs >= 0).all(dim=-1)
    valid = finite & (probs.sum(dim=-1) > 0)
    if on_accelerator(probs.device):
        if keys is None:
            raise ValueError("keys: draws on an accelerator are keyed races")
        if not mark:
            _check_mass(valid, rids)
        tokens = keyed_race(probs, keys)
        return torch.where(valid, tokens, -1) if mark else tokens
    if not mark:
        _check_mass(valid, rids)
    elif not bool(valid.all()):  # (read on the host: free)
        rows = valid.nonzero().flatten().tolist()
        tokens = torch.full((probs.shape[0],), -1, dtype=torch.int64, device="cpu")
        if rows:
            tokens[rows] = draw(probs[rows], [generators[i] for i in rows], [rids[i] for i in rows])
        return tokens
    if not _race_matches_multinomial():
        return torch.stack(
            [torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probs, generators)]
        )
    return _exponential_race(probs, generators)


def _check_mass(valid: torch.Tensor, rids: list[int]) -> None:
    if not bool(valid.all()):
        rid = rids[int((~valid).nonzero()[0, 0])]
        raise ValueError(f"request {rid}: {NO_MASS}")


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    vocab = probs.shape[-1]
    uniform = torch.empty(vocab, dtype=torch.float64, device="cpu")  # [vocab], reused per row
    counts = (probs > 0).sum(dim=-1).tolist()
    winners = []
    for row, generator, count in zip(probs, generators, counts):
        uniform.uniform_(generator=generator)  # every draw, so the generator stays in step
        if count * 4 < vocab:  # after top-k / top-p: race only where the row has mass
            index = row.nonzero().flatten()
            log_q = torch.log1p(uniform[index].neg_())  # log1p(-u) <= 0
            scores = row[index] / log_q.float().neg_()
            winners.append(index[scores.max(dim=-1).indices])
        else:
            torch.log1p(uniform.neg_(), out=uniform)
            winners.append((row / uniform.float().neg_()).max(dim=-1).indices)
    return torch.stack(winners)


@functools.cache
def _race_matches_multinomial() -> bool:
    noise = torch.randn(4, 1000, generator=_cpu_generator(0), device="cpu")
    probs = torch.softmax(noise, -1)
    raced_with = [_cpu_generator(s) for s in range(4)]
    drawn_with = [_cpu_generator(s) for s in range(4)]
    raced = _exponential_race(probs, raced_with).tolist()
    drawn = [int(torch.multinomial(p, 1, generator=g)[0]) for p, g in zip(probs, drawn_with)]
    same_states = all(
        torch.equal(a.get_state(), b.get_state()) for a, b in zip(raced_with, drawn_with)
    )
    return raced == drawn and same_states


def _cpu_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _apply_penalties_and_masks(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    vocab = logits.shape[-1]
    cloned = False
    penalised = [i for i, row in enumerate(rows) if row.penalty is not None]
    if penalised:
        logits, cloned = logits.clone(), True
        mine = [rows[i] for i in penalised]
        weights = [(r.params.frequency_penalty, r.params.presence_penalty) for r in mine]
        mine[0].penalty.counts.apply(logits, [r.penalty for r in mine], weights, penalised)
    # (row, token) pairs banned this step, set at once: one index copy and one launch for
    # the batch (a decode batch under min_new_tokens bans EOS in every row, every step).
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for i, row in enumerate(rows):
        banned_rows += [i] * len(row.banned)
        banned_ids += row.banned
    if banned_ids:
        if not cloned:
            logits, cloned = logits.clone(), True
        where = index_tensor(banned_rows + banned_ids, logits.device).view(2, -1)
        logits[where[0], where[1]] = float("-inf")
    constrained = [i for i, row in enumerate(rows) if row.mask_words is not None]
    if constrained:
        if not cloned:
            logits = logits.clone()
        index = index_tensor(constrained, logits.device)
        words = torch.stack([rows[i].mask_words for i in constrained])
        allowed = unpack_mask_words(words, vocab, logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def _filtered_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then min-p; each filter sees what the previous
    one kept, renormalised (transformers' and vLLM's order). Returns unnormalised probs
    [n, vocab]."""
    vocab = logits.shape[-1]
    top_k = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows]
    # [4, n] on the host: temperature, top-k, top-p and min-p; decisions are taken here, on
    # the float32 values the device gets (one copy), so the device is never read back.
    host = torch.tensor(
        [
            [r.params.temperature for r in rows],
            top_k,
            [r.params.top_p for r in rows],
            [r.params.min_p for r in rows],
        ],
        dtype=torch.float64,
        device="cpu",
    ).to(logits.dtype)
    params = to_device(host, logits.device)
    temps, top_p, min_p = params[0], params[2], params[3]
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    filtered = ((host[1] < vocab) | (host[2] < 1.0)).nonzero().flatten().tolist()
    if filtered:
        rows = index_tensor(filtered, logits.device)
        k = params[1].to(torch.int64)[rows]
        max_k = max((top_k[i] for i in filtered if top_k[i] < vocab), default=0)
        if on_accelerator(logits.device):  # (no sort, nothing read back)
            probs[rows] = top_k_top_p_unsorted(probs[rows], k, top_p[rows], max_k)
        else:
            probs[rows] = top_k_top_p(probs[rows], k, top_p[rows], max_top_k=max_k)
    if bool((host[3] > 0).any()):
        # Relative to the most likely token, so unaffected by the renormalisation above.
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs
