"""Retrieval-augmented generation: documents → chunks → a dense + BM25 index → ranked passages.

    index = build_index(["docs/"], load_encoder("minilm"), "my.index")   # or `tokenmind rag index`
    hits = index.search("how do I resume training?", k=5, mode="hybrid")
"""

from .chunking import Chunk, chunk_text
from .documents import Document, read_documents
from .index import RagIndex, build_index, reciprocal_rank_fusion

__all__ = ["Chunk", "Document", "RagIndex", "build_index", "chunk_text", "read_documents", "reciprocal_rank_fusion"]
