"""Applications on top of the engine and the models: retrieval-augmented generation (`rag`)."""
