"""A picture of the radix cache: each node's size, hits, and whether it is locked or
evictable.

`snapshot` copies the tree's shape (on the engine's loop thread, between steps, so the
live tree is never read while it changes); `RadixTreeView` draws the copy as SVG for
notebooks (`_repr_svg_`, no Graphviz needed) or as indented text (`str`).
"""

from __future__ import annotations

import html
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Tokens of an edge kept for its label.
PREVIEW_TOKENS = 12
BOX_W, BOX_H, GAP_X, GAP_Y = 132, 38, 22, 8
MAX_WIDTH = 860  # pixels: about a notebook's output column
FILLS = {"locked": "#fbd9d3", "evictable": "#d9f2df"}


@dataclass
class NodeView:
    num_tokens: int
    hit_count: int
    lock_ref: int
    preview: list[int]  # the first tokens of the edge into this node
    children: list[NodeView] = field(default_factory=list)

    @property
    def state(self) -> str:
        return "locked" if self.lock_ref > 0 else "evictable"


def snapshot(root: Any, max_nodes: int) -> tuple[NodeView, int]:
    """The tree under `root` (a `TreeNode`), breadth first, at most `max_nodes` nodes
    besides the root; returns it and how many nodes were left out."""
    view = NodeView(0, root.hit_count, root.lock_ref, [])
    queue = deque([(root, view)])
    kept = omitted = 0
    while queue:
        node, node_view = queue.popleft()
        for child in sorted(node.children.values(), key=lambda c: c.node_id):
            if kept >= max_nodes:
                omitted += 1 + _count_below(child)
                continue
            kept += 1
            child_view = NodeView(
                len(child.key), child.hit_count, child.lock_ref, list(child.key[:PREVIEW_TOKENS])
            )
            node_view.children.append(child_view)
            queue.append((child, child_view))
    return view, omitted


def _count_below(node: Any) -> int:
    return sum(1 + _count_below(child) for child in node.children.values())


class RadixTreeView:
    """A drawn copy of the radix cache (see `Engine.radix_tree`)."""

    def __init__(self, root: NodeView, omitted: int, decode: Callable[[list[int]], str]) -> None:
        self.root = root
        self.omitted = omitted
        self._decode = decode

    def nodes(self) -> list[tuple[int, NodeView]]:
        """(depth, node) for every node but the root, depth first."""
        out, stack = [], [(1, child) for child in reversed(self.root.children)]
        while stack:
            depth, node = stack.pop()
            out.append((depth, node))
            stack.extend((depth + 1, child) for child in reversed(node.children))
        return out

    def _text(self, node: NodeView) -> str:
        """The node's first tokens as text, `...` after them when the edge is longer."""
        text = self._decode(node.preview)
        return text + "..." if node.num_tokens > len(node.preview) else text

    def _label(self, node: NodeView) -> str:
        """`_text` for the drawing, control characters escaped (`\\n`, `\\x1b`): XML has
        no place for most of them, and an SVG holding one does not display."""
        return "".join(
            ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode()
            for ch in self._text(node)
        )

    def __str__(self) -> str:
        # `repr` of the raw text escapes control characters once; `repr` of `_label`
        # escaped its escapes again (a newline showed as `\\n`).
        lines = [f"radix cache: {len(self.nodes())} nodes"]
        for depth, node in self.nodes():
            lines.append(
                f"{'  ' * depth}{node.num_tokens} tokens, {node.hit_count} hits, "
                f"{node.state}: {self._text(node)!r}"
            )
        if self.omitted:
            lines.append(f"... {self.omitted} more nodes not shown")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"RadixTreeView({len(self.nodes())} nodes, {self.omitted} not shown)"

    def _repr_svg_(self) -> str:
        """Left to right: each depth in a column (the first holds the root's children),
        leaves one per row and each parent level with the middle of its children; red nodes are locked by running
        requests, green ones evictable. Hover a node for its whole label."""
        pos: dict[int, tuple[int, float]] = {}
        next_row = [0]

        def place(node: NodeView, depth: int) -> float:
            if node.children:
                rows = [place(child, depth + 1) for child in node.children]
                row = (rows[0] + rows[-1]) / 2
            else:
                row = next_row[0]
                next_row[0] += 1
            pos[id(node)] = (depth, row)
            return row

        for child in self.root.children:  # the root holds no tokens: not drawn
            place(child, 0)
        depth = max((d for d, _ in pos.values()), default=0)
        width = int((depth + 1) * (BOX_W + GAP_X) + GAP_X)
        height = int(max(next_row[0], 1) * (BOX_H + GAP_Y) + GAP_Y + 12)
        scale = min(1.0, MAX_WIDTH / width)  # a wide tree is drawn smaller, never cut off
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * scale:.0f}" '
            f'height="{height * scale:.0f}" viewBox="0 0 {width} {height}" '
            'font-family="monospace" font-size="10">'
        ]
        boxes = [(node, node.state, self._label(node)) for _, node in self.nodes()]
        for node, _, _ in boxes:
            x1, y1 = self._corner(pos[id(node)])
            for child in node.children:
                x2, y2 = self._corner(pos[id(child)])
                parts.append(
                    f'<line x1="{x1 + BOX_W}" y1="{y1 + BOX_H / 2}" x2="{x2}" '
                    f'y2="{y2 + BOX_H / 2}" stroke="#999"/>'
                )
        for node, state, label in boxes:
            x, y = self._corner(pos[id(node)])
            stats = f"{node.num_tokens} tok · {node.hit_count} hits"
            short = label if len(label) <= 18 else label[:17] + "…"
            parts.append(
                f"<g><title>{html.escape(label)}\n{stats} ({state})</title>"
                f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="5" '
                f'fill="{FILLS[state]}" stroke="#777"/>'
                f'<text x="{x + 6}" y="{y + 16}">{html.escape(short)}</text>'
                f'<text x="{x + 6}" y="{y + 31}" fill="#555">{html.escape(stats)}</text></g>'
            )
        if self.omitted:
            parts.append(
                f'<text x="{GAP_X}" y="{height - 6}" fill="#555">'
                f"{self.omitted} more nodes not shown</text>"
            )
        parts.append("</svg>")
        return "".join(parts)

    @staticmethod
    def _corner(position: tuple[int, float]) -> tuple[float, float]:
        depth, row = position
        return GAP_X + depth * (BOX_W + GAP_X), GAP_Y / 2 + row * (BOX_H + GAP_Y)
