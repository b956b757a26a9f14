"""float32 linear weights stored input-major on a CPU (`models/weight_layout.py`): the
engine as it loads by default against the same engine with `disable_input_major_weights`,
both in this process, at decode batches of 1, 8 and 32 and on a 500-token prefill.

Each round generates `--new-tokens` tokens (greedy, EOS ignored) for a batch of 32-token
prompts on each engine, the two alternating (`harness.alternate`); the prefix cache is
flushed before each. Outputs are compared token by token.

    .venv/bin/python benchmarks/bench_weight_layout.py [--repeats 4] [--new-tokens 24]
"""

from __future__ import annotations

import argparse

import harness
import torch
from harness import Phase
from torch import nn

BATCHES = (1, 8, 32)
PROMPT_TOKENS = 32
PREFILL_TOKENS = 500


def corpus_ids(tokenizer) -> list[int]:
    from pathlib import Path

    import lmprog_runtime

    corpus = Path(lmprog_runtime.__file__).parent / "data" / "corpus.txt"
    return tokenizer(corpus.read_text(encoding="utf-8")).input_ids


def layout(engine) -> str:
    """Which layers the probe stored input-major (it decides per shape)."""
    weights = [m.weight for m in engine.runner.model.modules() if type(m) is nn.Linear]
    changed = sum(not w.is_contiguous() for w in weights)
    return f"input-major for {changed} of {len(weights)} layers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=4)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.set_defaults(model="smollm2-135m-instruct")
    args = parser.parse_args()

    from lmprog_runtime import Engine

    options = {"dtype": "float32", "max_total_tokens": 16384}
    ours = Engine(args.model, **options)
    base = Engine(args.model, disable_input_major_weights=True, **options)
    chosen = layout(ours)
    if chosen.startswith("input-major for 0 "):
        print("the probe kept torch's layout on this machine: both sides are the same")
    ids = corpus_ids(ours.tokenizer)
    greedy = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    rows = []
    cases = [(f"decode, batch {b}", b, PROMPT_TOKENS, greedy) for b in BATCHES]
    cases.append((f"prefill, {PREFILL_TOKENS} tokens", 1, PREFILL_TOKENS, {"max_new_tokens": 1}))
    for name, batch, length, params in cases:
        stride = (len(ids) - length) // batch
        prompts = [ids[i * stride : i * stride + length] for i in range(batch)]

        def run(engine, prompts=prompts, params=params) -> list[list[int]]:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            return [o["output_ids"] for o in outs]

        for engine in (ours, base):
            harness.warm_engine(engine)
        phases = [
            Phase("input-major", lambda run=run: run(ours), before=lambda: harness.flush(ours)),
            Phase("torch's layout", lambda run=run: run(base), before=lambda: harness.flush(base)),
        ]
        harness.alternate(phases, args.repeats)
        same = harness.compare_tokens(phases[0].values[-1], phases[1].values[-1])
        rows.append(
            {
                "workload": name,
                "input-major (s, best / median)": f"{phases[0].best:.2f} / {phases[0].median:.2f}",
                "torch's layout (s, best / median)": (
                    f"{phases[1].best:.2f} / {phases[1].median:.2f}"
                ),
                "speedup (best / median)": harness.speedup(phases[1], phases[0]),
                "outputs": harness.describe_match(same, "sequences equal"),
            }
        )
    ours.shutdown()
    base.shutdown()
    harness.write_result(
        args,
        "weight_layout",
        {
            "title": "float32 linear weights input-major vs torch's layout (CPU)",
            "workload": (
                f"{args.new_tokens} new tokens per {PROMPT_TOKENS}-token prompt at each batch, "
                f"and one {PREFILL_TOKENS}-token prefill; {torch.get_num_threads()} threads; "
                f"the probe chose {chosen}; best / median of {args.repeats} alternating rounds"
            ),
            "columns": list(rows[0]),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
