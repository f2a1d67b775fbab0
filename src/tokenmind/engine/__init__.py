"""Generation: sampling, the simple KV-cache loop, and (later) the paged, batched engine."""
