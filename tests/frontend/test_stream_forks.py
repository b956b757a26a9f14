"""A streaming program's fork: sent as one group even while someone watches it, and shown
branch by branch in the notebook views.

The body fills a fork's branches one `+=` at a time; the fork waits (its hold) until every
branch has a node, so the branches go to the runtime together and decode as one batch. A
reader of the body's own state releases that hold, since it may need the fork to run; a
reader watching from outside (`run`'s caller reading `text_iter()` or a variable, the
notebook's live view) waited the same way and released it too, so branch 0 ran alone
while the body was still filling branch 1.

The views drew only the forked state's own text: a branch's gens never showed, while
they ran nor after (a join gathering variables adds no text).
"""

from __future__ import annotations

import html
import re
import threading
import time

import pytest

import lmprog as lp
import lmprog.display as lp_display

BRANCHES = 3
FILL_PAUSE_S = 0.15  # the body's Python work between two branches


@lp.function
def slow_fill(s, started):
    s += "Ideas for a trip:\n" + lp.gen("intro", max_tokens=3, temperature=0)
    forks = s.fork(BRANCHES)
    started.set()
    for i, f in enumerate(forks):
        time.sleep(FILL_PAUSE_S)  # a watcher is waiting meanwhile
        f += f" {i}." + lp.gen("idea", max_tokens=6, temperature=0, ignore_eos=True)
    forks.join()
    s += " Done."


def decode_sizes(engine, run):
    """The batch size of each decode pass while `run()` runs."""
    sizes: list[int] = []
    forward = engine.runner.forward

    def traced(batch):
        if batch.mode.name == "DECODE":
            sizes.append(len(batch.reqs))
        return forward(batch)

    engine.runner.forward = traced
    try:
        run()
    finally:
        del engine.runner.forward
    return sizes


def check_one_group(engine, state, sizes):
    assert state.error() is None
    assert len(state["idea"]) == BRANCHES
    plain = slow_fill.run(threading.Event(), backend=engine)
    assert state["idea"] == plain["idea"] and state.text() == plain.text()
    # The intro decodes alone; every decode after it holds all the branches.
    branch_sizes = sizes[2:]
    assert branch_sizes and set(branch_sizes) == {BRANCHES}, sizes


def test_a_caller_reading_text_iter_leaves_the_fork_to_the_body(engine):
    state = None

    def run():
        nonlocal state
        state = slow_fill.run(threading.Event(), stream=True, backend=engine)
        assert "".join(state.text_iter()) == state.text()

    sizes = decode_sizes(engine, run)
    check_one_group(engine, state, sizes)


def test_a_caller_reading_a_branch_variable_leaves_the_fork_to_the_body(engine):
    state = None

    def run():
        nonlocal state
        started = threading.Event()
        state = slow_fill.run(started, stream=True, backend=engine)
        started.wait(60)
        assert len(state["idea"]) == BRANCHES  # waits while the body fills the branches

    sizes = decode_sizes(engine, run)
    check_one_group(engine, state, sizes)


def test_the_live_view_leaves_the_fork_to_the_body(engine, monkeypatch):
    display_module = pytest.importorskip("IPython.display")

    class Handle:
        def update(self, obj) -> None:
            pass

    monkeypatch.setattr(display_module, "display", lambda obj, display_id=False: Handle())
    monkeypatch.setattr(lp_display, "in_notebook", lambda: True)
    monkeypatch.setattr(lp_display, "LIVE_INTERVAL_S", 0.0)  # it waits on new text at once
    state = None

    def run():
        nonlocal state
        state = slow_fill.run(threading.Event(), stream=True, backend=engine, live=True)
        state.sync()

    sizes = decode_sizes(engine, run)
    check_one_group(engine, state, sizes)


