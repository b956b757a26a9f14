"""What a map measures: each row's tokens, and the progress bar built from them.

`UsageBackend` wraps the backend of one row's program and adds up the `meta_info` of every
request it sends (gens, fork branches, each choice a `select` scores), so a row's counts are
exact whatever the program does, and rows running on one engine at once do not mix.
`Progress` is a tqdm bar that advances per finished row and shows rows/s (tqdm's rate),
output tokens/s, the prefix cache hit rate (prompt tokens served from the radix cache) and
the number of rows that failed, all over the rows finished so far.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

from lmprog.backend import Backend
from lmprog.chat_template import ChatRoles
from lmprog.function import advance_bar

USAGE_COLUMNS = ("prompt_tokens", "cached_tokens", "completion_tokens")


class UsageBackend(Backend):
    """A backend that counts the tokens of the requests sent through it."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.usage = dict.fromkeys(USAGE_COLUMNS, 0)
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)

    def submit(self, input_ids, params, **options: Any) -> list[Future]:
        futures = self.inner.submit(input_ids, params, **options)
        for future in futures:  # registered first: counted before the program sees it
            future.add_done_callback(self._count)
        return futures

    def _count(self, future: Future) -> None:
        if future.cancelled():
            return
        error = future.exception()
        # (a request past its deadline keeps what it generated, and its gen's text does:
        # its tokens were counted as none)
        output = getattr(error, "partial_output", None) if error is not None else future.result()
        if output is None:
            return
        meta = output["meta_info"]
        with self._lock:
            for name in USAGE_COLUMNS:
                self.usage[name] += int(meta.get(name) or 0)

    def abort(self, futures: list[Future]) -> None:
        self.inner.abort(futures)

    def check_can_wait(self, what: str) -> None:
        self.inner.check_can_wait(what)

    def may_compile(self, params: dict[str, Any]) -> bool:
        return self.inner.may_compile(params)

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False
    ) -> str:
        return self.inner.render_chat(messages, add_generation_prompt)

    @property
    def context_token_id(self) -> int:
        return self.inner.context_token_id

    def chat_roles(self) -> ChatRoles:
        return self.inner.chat_roles()  # computed once per model, not once per row

    def check_constraint(self, kind: str, pattern: str) -> None:
        self.inner.check_constraint(kind, pattern)


class Progress:
    """Totals over finished rows, and the bar that shows them (silent when disabled)."""

    def __init__(self, *, enabled: bool, total: int | None, desc: str) -> None:
        self.totals = dict.fromkeys(USAGE_COLUMNS, 0)
        self.num_rows = 0
        self.num_errors = 0
        self.num_skipped = 0
        self.num_skipped_errors = 0  # of them, rows whose line holds an error
        self._start = time.monotonic()
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="row")

    def row_skipped(self, is_error: bool = False) -> None:
        """An input row the output already holds (resume): the bar moves past it as a
        restart's `initial` would, so that the rates count only rows run."""
        self.num_skipped += 1
        self.num_skipped_errors += is_error
        bar = self._bar
        if bar is not None:
            bar.n += 1
            bar.initial += 1
            bar.last_print_n += 1

    def row_done(self, usage: dict[str, int], is_error: bool) -> None:
        self.num_rows += 1
        self.num_errors += is_error
        for name in USAGE_COLUMNS:
            self.totals[name] += usage.get(name, 0)
        if self._bar is not None:
            self._bar.set_postfix_str(self.postfix(), refresh=False)
            advance_bar(self._bar)

    def postfix(self) -> str:
        seconds = max(time.monotonic() - self._start, 1e-9)
        prompt = self.totals["prompt_tokens"]
        hit = self.totals["cached_tokens"] / prompt if prompt else 0.0
        out_rate = self.totals["completion_tokens"] / seconds
        return f"out {out_rate:.1f} tok/s, cache hit {hit:.0%}, errors {self.num_errors}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
