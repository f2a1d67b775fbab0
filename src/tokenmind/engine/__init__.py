"""Generation: sampling, the simple KV-cache loop (`generate`), and the paged, continuously batched
engine (`LLM` offline, `AsyncEngine` for serving)."""
