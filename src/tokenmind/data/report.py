"""Per-stage accounting: how many documents and characters each pipeline stage removed.

Data work is mostly judgement about thresholds, and a threshold can only be judged by what it
did. Every stage (normalization, each quality filter, boilerplate removal, both dedups,
decontamination, tokenization) owns a `StageStats` and records every document it sees, so the
final report can say "the duplicate-lines filter removed 3.1% of documents, 7.9% of text".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass
class StageStats:
    """Counts for one stage. Characters removed include whole dropped documents and text that
    the stage trimmed out of documents it kept (boilerplate lines, extra whitespace)."""

    name: str
    docs_in: int = 0
    docs_removed: int = 0
    chars_in: int = 0
    chars_removed: int = 0

    def record(self, chars_before: int, chars_after: int | None) -> None:
        """Account for one document; `chars_after=None` means the stage dropped it."""
        self.docs_in += 1
        self.chars_in += chars_before
        if chars_after is None:
            self.docs_removed += 1
            self.chars_removed += chars_before
        else:
            self.chars_removed += chars_before - chars_after

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def stages_table(stages: Sequence[dict[str, Any]], title: str = "Data pipeline") -> Table:
    """A rich table of stage dicts (as produced by `StageStats.to_dict`), in pipeline order."""
    table = Table(title=title)
    table.add_column("stage", no_wrap=True)
    for column in ("docs in", "dropped", "% docs", "chars cut", "% chars"):
        table.add_column(column, justify="right")
    for stage in stages:
        table.add_row(
            stage["name"],
            f"{stage['docs_in']:,}",
            f"{stage['docs_removed']:,}",
            _percent(stage["docs_removed"], stage["docs_in"]),
            f"{stage['chars_removed']:,}",
            _percent(stage["chars_removed"], stage["chars_in"]),
        )
    return table


def sources_table(sources: dict[str, Any]) -> Table:
    """A rich table of what each source contributed (the report's `sources`), with the weight asked for."""
    table = Table(title="Sources" + (f" (the mix ended when {sources['ended_by']} ran out)"
                                     if sources.get("ended_by") else ""))
    table.add_column("source", overflow="fold")
    for column in ("weight", "docs", "tokens", "% tokens"):
        table.add_column(column, justify="right")
    for name, row in sources["sources"].items():
        weight = "-" if row["weight"] is None else f"{100.0 * row['weight']:.1f}%"
        table.add_row(name, weight, f"{row['documents']:,}", f"{row['tokens']:,}", f"{100.0 * row['fraction']:.1f}%")
    return table


def print_report(report: dict[str, Any], console: Console | None = None) -> None:
    """Print a pipeline report (the dict `run_pipeline` returns, or a loaded report.json)."""
    console = console or Console()
    console.print(stages_table(report["stages"]))
    if "sources" in report:
        console.print(sources_table(report["sources"]))
    output = report["output"]
    splits = ", ".join(
        f"{name}: {split['documents']:,} docs / {split['tokens']:,} tokens"
        for name, split in output["splits"].items()
    )
    console.print(
        f"read {report['documents_read']:,} documents ({report['characters_read']:,} chars); "
        f"kept {output['documents']:,} ({output['characters']:,} chars) -> "
        f"{output['tokens']:,} tokens ({splits}) in {report['seconds']:.1f}s"
    )
