"""Tracing programs into IR graphs and static checks; programs give the same results alone
and in batches, with their body run once."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import lmprog as lp
from lmprog.ir import Fork, ForkItem, Gen, Join, Select, Text

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def _kinds(traced) -> list[str]:
    return [type(traced.graph.nodes[n]["node"]).__name__ for n in sorted(traced.graph)]


def _data_edges(traced) -> list[tuple[int, int]]:
    return [(a, b) for a, b, d in traced.graph.edges(data=True) if "data" in d["kind"]]


def test_few_shot_graph_is_a_chain_with_a_constant_prefix():
    from few_shot_qa import few_shot_qa

    traced = few_shot_qa.trace(question="Who wrote Hamlet?")
    assert traced.is_complete
    kinds = _kinds(traced)
    assert kinds[-1] == "Gen" and kinds.count("Gen") == 1
    assert all(
        traced.graph.out_degree(n) == 1 for n in sorted(traced.graph)[:-1]
    )  # one text-order chain
    assert traced.prefix.startswith("Answer each question in one word.\n\nQuestion: What is")
    assert traced.prefix.endswith("Question: Who wrote Hamlet?\nAnswer:")
    assert "gen answer" in str(traced) and "digraph" in traced.to_dot()
    assert traced._repr_svg_().startswith("<svg")


def test_symbolic_arguments_stop_the_prefix():
    @lp.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + lp.gen("a")

    traced = qa.trace()
    assert traced.prefix == "Q: "
    assert "argument question" in str(traced)


def test_fork_join_graph_and_data_edges():
    @lp.function
    def prog(s):
        s += "Plan:" + lp.gen("plan", max_tokens=4)
        forks = s.fork(3)
        forks += lambda i: f" step {i}:" + lp.gen("step", max_tokens=4)
        forks.join()
        s += " Summary of " + s["plan"] + lp.gen("summary", max_tokens=4)

    traced = prog.trace()
    g = traced.graph
    fork = next(n for n in g if isinstance(g.nodes[n]["node"], Fork))
    join = next(n for n in g if isinstance(g.nodes[n]["node"], Join))
    items = [n for n in g.successors(fork) if isinstance(g.nodes[n]["node"], ForkItem)]
    assert len(items) == 3
    text_into_join = [p for p in g.predecessors(join) if "text" in g.edges[p, join]["kind"]]
    assert len(text_into_join) == 3  # every branch ends in the join
    steps = [
        n for n in g if isinstance(g.nodes[n]["node"], Gen) and g.nodes[n]["node"].name == "step"
    ]
    assert len(steps) == 3 and all((s, join) in _data_edges(traced) for s in steps)
    plan = next(
        n for n in g if isinstance(g.nodes[n]["node"], Gen) and g.nodes[n]["node"].name == "plan"
    )
    assert any(a == plan for a, _ in _data_edges(traced))  # s["plan"] is read later


def test_nested_forks_and_inlined_programs():
    @lp.function
    def leaf(s, label):
        s += " " + label + lp.gen("leaf", max_tokens=2)

    @lp.function
    def tree(s):
        s += "Root."
        outer = s.fork(2)
        for i, branch in enumerate(outer):
            inner = branch.fork(2)
            for j, b in enumerate(inner):
                leaf(b, f"{i}.{j}")  # another program, inlined
            inner.join()
        outer.join()

    traced = tree.trace()
    kinds = _kinds(traced)
    assert kinds.count("Fork") == 3 and kinds.count("Join") == 3 and kinds.count("Gen") == 4
    paths = {traced.graph.nodes[n]["path"] for n in traced.graph}
    assert max(len(p) for p in paths) == 2  # branches of branches
    assert any(
        isinstance(n, Text) and n.value == " 1.0" for _, n in traced.stream(((0, 1), (2, 0)))
    )


def test_trace_stops_where_python_needs_a_value():
    from react_loop import support_agent

    traced = support_agent.trace(question="Where is my order?")
    assert not traced.is_complete and "comparison" in traced.stopped
    assert any(isinstance(d["node"], Select) for _, d in traced.graph.nodes(data=True))

    @lp.function
    def counts(s):
        s += "n=" + lp.gen("n", max_tokens=2)
        return int(s["n"])

    assert "int()" in counts.trace().stopped


def test_static_errors_before_any_request(engine):
    @lp.function
    def unknown(s):
        s += "x" + s["missing"]

    @lp.function
    def bad_regex(s):
        s += lp.gen("a", regex="(unclosed")

    @lp.function
    def bad_schema(s):
        s += lp.gen("a", json_schema="{not json")

    @lp.function
    def empty_select(s):
        s += lp.select("a", choices=[])

    @lp.function
    def duplicate_select(s):
        s += lp.select("a", choices=["x", "x"])

    engine.reset_stats()
    cases = [
        (unknown, "missing", KeyError),  # running, the read itself fails
        (bad_regex, "invalid regex", ValueError),
        (bad_schema, "invalid JSON schema", ValueError),
        (empty_select, "non-empty", ValueError),
        (duplicate_select, "duplicate", ValueError),
    ]
    for program, message, run_error in cases:
        with pytest.raises(ValueError, match=message):
            program.trace()
        if run_error is not None:
            with pytest.raises(run_error, match=message):
                program.run(backend=engine)
            states = program.run_batch([{}, {}], backend=engine)
            assert all(isinstance(s.error(), run_error) for s in states)
    assert engine.stats()["forward_passes"] == 0  # nothing reached the engine


@pytest.mark.parametrize(
    ("constraint", "message", "traced"),
    [
        ({"regex": "a{2,1}"}, "min repeat greater than max", True),
        ({"regex": r"(a|b)\1"}, "back-reference", True),
        ({"regex": r"(?<=x)y"}, "lookaround", True),
        ({"regex": r"\bword\b"}, r"\\b", True),
        # (3.10's re has no possessive repeat: it refuses it itself)
        ({"regex": "a*+"}, "possessive" if sys.version_info >= (3, 11) else "multiple", True),
        ({"regex": "x(a|^b)"}, "only at the start", False),
        ({"regex": "[[:digit:]]"}, "Rust", False),
        ({"json_schema": '{"type": "strin"}'}, "strin", False),
        ({"json_schema": '{"type": "integer", "multipleOf": 3}'}, "multipleOf", False),
    ],
)
def test_constraints_the_runtime_refuses_are_refused_at_the_line_that_writes_them(
    engine, constraint, message, traced
):
    """These passed `+=` (and `trace()`), failing only once submitted. Tracing, with no
    backend, sees what the pattern language refuses; a run asks its backend too."""

    @lp.function
    def program(s):
        s += "x" + lp.gen("a", max_tokens=4, **constraint)

    engine.reset_stats()
    if traced:
        with pytest.raises(ValueError, match=message):
            program.trace()
    with pytest.raises(ValueError, match=message):
        program.run(backend=engine)
    assert engine.stats()["forward_passes"] == 0
    with pytest.raises(ValueError, match="cannot compile|unsupported|Rust"):  # the reference
        engine.generate("x", {"max_new_tokens": 1, **constraint})


SERVED = [r"[\u0400-\u04FF]{2}", r"\u00e9{2}", "(yes|no)$", r"\A(yes|no)\Z", "^a{,3}b$"]


@pytest.mark.parametrize("regex", SERVED)
def test_patterns_the_static_check_once_refused_run_in_programs(engine, regex):
    """The static check once asked interegular (the jump-forward FSM's reader), which
    cannot read the first three, and refused `\\A`: programs refused these, though the
    engine serves them (since it reads `^` and `a{,3}` as Python's `re` does)."""

    @lp.function
    def program(s):
        s += "Answer: " + lp.gen("a", regex=regex, max_tokens=8, temperature=0)

    assert re.fullmatch(regex, program.run(backend=engine)["a"])


@pytest.mark.parametrize(
    ("module", "program", "kwargs"),
    [
        ("few_shot_qa", "few_shot_qa", {"question": "Who wrote Hamlet?"}),
        ("select_classifier", "classify", {"message": "My parcel is late."}),
        ("skeleton_of_thought", "skeleton_of_thought", {"topic": "tea"}),
        ("react_loop", "support_agent", {"question": "Where is my order 1042?"}),
    ],
)
def test_examples_give_the_same_results_alone_and_in_a_batch(engine, module, program, kwargs):
    prog = getattr(__import__(module), program)
    alone = prog.run(backend=engine, temperature=0, **kwargs)
    batch = prog.run_batch([kwargs] * 3, backend=engine, temperature=0, num_threads=2)
    for state in batch:
        assert state.error() is None
        assert state.text() == alone.text()
        assert state.ret_value == alone.ret_value


def test_run_batch_prefills_a_shared_system_prompt_once(engine):
    system = "You are the assistant of a small bookshop; answer briefly. " * 10

    @lp.function
    def ask(s, i):
        s += lp.system(system)
        s += lp.user(f"Question {i}?")
        s += lp.assistant(lp.gen("a", max_tokens=2, temperature=0))

    engine.flush_cache()
    engine.reset_stats()
    states = ask.run_batch([{"i": i} for i in range(64)], backend=engine)
    assert all(s.error() is None for s in states)
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}], tokenize=False
    )
    prefix_tokens = len(engine.encode(rendered))
    suffix_tokens = len(engine.encode("Question 10?<|im_end|>\n<|im_start|>assistant\n")) + 2
    stats = engine.stats()
    assert prefix_tokens > 100
    assert stats["prefill_tokens"] <= prefix_tokens + 64 * suffix_tokens
    assert stats["cached_tokens"] >= 63 * (prefix_tokens - 2)
    alone = [ask.run(i=i, backend=engine) for i in range(4)]
    assert [s.text() for s in alone] == [s.text() for s in states[:4]]


