"""Progress bars on stderr for long work (generating a batch, scoring an evaluation): rich bars, one
per task, each with a free status text (a rate, say), or nothing at all when disabled; and `Stages`, the
resumable stage runner of the speedruns."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


class Stages:
    """Runs named stages in order, timing each, skipping those already done: a stage's result (JSON)
    is recorded in `out/stages.json` when it finishes, so a re-run resumes after the last finished one."""

    def __init__(self, out: Path):
        self.out, self.timings = out, {}
        self.done_path = out / "stages.json"
        self.done = json.loads(self.done_path.read_text()) if self.done_path.exists() else {}

    def run(self, name: str, fn) -> Any:
        from rich.console import Console

        console = Console(stderr=True)
        if name in self.done:
            console.print(f"[bold]speedrun[/bold] {name}: already done, skipping")
            self.timings[name] = self.done[name]["seconds"]
            return self.done[name]["result"]
        console.rule(f"[bold]speedrun[/bold] {name}")
        t0 = time.perf_counter()
        result = fn()
        seconds = round(time.perf_counter() - t0, 1)
        self.timings[name] = seconds
        self.done[name] = {"seconds": seconds, "result": result}
        tmp = self.done_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.done, indent=2, default=str))
        tmp.replace(self.done_path)
        return result
