"""`lmprog.ray` on a real local Ray cluster: 200 rows through two actors, each with its own
Engine, give the single-process rows; a failing row is an error value, not a failed task;
prefix routing keeps each system prompt's rows together."""

from __future__ import annotations

import os
import sys
from collections import defaultdict

import pytest
from map_programs import GREEDY, SYSTEMS, make_rows

import lmprog as lp

ray = pytest.importorskip("ray")


@lp.function
def located(s, system, question):
    """`qa`'s first turn; returns the id of the process (the actor) that ran it."""
    s += lp.system(system)
    s += lp.user(question)
    s += lp.assistant(lp.gen("answer", max_tokens=4))
    return os.getpid()


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # The workers cannot import this test module: send its programs by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    context = ray.data.DataContext.get_current()
    wait, context.wait_for_min_actors_s = context.wait_for_min_actors_s, 300
    yield  # (both actors have their Engine before the first batch: both get batches)
    context.wait_for_min_actors_s = wait
    ray.shutdown()


def test_routing_puts_rows_with_a_shared_prefix_together(cluster):
    from lmprog.ray import route_by_prefix

    rows = make_rows(200)  # 8 system prompts, 25 rows each, shuffled
    ds = ray.data.from_items(rows, override_num_blocks=8)
    blocks = [
        batch["system"].tolist()
        for batch in route_by_prefix(ds, located, num_blocks=4).iter_batches(batch_size=None)
    ]
    assert len(blocks) == 4 and sum(map(len, blocks)) == 200
    order = [system for block in blocks for system in block]
    assert sum(a != b for a, b in zip(order, order[1:])) == len(SYSTEMS) - 1  # one run each
    assert all(len(set(block)) <= 3 for block in blocks)  # 2 groups, and one cut


def test_two_actors_give_the_single_process_rows(cluster, engine):
    from lmprog.ray import ProgramRunner, route_by_prefix

    rows = make_rows(200)
    rows[17] = {**rows[17], "question": " word" * (engine.context_len + 10)}
    ds = ray.data.from_items(rows, override_num_blocks=8)
    routed = route_by_prefix(ds, located, num_blocks=4).materialize()  # CPUs go to actors
    out = routed.map_batches(
        ProgramRunner,
        fn_constructor_kwargs={
            "program": located,
            "model": "tiny",
            "engine_options": {"num_threads": 1},
            "defaults": GREEDY,
            "include_usage": True,
        },
        compute=ray.data.ActorPoolStrategy(size=2, max_tasks_in_flight_per_actor=1),
        batch_size=25,
    ).take_all()

    local = {r["id"]: r for r in located.map(rows, id_column="id", backend=engine, **GREEDY)}
    assert sorted(r["id"] for r in out) == sorted(local)
    for row in out:
        want = local[row["id"]]
        assert (row["answer"], row["error"]) == (want.get("answer"), want["error"]), row["id"]
        assert (row["system"], row["question"]) == (want["system"], want["question"])
        assert row["prompt_tokens"] > 0 or row["error"]
    bad = next(r for r in out if r["id"] == rows[17]["id"])
    assert str(engine.context_len) in bad["error"]  # an error value, not a failed task

    actors = defaultdict(set)  # actor process -> system prompts it ran
    for row in out:
        actors[row["ret_value"]].add(row["system"])
    assert os.getpid() not in actors and len(actors) == 2
    # Whole blocks of 2 prompts go to an actor: it computes only those (random: all 8).
    assert sum(len(s) for s in actors.values()) <= len(SYSTEMS) + 3, actors


@lp.function
def answer(s, question):
    s += lp.user(question)
    s += lp.assistant(lp.gen("answer", max_tokens=3))


def test_every_batch_has_the_same_columns_and_types(tmp_path):
    """Ray writes each batch as its own file: a batch without errors (error all None), one
    where every row fails before its gen (a prompt past the context: no answer at all) and
    a mixed one once had three schemas, and pandas could not read the directory back."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.block import BlockAccessor

    from lmprog.ray import ProgramRunner

    runner = ProgramRunner(answer, "tiny", defaults=GREEDY, include_usage=True)
    too_long = " word" * (runner.engine.context_len + 10)
    batches = [
        {"question": np.array(["Hi?", "Why?"])},  # Ray's default batch format
        {"question": np.array([too_long, too_long])},
        pa.table({"question": [too_long, "Who?"]}),
    ]
    try:
        for i, batch in enumerate(batches):
            block = BlockAccessor.batch_to_block(runner(batch))  # what Ray makes of it
            pq.write_table(block, tmp_path / f"{i}.parquet")  # a file per batch, as Ray does
    finally:
        runner.engine.shutdown()
    schemas = [pq.read_schema(tmp_path / f"{i}.parquet") for i in range(len(batches))]
    assert all(schema.equals(schemas[0]) for schema in schemas), schemas
    assert schemas[0].field("error").type == pa.string()
    assert schemas[0].field("answer").type == pa.string()
    df = pd.read_parquet(tmp_path)
    assert sorted(df["question"]) == sorted(["Hi?", "Why?", too_long, too_long, too_long, "Who?"])
    for row in df.to_dict("records"):
        is_too_long = row["question"] == too_long
        assert pd.isna(row["error"]) != is_too_long and pd.isna(row["answer"]) == is_too_long
        assert str(runner.engine.context_len) in row["error"] if is_too_long else row["answer"]


def test_a_batch_of_values_arrow_cannot_type_exactly_is_written_as_json_text(tmp_path):
    """A `ret_value` of `{}` in every row made a struct with no field, which Parquet cannot
    write; dicts of different keys came back with each other's keys as nulls."""
    import json

    import pyarrow.parquet as pq
    from ray.data.block import BlockAccessor

    from lmprog.ray import ProgramRunner

    @lp.function
    def returns(s, key):
        s += "Say:" + lp.gen("said", max_tokens=2)
        return {} if key == "" else {key: 1}

    runner = ProgramRunner(returns, "tiny", defaults=GREEDY)
    try:
        for i, keys in enumerate([["", ""], ["a", "b"]]):
            block = BlockAccessor.batch_to_block(runner({"key": keys}))
            pq.write_table(block, tmp_path / f"{i}.parquet")
            back = pq.read_table(tmp_path / f"{i}.parquet").column("ret_value").to_pylist()
            assert [json.loads(v) for v in back] == [{} if k == "" else {k: 1} for k in keys]
    finally:
        runner.engine.shutdown()
