"""The retrieval index: chunks with their sources, unit vectors from the encoder, and BM25.

Three ways to rank chunks for a query: `dense` (cosine similarity of encoder vectors),
`bm25` (word overlap weighted by rarity, `bm25s`), and `hybrid` — the two lists merged by
reciprocal rank fusion, which needs no score calibration between them (Cormack et al. 2009).
Two optional stages act on the first `candidates` chunks of a mode: a reranker (`rerank.py`: the
chat model judges each passage against the question) re-scores them, and maximal marginal
relevance picks the k returned so that they are relevant but not near copies of one another.

Dense search is exact below HNSW_MIN_CHUNKS chunks; above, an HNSW graph (faiss) answers in
about a millisecond at the price of sometimes missing a true neighbour (`benchmarks/bench_rag.py`
measures both). On disk an index is a folder: `meta.json` (settings and a SHA-256 per document),
`chunks.jsonl`, `vectors.npy`, `bm25/` and, with HNSW, `hnsw.faiss`. It is written beside the old
one and swapped in by renames, so a reader never sees half an index. Re-indexing reuses the
vectors of documents whose text is unchanged: only new and edited documents are chunked and
embedded again (the HNSW graph is rebuilt from all vectors).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ...jsonl import read_jsonl
from ...progress import Bars
from .chunking import Chunk, chunk_text
from .documents import Document, read_documents

FORMAT, VERSION = "tokenmind-rag-index", 1
MODES = ("dense", "bm25", "hybrid")
RRF_K = 60  # the usual damping constant of reciprocal rank fusion
HNSW_MIN_CHUNKS = 20_000  # below this, exact search (one matrix-vector product) is as fast and never misses
HNSW_NEIGHBOURS, HNSW_EF_CONSTRUCTION = 32, 80
CANDIDATES = 20  # first-stage chunks a reranker or MMR chooses from


@dataclass(frozen=True)
class Hit:
    chunk: Chunk
    score: float  # cosine (dense), BM25 score (bm25), fused score (hybrid) or a reranker's log-odds
    id: int  # the chunk's row in the index


def reciprocal_rank_fusion(rankings: list[list[int]], k: int = RRF_K) -> list[tuple[int, float]]:
    """Merge ranked id lists: each id scores Σ 1 / (k + rank) over the lists it is in (rank from 1)."""
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))


def maximal_marginal_relevance(scores: np.ndarray, vectors: np.ndarray, k: int, lam: float) -> list[int]:
    """Which k of the candidates to return, in the order maximal marginal relevance picks them
    (Carbonell & Goldstein 1998): each pick maximises λ · relevance − (1 − λ) · its highest cosine
    to a candidate already picked. `scores` may be on any scale (cosine, BM25, fused, log-odds): they
    are rescaled to [0, 1] over the candidates, so λ weighs them against cosines. `vectors` are the
    candidates' unit vectors. λ = 1 keeps the relevance order; lower λ trades relevance for diversity."""
    if not 0 <= lam <= 1:
        raise ValueError(f"the MMR lambda must be in [0, 1] (1 = relevance only); got {lam}")
    if len(scores) == 0:
        return []
    spread = scores.max() - scores.min()
    relevance = (scores - scores.min()) / spread if spread > 0 else np.ones(len(scores))
    similarity = vectors @ vectors.T
    redundancy = np.zeros(len(scores))  # each candidate's highest cosine to the picked ones
    left, picked = list(range(len(scores))), []
    while left and len(picked) < k:
        gain = lam * relevance[left] - (1 - lam) * redundancy[left]
        best = left.pop(int(np.argmax(gain)))  # ties: the earlier candidate
        picked.append(best)
        redundancy = np.maximum(redundancy, similarity[best])
    return picked


