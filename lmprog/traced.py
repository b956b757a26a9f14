"""A traced program: its IR graph, its constant prefix, and ways to look at it.

Nodes of `graph` carry `node` (the IR node) and `path` (which fork branch it is in);
edges carry `kind`: "text" (text order), "data" (a value flows from its producer) or
"text+data" (drawn as data).
"""

from __future__ import annotations

import html
from typing import Any

import networkx as nx

from lmprog.ir import Argument, Expr, Fork, ForkItem, Gen, Join, RoleBegin, RoleEnd, Select, Text
from lmprog.tracer import Path


class TracedProgram:
    def __init__(
        self, graph: nx.DiGraph, stopped: str | None, ret: Any, backend: Any = None
    ) -> None:
        self.graph = graph
        self.stopped = stopped  # why the trace ended early, or None if it is complete
        self.ret = ret
        self._backend = backend

    @property
    def is_complete(self) -> bool:
        return self.stopped is None

    def stream(self, path: Path = ()) -> list[tuple[int, Expr]]:
        """The nodes of one state (root or fork branch), in text order."""
        nodes = sorted(n for n, data in self.graph.nodes(data=True) if data["path"] == path)
        return [(n, self.graph.nodes[n]["node"]) for n in nodes]

    @property
    def prefix(self) -> str:
        """The constant leading text: everything before the first generated or symbolic
        value. Roles are rendered with the backend's chat template when one is known."""
        from lmprog.ops import ExecState, ProgramOps

        backend = self._backend
        if backend is None:
            from lmprog.backend import get_default_backend

            try:
                backend = get_default_backend()
            except RuntimeError:
                backend = None  # without a chat template the prefix stops at the first role
        ops = ProgramOps(backend, {}) if backend is not None else None
        st = ExecState()
        for _, node in self.stream(()):
            if isinstance(node, Text):
                st.emit(node.value)
            elif isinstance(node, (RoleBegin, RoleEnd)) and ops is not None:
                ops.apply_constant(st, node)
            else:
                break
        return st.text

    def __repr__(self) -> str:
        status = "complete" if self.is_complete else f"stopped: {self.stopped}"
        return f"TracedProgram({self.graph.number_of_nodes()} nodes, {status})"

    def __str__(self) -> str:
        lines = []
        for n in nx.topological_sort(self.graph):
            data = self.graph.nodes[n]
            deps = [p for p in self.graph.predecessors(n) if _carries_data(self.graph.edges[p, n])]
            where = "".join(f"/fork{f}.{i}" for f, i in data["path"]) or "/"
            dep = f"  <- {deps}" if deps else ""
            lines.append(f"{n:>3} {where:<12} {_label(data['node'])}{dep}")
        if self.stopped:
            lines.append(f"... trace stopped: {self.stopped}")
        return "\n".join(lines)

    def to_dot(self) -> str:
        """The graph in Graphviz DOT (text edges solid, data edges dashed)."""
        out = ["digraph program {", "  node [shape=box, fontname=monospace];"]
        for n, data in self.graph.nodes(data=True):
            label = _label(data["node"]).replace("\\", "\\\\").replace('"', '\\"')
            out.append(f'  n{n} [label="{label}"];')
        for a, b, data in self.graph.edges(data=True):
            style = " [style=dashed, color=blue]" if _carries_data(data) else ""
            out.append(f"  n{a} -> n{b}{style};")
        out.append("}")
        return "\n".join(out)

    def _repr_svg_(self) -> str:
        """A layered drawing for notebooks (no Graphviz needed)."""
        layers = list(nx.topological_generations(self.graph))
        pos = {}
        width = max((len(layer) for layer in layers), default=1)
        box_w, box_h, gap_x, gap_y = 220, 26, 20, 22
        for y, layer in enumerate(layers):
            for x, n in enumerate(sorted(layer)):
                pos[n] = (10 + x * (box_w + gap_x), 10 + y * (box_h + gap_y))
        w = 20 + width * (box_w + gap_x)
        h = 20 + len(layers) * (box_h + gap_y)
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="monospace" font-size="11">'
        ]
        for a, b, data in self.graph.edges(data=True):
            (x1, y1), (x2, y2) = pos[a], pos[b]
            dash = (
                ' stroke-dasharray="4,3" stroke="#36c"' if _carries_data(data) else ' stroke="#888"'
            )
            parts.append(
                f'<line x1="{x1 + box_w / 2}" y1="{y1 + box_h}" x2="{x2 + box_w / 2}" y2="{y2}"{dash}/>'
            )
        for n, (x, y) in pos.items():
            node = self.graph.nodes[n]["node"]
            fill = "#d7f5d7" if isinstance(node, (Gen, Select)) else "#f3f3f3"
            label = _label(node)
            label = html.escape(label if len(label) <= 31 else label[:30] + "…")
            parts.append(
                f'<rect x="{x}" y="{y}" width="{box_w}" height="{box_h}" fill="{fill}" stroke="#666" rx="4"/>'
            )
            full = html.escape(_label(node))
            parts.append(f'<text x="{x + 6}" y="{y + 17}"><title>{full}</title>{label}</text>')
        parts.append("</svg>")
        return "".join(parts)


def _label(node: Expr) -> str:
    if isinstance(node, Text):
        text = node.value if len(node.value) <= 40 else node.value[:37] + "..."
        return f"text {text!r}"
    if isinstance(node, Gen):
        args = "".join(f" {k}={v!r}" for k, v in node.sampling.items() if v is not None)
        return f"gen {node.name}{args}"
    if isinstance(node, Select):
        return f"select {node.name} {list(node.choices)}"
    if isinstance(node, (RoleBegin, RoleEnd)):
        return f"{'begin' if isinstance(node, RoleBegin) else 'end'} {node.role}"
    if isinstance(node, Fork):
        return f"fork {node.fork_id} x{node.num_branches}"
    if isinstance(node, ForkItem):
        return f"branch {node.fork_id}.{node.index}"
    if isinstance(node, Join):
        return f"join {node.fork_id} ({node.mode})"
    if isinstance(node, Argument):
        return f"argument {node.name}"
    return repr(node)


def _carries_data(edge: dict) -> bool:
    """A "data" or "text+data" edge (a value flows along it): drawn and listed as data."""
    return "data" in edge["kind"]
