"""JSON extraction with a long-key schema: the Engine (with and without jump-forward)
against outlines driving transformers, on the same model, schema, grammar and prompts.

Two workloads: `orders` (default; 16 order emails, five long keys) and `--workload records`
(20 customer records, a pydantic schema with `conint(ge=0, le=100000)`; also reports how many
fields equal the record's and how many outputs hit `max_tokens`; run it on
`--model smollm2-135m-instruct`, a model that can read the records).

Equal work: outlines gets the engine's own regex for the schema (`outlines.types.Regex` of
`schema_to_regex`: the same bounded numbers and the same whitespace layout, checked on
every output) and the same prompts (outlines wraps a plain string in the chat template,
so both sides get the document as a chat user message, rendered once; the token ids are
checked equal); every side warms up on another
document and no cache keeps a benchmark prompt (the engines are flushed before each
phase); rounds alternate their order; float32 on both sides. Jump-forward changes how many
tokens are sampled, so outputs are compared as parsed JSON objects, with each side's output
tokens per document side by side. Needs `pip install outlines` (benchmark only).

    .venv/bin/python benchmarks/bench_json.py [--model small] [--docs 16] [--repeats 3]
    .venv/bin/python benchmarks/bench_json.py --workload records --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import re
from importlib.metadata import version
from typing import Any

import harness
from harness import Phase

from lmprog_runtime.constrained.json_schema import schema_to_regex

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
WARMUP_DOC = "Extract the order as JSON. Email: warm-up message, not a benchmark document."
# The records workload: what each record holds, and the prompt that shows it.
NAMES = "Ann Lee,Bob Stone,Carla Diaz,Dev Patel,Eva Novak,Finn Berg,Gia Rossi,Hugo Kim,Ida Park,"
NAMES += "Jon Reyes,Kim Ngo,Leo Marx,Mia Wong,Ned Cole,Olga Ivanova,Pat Quinn,Raj Mehta,Sara Holm,"
NAMES += "Tom Hardy,Uma Bose"
STREETS = (
    "1 Elm St,22 Oak Ave,305 Pine Rd,4 Birch Ln,57 Cedar Ct,68 Maple Dr,7 Ash Way,810 Lake Rd,"
)
STREETS += "9 Hill St,10 River Ave,11 Park Pl,120 Main St,13 King St,14 Queen Ave,155 Bay Rd,"
STREETS += "16 Rose Ln,17 Mill St,180 High St,19 Church Rd,20 Bridge St"
POINTS = [120, 45, 3000, 0, 999, 15000, 7, 250, 88000, 560, 12, 4321, 100000, 64, 700, 1800]
POINTS += [33, 9050, 501, 27]


def records_schema() -> dict:
    from pydantic import BaseModel, conint

    class Customer(BaseModel):
        customer_full_legal_name: str
        customer_postal_address_line: str
        customer_account_is_active: bool
        customer_loyalty_points_balance: conint(ge=0, le=100000)

    return Customer.model_json_schema()


def records(n: int) -> list[dict]:
    names, streets = NAMES.split(","), STREETS.split(",")
    return [
        {
            "customer_full_legal_name": names[i % 20],
            "customer_postal_address_line": streets[i % 20],
            "customer_account_is_active": i % 3 != 1,
            "customer_loyalty_points_balance": POINTS[i % 20],
        }
        for i in range(n)
    ]


def record_prompt(i: int, record: dict) -> str:
    """The record shown field by field, then the request for JSON."""
    active = "active" if record["customer_account_is_active"] else "inactive"
    return (
        f"Customer record {i}:\nName: {record['customer_full_legal_name']}\n"
        f"Address: {record['customer_postal_address_line']}\nStatus: {active}\n"
        f"Loyalty points: {record['customer_loyalty_points_balance']}\n"
        "Write this record as JSON."
    )


def workload(name: str, n: int) -> tuple[dict, list[str], list[dict] | None, str]:
    """(schema, documents, the records they show or None, warm-up document)."""
    if name == "records":
        rs = records(n)
        warm = "Customer record as JSON. Warm-up only, not a benchmark record."
        return records_schema(), [record_prompt(i, r) for i, r in enumerate(rs)], rs, warm
    names = ["Alice", "Bob", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana"]
    docs = [
        f"Extract the order as JSON. Email: Hi, this is {names[i % 8]}. My order "
        f"AB{1000 + i} has {i % 5 + 1} items, please ship it to the {['north', 'south'][i % 2]}."
        for i in range(n)
    ]
    return SCHEMA, docs, None, WARMUP_DOC


def parse(text: str, schema: dict) -> Any:
    """The JSON object if `text` validates against `schema`, else None."""
    import jsonschema

    try:
        obj = json.loads(text)
        jsonschema.validate(obj, schema)
    except (ValueError, jsonschema.ValidationError):
        return None
    return obj


def outlines_phase(
    path: str, dtype: str, docs: list[str], max_tokens: int, regex: str, warm_doc: str
) -> tuple[Phase, Any, list[list[int]]]:
    """outlines 1.x over transformers' batched generate; token counts read off `generate`.
    Also returns the model and the prompt ids outlines feeds it."""
    import outlines
    from outlines.inputs import Chat
    from outlines.types import Regex

    hf = harness.load_hf_model(path, dtype)
    tokenizer = harness.load_hf_tokenizer(path)
    chats = [Chat([{"role": "user", "content": d}]) for d in docs]
    prompt_ids: list[list[int]] = []
    model = outlines.from_transformers(hf, tokenizer)
    generator = outlines.Generator(model, Regex(regex))
    config_eos = hf.generation_config.eos_token_id  # None, an id or a list of ids
    eos = {tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])}
    generated: list[Any] = []
    generate = hf.generate

    def recording_generate(*a: Any, **kw: Any) -> Any:
        out = generate(*a, **kw)
        n = kw["input_ids"].shape[1]  # left-padded: [batch, n]
        generated.append(out[:, n:].tolist())
        mask = kw["attention_mask"].bool()
        prompt_ids[:] = [row[m].tolist() for row, m in zip(kw["input_ids"], mask)]
        return out

    hf.generate = recording_generate

    def run() -> tuple[list[str], list[int]]:
        generated.clear()
        outs = generator.batch(chats, max_new_tokens=max_tokens, do_sample=False)
        # Rows that finished early are padded after their EOS; count up to it, inclusive.
        counts = [next((i + 1 for i, t in enumerate(r) if t in eos), len(r)) for r in generated[0]]
        return outs, counts

    warm = Chat([{"role": "user", "content": warm_doc}])
    generator(warm, max_new_tokens=8, do_sample=False)  # the index compiles here
    return Phase("outlines + transformers", run), hf, prompt_ids


def engine_phase(engine: Any, texts: list[str], max_tokens: int, name: str, schema: dict) -> Phase:
    params = {"max_new_tokens": max_tokens, "temperature": 0, "json_schema": json.dumps(schema)}
    harness.warm_engine(engine, params)  # compiles the grammar; then flushed

    def run() -> tuple[list[str], list[int], dict[str, float]]:
        outs = engine.generate(texts, params)
        texts_out = [o["text"] for o in outs]
        reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
        return texts_out, [len(o["output_ids"]) for o in outs], engine.stats(), reasons

    return Phase(name, run, before=lambda: harness.flush(engine))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser)
    parser.add_argument("--workload", choices=["orders", "records"], default="orders")
    parser.add_argument("--docs", type=int, default=None, help="16 orders / 20 records")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    from lmprog_runtime import Engine

    path = harness.resolve_model(args.model)
    n = args.docs or (20 if args.workload == "records" else 16)
    schema, docs, truth, warm_doc = workload(args.workload, n)
    regex = schema_to_regex(json.dumps(schema))  # what the engine enforces, outlines too
    jf_engine = Engine(path, dtype=args.dtype)
    plain_engine = Engine(path, dtype=args.dtype, disable_jump_forward=True)
    # The rendering outlines applies to a Chat input: user message + generation prompt.
    texts = [
        jf_engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": d}], tokenize=False, add_generation_prompt=True
        )
        for d in docs
    ]
    ol, hf, ol_prompt_ids = outlines_phase(path, args.dtype, docs, args.max_tokens, regex, warm_doc)
    plain = engine_phase(plain_engine, texts, args.max_tokens, "engine, no jump-forward", schema)
    jf = engine_phase(jf_engine, texts, args.max_tokens, "engine, jump-forward", schema)
    print(f"model={path} workload={args.workload} docs={n}")
    harness.alternate([ol, plain, jf], args.repeats)

    ol_texts, ol_counts = ol.values[-1]
    reference = [parse(t, schema) for t in ol_texts]
    prompt_ids = [plain_engine.encode(t) for t in texts]
    same_prompts = sum(a == b for a, b in zip(prompt_ids, ol_prompt_ids))

    def row(phase: Phase, texts_out: list[str], counts: list[int], fwd: str, outputs: str):
        objs = [parse(t, schema) for t in texts_out]
        cells = {
            "system": phase.name,
            "docs/s (best)": f"{n / phase.best:.2f}",
            "docs/s (median)": f"{n / phase.median:.2f}",
            "vs outlines (best / median)": harness.speedup(ol, phase),
            "output tokens per doc": f"{sum(counts) / n:.1f}",
            "forward passes per output token": fwd,
            "valid": f"{sum(o is not None for o in objs)}/{n}",
        }
        if truth is not None:
            right = sum(
                o is not None and o[k] == v for o, r in zip(objs, truth) for k, v in r.items()
            )
            cells["fields right"] = f"{right}/{4 * n}"
            cells["hit max_tokens"] = f"{sum(c >= args.max_tokens for c in counts)}/{n}"
        return {**cells, "outputs": outputs}

    ol_layout = sum(bool(re.fullmatch(regex, t)) for t in ol_texts)
    rows = [
        row(ol, ol_texts, ol_counts, "-", f"reference; match the engine's regex {ol_layout}/{n}")
    ]
    checks: dict[str, Any] = {"outlines_match_regex": ol_layout, "prompts_equal": same_prompts}
    for phase in (plain, jf):
        out_texts, counts, stats, reasons = phase.values[-1]
        # A batch shares its forwards: divide by one document's tokens, on average.
        per_token = stats["forward_passes"] / (sum(counts) / n)
        equal = sum(r is not None and parse(t, schema) == r for t, r in zip(out_texts, reference))
        same_tokens = sum(c == r for c, r in zip(counts, ol_counts))
        outputs = (
            f"{equal}/{n} JSON objects equal to outlines'; token counts equal {same_tokens}/{n}"
        )
        rows.append(row(phase, out_texts, counts, f"{per_token:.2f}", outputs))
        checks[phase.name] = {"objects_equal": equal, "token_counts_equal": same_tokens}
        checks[phase.name]["match_regex"] = sum(bool(re.fullmatch(regex, t)) for t in out_texts)
        checks[phase.name]["finish_length"] = reasons.count("length")
        checks[phase.name]["jump_forward_tokens"] = stats["jump_forward_tokens"]
    notes = [f"Prompt token ids identical on both sides for {same_prompts}/{n} documents."]
    # outlines maps tokens to strings, so a token that is an invalid UTF-8 byte passes as
    # U+FFFD; lmprog maps tokens to bytes and refuses it: such documents differ.
    replaced = sum("\ufffd" in t for t in ol_texts)
    if replaced:
        notes.append(f"{replaced}/{n} outlines outputs hold U+FFFD (an invalid UTF-8 token).")
    dtypes = {"engine": harness.param_dtype(jf_engine.runner.model), "hf": harness.param_dtype(hf)}
    for engine in (jf_engine, plain_engine):
        engine.shutdown()
    what = (
        "customer records (name, street, active flag, points), a pydantic schema with "
        "`conint(ge=0, le=100000)`, four long keys"
        if truth is not None
        else "documents, a schema with five long keys (a bounded string, a patterned id, a "
        "boolean, two enums)"
    )
    harness.write_result(
        args,
        "json" if truth is None else "json_records",
        {
            "title": "JSON extraction" + (" of records" if truth is not None else ""),
            "workload": (
                f"{n} {what}, greedy, `max_tokens` {args.max_tokens}; the engine's JSON layout "
                '(`{"a": 1, "b": 2}`) and bounded numbers, the same regex for outlines '
                f"{version('outlines')} driving transformers' batched `generate`; "
                f"{args.repeats} rounds in alternating order, every side warmed on another "
                "document, engine caches flushed before each phase"
            ),
            "columns": list(rows[0]),
            "rows": rows,
            "notes": notes,
            "param_dtypes": dtypes,
            "prompt_tokens": sum(len(ids) for ids in prompt_ids),
            "timings": {p.name: p.timing() for p in (ol, plain, jf)},
            "outputs": {p.name: p.values[-1][0] for p in (ol, plain, jf)},
            "checks": checks,
        },
    )


if __name__ == "__main__":
    main()