def test_python_on_generated_values_runs_once_with_the_values(engine):
    runs = []

    @lp.function
    def branchy(s, topic):
        runs.append(topic)
        s += "Topic: " + topic + ". Word:" + lp.gen("word", max_tokens=3, ignore_eos=True)
        s += " Mood:" + lp.select("mood", choices=[" happy", " sad"])
        if s["mood"] == " happy":  # a trace stops here; a run reads the value
            s += " Cheer:" + lp.gen("more", max_tokens=4, ignore_eos=True)
        else:
            s += " Comfort:" + lp.gen("more", max_tokens=4, ignore_eos=True)
        return s["word"].strip() + "/" + s["more"]

    assert not branchy.trace(topic="tea").is_complete
    runs.clear()
    engine.flush_cache()
    engine.reset_stats()
    topics = ("tea", "rain", "cats")
    states = branchy.run_batch([{"topic": t} for t in topics], backend=engine, temperature=0)
    assert sorted(runs) == sorted(topics)  # each body ran exactly once
    decode_tokens = engine.stats()["decode_tokens"]
    for topic, state in zip(topics, states):
        alone = branchy.run(topic=topic, backend=engine, temperature=0)
        assert state.text() == alone.text() and state.ret_value == alone.ret_value
        assert state.ret_value == state["word"].strip() + "/" + state["more"]
        word = "Cheer" if state["mood"] == " happy" else "Comfort"
        assert f" {word}:" + state["more"] in state.text()
    # 3 tokens for the word and 4 for the rest, per program: nothing generated twice.
    assert decode_tokens <= 3 * (3 + 4)


