"""Retrieval at scale: build time, memory and query latency of a large index, and what HNSW costs in recall.

The corpus is SQuAD's 803 gold paragraphs (`tokenmind data fetch squad`) among distractor passages
cut from the other fetched text (`data/pretrain/*.jsonl`, the `text` of `data/eval/*.jsonl` items),
up to `--chunks` passages in all. Two indexes of the same vectors are built, exact and HNSW
(faiss); over SQuAD's 1,000 questions the script reports, at k = 10:

- query latency p50 / p99 for dense exact, dense HNSW, BM25 and hybrid (each includes embedding
  the query, which BM25 does not need);
- HNSW's recall of the exact top 10, and SQuAD recall@10 / MRR@10 with each;
- build seconds (embedding, BM25, HNSW), bytes of vectors, graph and BM25 on disk, and the peak
  resident memory of the whole run (encoder, both indexes and the texts).

At 100k passages the fetched text runs short of 60-word passages: `--words 40` reaches it.

    python benchmarks/bench_rag.py [--chunks 100000] [--out result.json]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info  # noqa: E402

from tokenmind.jsonl import read_jsonl  # noqa: E402


def distractor_passages(data: Path, words_per_passage: int, limit: int) -> list[str]:
    """Passages of about `words_per_passage` words from every fetched text file, in file order."""
    passages: list[str] = []
    files = sorted((data / "pretrain").glob("*.jsonl")) + sorted((data / "eval").glob("*.jsonl"))
    for path in files:
        if path.name == "squad.jsonl":
            continue
        words: list[str] = []
        for row in read_jsonl(path):
            words += row.get("text", "").split()
            while len(words) >= words_per_passage:
                passages.append(" ".join(words[:words_per_passage]))
                words = words[words_per_passage:]
                if len(passages) >= limit:
                    return passages
    return passages


def latency_ms(fn, queries: list[str]) -> tuple[float, float, list]:
    times, results = [], []
    for q in queries:
        t0 = time.perf_counter()
        results.append(fn(q))
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return round(statistics.median(times), 3), round(times[int(0.99 * (len(times) - 1))], 3), results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="data", help="the folder `tokenmind data fetch` filled (default data)")
    ap.add_argument("--chunks", type=int, default=100_000, help="passages in the index, SQuAD's included")
    ap.add_argument("--words", type=int, default=60, help="words per distractor passage (default 60)")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    from tokenmind.apps.rag import Document, index_documents
    from tokenmind.apps.rag.evaluate import load_qa, passages
    from tokenmind.model.encoder import load_encoder

    items = load_qa(Path(args.data) / "eval" / "squad.jsonl")
    gold_docs, gold = passages(items)
    extra = distractor_passages(Path(args.data), args.words, args.chunks - len(gold_docs))
    if len(gold_docs) + len(extra) < args.chunks:
        print(f"the fetched text gives {len(extra)} passages of {args.words} words, {len(gold_docs) + len(extra)} "
              f"in all, short of --chunks {args.chunks}; use fewer --words", file=sys.stderr)
    docs = gold_docs + [Document(f"distractor-{i:06d}", text) for i, text in enumerate(extra)]
    encoder = load_encoder("minilm")
    questions = [i.question for i in items]
    with tempfile.TemporaryDirectory() as scratch:
        t0 = time.perf_counter()
        index, _ = index_documents(docs, encoder, Path(scratch) / "exact", hnsw=False, progress=sys.stderr.isatty())
        build = {"embed_and_bm25_s": round(time.perf_counter() - t0, 1)}
        t0 = time.perf_counter()
        index.build_hnsw()
        build["hnsw_s"] = round(time.perf_counter() - t0, 1)
        index.save(Path(scratch) / "hnsw")
        sizes = {name: sum(f.stat().st_size for f in (Path(scratch) / "hnsw" / name).rglob("*")) if
                 (Path(scratch) / "hnsw" / name).is_dir() else (Path(scratch) / "hnsw" / name).stat().st_size
                 for name in ("vectors.npy", "hnsw.faiss", "bm25", "chunks.jsonl")}
        qvec = {q: v for q, v in zip(questions, encoder.embed(questions).numpy())}
        k = args.k
        rows = {}
        for name, fn in {
            "dense_exact": lambda q: index.nearest(encoder.embed([q])[0].numpy(), k, exact=True),
            "dense_hnsw": lambda q: index.nearest(encoder.embed([q])[0].numpy(), k),
            "bm25": lambda q: index.bm25_ranking(q, k),
            "hybrid (hnsw)": lambda q: [(h.id, h.score) for h in index.search(q, k, "hybrid")],
        }.items():
            p50, p99, results = latency_ms(fn, questions)
            ranks = []
            for item, ranked in zip(items, results):
                sources = [index.chunks[i].source for i, _ in ranked]
                ranks.append(sources.index(gold[item.id]) + 1 if gold[item.id] in sources else None)
            rows[name] = {"p50_ms": p50, "p99_ms": p99,
                          f"squad_recall@{k}": round(sum(r is not None for r in ranks) / len(items), 4),
                          f"squad_mrr@{k}": round(sum(1 / r for r in ranks if r) / len(items), 4)}
        overlap = [len({i for i, _ in index.nearest(v, k)} & {i for i, _ in index.nearest(v, k, exact=True)}) / k
                   for v in qvec.values()]
    result = {"benchmark": "rag", "machine": machine_info(), "chunks": len(index.chunks), "squad_paragraphs":
              len(gold_docs), "questions": len(items), "k": k, "build": build, "bytes": sizes,
              "hnsw_recall_of_exact_top_k": round(float(np.mean(overlap)), 4), "queries": rows,
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
