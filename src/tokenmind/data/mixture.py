"""Data mixtures: what share of the shards' tokens each source gets.

A corpus made of sources of very different sizes (25 M characters of Python beside 4 M of Jane
Austen) would, taken whole, train mostly on the biggest one. A mixture names a weight per source
(`{"code-sympy": 0.3, "austen": 0.7}`); the pipeline then reads all sources side by side and
takes each next document from the source furthest below its share of the tokens written so far
(w_i * total - tokens_i largest), so at every point of the stream, not only at its end, the
realised fractions are within one document of the weights. A source never repeats: the mix ends
when the source it next needs runs out, so the source smallest relative to its weight sets the
size of the whole. A weight of 0 leaves a source out.

Sources are the pipeline's inputs (a file or folder each, as `Document.source` names them); a
weight's key is the input as given, its file or folder name, or that name without the extension
(`austen` for `data/pretrain/austen.jsonl`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenmind.data.readers import SUPPORTED_EXTENSIONS


def source_name(source: str | Path) -> str:
    """An input's short name: its file or folder name without a supported extension."""
    name = Path(source).name
    return next((name[: -len(ext)] for ext in SUPPORTED_EXTENSIONS if name.endswith(ext)), name)


def mixture_weights(inputs: Sequence[str | Path], weights: Mapping[str, float]) -> list[float]:
    """One weight per input, normalised to sum to 1; ValueError naming the problem for bad weights."""
    keys = {str(source): i for i, source in enumerate(inputs)}
    for i, source in enumerate(inputs):
        keys.setdefault(Path(source).name, i)
        keys.setdefault(source_name(source), i)
    found: list[float | None] = [None] * len(inputs)
    for key, weight in weights.items():
        if key not in keys:
            raise ValueError(f"mixture weight for {key!r}, which is not an input; the inputs are: "
                             f"{', '.join(sorted({source_name(s) for s in inputs}))}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"mixture weight for {key!r} is {weight!r}; weights are finite numbers >= 0 "
                             "(0 leaves the source out)")
        if found[keys[key]] is not None:
            raise ValueError(f"input {str(inputs[keys[key]])!r} has two mixture weights; give one")
        found[keys[key]] = float(weight)
    missing = [str(inputs[i]) for i, w in enumerate(found) if w is None]
    if missing:
        raise ValueError(f"no mixture weight for {', '.join(missing)}; give every input a weight (0 leaves it out)")
    total = sum(w for w in found if w is not None)
    if total <= 0:
        raise ValueError("every mixture weight is 0; give at least one source a positive weight")
    return [w / total for w in found if w is not None]


class Mixer:
    """Picks the stream each next document comes from, so token shares follow the weights, and counts
    what each source contributed. Without weights there is one stream (all inputs in order)."""

    def __init__(self, sources: Sequence[str | Path], weights: Sequence[float] | None = None) -> None:
        self.names = [str(source) for source in sources]
        self.weights = list(weights) if weights is not None else None
        self.tokens = dict.fromkeys(self.names, 0)
        self.documents = dict.fromkeys(self.names, 0)
        self.ended_by: str | None = None  # the source whose end ended a weighted mix

    def next_stream(self) -> int:
        """The source most below its share of the tokens so far (ties: the first listed)."""
        if self.weights is None:
            return 0
        total = sum(self.tokens.values())
        deficit = [w * total - self.tokens[name] if w > 0 else -math.inf for name, w in zip(self.names, self.weights)]
        return max(range(len(deficit)), key=lambda i: (deficit[i], -i))

    def record(self, source: str, tokens: int) -> None:
        """Count one written document of `source` (a `Document.source`) and its tokens."""
        self.documents[source] += 1
        self.tokens[source] += tokens

    def report(self) -> dict[str, Any]:
        """Per source: its weight (None when unweighted), documents, tokens and realised token fraction."""
        total = sum(self.tokens.values())
        weights = dict(zip(self.names, self.weights or [None] * len(self.names)))
        return {
            "ended_by": self.ended_by,
            "sources": {name: {"weight": weights[name], "documents": self.documents[name], "tokens": tokens,
                               "fraction": tokens / total if total else 0.0}
                        for name, tokens in self.tokens.items()},
        }
