"""The data pipeline: raw text -> clean, deduplicated, decontaminated token shards -> batches.

Modules, in pipeline order: `readers` (files to documents), `clean` and `quality`
(normalization, boilerplate, quality rules), `dedup` (exact and MinHash-LSH), `decontaminate`
(n-gram overlap with evaluation sets), `shards` (the on-disk token format), `pipeline` (all of
it in one call), `loader` (packed, resumable training batches), plus `hashing` and `report`.

Names are exported lazily: tokenization worker processes import this package, and should not
pay for importing torch (only `loader` needs it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Document": "readers",
    "ReaderConfig": "readers",
    "DataReadError": "readers",
    "read_documents": "readers",
    "CleanConfig": "clean",
    "DocumentCleaner": "clean",
    "normalize_text": "clean",
    "QualityConfig": "quality",
    "ExactDeduplicator": "dedup",
    "MinHashConfig": "dedup",
    "MinHashDeduplicator": "dedup",
    "DecontaminationConfig": "decontaminate",
    "Decontaminator": "decontaminate",
    "ShardConfig": "shards",
    "ShardWriter": "shards",
    "TokenShards": "shards",
    "DataPipelineConfig": "pipeline",
    "run_pipeline": "pipeline",
    "TokenBatch": "loader",
    "LoaderConfig": "loader",
    "PackedLoader": "loader",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from tokenmind.data.clean import CleanConfig, DocumentCleaner, normalize_text
    from tokenmind.data.decontaminate import DecontaminationConfig, Decontaminator
    from tokenmind.data.dedup import ExactDeduplicator, MinHashConfig, MinHashDeduplicator
    from tokenmind.data.loader import LoaderConfig, PackedLoader, TokenBatch
    from tokenmind.data.pipeline import DataPipelineConfig, run_pipeline
    from tokenmind.data.quality import QualityConfig
    from tokenmind.data.readers import DataReadError, Document, ReaderConfig, read_documents
    from tokenmind.data.shards import ShardConfig, ShardWriter, TokenShards


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
