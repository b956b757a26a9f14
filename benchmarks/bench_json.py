"""JSON extraction with a long-key schema: the Engine (with and without jump-forward)
against outlines driving transformers, on the same model and schema, in one run.

Reports the engine's model forward passes per output token (target with jump-forward:
at most 0.5), documents per second for each system, and that every output validates.
Needs `pip install outlines` (benchmark only; not a dependency of lmprog).

    .venv/bin/python benchmarks/bench_json.py [--docs 16]
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name_as_written_on_the_order": {"type": "string", "maxLength": 12},
        "order_identifier_from_the_confirmation_email": {
            "type": "string",
            "pattern": "^[A-Z]{2}[0-9]{4}$",
        },
        "requested_priority_shipping_for_this_order": {"type": "boolean"},
        "delivery_region_of_the_shipping_address": {"enum": ["north", "south", "east", "west"]},
        "number_of_items_in_the_parcel_declared": {"enum": [1, 2, 3, 4, 5]},
    },
    "required": [
        "customer_full_name_as_written_on_the_order",
        "order_identifier_from_the_confirmation_email",
        "requested_priority_shipping_for_this_order",
        "delivery_region_of_the_shipping_address",
        "number_of_items_in_the_parcel_declared",
    ],
}


def prompts(n: int) -> list[str]:
    names = ["Alice", "Bob", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana"]
    return [
        f"Extract the order as JSON. Email: Hi, this is {names[i % 8]}. My order "
        f"AB{1000 + i} has {i % 5 + 1} items, please ship it to the {['north', 'south'][i % 2]}."
        for i in range(n)
    ]


def run_engine(model_path: str, texts: list[str], jump_forward: bool) -> tuple[float, dict, list]:
    from lmprog_runtime import Engine

    params = {"max_new_tokens": 256, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    with Engine(model_path, disable_jump_forward=not jump_forward) as engine:
        engine.generate(texts[0], {**params, "max_new_tokens": 4})  # warm up, compile once
        engine.reset_stats()
        start = time.perf_counter()
        outs = engine.generate(texts, params)
        elapsed = time.perf_counter() - start
        stats = engine.stats()
        # A batch shares its forwards: divide by one document's tokens, on average.
        mean_tokens = sum(len(o["output_ids"]) for o in outs) / len(outs)
        stats["forwards_per_token"] = stats["forward_passes"] / mean_tokens
        return elapsed, stats, [o["text"] for o in outs]


def run_outlines(model_path: str, texts: list[str]) -> tuple[float, list]:
    import outlines
    import torch
    from outlines.types import JsonSchema
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model = outlines.from_transformers(hf, AutoTokenizer.from_pretrained(model_path))
    generator = outlines.Generator(model, JsonSchema(json.dumps(SCHEMA)))
    generator(texts[0], max_new_tokens=4)  # warm up: the index compiles here
    start = time.perf_counter()
    outs = generator.batch(texts, max_new_tokens=256)
    return time.perf_counter() - start, outs


def valid(texts: list[str]) -> int:
    import jsonschema

    count = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            count += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: built-in small)")
    args = parser.parse_args()

    from lmprog_runtime import default_model_path

    model_path = args.model or default_model_path("small")
    texts = prompts(args.docs)
    jf_s, jf_stats, jf_out = run_engine(model_path, texts, jump_forward=True)
    plain_s, plain_stats, plain_out = run_engine(model_path, texts, jump_forward=False)
    ol_s, ol_out = run_outlines(model_path, texts)

    n = len(texts)
    print(f"model={model_path} docs={n}")
    print()
    print("| system | docs/s | vs outlines | forward passes per output token | valid |")
    print("|---|---|---|---|---|")
    print(f"| outlines + transformers | {n / ol_s:.2f} | 1.00x | - | {valid(ol_out)}/{n} |")
    print(
        f"| lmprog Engine, no jump-forward | {n / plain_s:.2f} | {ol_s / plain_s:.2f}x | "
        f"{plain_stats['forwards_per_token']:.2f} | {valid(plain_out)}/{n} |"
    )
    print(
        f"| lmprog Engine, jump-forward | {n / jf_s:.2f} | {ol_s / jf_s:.2f}x | "
        f"{jf_stats['forwards_per_token']:.2f} | {valid(jf_out)}/{n} |"
    )


if __name__ == "__main__":
    main()
