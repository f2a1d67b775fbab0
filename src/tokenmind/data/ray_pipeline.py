"""The data pipeline on Ray Data: `pipeline.py`'s stages spread over a Ray cluster, writing
byte-identical shards (`DataPipelineConfig(engine="ray")`, `data prepare --engine ray`).

The local engine decides everything in one pass over the documents in input order, and "keep the
first occurrence" makes both dedups depend on that order. Here each stage is a map over documents
or a shuffle by key, so the order travels as data: every document carries `order` = (rank of its
file) << 32 | (its position in the file), its position in the local engine's stream.

    read (a task per file) -> boilerplate line counts (shuffle by source and line)
      -> clean (map, materialized) -> exact key and LSH band keys (map)
      -> shuffle by key: an exact group drops all but its first document; a band bucket yields the
         pairs in it whose estimated Jaccard reaches the threshold (verified edges)
      -> connected components of the edges (driver); each component replays the greedy keep/drop in
         document order (tasks) -> decontaminate + tokenize (map) -> shards (driver, in order)

Why the replay reproduces the local decisions: `MinHashDeduplicator.is_duplicate` drops a document
iff an earlier *kept* document shares a band bucket with it at estimated Jaccard >= threshold, that
is iff it has a verified edge to an earlier kept document. That depends on the edges alone, so
walking them in order of their later end decides every document as the local engine did, and
documents of different components never affect each other, so components replay independently.
Exact duplicates never enter the local MinHash index, so their edges go before the components form.
Near-duplicate removal is therefore global: two copies on different workers meet in their bucket.

The driver writes the shards: shard boundaries and the val split depend on every earlier document,
and appending tokens is sequential I/O, cheap next to cleaning, hashing and tokenizing. Mixtures are
not supported: the local mixer interleaves sources by the tokens written so far, which makes the
dedup order depend on tokenization.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenmind.data.clean import DocumentCleaner
from tokenmind.data.dedup import MinHashDeduplicator, exact_key
from tokenmind.data.mixture import Mixer
from tokenmind.data.stages import (
    DataPipelineConfig,
    DocumentEncoder,
    Tokenizer,
    document_checks,
    eval_set,
    finish_report,
    open_writer,
    passes_checks,
    write_documents,
)
from tokenmind.data.readers import Document, ReaderConfig, list_input_files, read_file
from tokenmind.data.report import StageStats

POSITION_BITS = 32  # order = file rank << POSITION_BITS | position in the file
_EXACT, _BAND = b"e", b"b"  # bucket key prefixes: exact-duplicate groups and LSH band buckets
_DOCS_KEY = b""  # the boilerplate count row that counts the document itself
_ROWS_PER_PARTITION = 1_000_000  # shuffle rows per partition (a partition is one block in memory)


def import_ray() -> Any:
    """The `ray` module, or an ImportError that says how to install it."""
    try:
        import ray
        import ray.data
    except ImportError as err:
        raise ImportError("the Ray engine needs Ray, which is not installed: pip install 'tokenmind[ray]'") from err
    return ray


@contextlib.contextmanager
def ray_session(cfg: DataPipelineConfig) -> Iterator[Any]:
    """Ray, joined to the cluster at cfg.ray_address, or the one this process already joined, or a new
    local instance (shut down on exit); Ray Data set to keep block order and to hash-shuffle whole
    partitions into single blocks (SHUFFLE_V2), which the grouping below relies on."""
    ray = import_ray()
    from ray.data.context import ShuffleStrategy

    started = not ray.is_initialized()
    if started:
        ray.init(address=cfg.ray_address, num_cpus=cfg.ray_num_cpus if cfg.ray_address is None else None,
                 include_dashboard=False)
    context = ray.data.DataContext.get_current()
    saved = context.execution_options.preserve_order, context.shuffle_strategy
    context.execution_options.preserve_order = True
    context.shuffle_strategy = ShuffleStrategy.SHUFFLE_V2
    try:
        yield ray
    finally:
        context.execution_options.preserve_order, context.shuffle_strategy = saved
        if started:
            ray.shutdown()


def _table(columns: dict[str, tuple[list[Any], Any]]) -> Any:
    """A pyarrow table from (values, type) columns: typed even when a batch yields no rows."""
    import pyarrow as pa

    return pa.table({name: pa.array(values, type=kind) for name, (values, kind) in columns.items()})


# --- the map and reduce functions (run on the workers) --------------------------------------------


def _read_batch(batch: dict[str, np.ndarray], reader: ReaderConfig) -> Any:
    import pyarrow as pa

    orders, sources, ids, texts = [], [], [], []
    for rank, source, path in zip(batch["rank"], batch["source"], batch["path"]):
        for position, doc in enumerate(read_file(Path(path), str(source), reader)):
            orders.append((int(rank) << POSITION_BITS) | position)
            sources.append(doc.source)
            ids.append(doc.id)
            texts.append(doc.text)
    return _table({"order": (orders, pa.int64()), "source": (sources, pa.string()), "id": (ids, pa.string()),
                   "text": (texts, pa.large_string())})


def _line_key_batch(batch: dict[str, np.ndarray], cleaner: DocumentCleaner) -> Any:
    """One row per (document, distinct line that could be boilerplate), plus one per document."""
    import pyarrow as pa

    sources, keys = [], []
    for source, text in zip(batch["source"], batch["text"]):
        for key in (_DOCS_KEY, *cleaner.boilerplate_keys(Document(text=text, source=source, id=""))):
            sources.append(source)
            keys.append(key)
    return _table({"source": (sources, pa.string()), "key": (keys, pa.binary())})


def _count_batch(batch: dict[str, np.ndarray], min_docs: int) -> Any:
    """Documents per (source, line) in one hash partition. Lines in fewer than `min_docs` documents
    are left out: the boilerplate threshold is never below it, so they could never be stripped."""
    import pyarrow as pa

    counts = Counter(zip(batch["source"], batch["key"]))
    rows = [(source, key, n) for (source, key), n in counts.items() if n >= min_docs or key == _DOCS_KEY]
    return _table({"source": ([r[0] for r in rows], pa.string()), "key": ([r[1] for r in rows], pa.binary()),
                   "count": ([r[2] for r in rows], pa.int64())})


def _stats_array(stats: list[StageStats]) -> np.ndarray:
    return np.array([[s.docs_in, s.docs_removed, s.chars_in, s.chars_removed] for s in stats], dtype=np.int64)


def _clean_batch(batch: dict[str, np.ndarray], cleaner: DocumentCleaner) -> Any:
    """Clean each document; its row keeps what each cleaning step counted for it (`stats`), so the
    driver can sum the stages' rows of the report however the documents were spread."""
    import pyarrow as pa

    texts, kept, deltas = [], [], []
    before = _stats_array(cleaner.stats)
    for source, doc_id, text in zip(batch["source"], batch["id"], batch["text"]):
        cleaned = cleaner(Document(text=text, source=source, id=doc_id))
        after = _stats_array(cleaner.stats)
        deltas.append((after - before).tobytes())
        before = after
        texts.append("" if cleaned is None else cleaned.text)
        kept.append(cleaned is not None)
    return _table({"order": (batch["order"], pa.int64()), "source": (batch["source"], pa.string()),
                   "id": (batch["id"], pa.string()), "raw_chars": ([len(t) for t in batch["text"]], pa.int64()),
                   "kept": (kept, pa.bool_()), "text": (texts, pa.large_string()), "stats": (deltas, pa.binary())})