def test_the_body_reading_a_branch_before_filling_the_others_still_runs(engine):
    """The body's own read releases the hold: its branch runs alone, the program ends."""

    @lp.function
    def reads_early(s):
        s += "Count:"
        forks = s.fork(2)
        forks[0] += lp.gen("n", max_tokens=3, temperature=0)
        first = forks[0]["n"]  # branch 1 is still empty: the fork must run without it
        forks[1] += first + lp.gen("n", max_tokens=3, temperature=0)
        forks.join()

    state = reads_early.run(stream=True, backend=engine)
    assert "".join(state.text_iter()) == state.text()
    assert state.error() is None and len(state["n"]) == 2


def branch_blocks(page: str) -> dict[str, str]:
    """Each branch block of a transcript page: its label -> its HTML."""
    parts = page.split('<div class="lmprog-branch"><span class="lmprog-role-name">')[1:]
    return dict(part.split("</span>", 1) for part in parts)


def test_the_transcript_shows_each_branch_below_the_forked_state(engine):
    @lp.function
    def nested(s):
        s += lp.user("Plan a trip.")
        s += lp.assistant_begin()  # the fork happens inside the assistant's turn
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Option {i} <a&b>:" + lp.gen("idea", max_tokens=4, temperature=0)
        inner = forks[1].fork(2)
        for f in inner:
            f += lp.gen("detail", max_tokens=3, temperature=0)
        inner.join()
        forks.join()
        s += lp.assistant_end()

    state = nested.run(backend=engine)
    page = state._repr_html_()
    blocks = branch_blocks(page)
    labels = ["fork 0, branch 0", "fork 0, branch 1"]
    labels += ["fork 0, branch 1 / fork 0, branch 0", "fork 0, branch 1 / fork 0, branch 1"]
    assert list(blocks) == labels
    for i in range(2):
        block = blocks[labels[i]]
        assert f"Option {i} &lt;a&amp;b&gt;:" in block and "Plan a trip" not in block
        # It goes on inside the assistant's turn, and its gen is highlighted and named.
        assert block.startswith('<div class="lmprog-role lmprog-role-assistant"')
        assert html.escape(state["idea"][i]) in block and "<sub>idea</sub>" in block
    for block in list(blocks.values())[2:]:
        assert "<sub>detail</sub>" in block and "Option" not in block
    assert page.count("<div") == page.count("</div>")  # every block is closed


def test_the_live_view_draws_the_branches_while_they_run(engine, monkeypatch):
    display_module = pytest.importorskip("IPython.display")
    drawn: list[str] = []

    class Handle:
        def update(self, obj) -> None:
            drawn.append(obj.data)

    def display(obj, display_id=False):
        drawn.append(obj.data)
        return Handle()

    monkeypatch.setattr(display_module, "display", display)
    monkeypatch.setattr(lp_display, "in_notebook", lambda: True)
    monkeypatch.setattr(lp_display, "LIVE_INTERVAL_S", 0.0)
    forward = engine.runner.forward

    def slow_forward(batch):  # (the view draws between two tokens, however loaded the CPU)
        time.sleep(0.05)
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", slow_forward)
    state = slow_fill.run(threading.Event(), stream=True, backend=engine, live=True)
    state.sync()
    for thread in threading.enumerate():
        if thread.name == "lmprog-live-view":
            thread.join(60)  # (the view's last draw comes from its own thread)
    ideas = state["idea"]
    # The last draw shows every branch's whole gen; an earlier one a branch's gen partly
    # written (it streamed), while the state itself had no text of it.
    final = branch_blocks(drawn[-1])
    assert [
        html.unescape(re.sub("<[^>]+>", "", final[f"fork 0, branch {i}"])) for i in range(3)
    ] == [f" {i}.{idea}idea" for i, idea in enumerate(ideas)]
    partial = [
        page
        for page in drawn
        for block in branch_blocks(page).values()
        if "<sub>idea</sub>" in block and not any(html.escape(i) in block for i in ideas)
    ]
    assert partial and all(" Done." not in page for page in partial)
