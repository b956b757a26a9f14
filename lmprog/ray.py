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
never a failed task. Batches have the same columns of the same types (Ray writes each
batch as its own file, and a reader of the directory needs one schema): `error` is always
a string column, and the variables of the program's gens and selects are there even in a
batch where every row failed: those that tracing the program finds, and those earlier
batches on the actor had. `route_by_prefix` sorts the dataset by a hash of each row's prompt
prefix (`lmprog.datasets.ordering.route_key`), so each actor receives contiguous key ranges
and its radix cache sees rows that share their prompts (the job sglang-router's cache-aware
routing does for servers), while Ray's sort keeps the ranges balanced.

Ray is an optional extra (`pip install 'lmprog[ray]'`); this module imports it lazily.
Nothing here changes how a row runs: that is `Function.map`'s.
"""

from __future__ import annotations

from typing import Any

from lmprog.datasets.mapping import map_program
from lmprog.datasets.ordering import PrefixTemplate, program_params, route_key
from lmprog.datasets.progress import USAGE_COLUMNS
from lmprog.datasets.sources import native
from lmprog.function import Function
from lmprog.ir import Argument, Gen, Select

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
        import pyarrow as pa

        # The columns `map` writes after the variables, in its order, and their types.
        tail = {"ret_value": None, **({"text": pa.string()} if include_text else {})}
        tail |= dict.fromkeys(USAGE_COLUMNS, pa.int64()) if include_usage else {}
        self.tail = [*tail, "error"]
        # Every column known so far, with its type (for a batch whose values are all None).
        self.types = _variable_types(program)
        self.types |= {n: t for n, t in tail.items() if t is not None} | {"error": pa.string()}

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        rows = batch_rows(batch)
        results = map_program(
            self.program, rows, backend=self.engine, index_column=None, **self.options
        )
        table = _table(list(results), rows, self.types, self.tail)
        for field in table.schema:  # (for later batches where this column is all None)
            if field.type != pa.null():
                self.types.setdefault(field.name, field.type)
        return table


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


def _variable_types(program: Function) -> dict[str, Any]:
    """The variables of the program's gens and selects outside forks, as far as tracing it
    with symbolic arguments sees (it stops where Python needs an argument's value: an `if`
    on it), and their types: strings, or numbers for a gen with `dtype`."""
    import pyarrow as pa

    try:
        traced = program.trace(**{p.name: Argument(p.name) for p in program_params(program)})
        nodes = [node for _, node in traced.stream(())]
    except Exception:  # noqa: BLE001 - the columns are then the ones the rows give
        nodes = []
    types: dict[str, Any] = {}
    for node in nodes:
        if isinstance(node, (Gen, Select)) and node.name is not None:
            dtype = node.dtype if isinstance(node, Gen) else None
            types[node.name] = {int: pa.int64(), float: pa.float64()}.get(dtype, pa.string())
    return types


def _table(
    results: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    types: dict[str, Any],
    tail: list[str],
) -> Any:
    """Result rows as a pyarrow Table: the input columns, the variables (those of `types`
    included, even where no row has them), then `tail`. A column all None takes its type
    from `types`; one no Arrow type holds as it is (mixed types, dicts of other keys, `{}`)
    is JSON text, as in a Parquet output."""
    import pyarrow as pa

    from lmprog.datasets.parquet import column_array

    names: dict[str, None] = dict.fromkeys(rows[0]) if rows else {}
    names.update(dict.fromkeys(types))
    for result in results:
        names.update(dict.fromkeys(result))
    order = [n for n in names if n not in tail] + tail
    arrays = []
    for name in order:
        values = [r.get(name) for r in results]
        array = column_array(values)
        if pa.types.is_null(array.type) and name in types:
            array = pa.nulls(len(values), types[name])
        arrays.append(array)
    return pa.Table.from_arrays(arrays, names=order)