def _bucket_batch(batch: dict[str, np.ndarray], exact: bool, near: MinHashDeduplicator | None) -> Any:
    """The keys each kept document is grouped by: its exact key, and its LSH band keys (with its
    signature, so a bucket can verify its pairs without another lookup)."""
    import pyarrow as pa

    buckets, orders, signatures = [], [], []
    for order, text in zip(batch["order"][batch["kept"]], batch["text"][batch["kept"]]):
        if exact:
            buckets.append(_EXACT + exact_key(text))
            orders.append(order)
            signatures.append(b"")
        signature = near.signature(text) if near is not None else None
        if signature is not None:
            for band, key in enumerate(near.band_keys(signature)):  # type: ignore[union-attr]
                buckets.append(_BAND + band.to_bytes(2, "little") + key)
                orders.append(order)
                signatures.append(signature.tobytes())
    return _table({"bucket": (buckets, pa.binary()), "order": (orders, pa.int64()),
                   "signature": (signatures, pa.binary())})


def _group_batch(batch: dict[str, np.ndarray], threshold: float) -> Any:
    """One hash partition of buckets (whole: SHUFFLE_V2 keeps a partition in one block). Exact
    groups drop all but their first document (kind 0, `a`); band buckets give their verified
    pairs (kind 1, `a` < `b`), with `MinHashDeduplicator.estimate_jaccard`'s arithmetic."""
    import pyarrow as pa

    kinds: list[int] = []
    firsts: list[int] = []
    seconds: list[int] = []
    index = np.argsort(batch["bucket"], kind="stable")
    buckets, orders, signatures = batch["bucket"][index], batch["order"][index], batch["signature"][index]
    starts = np.flatnonzero(np.concatenate([[True], buckets[1:] != buckets[:-1], [True]]))
    for start, stop in zip(starts[:-1], starts[1:]):
        if stop - start < 2:
            continue
        members = np.argsort(orders[start:stop], kind="stable") + start
        if buckets[start].startswith(_EXACT):
            kinds += [0] * (len(members) - 1)
            firsts += orders[members[1:]].tolist()
            seconds += [-1] * (len(members) - 1)
            continue
        group = np.frombuffer(b"".join(signatures[members]), dtype=np.uint32).reshape(len(members), -1)
        for i in range(len(members) - 1):
            similar = np.flatnonzero((group[i + 1 :] == group[i]).mean(axis=1) >= threshold) + i + 1
            kinds += [1] * len(similar)
            firsts += [int(orders[members[i]])] * len(similar)
            seconds += orders[members[similar]].tolist()
    return _table({"kind": (kinds, pa.int8()), "a": (firsts, pa.int64()), "b": (seconds, pa.int64())})


