"""What an Engine shows of itself (a mixin of `Engine`): its counters, where its KV slots
are, a drawing of its prefix cache, one line of text in a terminal and a small report in
Jupyter (its model, the KV slots and the counters since the last reset).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING

from lmprog_runtime.kvcache.radix_view import RadixTreeView

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from lmprog_runtime.engine import Engine

# Share of the KV pool per memory state, in the bar.
BAR_COLORS = {"locked": "#e4796a", "cached": "#5bb974", "free": "#e6e6e6"}


def _model_name(engine: Engine) -> str:
    return Path(engine.config.model_path).name


def engine_repr(engine: Engine) -> str:
    """One line; a shut-down engine says so (its empty queues would read as idle)."""
    memory = engine.memory_state()
    if engine._stopping:
        requests = "shut down"
    else:
        requests = f"running={memory['num_running']}, waiting={memory['num_waiting']}"
    return (
        f"Engine(model={_model_name(engine)!r}, device={engine.config.device!r}, "
        f"kv_slots={memory['kv_slots_total']}, {requests})"
    )


def engine_html(engine: Engine) -> str:
    memory = engine.memory_state()
    stats = engine.stats()
    runner = engine.runner
    dtype = str(next(runner.model.parameters()).dtype).removeprefix("torch.")
    total = max(memory["kv_slots_total"], 1)
    shares = {
        "locked": memory["kv_slots_locked"],
        "cached": memory["kv_slots_cached"] - memory["kv_slots_locked"],
        "free": memory["kv_slots_free"],
    }
    bar = "".join(
        f'<div title="{name}: {count}" style="width:{100 * count / total:.2f}%;'
        f'background:{BAR_COLORS[name]}"></div>'
        for name, count in shares.items()
        if count
    )
    # (not prefill + cached: prefill counts jumped-forward and recomputed tokens too)
    prompt = stats["prompt_tokens"]
    hit_rate = stats["cached_tokens"] / prompt if prompt else 0.0
    rows = {
        "model": f"{_model_name(engine)} ({dtype}, {engine.config.device}, "
        f"{runner.attention_backend} attention)",
        "KV slots": f"{memory['kv_slots_total']:,} total: {shares['free']:,} free, "
        f"{shares['cached']:,} cached, {shares['locked']:,} locked",
        "requests": (
            "none: shut down"
            if engine._stopping
            else f"{memory['num_running']} running, {memory['num_waiting']} waiting"
        )
        + f", {int(stats['finished_requests']):,} finished",
        "prefix cache hit rate": f"{hit_rate:.1%} of {int(prompt):,} prompt tokens",
        "tokens": f"{int(stats['prefill_tokens']):,} prefilled, "
        f"{int(stats['decode_tokens']):,} decoded, "
        f"{int(stats['jump_forward_tokens']):,} jumped forward",
        "forward passes": f"{int(stats['forward_passes']):,} "
        f"({stats['forward_seconds']:.2f} s of {stats['step_seconds']:.2f} s in steps)",
    }
    cells = "".join(
        f'<tr><th style="text-align:left;padding-right:1em">{html.escape(k)}</th>'
        f'<td style="text-align:left">{html.escape(v)}</td></tr>'
        for k, v in rows.items()
    )
    return (
        '<div class="lmprog-engine" style="font-family:ui-monospace,Menlo,monospace;'
        f'font-size:12px"><b>lmprog Engine{" (shut down)" if engine._stopping else ""}</b>'
        f'<div style="display:flex;height:10px;width:24em;margin:4px 0;border:1px solid #bbb">'
        f"{bar}</div><table>{cells}</table></div>"
    )


class EngineView:
    """`Engine`'s read-only views (`Engine` sets the fields they read)."""

    def stats(self) -> dict[str, float]:
        """Counters since start or the last `reset_stats()` (see DESIGN.md for the keys)."""
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer (`self.tokenizer`; SGLang's `Runtime.get_tokenizer()`)."""
        return self.tokenizer

    def memory_state(self) -> dict[str, int]:
        """Where the KV slots are (when idle: free + cached == total and nothing is locked),
        and how many request slots and penalty rows are held."""
        runner, tree = self.runner, self.tree_cache
        # Running: the requests taken in and not waiting, the batch being prefilled among
        # them (it left `waiting` and joins `running` after its forward: a long prefill
        # showed none running nor waiting).
        taken_in, waiting = len(self._live), len(self.scheduler.waiting)
        return {
            "kv_slots_total": runner.allocator.num_slots,
            "kv_slots_free": runner.allocator.num_free,
            "kv_slots_cached": tree.total_size if tree is not None else 0,
            "kv_slots_locked": tree.protected_size if tree is not None else 0,
            "req_slots_total": runner.req_to_token.num_reqs,
            "req_slots_free": runner.req_to_token.num_free,
            "num_running": max(taken_in - waiting, 0),
            "num_waiting": waiting + len(self._inbox),
            "penalty_rows_used": self.penalty_counts.num_used,
        }

    def radix_tree(self, max_nodes: int = 200) -> RadixTreeView:
        """A drawing of the prefix cache as it is now: each node's tokens, hit count and
        whether running requests lock it (an SVG in notebooks, indented text with `str`).
        Past `max_nodes` nodes (breadth first) the rest are counted, not drawn.

        Example:
            >>> engine.radix_tree()  # doctest: +SKIP
        """
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be a positive int, got {max_nodes!r}")
        if self.tree_cache is None:
            raise RuntimeError("this engine runs without a prefix cache")
        root, omitted = self._command("radix_snapshot", max_nodes)
        return RadixTreeView(root, omitted, self.tokenizer.decode)

    def __repr__(self) -> str:
        return engine_repr(self)

    def _repr_html_(self) -> str:
        """Jupyter: the model, the KV memory and the counters."""
        return engine_html(self)
