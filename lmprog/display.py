"""How program states look: a chat transcript in Jupyter (a fork's branches below it),
short text everywhere else, a live view of a streaming run, and a table of many states.

Jupyter asks for `_repr_html_`; a terminal only ever sees `repr()` / `str()`, so no HTML
reaches it. IPython and pandas are imported only when a notebook view or a DataFrame is
asked for (`pip install lmprog[notebook]`); `import lmprog` needs neither.
"""

from __future__ import annotations

import html
import sys
import threading
import warnings
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from lmprog.ops import Span

if TYPE_CHECKING:
    from lmprog.ops import ExecState
    from lmprog.state import ProgramState
    from lmprog.stream import Stream

ROLE_COLORS = {"system": "#9a9a9a", "user": "#3a7bd5", "assistant": "#2e9e5b"}
SPAN_COLORS = {"gen": "#d9f2df", "select": "#dde8fb"}
CSS = (
    "<style>.lmprog-state{font-family:ui-monospace,Menlo,monospace;font-size:12.5px;"
    "line-height:1.45;max-width:60em}"
    ".lmprog-role{border-left:3px solid;margin:6px 0;padding:2px 8px;white-space:pre-wrap}"
    ".lmprog-role-name{font-size:11px;font-weight:600;text-transform:uppercase;"
    "letter-spacing:.04em;opacity:.75;display:block;white-space:normal}"
    ".lmprog-text{white-space:pre-wrap;margin:4px 0}"
    ".lmprog-span{border-radius:3px;padding:0 2px}"
    ".lmprog-span sub{font-size:9px;opacity:.6;margin-left:2px}"
    ".lmprog-branch{border-left:3px dashed #c9a227;margin:6px 0 6px 14px;padding:2px 8px}"
    ".lmprog-error{color:#b00020;margin-top:6px}</style>"
)
# A repr longer than this shows its start and end only.
REPR_CHARS = 120
# The live view draws a streaming transcript at most once per this many seconds: each draw
# sends the whole transcript, and one per token cost more than the generation itself.
LIVE_INTERVAL_S = 0.1
LIVE_FLUSH_S = 5.0  # how long `run`'s caller waits, at most, for the live view to draw


def state_html(
    st: ExecState,
    error: BaseException | None = None,
    branches: Iterable[tuple[str, ExecState, int]] = (),
) -> str:
    """The state as a transcript: one block per chat role, generated and selected spans
    highlighted with their variable names (a select's choices and scores on hover). Below
    it, each of `branches` (a label, a fork branch's state, and how many of its spans it
    inherited at the fork): its own text, what it added to the forked state."""
    out = [CSS, '<div class="lmprog-state">']
    _transcript(out, st.spans, st.meta)
    for label, branch, first in branches:
        out.append(
            f'<div class="lmprog-branch"><span class="lmprog-role-name">{html.escape(label)}</span>'
        )
        roles = [span.name for span in branch.spans[:first] if span.kind == "role"]
        open_role = roles[-1] if len(roles) % 2 else None  # (a role's begin and end alike)
        _transcript(out, branch.spans[first:], branch.meta, open_role)
        out.append("</div>")
    if error is not None:
        message = html.escape(f"{type(error).__name__}: {error}")
        out.append(f'<div class="lmprog-error">{message}</div>')
    out.append("</div>")
    return "".join(out)


def stream_html(stream: Stream, error: BaseException | None = None) -> str:
    """`state_html` of a program's state with its fork branches that have started (a
    branch's own branches right after it), as they stand now."""
    branches: list[tuple[str, ExecState, int]] = []

    def add(parent: Stream, prefix: str) -> None:
        for fork_id, forked in parent.branches.items():
            for i, branch in enumerate(forked):
                if branch.is_started:
                    label = f"{prefix}fork {fork_id}, branch {i}"
                    branches.append((label, branch.st.copy(), branch.fork_spans))
                    add(branch, f"{label} / ")

    with stream.lock:
        st = stream.st.copy()
        add(stream, "")
    return state_html(st, error, branches)


def _transcript(
    out: list[str], spans: list[Span], meta: dict, open_role: str | None = None
) -> None:
    """Append `spans` to `out` as HTML; they begin inside role `open_role` if not None."""
    plain: list[str] = []  # text outside any role

    def flush_plain() -> None:
        if plain:
            out.append(f'<div class="lmprog-text">{"".join(plain)}</div>')
            plain.clear()

    def begin(role: str) -> None:
        color = ROLE_COLORS.get(role, "#888")
        out.append(
            f'<div class="lmprog-role lmprog-role-{html.escape(role)}" '
            f'style="border-color:{color}"><span class="lmprog-role-name" '
            f'style="color:{color}">{html.escape(role)}</span>'
        )

    target = plain
    if open_role is not None:
        begin(open_role)
        target = out
    for span in _merged(spans):
        if span.kind == "role":
            if target is plain:  # a role begins
                flush_plain()
                begin(span.name or "")
                target = out
            else:  # it ends
                out.append("</div>")
                target = plain
        elif span.kind in SPAN_COLORS:
            own = span.meta if span.meta is not None else meta.get(span.name)
            target.append(_span_html(span.kind, span.text, span.name, own))
        else:
            target.append(html.escape(span.text))
    if target is out:
        out.append("</div>")
    flush_plain()


