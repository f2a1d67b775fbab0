"""Text files in, pre-training token shards out: the whole data pipeline in one call.

`run_pipeline` chains the stages in the order that makes each one cheapest and most
effective:

    read -> normalize -> boilerplate -> quality rules -> exact dedup -> near dedup
         -> decontaminate -> tokenize (worker processes; fill-in-the-middle) -> mixture -> shards

Cleaning comes first so that dedup compares canonical text; exact dedup comes before MinHash
because it is far cheaper and removes the bulk of duplicates; decontamination runs on what
survived. Documents stream through one at a time: memory holds dedup digests and signatures,
not text. Boilerplate removal needs line counts before it can strip anything, so when it is
enabled the inputs are read twice (the readers are deterministic, so both passes agree).

Tokenization is the expensive stage, so batches of documents are encoded by a pool of worker
processes while the main process keeps cleaning; results are consumed in submission order,
so the shards are byte-identical whatever `num_workers` is.

Documents become token ids in one place, `DocumentEncoder`, which is also where the
fill-in-the-middle transform (`fim.py`) cuts documents at characters before encoding them. With a
data mixture (`mixture.py`) each input is its own stream, read side by side, and the mixer takes
each next document from the source furthest below its share of the tokens; the report and the
manifest give every source's realised tokens and fraction.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenmind.data.clean import DocumentCleaner
from tokenmind.data.dedup import ExactDeduplicator, MinHashDeduplicator
from tokenmind.data.mixture import Mixer, mixture_weights
from tokenmind.data.readers import Document, read_documents
from tokenmind.data.stages import (  # noqa: F401  (tokenizer_identity: callers import it from here)
    DataPipelineConfig,
    DocumentEncoder,
    Tokenizer,
    Check,
    document_checks,
    eval_set,
    finish_report,
    open_writer,
    passes_checks,
    tokenizer_identity,
    write_documents,
)

# --- tokenization workers --------------------------------------------------------------------

_worker_encoder: DocumentEncoder | None = None


def _init_worker(encoder: DocumentEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    assert _worker_encoder is not None, "worker was started without an encoder"
    return _worker_encoder(texts)


class _Done:
    """An already computed result, with the `get()` of a pool's async result."""

    def __init__(self, value: list[np.ndarray]) -> None:
        self.value = value

    def get(self) -> list[np.ndarray]:
        return self.value


def _encoded_documents(
    docs: Iterable[Document], encoder: DocumentEncoder, pool: Any, cfg: DataPipelineConfig, read_ahead: int
) -> Iterator[tuple[Document, np.ndarray]]:
    """(document, its token ids), in input order, with at most `read_ahead` batches in flight so
    memory stays bounded however large the corpus."""
    pending: deque[tuple[list[Document], Any]] = deque()
    for batch in _batched(docs, cfg.docs_per_task):
        texts = [doc.text for doc in batch]
        result = _Done(encoder(texts)) if pool is None else pool.apply_async(_encode_in_worker, (texts,))
        pending.append((batch, result))
        if len(pending) > read_ahead:
            done, result = pending.popleft()
            yield from zip(done, result.get())
    while pending:
        done, result = pending.popleft()
        yield from zip(done, result.get())


def _worker_pool(encoder: DocumentEncoder, cfg: DataPipelineConfig) -> Any:
    """A pool of tokenization processes, or None (encode here) when num_workers <= 1."""
    if cfg.num_workers <= 1:
        return contextlib.nullcontext(None)
    context = multiprocessing.get_context(cfg.start_method)
    return context.Pool(cfg.num_workers, initializer=_init_worker, initargs=(encoder,))


def _batched(docs: Iterable[Document], size: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# --- the pipeline ----------------------------------------------------------------------------


def _local_checks(cfg: DataPipelineConfig, contaminated: list[dict[str, str]]) -> list[Check]:
    exact = ExactDeduplicator()
    near = MinHashDeduplicator(cfg.near_dedup) if cfg.near_dedup is not None else None
    eval_docs, index = eval_set(cfg)
    return document_checks(
        cfg, contaminated, [doc.id for doc in eval_docs],
        exact=lambda doc: exact.is_duplicate(doc.text),
        near=lambda doc: near is not None and near.is_duplicate(doc.text),
        match=lambda doc: None if index is None else index.match(doc.text),
    )


def _surviving(
    docs: Iterable[Document], cleaner: DocumentCleaner, checks: list[Check], totals: dict[str, int]
) -> Iterator[Document]:
    for doc in docs:
        totals["documents"] += 1
        totals["characters"] += len(doc.text)
        cleaned = cleaner(doc)
        if cleaned is not None and passes_checks(cleaned, checks):
            yield cleaned


def run_pipeline(
    inputs: str | Path | Iterable[str | Path],
    output_dir: str | Path,
    tokenizer: Tokenizer,
    cfg: DataPipelineConfig | None = None,
) -> dict[str, Any]:
    """Turn the documents under `inputs` into token shards in `output_dir`.

    Returns the report (also written to `output_dir/report.json` and, if `cfg.print_report`,
    printed as a table): documents and characters read, per-stage removals, what was written,
    contaminated documents found, and the configuration used.
    """
    cfg = cfg or DataPipelineConfig()
    if cfg.engine == "ray":
        from tokenmind.data.ray_pipeline import run_ray_pipeline

        return run_ray_pipeline(inputs, output_dir, tokenizer, cfg)
    started = time.perf_counter()
    inputs = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    output_dir = Path(output_dir)

    writer = open_writer(output_dir, tokenizer, cfg)
    weights = mixture_weights(inputs, cfg.mixture) if cfg.mixture else None
    encoder = DocumentEncoder(tokenizer, cfg.fim)
    cleaner = DocumentCleaner(cfg.clean)
    if cleaner.needs_first_pass:
        for doc in read_documents(inputs, cfg.reader):
            cleaner.observe(doc)
    contaminated: list[dict[str, str]] = []
    checks = _local_checks(cfg, contaminated)
    totals = {"documents": 0, "characters": 0}
    mixer = Mixer(inputs, weights)
    # One stream over all inputs, or one per input for a mixture. A single stream's read-ahead
    # cannot change what is written; a mixture's can (it decides which of two duplicates in different
    # sources is read first), so there it is a fixed number of batches, whatever num_workers is.
    stream_inputs = [inputs] if weights is None else [[source] for source in inputs]
    read_ahead = 2 * cfg.num_workers if weights is None else 4

    with writer, _worker_pool(encoder, cfg) as pool:
        streams = [_encoded_documents(_surviving(read_documents(paths, cfg.reader), cleaner, checks, totals),
                                      encoder, pool, cfg, read_ahead)
                   for paths in stream_inputs]
        tokenize_stats, output = write_documents(writer, streams, mixer, cfg)
    stages = [*cleaner.stats, *(check.stats for check in checks), tokenize_stats]
    return finish_report(inputs, output_dir, cfg, writer.manifest, totals, stages, output, mixer, contaminated,
                         started)
