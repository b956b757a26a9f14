"""What frequency / presence penalties cost a draw, by output length: a batch of greedy
rows drawn as the engine draws them (`sample_rows` on the loop's side, `sample_each` on
the device's, the token appended), three ways in one run, best of `--repeats`:

- "plain": no penalties (the baseline);
- "kept": penalties, their counts kept on the device and counted by the draws
  (`penalties.PenaltyCounts`, what the engine does);
- "recounted": penalties, every draw counting its rows again from the outputs on the
  host (what keeping no counts between draws costs: the host sends each whole output).

    .venv/bin/python benchmarks/bench_penalties.py [--rows 64] [--vocab 49152]
        [--lengths 100,1000,4000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from harness import best_seconds  # noqa: E402

from lmprog_runtime.penalties import PenaltyCounts  # noqa: E402
from lmprog_runtime.request import Req  # noqa: E402
from lmprog_runtime.sampling import sample_each, sample_rows  # noqa: E402
from lmprog_runtime.sampling_params import SamplingParams  # noqa: E402

DRAWS = 10  # per timing


def requests(rows: int, length: int, vocab: int, penalised: bool) -> list[Req]:
    params = {"temperature": 0, "max_new_tokens": 10**6}
    if penalised:
        params |= {"frequency_penalty": 0.5, "presence_penalty": 0.2}
    reqs = []
    for i in range(rows):
        req = Req(
            i,
            [1, 2, 3],
            SamplingParams.from_dict(params),
            tokenizer=None,
            eos_token_ids=frozenset(),
            context_len=10**7,
        )
        req.output_ids = [(i * 31 + j * 7) % vocab for j in range(length)]
        reqs.append(req)
    return reqs


def seconds_per_draw(reqs: list[Req], logits: torch.Tensor, recount: bool, repeats: int) -> float:
    counts, vocab = PenaltyCounts(), logits.shape[-1]

    def draw() -> None:
        if recount:
            for req in reqs:
                req.penalty_counted = None
        token_ids, _ = sample_each(logits, sample_rows(reqs, vocab, counts))
        for req, token in zip(reqs, token_ids.tolist()):
            req.output_ids.append(token)

    best = best_seconds(draw, DRAWS, repeats)  # (its warm-up draw counts every row)
    for req in reqs:
        counts.release(req)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--lengths", default="100,1000,4000")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    print(f"{args.rows} greedy rows, vocabulary {args.vocab}, {torch.get_num_threads()} threads")
    print("| tokens each | plain | kept | recounted | kept vs recounted |")
    print("|---|---|---|---|---|")
    for length in map(int, args.lengths.split(",")):
        times = {
            name: seconds_per_draw(
                requests(args.rows, length, args.vocab, name != "plain"),
                logits,
                name == "recounted",
                args.repeats,
            )
            for name in ("plain", "kept", "recounted")
        }
        ms = {name: f"{t * 1e3:.2f} ms" for name, t in times.items()}
        ratio = times["recounted"] / times["kept"]
        print(f"| {length} | {ms['plain']} | {ms['kept']} | {ms['recounted']} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
