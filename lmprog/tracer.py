"""Run a program symbolically and record its IR as a dataflow graph (networkx).

The tracer hands the program a `TracerState` instead of a real state. Appending records IR
nodes in text order; `s[name]` returns a `VarRef` (a data dependency on the node that
produces `name`); arguments not given to `trace(...)` are symbolic `Argument`s. When the
Python code needs a concrete generated value (an `if` on it, `int()`, an f-string), the
trace stops there and records why: it never guesses.

Edges carry `kind`: "text" (text order), "data" (a value flows from its producer), or
"text+data". Static checks run while tracing, before any request is sent: reading a variable nothing
produces, conflicting variable names in one scope, and invalid regexes or JSON schemas.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import networkx as nx

from lmprog.ir import (
    Argument,
    AutoNames,
    ConcreteValueNeeded,
    Expr,
    Fork,
    ForkItem,
    Gen,
    Join,
    Select,
    VarRef,
    VarScopeEnd,
    as_expr,
    flatten,
)
from lmprog.state_blocks import BranchGroup, JoinMode, StateBlocks, check_join_mode
from lmprog.static_checks import check_static

Path = tuple[tuple[int, int], ...]  # (fork id, branch index) from the root to a stream


class TraceStop(Exception):
    """Raised inside the traced program when it needs a concrete value."""


class _Stream:
    """One sequence of nodes in text order: the root state or a fork branch."""

    def __init__(self, path: Path, last: int | None, producers: dict[str, int]) -> None:
        self.path = path
        self.last = last
        self.producers = dict(producers)  # variable -> node that produces it
        self.local: set[str] = set()  # variables produced in this stream (gathered by join)
        self.auto_names = AutoNames()


class Tracer:
    def __init__(self) -> None:
        self.graph = nx.DiGraph()
        self.stopped: str | None = None
        self._next_id = 0
        self._next_fork = 0

    def add(self, stream: _Stream, node: Expr, after: list[int] | None = None) -> int:
        check_static(node)
        nid = self._next_id
        self._next_id += 1
        self.graph.add_node(nid, node=node, path=stream.path)
        for prev in (
            after if after is not None else ([stream.last] if stream.last is not None else [])
        ):
            self.graph.add_edge(prev, nid, kind="text")
        stream.last = nid
        if isinstance(node, VarRef):
            if node.name not in stream.producers:
                raise ValueError(
                    f"the program reads variable {node.name!r}, which no earlier node produces"
                )
            self.add_data_edge(stream.producers[node.name], nid)
        name = _produced_name(node)
        if name is not None:  # (a name produced again is the new value, as in SGLang)
            stream.local.add(name)
            stream.producers[name] = nid
        return nid

    def add_data_edge(self, producer: int, consumer: int) -> None:
        """Edge kinds: "text", "data", or "text+data" when a value flows along text order."""
        if self.graph.has_edge(producer, consumer):
            self.graph.edges[producer, consumer]["kind"] = "text+data"
        else:
            self.graph.add_edge(producer, consumer, kind="data")


class TracerState(StateBlocks):
    """What a traced program receives as `s`."""

    def __init__(self, tracer: Tracer, stream: _Stream) -> None:
        self._tracer = tracer
        self._stream = stream
        self.ret_value: Any = None

    def __iadd__(self, expr: Expr | str) -> TracerState:
        for leaf in flatten(as_expr(expr)):
            if isinstance(leaf, (Gen, Select)) and leaf.name is None:
                from dataclasses import replace

                leaf = replace(leaf, name=self._stream.auto_names.take())
            self._tracer.add(self._stream, leaf)
        return self

    def __getitem__(self, name: str) -> VarRef:
        if name not in self._stream.producers:
            raise ValueError(f"the program reads variable {name!r}, which no earlier node produces")
        return VarRef(name)

    def _stop(self, why: str) -> None:
        raise TraceStop(why)

    def __contains__(self, name: str) -> bool:
        self._stop("`in` on the state")

    def __setitem__(self, name: str, value: Any) -> None:
        self._stop(f"assignment s[{name!r}] = ...")

    def text(self) -> str:
        self._stop("s.text()")

    def messages(self) -> list:
        self._stop("s.messages()")

    def get_meta_info(self, name: str) -> dict:
        self._stop(f"s.get_meta_info({name!r})")

    def sync(self) -> None:
        pass

    def error(self) -> None:
        return None

    def _append_node(self, node: Expr) -> None:
        self._tracer.add(self._stream, node)

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> TracerGroup:
        num_branches = size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be a positive int, got {size!r}")
        tracer = self._tracer
        fork_id = tracer._next_fork
        tracer._next_fork += 1
        fork_node = tracer.add(self._stream, Fork(fork_id, num_branches))
        branches = []
        names = self._stream.auto_names.fork(num_branches)
        for i in range(num_branches):
            stream = _Stream(self._stream.path + ((fork_id, i),), fork_node, self._stream.producers)
            stream.auto_names = names[i]  # (as `ProgramState.fork` names them)
            tracer.add(stream, ForkItem(fork_id, i))
            branches.append(TracerState(tracer, stream))
        return TracerGroup(self, branches, fork_id)


class TracerGroup(BranchGroup["TracerState"]):
    def __init__(self, parent: TracerState, branches: list[TracerState], fork_id: int) -> None:
        super().__init__(branches)
        self._parent = parent
        self._fork_id = fork_id

    def join(self, mode: JoinMode = "gather_variable") -> None:
        check_join_mode(mode)
        parent = self._parent._stream
        tracer = self._parent._tracer
        lasts = [b._stream.last for b in self._branches]
        join_node = tracer.add(parent, Join(self._fork_id, mode), after=lasts)
        if mode == "gather_variable":
            for branch in self._branches:
                for name in branch._stream.local:
                    parent.producers[name] = join_node
                    tracer.add_data_edge(branch._stream.producers[name], join_node)


def trace(func: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[Tracer, Any]:
    """Trace `func(s, *args, **kwargs)`; parameters not given become symbolic Arguments."""
    params = list(inspect.signature(func).parameters.values())[1:]
    bound = dict(kwargs)
    for i, p in enumerate(params):
        if i < len(args):
            continue
        if p.name not in bound and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            bound[p.name] = (
                p.default if p.default is not inspect.Parameter.empty else Argument(p.name)
            )
    tracer = Tracer()
    state = TracerState(tracer, _Stream((), None, {}))
    ret = None
    try:
        ret = func(state, *args, **bound)
    except TraceStop as stop:
        tracer.stopped = str(stop)
    except ConcreteValueNeeded as need:
        tracer.stopped = f"{need.operation} of {need.expr!r}"
    except (TypeError, AttributeError) as error:
        # A placeholder handed where Python wants a value (`json.loads(s["x"])`): the
        # error names its class. Any other error is the program's own.
        if not _names_a_placeholder(str(error)):
            raise
        tracer.stopped = f"{type(error).__name__}: {error}"
    return tracer, ret


def _names_a_placeholder(message: str) -> bool:
    """Whether an error's message names a node class as Python names a value's type
    (`'VarRef' object has no attribute 'strip'`, `... not VarRef`)."""
    names, pending = set(), [Expr]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        pending.extend(cls.__subclasses__())
    return any(re.search(rf"'{name}'|\bnot {name}\b", message) for name in names)


def _produced_name(node: Expr) -> str | None:
    if isinstance(node, (Gen, Select)):
        return node.name
    if isinstance(node, VarScopeEnd):
        return node.name
    return None
