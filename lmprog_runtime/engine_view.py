"""How an Engine looks: one line of text in a terminal, a small report in Jupyter (its
model, where the KV slots are, and the counters since the last reset). Reads only the
public `memory_state()` and `stats()`.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmprog_runtime.engine import Engine

# Share of the KV pool per memory state, in the bar.
BAR_COLORS = {"locked": "#e4796a", "cached": "#5bb974", "free": "#e6e6e6"}


def _model_name(engine: Engine) -> str:
    return Path(engine.config.model_path).name


def engine_repr(engine: Engine) -> str:
    memory = engine.memory_state()
    return (
        f"Engine(model={_model_name(engine)!r}, device={engine.config.device!r}, "
        f"kv_slots={memory['kv_slots_total']}, running={memory['num_running']}, "
        f"waiting={memory['num_waiting']})"
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
    prompt = stats["prefill_tokens"] + stats["cached_tokens"]
    hit_rate = stats["cached_tokens"] / prompt if prompt else 0.0
    rows = {
        "model": f"{_model_name(engine)} ({dtype}, {engine.config.device}, "
        f"{runner.attention_backend} attention)",
        "KV slots": f"{memory['kv_slots_total']:,} total: {shares['free']:,} free, "
        f"{shares['cached']:,} cached, {shares['locked']:,} locked",
        "requests": f"{memory['num_running']} running, {memory['num_waiting']} waiting, "
        f"{int(stats['finished_requests']):,} finished",
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
        'font-size:12px"><b>lmprog Engine</b>'
        f'<div style="display:flex;height:10px;width:24em;margin:4px 0;border:1px solid #bbb">'
        f"{bar}</div><table>{cells}</table></div>"
    )