def _merged(spans: list[Span]) -> list[Span]:
    """Consecutive pieces of one gen (streamed chunk by chunk) as one span."""
    out: list[Span] = []
    for span in spans:
        last = out[-1] if out else None
        if (
            last is not None
            and span.kind != "role"
            and (last.kind, last.name) == (span.kind, span.name)
        ):
            out[-1] = Span(span.kind, last.text + span.text, span.name, span.meta or last.meta)
        else:
            out.append(span)
    return out


def _span_html(kind: str, text: str, name: str | None, meta: dict[str, Any] | None) -> str:
    title = name or ""
    if kind == "select" and meta is not None and "scores" in meta:
        scores = ", ".join(
            f"{'> ' if c == meta['choice'] else ''}{c!r}: {s:.3f}"
            for c, s in zip(meta["choices"], meta["scores"])
        )
        title = f"{name} ({meta['method']}) {scores}"
    elif meta is not None and "completion_tokens" in meta:
        title = f"{name}: {meta['completion_tokens']} tokens"
    return (
        f'<span class="lmprog-span lmprog-{kind}" style="background:{SPAN_COLORS[kind]}" '
        f'title="{html.escape(title, quote=True)}">{html.escape(text)}'
        f"<sub>{html.escape(name or '')}</sub></span>"
    )


def short_repr(kind: str, text: str, variables: dict[str, Any], error: Any) -> str:
    """`Kind(text='...', variables=[...])`, the text shortened to its start and end."""
    if len(text) > REPR_CHARS:
        half = REPR_CHARS // 2
        text = text[:half] + " ... " + text[-half:]
    status = f", error={type(error).__name__}" if error is not None else ""
    return f"{kind}(text={text!r}, variables={sorted(variables)}{status})"


def in_notebook() -> bool:
    """True inside a Jupyter kernel (not a terminal IPython, not plain Python)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def show_live(state: ProgramState) -> threading.Thread | None:
    """Show a streaming state in the current output cell and update it in place as text
    arrives (one display handle), until its program ends. Returns the updating thread.

    Each update sends the whole transcript, so while text arrives the view is drawn at most
    once every `LIVE_INTERVAL_S`; the finished transcript (with the program's error, if
    any) is always drawn last. Outside a Jupyter kernel there is no cell to update
    (`display` only prints the object's name, and returns no handle): a warning, no view.
    """
    if not in_notebook():
        warnings.warn(
            "live=True shows a view only in a Jupyter notebook; the program runs without one",
            stacklevel=3,  # the caller of `run`
        )
        return None
    from IPython.display import HTML, display

    stream = state._stream
    handle = display(HTML(stream_html(stream)), display_id=True)
    with stream.lock:
        stream.live_drawn = 0

    def follow() -> None:
        drawn, is_done = 0, False
        try:
            while not is_done:
                with stream.lock:  # new text (its own or a fork branch's), or the end
                    stream.cv.wait_for(lambda seen=drawn: stream.emitted > seen or stream.is_done)
                    drawn, is_done = stream.emitted, stream.is_done
                    stream.live_flush = False
                handle.update(HTML(stream_html(stream, stream.failure() if is_done else None)))
                with stream.lock:
                    stream.live_drawn = drawn
                    stream.cv.notify_all()  # (a reader waiting for this draw)
                    if not is_done:  # let text gather; wake at the end, or for a reader
                        stream.cv.wait_for(
                            lambda: stream.is_done or stream.live_flush, LIVE_INTERVAL_S
                        )
        finally:
            with stream.lock:
                stream.live_drawn = None
                stream.cv.notify_all()

    thread = threading.Thread(target=follow, name="lmprog-live-view", daemon=True)
    thread.start()
    return thread


def to_dataframe(states: Iterable[ProgramState], text: bool = True) -> Any:
    """One row per state: its variables (one column each), `ret_value`, `text` (optional)
    and `error` (None, or the exception's message)."""
    import pandas as pd

    return pd.DataFrame([state_record(state, text) for state in states])


def state_record(state: ProgramState, text: bool = True) -> dict[str, Any]:
    """A finished state as a flat dict (see `to_dataframe`)."""
    error = state.error()
    reserved = {"ret_value", "error", *(["text"] if text else [])}
    record: dict[str, Any] = {}
    for name, value in state._stream.st.variables.items():
        record[free_name(name, reserved | record.keys())] = value
    record["ret_value"] = state.ret_value
    if text:
        record["text"] = state._stream.st.text
    record["error"] = None if error is None else describe_error(error)
    return record


def free_name(name: str, taken: Collection[str]) -> str:
    """`name`, or `var_name` (`var_var_name`, ...) where that is taken: a program variable
    never overwrites a column of the input or one the record writes itself.

    Example:
        >>> free_name("text", {"text", "var_text"})
        'var_var_text'
    """
    while name in taken:
        name = f"var_{name}"
    return name


def describe_error(error: BaseException) -> str:
    """An error as a table cell: the exception's type and message."""
    message = error.args[0] if isinstance(error, KeyError) and error.args else error
    return f"{type(error).__name__}: {message}"