def _finish_batch(
    batch: dict[str, np.ndarray],
    exact_dropped: np.ndarray,
    near_dropped: np.ndarray,
    eval_index: Any,
    remove_contaminated: bool,
    encoder: DocumentEncoder,
) -> Any:
    """Mark the dedup decisions, decontaminate and tokenize what survives."""
    import pyarrow as pa

    kept, orders, texts = batch["kept"], batch["order"], batch["text"]
    exact = kept & np.isin(orders, exact_dropped)
    near = kept & ~exact & np.isin(orders, near_dropped)
    survives = kept & ~exact & ~near
    match = np.full(len(orders), -1, dtype=np.int64)
    if eval_index is not None:
        for i in np.flatnonzero(survives):
            found = eval_index.match(texts[i])
            match[i] = -1 if found is None else found
        if remove_contaminated:
            survives &= match < 0
    tokens = [b""] * len(orders)
    chosen = np.flatnonzero(survives)
    for i, ids in zip(chosen, encoder([texts[i] for i in chosen]) if len(chosen) else []):
        tokens[i] = ids.astype(np.int64).tobytes()
    return _table({"order": (orders, pa.int64()), "source": (batch["source"], pa.string()),
                   "id": (batch["id"], pa.string()), "raw_chars": (batch["raw_chars"], pa.int64()),
                   "kept": (kept, pa.bool_()), "text": (texts, pa.large_string()),
                   "stats": (batch["stats"], pa.binary()), "exact": (exact, pa.bool_()), "near": (near, pa.bool_()),
                   "match": (match, pa.int64()), "tokens": (tokens, pa.binary())})


# --- the driver's parts ---------------------------------------------------------------------------


