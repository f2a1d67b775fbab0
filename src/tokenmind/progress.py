"""Progress bars on stderr for long work (generating a batch, scoring an evaluation): rich bars, one
per task, each with a free status text (a rate, say), or nothing at all when disabled."""

from __future__ import annotations

from collections.abc import Callable


class Bars:
    """`with Bars(enabled) as bars: advance = bars.add("arc_easy", 500)`; `advance(n, status)` moves
    the bar n steps and sets its status text. `add` returns None when disabled, which is what the
    evaluators' `progress` arguments take to mean "no progress"."""

    def __init__(self, enabled: bool):
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
                                     console=Console(stderr=True))

    def __enter__(self) -> Bars:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def add(self, name: str, total: int | None) -> Callable[..., None] | None:
        if self.progress is None:
            return None
        bar = self.progress.add_task(name, total=total, status="")

        def advance(n: int = 1, status: str | None = None) -> None:
            self.progress.update(bar, advance=n, **({} if status is None else {"status": status}))

        return advance
