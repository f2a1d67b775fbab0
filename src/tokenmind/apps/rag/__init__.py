"""Retrieval-augmented generation: documents → chunks → a dense + BM25 index → ranked passages.

    index = build_index(["docs/"], load_encoder("minilm"), "my.index")   # or `tokenmind rag index`
    hits = index.search("how do I resume training?", k=5, mode="hybrid")
    answer, stream = ask(LLM(load_model("qwen2.5-coder-0.5b")), index, "how do I resume training?", params)
"""

from .answer import Answer, CitationFilter, ask, grounded_messages
from .chunking import Chunk, chunk_text
from .documents import Document, read_documents
from .index import RagIndex, build_index, index_documents, reciprocal_rank_fusion

__all__ = ["Answer", "Chunk", "CitationFilter", "Document", "RagIndex", "ask", "build_index", "chunk_text",
           "grounded_messages", "index_documents", "read_documents", "reciprocal_rank_fusion"]
