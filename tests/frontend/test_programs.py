"""Programs end to end on the tiny model: gen, roles, fork/join, run_batch, streaming,
variables, errors. References: Engine.generate on the same prompt, the tokenizer's own
chat template, and engine counters."""

from __future__ import annotations

import html
import time

import pytest

import lmprog as lp

GREEDY = {"temperature": 0}


def test_one_gen_equals_engine_generate_on_the_rendered_prompt(engine):
    @lp.function
    def qa(s, question):
        s += lp.user(question)
        s += lp.assistant(lp.gen("answer", max_tokens=12, temperature=0))

    state = qa.run(question="Where is my parcel?", backend=engine)
    tokenizer = engine.tokenizer
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Where is my parcel?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert state.text().startswith(rendered)
    expected = engine.generate(rendered, {"max_new_tokens": 12, "temperature": 0})
    assert state["answer"] == expected["text"]
    assert (
        state.get_meta_info("answer")["completion_tokens"]
        == expected["meta_info"]["completion_tokens"]
    )
    # The template's default system prompt comes first (listed, as SGLang lists it); the
    # whole conversation renders to the text.
    assert state.messages()[:2] == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Where is my parcel?"},
    ]
    full = tokenizer.apply_chat_template(state.messages(), tokenize=False)
    assert state.text() == full


def test_a_change_to_a_branchs_meta_info_is_its_own(engine):
    """A fork's branches share their parent's meta info (a copy of every earlier gen's
    made a long program's fork rounds cost memory in the square); what `get_meta_info`
    hands out is a copy, so a caller's change to it reaches no other state."""

    @lp.function
    def forked(s):
        s += "Q:" + lp.gen("x", max_tokens=2, temperature=0)
        forks = s.fork(2)
        for f in forks:
            f += " A:" + lp.gen("y", max_tokens=1, temperature=0)
        forks[0].get_meta_info("x")["note"] = "branch 0's"
        forks.join()
        return [f.get_meta_info("x").get("note") for f in forks]

    state = forked.run(backend=engine)
    assert state.ret_value == [None, None]
    assert "note" not in state.get_meta_info("x")
    gathered = state.get_meta_info("y")
    gathered[0]["note"] = "mine"
    assert "note" not in state.get_meta_info("y")[0]


def test_a_gathered_variables_meta_info_is_its_branches_in_order(engine):
    """(None before, as in SGLang: the join copied the values only; and a streamed state's
    `text_iter` of it gave nothing)"""

    @lp.function
    def two(s):
        s += "Topics:"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" {i}." + lp.gen("r", max_tokens=i + 1, temperature=0, ignore_eos=True)
        forks[2]["extra"] = "set, not generated"
        forks.join()
        return [f.get_meta_info("r") for f in forks]

    state = two.run(backend=engine)
    metas = state.get_meta_info("r")
    assert metas == state.ret_value and [m["completion_tokens"] for m in metas] == [1, 2, 3]
    assert state["extra"] == [None, None, "set, not generated"]
    assert state.get_meta_info("extra") is None  # (no branch generated it)
    # Streamed, such a variable comes whole, once, as without streaming (it gave nothing).
    import asyncio

    async def read_async(state):
        return [chunk async for chunk in state.text_async_iter("r", return_meta_data=True)]

    streamed = two.run(backend=engine, stream=True)
    assert list(streamed.text_iter("r")) == [state["r"]] == list(state.text_iter("r"))
    assert asyncio.run(read_async(streamed)) == [(state["r"], streamed.get_meta_info("r"))]