def connected_components(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, each node's component label: the smallest node of its component) of an undirected
    graph given as (E, 2) int64 edges: min-label propagation with pointer jumping, vectorized."""
    nodes, index = np.unique(edges, return_inverse=True)
    index = index.reshape(-1, 2)
    label = np.arange(len(nodes))  # invariant: label[i] <= i, in i's component
    while True:
        new = label.copy()
        np.minimum.at(new, index[:, 0], label[index[:, 1]])
        np.minimum.at(new, index[:, 1], label[index[:, 0]])
        new = new[new]
        if np.array_equal(new, label):
            return nodes, nodes[label]
        label = new


def greedy_replay(edges: np.ndarray) -> np.ndarray:
    """The documents near dedup drops, from verified edges (earlier, later) of whole components: a
    document goes iff one of its edges leads to an earlier kept document, the decision
    `MinHashDeduplicator.is_duplicate` makes. Sorted by their later end, every edge into a document
    is seen before any edge out of it, so each document's fate is settled before it is used."""
    dropped: set[int] = set()
    for earlier, later in edges[np.lexsort((edges[:, 0], edges[:, 1]))].tolist():
        if earlier not in dropped:
            dropped.add(later)
    return np.array(sorted(dropped), dtype=np.int64)


def _collect(dataset: Any) -> dict[str, np.ndarray]:
    """A (small) dataset's columns, gathered in the driver."""
    batches = list(dataset.iter_batches(batch_size=None, batch_format="numpy"))
    return {name: np.concatenate([b[name] for b in batches]) for name in batches[0]} if batches else {}


def _partitions(ray: Any, rows: int) -> int:
    return max(int(ray.cluster_resources().get("CPU", 1)), -(-rows // _ROWS_PER_PARTITION))


def _boilerplate_counts(ray: Any, docs: Any, cleaner: DocumentCleaner, cfg: DataPipelineConfig) -> None:
    """The first pass: documents per boilerplate candidate line, counted across the cluster."""
    keys = docs.map_batches(_line_key_batch, batch_format="numpy", batch_size=cfg.docs_per_task,
                            fn_kwargs={"cleaner": cleaner}).materialize()
    counted = _collect(keys.repartition(_partitions(ray, keys.count()), keys=["source", "key"])
                       .map_batches(_count_batch, batch_format="numpy", batch_size=None,
                                    fn_kwargs={"min_docs": cfg.clean.boilerplate_min_docs}))
    documents: Counter[str] = Counter()
    lines: defaultdict[str, dict[bytes, int]] = defaultdict(dict)
    for source, key, count in zip(counted.get("source", []), counted.get("key", []), counted.get("count", [])):
        if key == _DOCS_KEY:
            documents[source] += int(count)
        else:
            lines[source][key] = int(count)
    for source, count in documents.items():
        cleaner.add_boilerplate_counts(source, count, lines[source])


def _duplicates(ray: Any, cleaned: Any, cfg: DataPipelineConfig) -> tuple[np.ndarray, np.ndarray]:
    """(exact duplicates, near duplicates): the orders of the documents each dedup drops."""
    none = np.zeros(0, dtype=np.int64)
    if not cfg.exact_dedup and cfg.near_dedup is None:
        return none, none
    near = MinHashDeduplicator(cfg.near_dedup) if cfg.near_dedup is not None else None
    buckets = cleaned.map_batches(_bucket_batch, batch_format="numpy", batch_size=cfg.docs_per_task,
                                  fn_kwargs={"exact": cfg.exact_dedup, "near": near}).materialize()
    grouped = _collect(buckets.repartition(_partitions(ray, buckets.count()), keys=["bucket"])
                       .map_batches(_group_batch, batch_format="numpy", batch_size=None,
                                    fn_kwargs={"threshold": near.cfg.threshold if near is not None else 1.0}))
    if not grouped:
        return none, none
    exact_dropped = np.unique(grouped["a"][grouped["kind"] == 0])
    edges = np.stack([grouped["a"], grouped["b"]], axis=1)[grouped["kind"] == 1]
    edges = np.unique(edges[~np.isin(edges, exact_dropped).any(axis=1)], axis=0)
    if not len(edges):
        return exact_dropped, none
    nodes, labels = connected_components(edges)
    component = labels[np.searchsorted(nodes, edges[:, 0])]
    workers = int(ray.cluster_resources().get("CPU", 1))
    replay = ray.remote(greedy_replay)
    parts = [replay.remote(edges[component % workers == w]) for w in range(workers) if (component % workers == w).any()]
    return exact_dropped, np.sort(np.concatenate(ray.get(parts)))


def _add_stats(stats: list[StageStats], delta: np.ndarray) -> None:
    for stage, (docs_in, docs_removed, chars_in, chars_removed) in zip(stats, delta.tolist()):
        stage.docs_in += docs_in
        stage.docs_removed += docs_removed
        stage.chars_in += chars_in
        stage.chars_removed += chars_removed


def run_ray_pipeline(
    inputs: str | Path | list[str | Path], output_dir: str | Path, tokenizer: Tokenizer, cfg: DataPipelineConfig
) -> dict[str, Any]:
    """`run_pipeline` with engine="ray" (see the module docstring): the same shards, manifest and
    report counts as the local engine."""
    if cfg.mixture:
        raise ValueError("a data mixture needs the local engine (engine='local'): its interleaving of sources "
                         "follows the tokens written so far, which a distributed run cannot reproduce")
    import_ray()  # fail before any work when Ray is not installed
    started = time.perf_counter()
    inputs = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
    output_dir = Path(output_dir)
    files = [(str(root), str(path)) for root in inputs for path in list_input_files(root)]
    encoder = DocumentEncoder(tokenizer, cfg.fim)
    cleaner = DocumentCleaner(cfg.clean)
    eval_docs, eval_index = eval_set(cfg)
    contaminated: list[dict[str, str]] = []
    decided: dict[str, Any] = {}
    checks = document_checks(cfg, contaminated, [doc.id for doc in eval_docs],
                             exact=lambda doc: decided["exact"], near=lambda doc: decided["near"],
                             match=lambda doc: decided["match"])
    cleaner_stats = DocumentCleaner(cfg.clean).stats  # zeroed; the workers' counts are added in
    totals = {"documents": 0, "characters": 0}
    mixer = Mixer(inputs)

    with open_writer(output_dir, tokenizer, cfg) as writer, ray_session(cfg) as ray:
        items = [{"rank": rank, "source": source, "path": path} for rank, (source, path) in enumerate(files)]
        docs = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
            _read_batch, batch_format="numpy", batch_size=1, fn_kwargs={"reader": cfg.reader})
        if cleaner.needs_first_pass:
            _boilerplate_counts(ray, docs, cleaner, cfg)
        cleaned = docs.map_batches(_clean_batch, batch_format="numpy", batch_size=cfg.docs_per_task,
                                   fn_kwargs={"cleaner": cleaner}).materialize()
        exact_dropped, near_dropped = _duplicates(ray, cleaned, cfg)
        final = cleaned.map_batches(_finish_batch, batch_format="numpy", batch_size=cfg.docs_per_task, fn_kwargs={
            "exact_dropped": exact_dropped, "near_dropped": near_dropped, "eval_index": eval_index,
            "remove_contaminated": cfg.decontamination.action == "remove", "encoder": encoder})

        def surviving() -> Iterator[tuple[Document, np.ndarray]]:
            last = -1
            for batch in final.iter_batches(batch_size=cfg.docs_per_task, batch_format="numpy"):
                for row in zip(*(batch[name] for name in ("order", "source", "id", "raw_chars", "kept", "text",
                                                          "stats", "exact", "near", "match", "tokens"))):
                    order, source, doc_id, raw_chars, kept, text, stats, exact, near, match, tokens = row
                    if order <= last:
                        raise RuntimeError("Ray Data returned documents out of order; the shards would differ "
                                           "from the local engine's (is preserve_order off?)")
                    last = order
                    totals["documents"] += 1
                    totals["characters"] += int(raw_chars)
                    _add_stats(cleaner_stats, np.frombuffer(stats, dtype=np.int64).reshape(-1, 4))
                    if not kept:
                        continue
                    decided.update(exact=bool(exact), near=bool(near), match=None if match < 0 else int(match))
                    doc = Document(text=str(text), source=str(source), id=str(doc_id))
                    if passes_checks(doc, checks):
                        yield doc, np.frombuffer(tokens, dtype=np.int64)

        tokenize_stats, output = write_documents(writer, [surviving()], mixer, cfg)
    stages = [*cleaner_stats, *(check.stats for check in checks), tokenize_stats]
    return finish_report(inputs, output_dir, cfg, writer.manifest, totals, stages, output, mixer, contaminated,
                         started)
