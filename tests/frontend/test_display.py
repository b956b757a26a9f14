"""How states, engines and the radix cache look (issue 16): HTML in Jupyter with the
structure a reader needs, short plain text everywhere else, and no IPython or pandas
imported until a notebook view or a table is asked for.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET

import pytest

import lmprog as lp
from lmprog.display import REPR_CHARS, in_notebook

LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}


@lp.function
def triage(s, message):
    s += lp.system("Sort messages.")
    s += lp.user("Message: " + message)
    s += lp.assistant("Category: " + lp.select("category", choices=["refund", "shipping"]))
    s += lp.user("Reply <briefly> & kindly.")
    s += lp.assistant(lp.gen("reply", max_tokens=6, temperature=0))


def test_state_html_is_a_transcript_by_role(engine):
    state = triage.run(message="Where is my parcel?", backend=engine)
    page = state._repr_html_()
    roles = re.findall(r'class="lmprog-role lmprog-role-(\w+)"', page)
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    # The chat template's markup is not shown; the messages' own text is, escaped.
    assert "<|im_start|>" not in page and "&lt;briefly&gt; &amp; kindly" in page
    # The select span: its value, its name, every choice's score on hover.
    meta = state.get_meta_info("category")
    title = re.search(r'class="lmprog-span lmprog-select"[^>]*title="([^"]*)"', page).group(1)
    for choice, score in zip(meta["choices"], meta["scores"]):
        assert f"{choice!r}: {score:.3f}" in title.replace("&#x27;", "'")
    assert f"> '{state['category']}'" in title.replace("&#x27;", "'").replace("&gt;", ">")
    # The gen span: its text and name, its token count on hover.
    tokens = state.get_meta_info("reply")["completion_tokens"]
    assert f'title="reply: {tokens} tokens"' in page
    assert "<sub>reply</sub>" in page and "<sub>category</sub>" in page


def test_a_failed_program_shows_its_error(engine):
    @lp.function
    def broken(s):
        s += "Hello" + lp.gen("x", max_tokens=2, temperature=0)
        raise RuntimeError("the program's own bug")

    with pytest.raises(RuntimeError):
        broken.run(backend=engine)
    state = broken.run_batch([{}], backend=engine)[0]
    assert 'class="lmprog-error"' in state._repr_html_()
    assert "the program&#x27;s own bug" in state._repr_html_()
    assert "error=RuntimeError" in repr(state)


def test_repr_of_a_running_program_does_not_wait_for_it(engine):
    """repr waited for the program's end (so did `asyncio.run` returning a running state)."""
    release = threading.Event()

    @lp.function
    def slow(s):
        s += "Hello" + lp.gen("x", max_tokens=2, temperature=0)
        release.wait(60)  # a tool call, say
        s += " bye"

    state = slow.run(backend=engine, stream=True)
    try:
        assert state["x"] is not None
        assert repr(state).startswith("ProgramState[running](text='Hello")
    finally:
        release.set()
    state.sync()
    assert repr(state).startswith("ProgramState(text='Hello") and "bye" in repr(state)


def test_repr_is_short_plain_text_however_long_the_state(engine):
    @lp.function
    def long(s):
        s += "word " * 400 + lp.gen("tail", max_tokens=3, temperature=0)

    state = long.run(backend=engine)
    text = repr(state)
    assert len(text) < REPR_CHARS + 100 and "<" not in text.replace("<|", "")
    assert text.startswith("ProgramState(text='word word") and "variables=['tail']" in text
    printed = []

    class Printer:
        def text(self, value):
            printed.append(value)

    state._repr_pretty_(Printer(), False)
    assert printed == [text]
    assert repr(long.trace()) == "TracedProgram(2 nodes, complete)"  # text, gen


