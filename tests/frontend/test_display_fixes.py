"""The notebook live view of a streaming run: drawn a bounded number of times however many
tokens stream (each draw sends the whole transcript), the finished transcript or the error
always drawn last, and outside a notebook a warning instead of a crashing thread.

The notebook is faked: `in_notebook()` says yes and IPython's `display` returns a handle
that records what it is sent, so no kernel is needed.
"""

from __future__ import annotations

import re
import threading

import pytest

import lmprog as lp
import lmprog.display as lp_display

NUM_TOKENS = 500


@lp.function
def long_reply(s, question):
    s += lp.user(question)
    s += lp.assistant(lp.gen("answer", max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0))


@lp.function
def failing(s):
    s += lp.user("hi") + lp.assistant(lp.gen("a", max_tokens=5, temperature=0))
    s["a"]  # waits for the gen, so the error comes after some text streamed
    raise ValueError("<boom & co>")


class FakeNotebook:
    """IPython's `display` as a kernel answers it: a handle whose updates are recorded."""

    def __init__(self) -> None:
        self.shown: list[str] = []  # the first display, then every update
        self.changed = threading.Condition()

    def display(self, obj, display_id=False):
        assert display_id is True
        self.shown.append(obj.data)
        return self

    def update(self, obj) -> None:
        with self.changed:
            self.shown.append(obj.data)
            self.changed.notify_all()

    def wait_for_last(self, html: str) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.shown[-1] == html, timeout=60)


@pytest.fixture
def notebook(monkeypatch):
    display_module = pytest.importorskip("IPython.display")
    fake = FakeNotebook()
    monkeypatch.setattr(display_module, "display", fake.display)
    monkeypatch.setattr(lp_display, "in_notebook", lambda: True)
    return fake


def test_a_long_stream_is_drawn_a_bounded_number_of_times(engine, notebook, monkeypatch):
    """With an interval longer than the run, a 500-token stream is drawn at most twice
    after its first display (the first text, then the end), not once per token; the last
    draw is the finished transcript."""
    monkeypatch.setattr(lp_display, "LIVE_INTERVAL_S", 3600.0)
    state = long_reply.run(question="Tell me.", backend=engine, stream=True, live=True)
    state.sync()
    assert state.get_meta_info("answer")["completion_tokens"] == NUM_TOKENS
    notebook.wait_for_last(state._repr_html_())  # returns early: the end wakes the view
    assert 2 <= len(notebook.shown) <= 3, len(notebook.shown)


def test_the_view_follows_the_stream_between_draws(engine, notebook, monkeypatch):
    """With no interval the view is drawn as text arrives (more than the end alone), and
    every draw holds the text of the draw before: a throttled view loses nothing."""
    monkeypatch.setattr(lp_display, "LIVE_INTERVAL_S", 0.0)
    state = long_reply.run(question="Tell me.", backend=engine, stream=True, live=True)
    state.sync()
    notebook.wait_for_last(state._repr_html_())
    assert len(notebook.shown) > 3
    answers = [
        "".join(re.findall(r'lmprog-gen"[^>]*>(.*?)<sub>', page, re.S)) for page in notebook.shown
    ]
    assert all(later.startswith(earlier) for earlier, later in zip(answers, answers[1:]))


def test_an_error_is_drawn_last_at_once(engine, notebook, monkeypatch):
    """The pause between draws ends when the program does: its error is shown without
    waiting out the interval."""
    monkeypatch.setattr(lp_display, "LIVE_INTERVAL_S", 3600.0)
    state = failing.run(backend=engine, stream=True, live=True)
    state.sync()
    assert isinstance(state.error(), ValueError)
    notebook.wait_for_last(state._repr_html_())
    assert "lmprog-error" in notebook.shown[-1] and "&lt;boom &amp; co&gt;" in notebook.shown[-1]


def test_live_outside_a_notebook_warns_and_runs_without_a_view(engine, monkeypatch, capsys):
    """Plain Python has no cell to update: `display` printed the object's name and
    returned None, and the view's thread died on `None.update`."""
    crashes = []
    monkeypatch.setattr(threading, "excepthook", crashes.append)
    threads_before = set(threading.enumerate())
    with pytest.warns(UserWarning, match="notebook"):
        state = long_reply.run(question="Hi", backend=engine, stream=True, live=True)
    state.sync()
    started = {t.name for t in set(threading.enumerate()) - threads_before}
    assert "lmprog-live-view" not in started
    assert crashes == []
    assert "HTML object" not in capsys.readouterr().out
    assert state["answer"]


