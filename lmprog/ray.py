"""Programs over Ray Data, beyond one machine: one Engine per actor, rows routed by prefix.

    import ray
    from lmprog.ray import ProgramRunner, route_by_prefix

    ds = route_by_prefix(ray.data.read_parquet("tickets/"), triage)
    out = ds.map_batches(
        ProgramRunner,
        fn_constructor_kwargs={"program": triage, "model": "smollm2-135m-instruct",
                               "defaults": {"temperature": 0}},
        compute=ray.data.ActorPoolStrategy(size=8),
        batch_size=256,
    )

`ProgramRunner` is the callable class `map_batches` builds once per actor: it loads the
model into an Engine and runs each batch as a program batch (`Function.map`, so a batch's
rows share the engine's continuous batching and radix cache), returning the input columns
with the program's variables, `ret_value` and `error`: a failing row is an error value,
never a failed task. `route_by_prefix` sorts the dataset by a hash of each row's prompt
prefix (`lmprog.datasets.ordering.route_key`), so each actor receives contiguous key ranges
and its radix cache sees rows that share their prompts (the job sglang-router's cache-aware
routing does for servers), while Ray's sort keeps the ranges balanced.

Ray is an optional extra (`pip install 'lmprog[ray]'`); this module imports it lazily.
Nothing here changes how a row runs: that is `Function.map`'s.
"""

from __future__ import annotations

from typing import Any

from lmprog.datasets.mapping import map_program
from lmprog.datasets.ordering import PrefixTemplate, route_key
from lmprog.datasets.sources import native
from lmprog.function import Function

ROUTE_COLUMN = "lmprog_route"


class ProgramRunner:
    """`ds.map_batches(ProgramRunner, fn_constructor_kwargs={...}, compute=...)`: one
    Engine per actor, each batch run as a program batch.

    `program` is an `@lp.function`; `model` and `engine_options` are `lp.Engine`'s
    arguments; `defaults` are sampling defaults for every gen (`{"temperature": 0}`);
    `include_text` / `include_usage` add those columns as in `Function.map`.
    """

    def __init__(
        self,
        program: Function,
        model: str | None = None,
        *,
        engine_options: dict[str, Any] | None = None,
        defaults: dict[str, Any] | None = None,
        include_text: bool = False,
        include_usage: bool = False,
        num_threads: int | str = "auto",
    ) -> None:
        if not isinstance(program, Function):
            raise TypeError(f"program must be an @lp.function, got {type(program).__name__}")
        from lmprog_runtime import Engine

        self.program = program
        self.engine = Engine(model, **(engine_options or {}))
        self.options = {
            "include_text": include_text,
            "include_usage": include_usage,
            "num_threads": num_threads,
            **(defaults or {}),
        }

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        rows = batch_rows(batch)
        results = map_program(
            self.program, rows, backend=self.engine, index_column=None, **self.options
        )
        return _columns(list(results), rows)


def route_by_prefix(ds: Any, program: Function, num_blocks: int | None = None) -> Any:
    """`ds` sorted by the hash of each row's prompt prefix under `program`, in `num_blocks`
    contiguous blocks (default: as many as `ds` has). Ray hands whole blocks to actors, so
    rows sharing a prefix reach the same actor when their group fits in a block: choose
    blocks of several groups each, a few blocks per actor. Lazy like any Ray transform;
    where the actors take every CPU of the cluster, `materialize()` the result before
    `map_batches` (the sort's own tasks need a CPU to run)."""
    if not isinstance(program, Function):
        raise TypeError(f"program must be an @lp.function, got {type(program).__name__}")
    if num_blocks is not None and (
        isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1
    ):
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    keyed = ds.map_batches(_RouteKeys(program), batch_format="pyarrow")
    routed = keyed.sort(ROUTE_COLUMN)
    if num_blocks is not None:
        routed = routed.repartition(num_blocks)  # splits and joins neighbours: order kept
    return routed.drop_columns([ROUTE_COLUMN])


class _RouteKeys:
    """Adds the routing key column to a pyarrow batch (run as Ray tasks, no engine)."""

    def __init__(self, program: Function) -> None:
        self.program = program

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        template = PrefixTemplate(self.program)
        keys = [route_key(template.pieces(row)) for row in batch.to_pylist()]
        return batch.append_column(ROUTE_COLUMN, pa.array(keys, type=pa.string()))


def batch_rows(batch: Any) -> list[dict[str, Any]]:
    """A Ray batch (pyarrow Table, pandas DataFrame or dict of numpy arrays) as rows."""
    if hasattr(batch, "to_pylist"):
        return batch.to_pylist()
    if hasattr(batch, "to_dict") and hasattr(batch, "iloc"):
        return [{str(k): native(v) for k, v in r.items()} for r in batch.to_dict("records")]
    if isinstance(batch, dict):
        columns = {name: native(values) for name, values in batch.items()}
        num_rows = len(next(iter(columns.values()), []))
        return [{name: columns[name][i] for name in columns} for i in range(num_rows)]
    raise TypeError(f"unsupported batch type {type(batch).__name__}")


def _columns(results: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Rows to columns; a column some rows lack (a variable only some programs set) is
    None there. An empty batch keeps its input columns."""
    names: dict[str, None] = dict.fromkeys(rows[0]) if rows else {}
    for result in results:
        names.update(dict.fromkeys(result))
    return {name: [r.get(name) for r in results] for name in names}
