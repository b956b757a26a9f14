"""Programs over datasets: `Function.map` and what it is made of.

    summary = qa.map("questions.jsonl", output="answers.parquet", id_column="id",
                     resume=True, temperature=0).run()

`sources` reads rows (lists of dicts, pandas, Hugging Face datasets, JSONL / CSV /
Parquet), `ordering` computes each row's prompt prefix (cache-aware order, Ray routing),
`runner` runs rows in bounded windows on a pool of threads, `sinks` appends results
durably and resumes (`parquet` builds a Parquet output from its journal), `progress`
counts tokens and draws the bar, `mapping` checks the arguments and ties them together.
`lmprog.ray` runs the same rows on Ray Data; the CLI (`lmprog.cli`) is a thin layer over
`map`.
"""

from __future__ import annotations

from lmprog.datasets.mapping import MapRun, MapSummary, map_program

__all__ = ["MapRun", "MapSummary", "map_program"]