def test_program_defaults_are_inherited_and_bind(engine):
    @lp.function
    def two(s, topic):
        s += "About " + topic + ":" + lp.gen("a") + lp.gen("b", max_tokens=2)

    state = two.bind(topic="tea").run(
        backend=engine, max_new_tokens=5, temperature=0, ignore_eos=True
    )
    assert state.get_meta_info("a")["completion_tokens"] == 5
    assert state.get_meta_info("b")["completion_tokens"] == 2
    plain = engine.generate(
        "About tea:", {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    )
    assert state["a"] == plain["text"]


def test_unnamed_gens_get_stable_names_and_var_scope(engine):
    @lp.function
    def prog(s):
        s += "Q: hi\nA:" + lp.gen(max_tokens=3, temperature=0) + lp.gen(max_tokens=2, temperature=0)
        with s.var_scope("tail"):
            s += " and more"

    state = prog.run(backend=engine)
    assert "gen_0" in state and "gen_1" in state and "gen_2" not in state
    assert state["tail"] == " and more"


def test_unnamed_gens_in_branches_go_on_from_the_parents_names(engine):
    """A branch's names began at gen_0 again: with an unnamed gen before the fork, each
    branch's gen_0 was the name it inherited, and the join (which gathers the names the
    branches made) lost their values. Traced, the graph names them the same way.
    Reference: each branch's text, generated alone by `Engine.generate`."""
    params = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}

    @lp.function
    def prog(s):
        s += "Hello" + lp.gen(**params)
        forks = s.fork(2)
        forks += lambda i: f" b{i}" + lp.gen(**params)
        s += " parent:" + lp.gen(**params)  # (it took gen_1 too, and the join overwrote it)
        forks.join()

    state = prog.run(backend=engine)
    parent = engine.generate(
        f"Hello{state['gen_0']} parent:", {"max_new_tokens": 2, **GREEDY, "ignore_eos": True}
    )
    assert state["gen_2"] == parent["text"] and state.text().endswith(" parent:" + parent["text"])
    expected = [
        engine.generate(
            f"Hello{state['gen_0']} b{i}", {"max_new_tokens": 2, **GREEDY, "ignore_eos": True}
        )
        for i in range(2)
    ]
    assert state["gen_1"] == [out["text"] for out in expected]
    names = {d["node"].name for _, d in prog.trace(backend=engine).graph.nodes(data=True)
             if getattr(d.get("node"), "name", None)}  # fmt: skip
    assert names == {"gen_0", "gen_1", "gen_2"}

    @lp.function
    def parent_first(s):  # (the parent's gen_1, then the branches': they took gen_1 too)
        s += "Hello" + lp.gen(**params)
        forks = s.fork(2)
        s += " parent:" + lp.gen(**params)
        forks += lambda i: f" b{i}" + lp.gen(**params)
        forks.join()

    state = parent_first.run(backend=engine)
    assert state["gen_1"] == parent["text"]
    assert state["gen_2"] == [out["text"] for out in expected]

    @lp.function
    def fork_twice(s):  # (each fork named its gen gen_0: the second join lost its values)
        s += "Hello"
        for _ in range(2):
            forks = s.fork(2)
            forks += lambda i: f" b{i}" + lp.gen(**params)
            forks.join()

    state = fork_twice.run(backend=engine)
    branch = [
        engine.generate(f"Hello b{i}", {"max_new_tokens": 2, **GREEDY, "ignore_eos": True})
        for i in range(2)
    ]
    assert state["gen_0"] == state["gen_1"] == [out["text"] for out in branch]