@lp.function
def reused_names(s):
    s += "One:" + lp.gen("a", max_tokens=3, ignore_eos=True, temperature=0)
    s += " Two:" + lp.gen("a", max_tokens=9, ignore_eos=True, temperature=0)
    s += " Pick:" + lp.select("c", choices=[" red", " blue"])
    s += " Again:" + lp.select("c", choices=[" cat", " dog"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_reused_name_shows_each_spans_own_meta(engine, stream):
    """Each span looked its meta up by name, which holds the last one: both `a` spans read
    "a: 9 tokens", and the first select's hover listed the second's choices."""
    state = reused_names.run(backend=engine, stream=stream)
    state.sync()
    page = state._repr_html_().replace("&#x27;", "'").replace("&gt;", ">")
    gens = re.findall(r'lmprog-gen"[^>]*title="([^"]*)"', page)
    assert gens == ["a: 3 tokens", "a: 9 tokens"]
    selects = re.findall(r'lmprog-select"[^>]*title="([^"]*)"', page)
    assert len(selects) == 2
    assert "' red'" in selects[0] and "' cat'" not in selects[0]
    assert "' cat'" in selects[1] and "' red'" not in selects[1]


def test_a_streamed_gen_keeps_one_meta_not_one_per_chunk(engine):
    """Each chunk's span kept that chunk's meta, whose logprob lists held every token so
    far: n^2 entries for n tokens (914,394 for 1,000). The transcript shows only the last."""

    @lp.function
    def logged(s):
        s += "Hi" + lp.gen("a", max_tokens=60, ignore_eos=True, temperature=0)

    state = logged.run(backend=engine, stream=True, return_logprob=True, top_logprobs_num=2)
    state.sync()
    spans = [span for span in state._stream.st.spans if span.name == "a"]
    assert len(spans) > 10
    assert [span.meta is not None for span in spans] == [False] * (len(spans) - 1) + [True]
    assert len(spans[-1].meta["output_token_logprobs"]) == 60
    assert 'title="a: 60 tokens"' in state._repr_html_()
    # The stream's events likewise keep the latest meta of a gen alone; a reader behind
    # gets it for the earlier deltas.
    metas = [meta for name, _, meta in state._stream.events if name == "a"]
    assert sum(isinstance(meta, dict) for meta in metas) == 1 and len(metas) >= len(spans)
    deltas, _, _ = state._stream.next_deltas(0, "a")
    assert "".join(d for d, _ in deltas) == state["a"]
    assert all(len(m["output_token_logprobs"]) == 60 for _, m in deltas)


def test_a_branch_streaming_a_name_of_its_parent_leaves_the_parents_span(engine):
    """A branch shares its parent's span objects: the branch's first chunk cleared the
    parent's span meta, and its tooltip went (the state's meta of the name then was the
    branches' list)."""

    @lp.function
    def shared_name(s):
        s += "Q:" + lp.gen("x", max_tokens=4, ignore_eos=True, temperature=0)
        forks = s.fork(2)
        forks += lp.gen("x", max_tokens=6, ignore_eos=True, temperature=0)
        forks.join()

    state = shared_name.run(backend=engine, stream=True)
    state.sync()
    spans = [span for span in state._stream.st.spans if span.name == "x"]  # (its chunks)
    assert spans[-1].meta is not None and spans[-1].meta["completion_tokens"] == 4


def test_a_reader_behind_gets_each_deltas_own_gens_meta(engine):
    """An earlier chunk's meta is its gen's next chunk's, resolved in the events read: it
    was the name's latest meta, another gen's where a loop reused the name (and a list
    after a join gathered it)."""

    @lp.function
    def loop(s):
        for i in range(3):
            s += f"\\nstep{i}:" + lp.gen("step", max_tokens=5, ignore_eos=True, temperature=0)

    state = loop.run(backend=engine, stream=True, return_logprob=True)
    state.sync()
    deltas, _, _ = state._stream.next_deltas(0, "step")
    ids = [meta["id"] for _, meta in deltas]
    runs = [ids[0]] + [b for a, b in zip(ids, ids[1:]) if a != b]
    assert len(runs) == 3 == len(set(runs))  # (each gen's deltas carry its own request)
    texts = {i: "".join(d for d, m in deltas if m["id"] == i) for i in runs}
    assert [texts[i] for i in runs] == [
        state.text().split(f"step{k}:")[1].split("\\n")[0] for k in range(3)
    ]


def test_a_gen_named_like_a_role_streams_its_own_text(engine):
    """A role's markup was emitted under the role's name: `text_iter("assistant")` gave
    every assistant turn's template text along with a gen named "assistant"."""

    @lp.function
    def chat(s):
        s += lp.user("hi") + lp.assistant(lp.gen("assistant", max_tokens=4, temperature=0))

    state = chat.run(backend=engine, stream=True)
    assert "".join(state.text_iter("assistant")) == state["assistant"]
