"""Retrieval-augmented generation: documents → chunks → a dense + BM25 index → ranked passages.

    index = build_index(["docs/"], load_encoder("minilm"), "my.index")   # or `tokenmind rag index`
    hits = index.search("how do I resume training?", k=5, mode="hybrid")
    hits = index.search("how do I resume training?", k=5, rerank=LLMReranker(load_model("qwen2.5-coder-1.5b")),
                        mmr=0.7)  # the chat model judges the top 20, then MMR picks 5 that differ
    answer, stream = ask(LLM(load_model("qwen2.5-coder-0.5b")), index, "how do I resume training?", params)
"""

from .answer import Answer, CitationFilter, ask, grounded_messages
from .chunking import Chunk, chunk_text
from .documents import Document, read_documents
from .index import RagIndex, build_index, index_documents, maximal_marginal_relevance, reciprocal_rank_fusion
from .rerank import LLMReranker

__all__ = ["Answer", "Chunk", "CitationFilter", "Document", "LLMReranker", "RagIndex", "ask", "build_index",
           "chunk_text", "grounded_messages", "index_documents", "maximal_marginal_relevance", "read_documents",
           "reciprocal_rank_fusion"]