def test_a_forks_branches_run_once_each_has_a_node_while_the_body_works_on(engine):
    """The parent holds its fork until every branch has a node (so that the branches go
    in together), then lets it run: the body need not read a branch or end first."""
    ran = []

    @lp.function
    def prog(s):
        s += "Ideas:"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" {i}." + lp.gen("idea", max_tokens=2, temperature=0)
        deadline = time.monotonic() + 20  # (other Python work, reading nothing)
        while engine.stats()["finished_requests"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        ran.append(engine.stats()["finished_requests"])
        forks.join()

    engine.reset_stats()
    state = prog.run(backend=engine)
    assert state.error() is None and ran[0] >= 3  # (and the shared prefix's own request)


def test_fork_prefills_the_parent_once_and_decodes_branches_together(engine):
    trace = []
    forward = engine.runner.forward

    def traced(batch):
        trace.append((batch.mode.name, len(batch.reqs)))
        return forward(batch)

    @lp.function
    def sot(s):
        s += lp.system("You plan trips. " * 20)
        s += lp.user("Give me four ideas.")
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += lp.assistant(
                f"Idea {i}:" + lp.gen("idea", max_tokens=8, temperature=0, ignore_eos=True)
            )
        forks.join()

    engine.flush_cache()
    engine.reset_stats()
    engine.runner.forward = traced
    try:
        state = sot.run(backend=engine)
    finally:
        del engine.runner.forward
    parent_len = len(engine.encode(lp_text_before_fork(engine)))
    stats = engine.stats()
    # The parent prompt is computed once, not once per branch.
    assert stats["prefill_tokens"] < parent_len + 4 * 20
    assert stats["cached_tokens"] >= 4 * (parent_len - 1)
    decode_sizes = [n for mode, n in trace if mode == "DECODE"]
    assert decode_sizes and all(n == 4 for n in decode_sizes)  # the branches decode together
    ideas = state["idea"]
    assert isinstance(ideas, list) and len(ideas) == 4
    for i in range(4):
        solo = engine.generate(
            lp_text_before_fork(engine) + lp_assistant_prefix(engine) + f"Idea {i}:",
            {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
        assert ideas[i] == solo["text"]  # branch order is kept


def lp_text_before_fork(engine) -> str:
    return engine.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You plan trips. " * 20},
            {"role": "user", "content": "Give me four ideas."},
        ],
        tokenize=False,
    )


def lp_assistant_prefix(engine) -> str:
    return "<|im_start|>assistant\n"


def test_join_concate_and_append(engine):
    @lp.function
    def prog(s):
        s += "Start."
        forks = s.fork(3)
        forks += lambda i: f" branch{i}"
        forks.join("concate_and_append")

    state = prog.run(backend=engine)
    assert state.text() == "Start. branch0 branch1 branch2"


def test_run_batch_order_failures_and_shared_prefix(engine):
    system = "You are a helpful shop assistant. " * 12

    @lp.function
    def ask(s, i):
        if i == 5:
            raise RuntimeError("program 5 fails")
        s += lp.system(system)
        s += lp.user(f"Question number {i}")
        s += lp.assistant(lp.gen("a", max_tokens=2, temperature=0))
        return i

    engine.flush_cache()
    engine.reset_stats()
    states = ask.run_batch([{"i": i} for i in range(64)], progress_bar=True, backend=engine)
    assert [s.ret_value for s in states if s.error() is None] == [i for i in range(64) if i != 5]
    assert isinstance(states[5].error(), RuntimeError)
    system_tokens = len(engine.encode(system))
    stats = engine.stats()
    # The shared system prompt is prefilled once; each program adds its own few tokens.
    per_program = len(engine.encode(lp_question_suffix())) + 8
    assert stats["prefill_tokens"] < system_tokens + 63 * per_program
    assert stats["cached_tokens"] >= 62 * system_tokens


def lp_question_suffix() -> str:
    return "<|im_end|>\n<|im_start|>user\nQuestion number 10<|im_end|>\n<|im_start|>assistant\n"


def test_streaming_increments_concatenate_to_the_final_text(engine):
    @lp.function
    def story(s):
        s += "Once upon a time" + lp.gen("story", max_tokens=16, temperature=0)

    state = story.run(stream=True, backend=engine)
    pieces = list(state.text_iter())
    assert len(pieces) > 2 and "".join(pieces) == state.text()
    state2 = story.run(stream=True, backend=engine)
    assert "".join(state2.text_iter("story")) == state2["story"] == state["story"]


def test_inlining_another_program(engine):
    @lp.function
    def greet(s, name):
        s += "Hello, " + name + "."

    @lp.function
    def outer(s):
        greet(s, "Ada")
        s += " Bye."

    assert outer.run(backend=engine).text() == "Hello, Ada. Bye."
    # Without a state, calling a program runs it (as in SGLang).
    assert greet("Ada", backend=engine).text() == "Hello, Ada."
    assert greet(name="Bo", backend=engine).text() == "Hello, Bo."


def test_clear_errors(engine):
    with pytest.raises(TypeError, match="placeholder"):
        f"{lp.gen('x')}"  # noqa: B018
    with pytest.raises(TypeError, match="placeholder"):
        str(lp.select("x", choices=["a"]))
    with pytest.raises(ValueError, match="non-empty"):
        lp.select("x", choices=[])
    with pytest.raises(TypeError, match="first parameter"):

        @lp.function
        def no_state():
            pass

    @lp.function
    def nested(s):
        s += lp.user_begin()
        s += lp.assistant("hi")

    with pytest.raises(ValueError, match="nested roles"):  # raised unchanged
        nested.run(backend=engine)

    @lp.function
    def reads_unknown(s):
        s += "hi"
        return s["nope"]

    engine.reset_stats()
    with pytest.raises(ValueError, match="reads variable 'nope'"):
        reads_unknown.trace()  # a static error: caught by the tracer
    with pytest.raises(KeyError, match="unknown variable 'nope'"):
        reads_unknown.run(backend=engine)
    assert engine.stats()["forward_passes"] == 0


def test_model_without_chat_template(engine, tiny_path, tmp_path):
    import json
    import shutil

    from lmprog_runtime import Engine

    path = tmp_path / "no_template"
    shutil.copytree(tiny_path, path)
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (path / "tokenizer_config.json").write_text(json.dumps(config))

    @lp.function
    def chat(s):
        s += lp.user("hi")

    with (
        Engine(str(path), max_total_tokens=256) as plain,
        pytest.raises(ValueError, match="no chat template"),
    ):
        chat.run(backend=plain)


def test_repr_html_highlights_and_escapes(engine):
    @lp.function
    def prog(s):
        s += lp.user("<b>bold</b> & co")
        s += lp.assistant(lp.gen("reply", max_tokens=4, temperature=0))

    state = prog.run(backend=engine)
    page = state._repr_html_()
    assert html.escape("<b>bold</b> & co") in page and "<b>bold</b> & co" not in page
    assert 'title="reply: 4 tokens"' in page
    assert "lmprog-role-user" in page and "lmprog-role-assistant" in page


def test_gen_logprobs_reach_the_meta_info(engine):
    @lp.function
    def prog(s):
        s += "Once upon a time" + lp.gen(
            "a", max_tokens=4, temperature=0, return_logprob=True, top_logprobs_num=2
        )
        s += "." + lp.gen("b", max_tokens=2, temperature=0)

    state = prog.run(backend=engine)
    info = state.get_meta_info("a")
    assert len(info["output_token_logprobs"]) == 4 and len(info["output_top_logprobs"][0]) == 2
    assert [t for _, t, _ in info["output_token_logprobs"]] == engine.generate(
        "Once upon a time", {"max_new_tokens": 4, "temperature": 0}
    )["output_ids"]
    assert "output_token_logprobs" not in state.get_meta_info("b")


def test_run_level_logprob_options_reach_every_gen(engine):
    @lp.function
    def prog(s):
        s += "Once upon a time" + lp.gen("a", max_tokens=3)
        s += "." + lp.gen("b", max_tokens=2, return_logprob=False)

    state = prog.run(
        backend=engine,
        temperature=0,
        return_logprob=True,
        top_logprobs_num=1,
        return_text_in_logprobs=True,
        use_thread=False,  # SGLang's option, nothing to do in-process
    )
    info = state.get_meta_info("a")
    reference = engine.generate(
        "Once upon a time", {"max_new_tokens": 3, "temperature": 0}, return_logprob=True
    )
    got = info["output_token_logprobs"]
    want = reference["meta_info"]["output_token_logprobs"]
    assert [(tid, text) for _, tid, text in got] == [(t, engine.decode([t])) for _, t, _ in want]
    assert [v for v, _, _ in got] == pytest.approx([v for v, *_ in want], abs=1e-4)
    assert len(info["output_top_logprobs"]) == 3
    # A gen's own value overrides the run's, False too (as SGLang's `is not None`); only
    # an unset one (None) inherits it.
    assert "output_token_logprobs" not in state.get_meta_info("b")


def test_a_gens_logprob_request_takes_the_runs_other_logprob_options(engine):
    @lp.function
    def prog(s):
        s += "Once upon a time" + lp.gen("a", max_tokens=3, return_logprob=True)

    info = prog.run(backend=engine, temperature=0, top_logprobs_num=2).get_meta_info("a")
    assert [len(top) for top in info["output_top_logprobs"]] == [2, 2, 2]


def test_generator_style_yields_states_as_they_finish(engine):
    @lp.function
    def write(s, n):
        s += f"Item {n}:" + lp.gen("x", max_tokens=n, ignore_eos=True, temperature=0)
        return n

    lengths = [40, 1, 2, 30, 1]
    finished = list(
        write.run_batch(
            [{"n": n} for n in lengths], backend=engine, generator_style=True, num_threads=5
        )
    )
    assert sorted(s.ret_value for s in finished) == sorted(lengths)
    order = [s.ret_value for s in finished]
    # The 40-token program cannot finish before the 1- and 2-token ones it ran beside.
    assert order.index(40) > max(order.index(1), order.index(2))
    assert all(s.get_meta_info("x")["completion_tokens"] == s.ret_value for s in finished)


def test_bounded_pool_and_no_thread_left_behind(engine):
    import threading

    running, peak = [0], [0]
    lock = threading.Lock()

    @lp.function
    def prog(s, i):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        s += f"Number {i}:" + lp.gen("x", max_tokens=2, temperature=0)
        s["x"]  # noqa: B018 - the body waits for its gen, holding its pool thread
        with lock:
            running[0] -= 1

    before = {t.ident for t in threading.enumerate()}
    states = prog.run_batch([{"i": i} for i in range(24)], backend=engine, num_threads=3)
    assert all(s.error() is None for s in states) and peak[0] <= 3
    with pytest.raises(ValueError, match="num_threads"):
        prog.run_batch([{"i": 0}], backend=engine, num_threads=0)
    # The interpreter thread exits once no program runs (it may take a moment to notice).
    import time

    deadline = time.monotonic() + 10
    while {t.ident for t in threading.enumerate()} - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not {t.name for t in threading.enumerate() if t.ident not in before}


def test_gen_logprob_start_len_gives_prompt_logprobs(engine):
    @lp.function
    def prog(s):
        s += "Once upon a time there was" + lp.gen(
            "a", max_tokens=2, temperature=0, return_logprob=True, logprob_start_len=3
        )

    state = prog.run(backend=engine)
    ids = engine.encode("Once upon a time there was")
    reference = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 2, "temperature": 0},
        return_logprob=True,
        logprob_start_len=3,
    )["meta_info"]["input_token_logprobs"]
    got = state.get_meta_info("a")["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[3:] == [t for _, t, _ in reference]
    assert [v for v, *_ in got] == pytest.approx([v for v, *_ in reference], abs=1e-4)


def test_a_fork_after_the_program_failed_ends_and_a_finished_state_cannot_fork(engine):
    import threading

    before = {t.ident for t in threading.enumerate()}

    @lp.function
    def refused_then_fork(s):
        s += "x " * (engine.context_len + 10) + lp.gen("a", max_tokens=2)
        s.error()  # returns once the refused request has failed the program
        forks = s.fork(2)
        forks += lp.gen("b", max_tokens=2)
        forks.join()

    with pytest.raises(ValueError, match="longer than the context"):
        refused_then_fork.run(backend=engine)

    @lp.function
    def short(s):
        s += "hi" + lp.gen("a", max_tokens=2)

    state = short.run(backend=engine)
    with pytest.raises(RuntimeError, match="cannot fork"):
        state.fork(2)
    # Nothing is left running: the interpreter thread exits (it may take a moment).
    import time

    deadline = time.monotonic() + 10
    while {t.ident for t in threading.enumerate()} - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.ident not in before]