def test_trace_stops_at_a_string_method_or_json_of_a_value():
    @lp.function
    def strips(s):
        s += "Q:" + lp.gen("x", max_tokens=2)
        if s["x"].strip() == "yes":
            s += "!"

    @lp.function
    def parses(s):
        s += "J:" + lp.gen("x", max_tokens=2)
        s += json.loads(s["x"])["a"]

    @lp.function
    def own_error(s):
        s += "Q:" + lp.gen("x", max_tokens=2)
        len(5)  # the program's own mistake: raised, not a stop

    assert "'VarRef' object has no attribute 'strip'" in strips.trace().stopped
    assert "not VarRef" in parses.trace().stopped
    with pytest.raises(TypeError, match="has no len"):
        own_error.trace()


def test_a_value_read_right_after_it_is_made_shows_as_data():
    """Text order and data on one edge ("text+data"): listed and drawn as data (once shown
    as plain text order)."""

    @lp.function
    def twice(s):
        s += "Q:" + lp.gen("a", max_tokens=2)
        s += s["a"]
        s += " / " + s["a"]

    traced = twice.trace()
    both = [(a, b) for a, b, kind in traced.graph.edges(data="kind") if kind == "text+data"]
    assert both
    producer, consumer = both[0]
    assert f"<- [{producer}" in str(traced).splitlines()[consumer]
    assert f"n{producer} -> n{consumer} [style=dashed" in traced.to_dot()


def test_a_name_produced_again_is_the_new_value_as_in_sglang():
    """SGLang's multi-turn shape (the same gen name each turn) traced: it was refused as a
    variable produced twice, though `run()` takes it; a later read gets the last value."""

    @lp.function
    def chat(s, questions):
        for question in questions:
            s += lp.user(question)
            s += lp.assistant(lp.gen("answer", max_tokens=4))
        s += "Last: " + s["answer"]

    traced = chat.trace(questions=["a", "b"])
    graph = traced.graph
    gens = [n for n, d in graph.nodes(data=True) if type(d["node"]).__name__ == "Gen"]
    reads = [n for n, d in graph.nodes(data=True) if type(d["node"]).__name__ == "VarRef"]
    assert len(gens) == 2 and len(reads) == 1
    data_in = [u for u, _, kind in graph.in_edges(reads[0], data="kind") if "data" in kind]
    assert data_in == [gens[1]]
