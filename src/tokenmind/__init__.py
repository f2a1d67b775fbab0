"""tokenmind: a full-stack LLM system in PyTorch, from text to a served, chatting model."""

__version__ = "0.1.0"
