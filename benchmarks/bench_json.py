"""JSON extraction with a long-key schema: the Engine (with and without jump-forward)
against outlines driving transformers, on the same model, schema, grammar and prompts.

Equal work: outlines gets the engine's compact grammar (`whitespace_pattern=""`: no
whitespace between JSON tokens, checked on every output) and the same prompts (outlines
wraps a plain string in the chat template, so both sides get the document as a chat user
message, rendered once; the token ids are checked equal); every side warms up on another
document and no cache keeps a benchmark prompt (the engines are flushed before each
phase); rounds alternate their order; float32 on both sides. Jump-forward changes how many
tokens are sampled, so outputs are compared as parsed JSON objects, with each side's output
tokens per document side by side. Needs `pip install outlines` (benchmark only).

    .venv/bin/python benchmarks/bench_json.py [--model small] [--docs 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version
from typing import Any

import harness
from harness import Phase

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


def documents(n: int) -> list[str]:
    names = ["Alice", "Bob", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana"]
    return [
        f"Extract the order as JSON. Email: Hi, this is {names[i % 8]}. My order "
        f"AB{1000 + i} has {i % 5 + 1} items, please ship it to the {['north', 'south'][i % 2]}."
        for i in range(n)
    ]


def parse(text: str) -> Any:
    """The JSON object if `text` validates against the schema, else None."""
    import jsonschema

    try:
        obj = json.loads(text)
        jsonschema.validate(obj, SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return None
    return obj


def is_compact(text: str) -> bool:
    """No whitespace between JSON tokens (whitespace inside strings is content)."""
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            return False
    return True


def outlines_phase(
    path: str, dtype: str, docs: list[str], max_tokens: int
) -> tuple[Phase, Any, list[list[int]]]:
    """outlines 1.x over transformers' batched generate; token counts read off `generate`.
    Also returns the model and the prompt ids outlines feeds it."""
    import outlines
    from outlines.inputs import Chat
    from outlines.types import JsonSchema

    hf = harness.load_hf_model(path, dtype)
    tokenizer = harness.load_hf_tokenizer(path)
    chats = [Chat([{"role": "user", "content": d}]) for d in docs]
    prompt_ids: list[list[int]] = []
    model = outlines.from_transformers(hf, tokenizer)
    generator = outlines.Generator(model, JsonSchema(json.dumps(SCHEMA), whitespace_pattern=""))
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

    warm = Chat([{"role": "user", "content": WARMUP_DOC}])
    generator(warm, max_new_tokens=8, do_sample=False)  # the index compiles here
    return Phase("outlines + transformers", run), hf, prompt_ids


def engine_phase(engine: Any, texts: list[str], max_tokens: int, name: str) -> Phase:
    params = {"max_new_tokens": max_tokens, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    harness.warm_engine(engine, params)  # compiles the grammar; then flushed

    def run() -> tuple[list[str], list[int], dict[str, float]]:
        outs = engine.generate(texts, params)
        return [o["text"] for o in outs], [len(o["output_ids"]) for o in outs], engine.stats()

    return Phase(name, run, before=lambda: harness.flush(engine))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    from lmprog_runtime import Engine

    path = harness.resolve_model(args.model)
    docs = documents(args.docs)
    jf_engine = Engine(path, dtype=args.dtype)
    plain_engine = Engine(path, dtype=args.dtype, disable_jump_forward=True)
    # The rendering outlines applies to a Chat input: user message + generation prompt.
    texts = [
        jf_engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": d}], tokenize=False, add_generation_prompt=True
        )
        for d in docs
    ]
    ol, hf, ol_prompt_ids = outlines_phase(path, args.dtype, docs, args.max_tokens)
    plain = engine_phase(plain_engine, texts, args.max_tokens, "engine, no jump-forward")
    jf = engine_phase(jf_engine, texts, args.max_tokens, "engine, jump-forward")
    print(f"model={path} docs={args.docs}")
    harness.alternate([ol, plain, jf], args.repeats)

    n = len(texts)
    ol_texts, ol_counts = ol.values[-1]
    reference = [parse(t) for t in ol_texts]
    ol_compact = sum(is_compact(t) for t in ol_texts)
    prompt_ids = [plain_engine.encode(t) for t in texts]
    same_prompts = sum(a == b for a, b in zip(prompt_ids, ol_prompt_ids))

    def row(phase: Phase, texts_out: list[str], counts: list[int], fwd: str, outputs: str):
        return {
            "system": phase.name,
            "docs/s (best)": f"{n / phase.best:.2f}",
            "docs/s (median)": f"{n / phase.median:.2f}",
            "vs outlines (best / median)": harness.speedup(ol, phase),
            "output tokens per doc": f"{sum(counts) / n:.1f}",
            "forward passes per output token": fwd,
            "valid": f"{sum(parse(t) is not None for t in texts_out)}/{n}",
            "outputs": outputs,
        }

    rows = [row(ol, ol_texts, ol_counts, "-", f"reference; compact JSON {ol_compact}/{n}")]
    checks: dict[str, Any] = {"outlines_compact": ol_compact, "prompts_equal": same_prompts}
    for phase in (plain, jf):
        out_texts, counts, stats = phase.values[-1]
        # A batch shares its forwards: divide by one document's tokens, on average.
        per_token = stats["forward_passes"] / (sum(counts) / n)
        equal = sum(r is not None and parse(t) == r for t, r in zip(out_texts, reference))
        same_tokens = sum(c == r for c, r in zip(counts, ol_counts))
        outputs = (
            f"{equal}/{n} JSON objects equal to outlines'; token counts equal {same_tokens}/{n}"
        )
        rows.append(row(phase, out_texts, counts, f"{per_token:.2f}", outputs))
        checks[phase.name] = {"objects_equal": equal, "token_counts_equal": same_tokens}
        checks[phase.name]["compact"] = sum(is_compact(t) for t in out_texts)
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
    harness.write_result(
        args,
        "json",
        {
            "title": "JSON extraction",
            "workload": (
                f"{n} documents, a schema with five long keys (a bounded string, a patterned "
                "id, a boolean, two enums), greedy, compact JSON on every side; outlines "
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