def _bm25_tokens(texts: list[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class RagIndex:
    def __init__(self, chunks: list[Chunk], vectors: np.ndarray, settings: dict, documents: dict[str, str],
                 bm25=None, hnsw=None):
        if len(chunks) != len(vectors):
            raise ValueError(f"{len(chunks)} chunks but {len(vectors)} vectors")
        self.chunks, self.vectors, self.settings, self.documents = chunks, vectors, settings, documents
        self._bm25 = bm25
        self.hnsw = hnsw  # a faiss HNSW graph over `vectors`, or None for exact search
        self._encoder = None

    def build_hnsw(self) -> None:
        """Approximate nearest-neighbour search (faiss HNSW, inner product = cosine on unit vectors)."""
        try:
            import faiss
        except ImportError as e:
            raise ImportError("an HNSW index needs faiss: pip install 'tokenmind[rag]'") from e
        graph = faiss.IndexHNSWFlat(self.vectors.shape[1], HNSW_NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
        graph.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        graph.add(np.ascontiguousarray(self.vectors, dtype=np.float32))
        self.hnsw = graph

    # ----------------------------------------------------------------- search

    @property
    def bm25(self):
        if self._bm25 is None:
            import bm25s

            self._bm25 = bm25s.BM25()
            if self.chunks:  # a chunk of stop words only gets a placeholder word: bm25s needs one per row
                texts = [c.for_embedding for c in self.chunks]
                self._bm25.index([words or ["\u2205"] for words in _bm25_tokens(texts)], show_progress=False)
        return self._bm25

    def encoder(self):
        """The encoder the index was built with (loaded on first use)."""
        if self._encoder is None:
            from ...model.encoder import load_encoder

            self._encoder = load_encoder(self.settings["encoder"], quantize=self.settings["quantize"])
        return self._encoder

    def dense_ranking(self, query: str, n: int, exact: bool = False) -> list[tuple[int, float]]:
        """The n chunks nearest the query: through the HNSW graph when there is one (unless `exact`),
        else every vector scored."""
        q = self.encoder().embed([query])[0].numpy()
        return self.nearest(q, n, exact)

    def nearest(self, q: np.ndarray, n: int, exact: bool = False) -> list[tuple[int, float]]:
        """(row, cosine) of the n vectors nearest the unit vector q, best first."""
        if self.hnsw is not None and not exact:
            self.hnsw.hnsw.efSearch = max(64, 2 * n)  # the candidate list: wider finds more of the true top n
            scores, ids = self.hnsw.search(q[None].astype(np.float32), min(n, len(self.chunks)))
            return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]
        # torch's product runs on the threads the encoder just used; numpy's BLAS would wake a second pool
        scores = (torch.from_numpy(self.vectors) @ torch.from_numpy(np.ascontiguousarray(q, np.float32))).numpy()
        if n < len(scores):  # select the n best first: a full sort of every score costs more than the product
            part = np.argpartition(-scores, n)[:n]
            top = part[np.argsort(-scores[part], kind="stable")]
        else:
            top = np.argsort(-scores, kind="stable")
        return [(int(i), float(scores[i])) for i in top]

    def bm25_ranking(self, query: str, n: int) -> list[tuple[int, float]]:
        words = _bm25_tokens([query])
        if not self.chunks or not words[0]:
            return []
        ids, scores = self.bm25.retrieve(words, k=min(n, len(self.chunks)), show_progress=False)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]  # no shared word: no hit

    def search(self, query: str, k: int = 5, mode: str = "hybrid", *, rerank=None, mmr: float | None = None,
               candidates: int = CANDIDATES) -> list[Hit]:
        """The k best chunks for `query`, best first.

        rerank: an `LLMReranker` (anything with `rerank(query, hits, k)`), which re-scores the first
        `candidates` chunks of `mode`. mmr: λ of maximal marginal relevance, which then picks the k
        from those candidates, passing over near copies of chunks already picked (None: off).
        """
        if mode not in MODES:
            raise ValueError(f"unknown retrieval mode {mode!r}; choose one of {', '.join(MODES)}")
        if not self.chunks or k < 1:
            return []
        n = max(k, candidates) if rerank is not None or mmr is not None else k
        if mode == "dense":
            ranked = self.dense_ranking(query, n)
        elif mode == "bm25":
            ranked = self.bm25_ranking(query, n)
        else:  # each list deeper than n, so a chunk second-best in both can still win
            depth = max(4 * n, 20)
            lists = [[i for i, _ in self.dense_ranking(query, depth)], [i for i, _ in self.bm25_ranking(query, depth)]]
            ranked = reciprocal_rank_fusion(lists)[:n]
        hits = [Hit(self.chunks[i], score, i) for i, score in ranked]
        if rerank is not None:
            hits = rerank.rerank(query, hits, len(hits))
        if mmr is not None:
            order = maximal_marginal_relevance(np.array([h.score for h in hits]),
                                               self.vectors[[h.id for h in hits]], k, mmr)
            hits = [hits[i] for i in order]
        return hits[:k]

    # ----------------------------------------------------------------- files

    def save(self, path: str | Path) -> Path:
        """Write the index folder beside `path`, then swap it in (renames only)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            meta = {"format": FORMAT, "version": VERSION, **self.settings, "documents": self.documents,
                    "chunks": len(self.chunks)}
            (scratch / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            with open(scratch / "chunks.jsonl", "w", encoding="utf-8") as f:
                for c in self.chunks:
                    f.write(json.dumps(asdict(c), ensure_ascii=False) + "\n")
            np.save(scratch / "vectors.npy", self.vectors.astype(np.float32))
            if self.hnsw is not None:
                import faiss

                faiss.write_index(self.hnsw, str(scratch / "hnsw.faiss"))
            if self.chunks:
                self.bm25.save(str(scratch / "bm25"), show_progress=False)
            old = None
            if path.exists():
                if not (path / "meta.json").is_file():
                    raise FileExistsError(f"{path} exists and is not a tokenmind index; choose another --out")
                old = path.with_name(f".{path.name}-old-{os.getpid()}")
                os.replace(path, old)
            os.replace(scratch, path)
            if old is not None:
                shutil.rmtree(old)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return path

    @classmethod
    def load(cls, path: str | Path) -> RagIndex:
        path = Path(path)
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise FileNotFoundError(f"{path} is not a tokenmind index (no readable meta.json: {e}); build one "
                                    "with `tokenmind rag index PATH... --out INDEX`") from e
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{path}: index format {meta.get('format')} v{meta.get('version')}, this tokenmind "
                             f"reads {FORMAT} v{VERSION}; rebuild it")
        chunks = [Chunk(**row) for row in read_jsonl(path / "chunks.jsonl")]  # not splitlines(): texts hold U+2028
        vectors = np.load(path / "vectors.npy")
        bm25 = None
        if chunks:
            import bm25s

            bm25 = bm25s.BM25.load(str(path / "bm25"), show_progress=False)
        hnsw = None
        if (path / "hnsw.faiss").is_file():
            import faiss

            hnsw = faiss.read_index(str(path / "hnsw.faiss"))
        settings = {"quantize": None,  # indexes written before the int8 encoder existed
                    **{k: v for k, v in meta.items() if k not in ("format", "version", "documents", "chunks")}}
        return cls(chunks, vectors, settings, meta["documents"], bm25, hnsw)


def build_index(paths: list[str | Path], encoder, out: str | Path, *, max_tokens: int = 200, overlap: int = 40,
                add: bool = False, hnsw: bool | None = None, progress: bool = True) -> tuple[RagIndex, dict[str, int]]:
    """Index the documents under `paths` into the folder `out`; returns the index and what changed.

    An index already at `out` (same encoder and chunking) is updated: unchanged documents keep
    their chunks and vectors; edited and new ones are chunked and embedded; documents no longer
    under `paths` are dropped (kept with `add=True`). `encoder` is a loaded `SentenceEncoder`.
    hnsw: also build an HNSW graph for approximate dense search (None: from HNSW_MIN_CHUNKS chunks
    on, when faiss is installed).
    """
    return index_documents(read_documents(paths), encoder, out, max_tokens=max_tokens, overlap=overlap, add=add,
                           hnsw=hnsw, progress=progress)


def index_documents(docs: list[Document], encoder, out: str | Path, *, max_tokens: int = 200, overlap: int = 40,
                    add: bool = False, hnsw: bool | None = None,
                    progress: bool = True) -> tuple[RagIndex, dict[str, int]]:
    """`build_index` over documents already in memory (e.g. an evaluation set's paragraphs)."""
    settings = {"encoder": str(encoder.path), "quantize": encoder.quantize, "dimensions": encoder.dimensions,
                "max_tokens": max_tokens, "overlap": overlap}
    old = None
    if (Path(out) / "meta.json").is_file():
        old = RagIndex.load(out)
        if old.settings != settings:
            old = None  # another encoder or chunking: nothing can be reused
    if len({d.source for d in docs}) != len(docs):
        raise ValueError("two documents have the same source name (duplicate JSONL ids?); name them apart")
    old_rows: dict[str, list[int]] = {}
    if old is not None:
        for i, c in enumerate(old.chunks):
            old_rows.setdefault(c.source, []).append(i)
    documents: dict[str, str] = {}
    chunks: list[Chunk] = []
    blocks: list[np.ndarray | int] = []  # per document: its reused vectors, or how many fresh chunks it has
    fresh: list[Chunk] = []
    stats = {"documents": 0, "unchanged": 0, "embedded": 0, "removed": 0, "chunks": 0}

    def count(text: str) -> int:
        return len(encoder.tokenizer.encode(text))

    def keep(source: str) -> None:
        rows = old_rows.get(source, [])
        chunks.extend(old.chunks[i] for i in rows)
        blocks.append(old.vectors[rows])

    for doc in docs:
        digest = hashlib.sha256(doc.text.encode()).hexdigest()
        documents[doc.source] = digest
        if old is not None and old.documents.get(doc.source) == digest:
            keep(doc.source)
            stats["unchanged"] += 1
        else:
            new = chunk_text(doc.text, doc.source, count, max_tokens, overlap)
            chunks.extend(new)
            fresh.extend(new)
            blocks.append(len(new))
            stats["embedded"] += 1
    if old is not None:
        if add:  # keep the documents that are not being re-indexed
            for source, digest in old.documents.items():
                if source not in documents:
                    documents[source] = digest
                    keep(source)
        stats["removed"] = len(set(old.documents) - set(documents))
    counts = [b for b in blocks if isinstance(b, int)]
    embedded = iter(np.split(_embed(encoder, fresh, progress), np.cumsum(counts)[:-1]) if counts else [])
    parts = [next(embedded) if isinstance(block, int) else block for block in blocks]
    matrix = np.concatenate(parts) if parts else np.zeros((0, encoder.dimensions), np.float32)
    index = RagIndex(chunks, matrix.astype(np.float32), settings, documents)
    if hnsw is None:
        hnsw = len(chunks) >= HNSW_MIN_CHUNKS and importlib.util.find_spec("faiss") is not None
    if hnsw and chunks:
        index.build_hnsw()
    stats["documents"], stats["chunks"] = len(documents), len(chunks)
    index.save(out)
    return index, stats


def _embed(encoder, chunks: list[Chunk], progress: bool, batch: int = 64) -> np.ndarray:
    """Unit vectors of the chunks, with a progress bar; one call, so batches group similar lengths
    across the whole collection."""
    if not chunks:
        return np.zeros((0, encoder.dimensions), np.float32)
    with Bars(progress) as bars:
        advance = bars.add("embedding", total=len(chunks))
        return encoder.embed([c.for_embedding for c in chunks], batch_size=batch, progress=advance).numpy()
