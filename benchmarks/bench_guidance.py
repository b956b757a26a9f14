"""Structured programs: lmprog against guidance on the same model, programs and machine.

Two workloads, each a program written once in each library's own words:
- `sheets`: a character sheet per topic (32 topics): a system and a user message, then
  "Name: " + gen (stop at a newline), "Class: " + select of five classes, "Age: " + a
  regex gen, "Weapon: " and "Motto: " + gens; the `gen`/`select`/regex mix of guidance's
  own examples;
- `records`: JSON extraction of 20 customer records (`bench_json.py --workload records`),
  guidance given the engine's own regex for the schema (`schema_to_regex`, as outlines is
  in bench_json), so both sides enforce the same grammar; fields right are counted against
  the records.

Sides, all greedy, float32 weights, the same torch thread count:
- guidance 0.3 over its Transformers model, one program after another (a guidance model
  holds one KV cache and one token stream; it reuses the cache's common prefix with the
  previous program). It runs in an environment of its own (guidance pins transformers
  4.53), in a worker process (`guidance_worker.py`) that blocks on a pipe while the other
  sides run, and times its programs itself;
- lmprog, one program after another (`program.run()` in a loop): the same use;
- lmprog, every program at once (`program.run_batch`): how lmprog is meant to run many.

Each side warms up on a program outside the workload; the engine's cache is flushed before
each of its phases; rounds alternate their order (ABC CBA ...). Both sides heal the
trailing space of "Name: " (guidance always heals; lmprog heals a trailing space by
default). The outputs are compared variable by variable: greedy float32 on both sides
gives the same text where the two agree on what the program means; select differs by
design (guidance decodes a choice token by token under the choices' grammar; lmprog scores
each choice's canonical tokens: `lp.greedy_token_selection` is the closest method, and
it is the one used here), and a later gen sees the earlier values.

    make bench-guidance   # builds .venv-guidance, then runs this on the instruct model
    .venv/bin/python benchmarks/bench_guidance.py --guidance-python .venv-guidance/bin/python \\
        [--model smollm2-135m-instruct] [--workloads sheets,records] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness
import torch
from bench_json import parse, records_schema, workload
from harness import Phase

import lmprog as lp
from lmprog_runtime.constrained.json_schema import schema_to_regex

HERE = Path(__file__).resolve().parent
TOPICS = [
    "knight",
    "wizard",
    "pirate",
    "baker",
    "ranger",
    "necromancer",
    "bard",
    "blacksmith",
    "monk",
    "paladin",
    "druid",
    "assassin",
    "alchemist",
    "samurai",
    "viking",
    "gladiator",
    "hunter",
    "priestess",
    "sorceress",
    "thief",
    "merchant",
    "sailor",
    "archer",
    "healer",
    "shaman",
    "warlock",
    "jester",
    "scholar",
    "tinker",
    "cartographer",
    "falconer",
    "herbalist",
]
SHEETS = {
    "system": "You are a game designer who writes short character sheets.",
    "classes": ["warrior", "mage", "rogue", "cleric", "ranger"],
    "age_regex": "[0-9]{1,3}",
    "name_tokens": 16,
    "weapon_tokens": 12,
    "motto_tokens": 24,
    "variables": ["name", "class", "age", "weapon", "motto"],
}
RECORDS = {
    "system": "You extract customer records as JSON.",
    "max_tokens": 256,
    "variables": ["order"],
}
WARM_TOPIC = "warm-up hero"


def lark_safe(regex: str) -> str:
    """`regex` with each `/` written `\\x2F`: guidance puts a gen's regex between slashes
    in a Lark grammar without escaping them (a JSON string's `\\/` escape ended it)."""
    out = re.sub(r"(?<!\\)((?:\\\\)*)/", lambda m: m.group(1) + "\\x2F", regex)
    return out


def lmprog_programs() -> dict[str, Any]:
    @lp.function
    def sheet(s, topic, spec):
        s += lp.system(spec["system"])
        s += lp.user(f"Write a character sheet for a {topic}.")
        s += lp.assistant_begin()
        s += "Name: " + lp.gen("name", stop="\n", max_tokens=spec["name_tokens"])
        s += "\nClass: " + lp.select(
            "class", choices=spec["classes"], choices_method=lp.greedy_token_selection
        )
        s += "\nAge: " + lp.gen("age", regex=spec["age_regex"])
        s += "\nWeapon: " + lp.gen("weapon", stop="\n", max_tokens=spec["weapon_tokens"])
        s += "\nMotto: " + lp.gen("motto", stop="\n", max_tokens=spec["motto_tokens"])
        s += lp.assistant_end()

    @lp.function
    def order(s, document, spec):
        s += lp.system(spec["system"])
        s += lp.user(document)
        s += lp.assistant(
            lp.gen("order", json_schema=spec["schema"], max_tokens=spec["max_tokens"])
        )

    return {"sheets": sheet, "records": order}


class GuidanceWorker:
    """The guidance side's process: one JSON line per command and per reply."""

    def __init__(self, python: str, model_dir: str, dtype: str, threads: int) -> None:
        command = [python, str(HERE / "guidance_worker.py"), "--model-dir", model_dir]
        command += ["--dtype", dtype, "--threads", str(threads)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.info = self._reply()

    def _reply(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the guidance worker exited ({self.process.wait()})")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"the guidance worker failed: {reply['error']}")
        return reply

    def run(self, name: str, items: list[str], spec: dict[str, Any]) -> tuple[float, list]:
        self.process.stdin.write(
            json.dumps({"cmd": "run", "workload": name, "items": items, "spec": spec}) + "\n"
        )
        self.process.stdin.flush()
        reply = self._reply()
        return reply["seconds"], reply["outputs"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
            self.process.stdin.close()
            self.process.wait(timeout=60)


def lmprog_outputs(states: list[Any], variables: list[str]) -> list[dict[str, Any]]:
    outs = []
    for state in states:
        if state.error() is not None:
            raise RuntimeError(f"a program failed: {state.error()!r}")
        outs.append({name: state[name] for name in variables} | {"text": state.text()})
    return outs


def agreement(ours: list[dict], theirs: list[dict], variables: list[str]) -> dict[str, Any]:
    """Programs whose variables are all equal, each variable's count of equal values, and
    whether the equal programs' whole texts are equal too (the same prompts and roles)."""
    same = [all(a[v] == b[v] for v in variables) for a, b in zip(ours, theirs, strict=True)]
    return {
        "programs_equal": sum(same),
        "programs": len(same),
        "per_variable": {v: sum(a[v] == b[v] for a, b in zip(ours, theirs)) for v in variables},
        "texts_equal_where_values_are": all(
            a["text"].rstrip().startswith(b["text"].rstrip())
            for a, b, s in zip(ours, theirs, same)
            if s
        ),
    }


def fields_right(outputs: list[dict], truth: list[dict]) -> int:
    schema = records_schema()
    right = 0
    for out, want in zip(outputs, truth):
        obj = parse(out["order"], schema)
        right += sum(obj is not None and obj.get(k) == v for k, v in want.items())
    return right


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(parser, repeats=2)
    parser.set_defaults(model="smollm2-135m-instruct")
    parser.add_argument(
        "--guidance-python", required=True, help="the guidance environment's python"
    )
    parser.add_argument("--workloads", default="sheets,records")
    parser.add_argument("--topics", type=int, default=32)
    parser.add_argument("--records", type=int, default=20)
    args = parser.parse_args()

    from lmprog_runtime import local_model_dir

    path = harness.resolve_model(args.model)
    threads = torch.get_num_threads()
    engine = lp.Engine(path, dtype=args.dtype)
    guidance = GuidanceWorker(args.guidance_python, local_model_dir(path), args.dtype, threads)
    print(f"guidance worker: {guidance.info}", flush=True)
    programs = lmprog_programs()
    rows, checks, notes = [], {}, []
    try:
        for name in args.workloads.split(","):
            if name == "sheets":
                items, truth, warm, key = TOPICS[: args.topics], None, [WARM_TOPIC], "topic"
                spec = guidance_spec = SHEETS
            else:
                schema, items, truth, warm_doc = workload("records", args.records)
                warm, key = [warm_doc], "document"
                spec = {**RECORDS, "schema": schema}
                guidance_spec = {**RECORDS, "regex": lark_safe(schema_to_regex(json.dumps(schema)))}
            program = programs[name]
            variables = spec["variables"]
            calls = [{key: item, "spec": spec} for item in items]
            # Warm-ups outside the workload: guidance compiles its grammars, lmprog its
            # patterns; then the engine's cache is flushed.
            guidance.run(name, warm, guidance_spec)
            program.run_batch([{key: warm[0], "spec": spec}], backend=engine, temperature=0)
            harness.flush(engine)

            def one_by_one(program=program, calls=calls, variables=variables):
                states = [program.run(**c, backend=engine, temperature=0) for c in calls]
                return lmprog_outputs(states, variables)

            def batched(program=program, calls=calls, variables=variables):
                states = program.run_batch(calls, backend=engine, temperature=0)
                return lmprog_outputs(states, variables)

            base = Phase(
                "guidance, one program at a time",
                lambda name=name, items=items, spec=guidance_spec: guidance.run(name, items, spec),
                timed_by_run=True,
            )
            flush = lambda: harness.flush(engine)  # noqa: E731
            seq = Phase("lmprog, one program at a time", one_by_one, before=flush)
            batch = Phase("lmprog, run_batch", batched, before=flush)
            print(f"{name}: {len(items)} programs", flush=True)
            harness.alternate([base, seq, batch], args.repeats)
            reference = base.values[-1]
            check = {}
            for phase in (base, seq, batch):
                agree = agreement(phase.values[-1], reference, variables)
                check[phase.name] = agree
                outputs = (
                    f"{agree['programs_equal']}/{agree['programs']} programs equal to guidance's"
                )
                if phase is base:
                    outputs = "reference"
                if truth is not None:
                    right = fields_right(phase.values[-1], truth)
                    outputs += f"; {right}/{4 * len(truth)} fields right"
                elif phase is not base:
                    per = ", ".join(f"{v} {n}" for v, n in agree["per_variable"].items())
                    outputs += f" ({per})"
                rows.append(
                    {
                        "workload": name,
                        "system": phase.name,
                        "seconds (best / median)": f"{phase.best:.2f} / {phase.median:.2f}",
                        "programs/s (best)": f"{len(items) / phase.best:.2f}",
                        "vs guidance (best / median)": harness.speedup(base, phase),
                        "outputs": outputs,
                    }
                )
            checks[name] = {
                "agreement": check,
                "timings": {p.name: p.timing() for p in (base, seq, batch)},
            }
    finally:
        guidance.close()
        engine.shutdown()
    info = guidance.info
    notes.append(
        f"guidance {info['guidance']} with transformers {info['transformers']} and torch "
        f"{info['torch']} ({info['threads']} threads), in a worker process of its own."
    )
    result = {
        "title": "lmprog vs guidance",
        "workload": (
            f"sheets: {args.topics} character sheets (gen with a stop, select of 5, regex gen, "
            f"two more gens); records: {args.records} customer records as JSON (the same "
            "grammar on both sides); greedy, float32, one program at a time on both sides and "
            "all at once on lmprog"
        ),
        "columns": list(rows[0]),
        "rows": rows,
        "notes": notes,
        "checks": checks,
        "guidance": info,
    }
    harness.write_result(args, "guidance", result)


if __name__ == "__main__":
    sys.exit(main())
