"""Jump-forward's character automaton for common pydantic models: interegular's DFA, built
whole when the grammar compiled (the baseline), against `CharFSM`'s NFA, whose subset
states are made as the text reaches them, in one run. Each is built and then walks a valid
document of its schema, asking for the forced text after every character (what a request
does as it decodes).

    .venv/bin/python benchmarks/bench_jump_forward_fsm.py

Writes `benchmarks/results/jump_forward_fsm.json`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pydantic import BaseModel, conlist, create_model

from lmprog_runtime.constrained.json_schema import schema_to_regex
from lmprog_runtime.constrained.jump_forward import MAX_JUMP_CHARS, CharFSM
from lmprog_runtime.constrained.portable_regex import without_edge_anchors

RESULTS = Path(__file__).parent / "results" / "jump_forward_fsm.json"


class Line(BaseModel):
    sku: str
    quantity: int
    price: float


def _cases() -> dict[str, tuple[type[BaseModel], str]]:
    ints = {n: create_model(f"L{n}", xs=(conlist(int, max_length=n), ...)) for n in (5, 10, 20)}
    optional = create_model("O", **{f"f{i}": (int | None, None) for i in range(10)})
    invoice = create_model("Invoice", number=(str, ...), lines=(conlist(Line, max_length=5), ...))
    return {
        "list of up to 5 ints": (ints[5], '{"xs": [1, 22, 333]}'),
        "list of up to 10 ints": (ints[10], '{"xs": [1, 22, 333, 4, 5]}'),
        "list of up to 20 ints": (ints[20], '{"xs": [7, 8, 9]}'),
        "10 optional ints": (optional, '{"f0": 1, "f3": null, "f9": 42}'),
        "invoice of up to 5 lines": (
            invoice,
            '{"number": "A1", "lines": [{"sku": "x", "quantity": 2, "price": 1.5}]}',
        ),
    }


class Interegular:
    """The baseline: interegular's DFA, as jump-forward built it before."""

    def __init__(self, regex: str) -> None:
        import interegular

        self.fsm = interegular.parse_pattern(regex).to_fsm()

    def walk(self, text: str, state=None):
        state = self.fsm.initial if state is None else state
        for ch in text:
            state = self.fsm.map.get(state, {}).get(self.fsm.alphabet[ch])
            if state is None:
                return None
        return state

    def forced(self, state, limit: int) -> str:  # (enough for timing: the first forced character)
        edges = self.fsm.map.get(state, {})
        return "" if len(edges) != 1 or state in self.fsm.finals else "?"


def _time(build, regex: str, document: str) -> tuple[float, float]:
    start = time.perf_counter()
    fsm = build(regex)
    built = time.perf_counter() - start
    state = None
    for ch in document:
        state = fsm.walk(ch, state)
        assert state is not None, (regex[:60], document)
        fsm.forced(state, limit=MAX_JUMP_CHARS)
    return built, time.perf_counter() - start


def main() -> None:
    rows = []
    for name, (model, document) in _cases().items():
        model.model_validate_json(document)  # (a valid document of its schema)
        # (as the grammar's own regex: jump-forward reads it, outlines-core a rewriting)
        regex = without_edge_anchors(schema_to_regex(json.dumps(model.model_json_schema())))
        new_build, new_total = _time(CharFSM, regex, document)
        row = {"schema": name, "regex_chars": len(regex), "lazy_nfa_s": round(new_total, 4)}
        row["lazy_nfa_build_s"] = round(new_build, 4)
        try:
            base_build, base_total = _time(Interegular, regex, document)
        except Exception as error:  # noqa: BLE001 - interegular's own exception types
            # (it cannot read the pattern: such a grammar had no jump-forward at all)
            row["interegular"] = f"cannot read it: {error}"
            print(
                f"{name:26} regex {len(regex):6} chars: interegular cannot read it, "
                f"lazy NFA {new_total:.3f} s"
            )
        else:
            row.update(interegular_s=round(base_total, 3), speedup=round(base_total / new_total))
            row["interegular_build_s"] = round(base_build, 3)
            print(
                f"{name:26} regex {len(regex):6} chars: interegular {base_total:7.2f} s, "
                f"lazy NFA {new_total:.3f} s ({base_total / new_total:,.0f}x)"
            )
        rows.append(row)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows}, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
