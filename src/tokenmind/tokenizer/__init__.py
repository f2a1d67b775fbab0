"""Tokenization: a `tokenizers`-backed `Tokenizer` (HF directories, GGUF files), chat templates,
assistant masks for SFT, and streaming detokenization."""

from tokenmind.tokenizer.chat_template import ChatTemplateError, render_chat, render_template
from tokenmind.tokenizer.streaming import StreamDecoder
from tokenmind.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "StreamDecoder", "Tokenizer", "render_chat", "render_template"]