def test_a_refused_request_in_a_branch_no_join_reads_fails_the_program(engine):
    """As an unread gen's refusal does on the main line; it once vanished (`error()`
    None, `run` returned), in `run`, `run_batch` and a dataset row alike."""

    @lp.function
    def branch_refused(s):
        s += "Hello."
        forks = s.fork(2)
        forks[0] += "x " * (engine.context_len + 10)
        forks += lp.gen("b", max_tokens=2)
        return forks[1]["b"]

    with pytest.raises(ValueError, match="longer than the context"):
        branch_refused.run(backend=engine)
    states = branch_refused.run_batch([{}, {}], backend=engine)
    assert all(isinstance(state.error(), ValueError) for state in states)
    assert "ValueError" in repr(states[0])
    (row,) = list(branch_refused.map([{}], backend=engine))
    assert "longer than the context" in row["error"]

    @lp.function
    def branch_cancelled(s):  # (on purpose: the program goes on)
        s += "Hello."
        forks = s.fork(2)
        forks += lp.gen("b", max_tokens=2)
        forks[1].cancel()
        return forks[0]["b"]

    state = branch_cancelled.run(backend=engine)
    assert state.error() is None and state.ret_value is not None


def test_a_forked_child_reading_a_program_running_in_the_parent_is_told(engine):
    """It waited forever: the parent's interpreter thread, which would end the program,
    is not in the child, and the streams' lock may have been copied held."""
    import os
    import signal
    import threading
    import time

    release = threading.Event()

    @lp.function
    def waits(s):
        s += "Hello" + lp.gen("x", max_tokens=2, temperature=0)
        release.wait(timeout=60)
        s += lp.gen("y", max_tokens=2, temperature=0)

    state = waits.run(stream=True, backend=engine)
    state["x"]  # noqa: B018 - (the body now waits)
    read, write = os.pipe()
    holding, release_lock = threading.Event(), threading.Event()

    def hold() -> None:  # (another thread's: the forking thread could take the RLock again)
        with state._stream.lock:
            holding.set()
            release_lock.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(30)
    pid = os.fork()
    if pid != 0:
        release_lock.set()
        holder.join()
    if pid == 0:
        try:
            error = state.error()
            os.write(write, f"{type(error).__name__}: {error}".encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    release.set()
    with os.fdopen(read) as pipe:
        assert "RuntimeError: this program was running in the process" in pipe.read()
    assert state.error() is None and state["y"] is not None  # (the parent's runs on)


def test_programs_on_two_engines_at_once_each_use_their_own(engine, tiny_path):
    from lmprog_runtime import Engine

    @lp.function
    def prog(s, i):
        s += f"Number {i}:" + lp.gen("x", max_tokens=3, temperature=0, ignore_eos=True)

    with Engine(tiny_path, max_total_tokens=2048, random_seed=7) as other:
        other.reset_stats()
        engine.reset_stats()
        results = {}

        def run(name, backend):
            results[name] = prog.run_batch([{"i": i} for i in range(8)], backend=backend)

        import threading

        threads = [
            threading.Thread(target=run, args=("a", engine)),
            threading.Thread(target=run, args=("b", other)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert other.stats()["decode_tokens"] == engine.stats()["decode_tokens"] == 8 * 2
    assert [s.text() for s in results["a"]] == [s.text() for s in results["b"]]


@pytest.mark.parametrize("error", [RuntimeError("the body's own"), KeyboardInterrupt()])
def test_a_body_that_raises_aborts_its_requests_in_flight(engine, error):
    @lp.function
    def prog(s):
        s += "Tell three long stories:"
        forks = s.fork(2)
        forks += lp.gen("story", max_tokens=1500, ignore_eos=True)
        s += lp.gen("story", max_tokens=1500, ignore_eos=True)
        time.sleep(0.2)  # (sent by now, most likely; if not, nothing is sent)
        raise error

    engine.reset_stats()
    with pytest.raises(type(error)):
        prog.run(backend=engine)
    # A raising body's requests (not Ctrl-C's) once ran to their ends: 4,500 tokens
    # computed for nothing while `run()` waited.
    assert engine.stats()["decode_tokens"] < 1500


def test_a_streamed_branch_streams_the_text_it_inherits(engine):
    """A branch's chunks add up to its text, the forked prefix included (once they began
    after it), as without streaming."""
    branches = {}

    @lp.function
    def prog(s):
        s += "Root text. "
        forks = s.fork(2)
        branches["forks"] = forks
        forks += lp.gen("x", max_tokens=4, temperature=0)
        forks.join()

    for stream in (False, True):
        prog.run(backend=engine, stream=stream).sync()
        branch = branches["forks"][0]
        assert branch.text().startswith("Root text. ")
        assert "".join(branch.text_iter()) == branch.text(), stream


def test_an_async_consumer_waiting_on_a_slow_program_starves_no_other(engine):
    """Each consumer waited on a thread of the loop's default executor: as many consumers
    as it has threads, their programs in a tool call, and every other consumer waited."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()

    @lp.function
    def slow(s):
        s += "Q:" + lp.gen("plan", max_tokens=2, temperature=0)
        release.wait(60)
        s += " done"

    @lp.function
    def quick(s):
        s += "Hi" + lp.gen("a", max_tokens=2, temperature=0)

    async def text(state):
        return "".join([delta async for delta in state.text_async_iter()])

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        waiting = asyncio.create_task(text(slow.run(backend=engine, stream=True)))
        await asyncio.sleep(0.2)
        state = quick.run(backend=engine, stream=True)
        try:
            got = await asyncio.wait_for(text(state), timeout=20)
        finally:
            release.set()
        return got, state.text(), await waiting

    got, expected, slow_text = asyncio.run(main())
    assert got == expected and slow_text.endswith(" done")


@pytest.mark.parametrize("name", ["age", "pick", "free"])
def test_a_streamed_value_comes_with_its_meta_info(engine, name):
    """`text_async_iter(name, return_meta_data=True)`: a number gen's and a select's value
    came with None (their meta info was set after their text was emitted)."""
    import asyncio

    @lp.function
    def prog(s):
        s += "Age: " + lp.gen("age", dtype=int, max_tokens=5, temperature=0)
        s += "\nPick:" + lp.select("pick", choices=["a", "b"])
        s += "\nFree:" + lp.gen("free", max_tokens=4, temperature=0)

    async def items(state):
        return [item async for item in state.text_async_iter(name, return_meta_data=True)]

    state = prog.run(backend=engine, stream=True)
    pieces = asyncio.run(items(state))
    assert "".join(value for value, _ in pieces) == state[name]
    assert pieces[-1][1] is not None
    assert pieces[-1][1]["completion_tokens"] == state.get_meta_info(name)["completion_tokens"]


def test_a_late_cancel_leaves_a_finished_program_as_it_ended(engine):
    """A batch stopped just as one of its programs ended (`map` closed, `run_batch`'s
    generator closed) once failed that program after the fact: its row went unwritten."""

    @lp.function
    def short(s):
        s += "Hi" + lp.gen("a", max_tokens=2)

    state = short.run(backend=engine)
    state._cancel(RuntimeError("the batch was stopped"))
    assert state.error() is None and len(state["a"]) > 0


def test_callers_never_take_the_shared_locks_through_condition_enter(engine, monkeypatch):
    """A Ctrl-C lands between bytecodes. In `threading.Condition.__enter__` (Python) it can
    land after the lock's acquire, before the `with` takes over: the lock stays held, and
    every program after it hangs (a probe saw it in 320 of 645 interrupts). So callers take
    the interpreter's and the engine's locks as `with lock:`, the RLock's own C method.
    Recorded here: each `Condition.__enter__` on the main thread over one of those locks,
    while a program runs, streams, forks, reads and batches, and the engine generates,
    aborts and runs a command."""
    import threading

    entered, main = [], threading.get_ident()
    enter = threading.Condition.__enter__

    def recording_enter(cv):
        if threading.get_ident() == main:  # (not current_thread(): a thread starting enters)
            entered.append(cv._lock)
        return enter(cv)

    @lp.function
    def prog(s):
        s += "Once" + lp.gen("a", max_tokens=3, **GREEDY)
        forks = s.fork(2)
        forks += lp.gen("b", max_tokens=2, **GREEDY)
        forks.join()
        s += s["a"] + lp.gen("c", max_tokens=2, **GREEDY)

    monkeypatch.setattr(threading.Condition, "__enter__", recording_enter)
    state = prog.run(backend=engine)
    streamed = prog.run(stream=True, backend=engine)
    assert "".join(streamed.text_iter()) and streamed["c"] == state["c"]
    prog.run_batch([{}, {}], backend=engine)
    engine.generate("Hi", {"max_new_tokens": 2})
    engine.abort(123456)
    engine.flush_cache()
    monkeypatch.undo()
    shared = {id(engine._cv._lock), id(state._stream.cv._lock)}
    assert not [lock for lock in entered if id(lock) in shared]


def test_a_lone_surrogate_is_refused_where_it_is_written(engine):
    """Half an emoji (`"\\ud83d"`) in appended text, an argument or a choice: a ValueError at
    the line, not the tokenizer's TypeError once the program ran."""

    @lp.function
    def appends(s, question):
        s += lp.user("Q: " + question)
        s += lp.gen("x", max_tokens=2)

    with pytest.raises(ValueError, match="appended text holds a lone surrogate, U\\+D83D"):
        appends.run(question="smile \ud83d", backend=engine)
    with pytest.raises(ValueError, match="select choice holds a lone surrogate"):
        lp.select("x", choices=["a", "b\udc00"])
    assert appends.run(question="smile \U0001f600", backend=engine).error() is None


def test_streaming_a_variable_the_program_never_produced_is_a_key_error(engine):
    """A misspelt name: the stream ended with nothing and no error, where reading the
    variable raises KeyError."""
    import asyncio

    @lp.function
    def prog(s):
        s += "Hi" + lp.gen("answer", max_tokens=3, **GREEDY)

    state = prog.run(stream=True, backend=engine)
    with pytest.raises(KeyError, match="unknown variable 'anwser'"):
        list(state.text_iter("anwser"))
    assert "".join(state.text_iter("answer")) == state["answer"]

    async def read(name):
        return [delta async for delta in state.text_async_iter(name)]

    with pytest.raises(KeyError, match="anwser"):
        asyncio.run(read("anwser"))
    assert "".join(asyncio.run(read("answer"))) == state["answer"]


def test_cancel_stops_a_running_program_and_leaves_an_ended_one(engine):
    """There was no public way to stop a program (a deadline, a notebook's stop button):
    `asyncio.wait_for` on its reader leaves it running. `cancel()` aborts its requests in
    flight and its next read raises ProgramCancelled."""

    @lp.function
    def long(s):
        s += "Tell a long story:" + lp.gen("story", max_tokens=3000, ignore_eos=True)
        s += lp.gen("more", max_tokens=3000, ignore_eos=True)

    engine.reset_stats()
    state = long.run(stream=True, backend=engine)
    chunks = state.text_iter("story")
    next(chunks)  # (the first tokens have come: the request runs)
    state.cancel()
    with pytest.raises(lp.ProgramCancelled):
        list(chunks)
    assert isinstance(state.error(), lp.ProgramCancelled)
    assert engine.stats()["decode_tokens"] < 3000  # (the rest was never computed)
    assert "more" not in state._stream.st.variables

    @lp.function
    def short(s):
        s += "Hi" + lp.gen("x", max_tokens=2)

    done = short.run(backend=engine)
    done.cancel()
    assert done.error() is None and len(done["x"]) > 0


def test_timeout_s_is_a_program_default_and_a_gen_argument(engine):
    """The engine's per-request deadline, which programs could not set: `run()` refused it
    as an argument the program does not take."""

    @lp.function
    def long(s):
        s += "Tell a long story:" + lp.gen("story", max_tokens=3000, ignore_eos=True)

    with pytest.raises(TimeoutError):
        long.run(timeout_s=0.05, backend=engine)
    states = long.run_batch([{}, {}], timeout_s=0.05, backend=engine)
    assert all(isinstance(state.error(), TimeoutError) for state in states)
    with pytest.raises(TypeError, match="timeout_s must be a number"):
        lp.gen("x", timeout_s="1")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": -1}, "max_tokens must be >= 0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        # (once: refused only once sent, in the runtime's names, min_new_tokens)
        ({"min_tokens": 5, "max_tokens": 2}, r"min_tokens \(5\) must be <= max_tokens \(2\)"),
    ],
)
def test_token_counts_are_refused_at_the_gen_in_its_own_names(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lp.gen("x", **kwargs)


def test_a_generator_batch_holds_only_a_window_of_states(engine):
    """Every program was queued at once, and each finished future kept its state until
    the batch ended: a generator over 8,000 rows held 8,000 states (70 MB) however the
    caller dropped them. Now a window of twice the threads is queued."""
    import gc
    import weakref

    @lp.function
    def tiny(s, i):
        s += f"Row {i}:" + lp.gen("x", max_tokens=1)

    alive = weakref.WeakSet()
    most = 0
    batch = tiny.run_batch([{"i": i} for i in range(120)], num_threads=4, generator_style=True,
                           backend=engine)  # fmt: skip
    for n, state in enumerate(batch):
        assert state.error() is None
        alive.add(state)
        del state
        if n % 20 == 19:
            gc.collect()
            most = max(most, len(alive))
    assert n == 119 and most <= 2 * 4 + 4


def test_the_engines_waits_enter_no_condition_on_the_callers_thread(engine, monkeypatch):
    """`threading.Event.wait` enters its condition in Python: a Ctrl-C there left that
    lock held, and the engine loop's `set()` of the event would then hang the loop. The
    caller waits on `DoneFlag`s (the lock's own C calls) instead."""
    import threading

    entered, main = [], threading.get_ident()
    enter = threading.Condition.__enter__

    def recording_enter(cv):
        if threading.get_ident() == main:  # (not current_thread(): a thread starting enters)
            entered.append(cv)
        return enter(cv)

    monkeypatch.setattr(threading.Condition, "__enter__", recording_enter)
    engine.generate(["Hi", "Ho"], {"max_new_tokens": 3})
    engine.flush_cache()
    monkeypatch.undo()
    assert entered == []