def test_import_lmprog_imports_neither_ipython_nor_pandas():
    code = (
        "import sys, lmprog\n"
        "assert 'IPython' not in sys.modules and 'pandas' not in sys.modules, sys.modules.keys()\n"
        "assert not lmprog.display.in_notebook()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert not in_notebook()


def test_states_to_dataframe(engine):
    pd = pytest.importorskip("pandas")

    @lp.function
    def pick(s, message):
        if message == "bad":
            raise ValueError("a bad row")
        s += "Message: " + message + lp.select("category", choices=["refund", "shipping"])
        return len(message)

    rows = [{"message": "Where is my parcel?"}, {"message": "bad"}, {"message": "Refund!"}]
    states = pick.run_batch(rows, backend=engine)
    frame = lp.to_dataframe(states)
    assert isinstance(frame, pd.DataFrame)
    assert list(frame.columns) == ["category", "ret_value", "text", "error"]
    assert frame["category"][0] == states[0]["category"] and frame["ret_value"][0] == 19
    assert frame["error"][1] == "ValueError: a bad row" and pd.isna(frame["error"][0])
    assert frame["text"][2] == states[2].text()
    assert "text" not in lp.to_dataframe(states, text=False).columns

    @lp.function
    def named_like_columns(s):
        s["error"] = "my field"
        s += "Write:" + lp.gen("text", max_tokens=2)

    (record,) = lp.to_dataframe(named_like_columns.run_batch([{}], backend=engine)).to_dict(
        "records"
    )  # (the variables were once dropped for the record's own columns)
    assert record["var_error"] == "my field" and record["error"] is None
    assert record["text"] == "Write:" + record["var_text"]


def test_engine_repr_and_report(engine):
    text = repr(engine)
    assert text.startswith("Engine(model=") and "kv_slots=" in text and "<" not in text
    page = engine._repr_html_()
    memory = engine.memory_state()
    assert f"{memory['kv_slots_total']:,} total" in page and "prefix cache hit rate" in page


def test_radix_tree_view_matches_the_cache(engine):
    engine.flush_cache()
    prompts = ["Shared system prompt. Question one?", "Shared system prompt. Question two?"]
    engine.generate(prompts, {"max_new_tokens": 3, "temperature": 0})
    engine.generate(prompts[0], {"max_new_tokens": 1, "temperature": 0})  # a hit
    view = engine.radix_tree()
    nodes = [node for _, node in view.nodes()]
    assert sum(n.num_tokens for n in nodes) == engine.memory_state()["kv_slots_cached"]
    assert view.omitted == 0 and len(view.root.children) == 1  # the shared prefix, once
    assert view.root.children[0].hit_count >= 1
    assert all(n.state == "evictable" for n in nodes)  # nothing runs now
    svg = ET.fromstring(view._repr_svg_())
    rects = [e for e in svg.iter() if e.tag.endswith("rect")]
    assert len(rects) == len(nodes)
    assert "tokens" in str(view) and "Shared system prompt" in str(view)
    small = engine.radix_tree(max_nodes=1)
    assert len(small.nodes()) == 1 and small.omitted == len(nodes) - 1
    with pytest.raises(ValueError, match="max_nodes"):
        engine.radix_tree(max_nodes=0)


def test_radix_tree_drawing_escapes_control_characters(engine):
    """A cached prompt with a bell, a form feed or an escape: the SVG held them raw, which
    XML forbids (the drawing did not display); the text view shows them escaped."""
    engine.flush_cache()
    engine.generate("Ding\x07 page\x0c colour\x1b[31m end", {"max_new_tokens": 1})
    view = engine.radix_tree()
    ET.fromstring(view._repr_svg_())  # well-formed
    assert "\\x07" in str(view) and "\x07" not in str(view)


def test_radix_tree_shows_what_running_requests_lock(engine):
    started = threading.Event()
    future = engine.submit("A long one", LONG, on_chunk=lambda i, c: started.set())[0]
    assert started.wait(60)
    try:
        states = {node.state for _, node in engine.radix_tree().nodes()}
        assert "locked" in states
    finally:
        engine.abort(future.request_id)
        future.exception(timeout=60)


def test_live_view_updates_one_display_until_the_end(engine, monkeypatch):
    """`run(stream=True, live=True)`: one display, updated in place; the last update is
    the finished transcript."""
    display_module = pytest.importorskip("IPython.display")
    monkeypatch.setattr("lmprog.display.in_notebook", lambda: True)  # (a kernel, faked)
    shown = []
    updated = threading.Condition()

    class Handle:
        def update(self, obj):
            with updated:
                shown.append(obj.data)
                updated.notify_all()

    def fake_display(obj, display_id=False):
        assert display_id is True
        shown.append(obj.data)
        return Handle()

    monkeypatch.setattr(display_module, "display", fake_display)
    state = triage.run(message="Where?", backend=engine, stream=True, live=True)
    state.sync()
    final = state._repr_html_()
    with updated:  # the view's last update follows the end of the program
        assert updated.wait_for(lambda: shown[-1] == final, timeout=60)
    assert len(shown) >= 2
    assert triage.run(message="Where?", backend=engine, stream=True).text()  # no live view


@pytest.mark.parametrize("read", ["variable", "sync"])
def test_the_callers_read_waits_for_the_live_views_draw(engine, monkeypatch, read):
    """A notebook run headless (nbconvert) ended before the view's last draw, and kept an
    older one (CI: the quickstart's page had no gen). The caller's read of a variable, or
    its `sync`, now returns once the view shows what had been emitted."""
    import time

    display_module = pytest.importorskip("IPython.display")
    monkeypatch.setattr("lmprog.display.in_notebook", lambda: True)  # (a kernel, faked)
    shown = []

    class SlowHandle:  # (a loaded kernel: each draw takes a while)
        def update(self, obj):
            time.sleep(0.3)
            shown.append(obj.data)

    def fake_display(obj, display_id=False):
        shown.append(obj.data)
        return SlowHandle()

    @lp.function
    def story(s):
        s += "Once upon a time" + lp.gen("tale", max_tokens=8, temperature=0)

    monkeypatch.setattr(display_module, "display", fake_display)
    state = story.run(backend=engine, stream=True, live=True)
    if read == "variable":
        tale = state["tale"]
    else:
        state.sync()
        tale = state._stream.st.variables["tale"]
    assert tale and html.escape(tale) in shown[-1]
