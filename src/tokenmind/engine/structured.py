"""Grammar-constrained decoding: a request's output must match a JSON schema, a Lark grammar or a regex.

`llguidance` does the grammar work: it compiles the constraint against the tokenizer's vocabulary
once per request and then, per step, tells which tokens may come next (a bitmask). The engine
keeps one `llguidance.LLMatcher` per sequence (forks copy it), masks the disallowed tokens to -inf
in the batched sampler before the draw (`mask_logits`), and feeds it each chosen token
(`advance`). When the grammar is complete and nothing more may follow, the sequence
ends with finish reason "stop"; when more may follow, EOS is among the allowed tokens.

Compiling takes 0.01–2 s for a large schema, so the server compiles on its request thread
(`GrammarCompiler.matcher`) and the engine then finds the result in the compiler's cache.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import llguidance

# JSON laid out as json.dumps does ({"a": 1, "b": 2}): the layout models saw most, and no free
# whitespace, which a small model can otherwise emit forever (a newline loop inside an object).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What the whole output must match: exactly one of a JSON schema, any JSON object, a Lark
    grammar (llguidance's dialect, which may embed `%json{...}` schemas) or a regular expression."""

    json_schema: dict | None = None
    json_object: bool = False
    lark: str | None = None
    regex: str | None = None

    def __post_init__(self) -> None:
        given = [self.json_schema is not None, self.json_object, self.lark is not None, self.regex is not None]
        if sum(given) != 1:
            raise ValueError("StructuredOutput takes exactly one of json_schema, json_object, lark, regex")

    def grammar(self) -> str:
        """The llguidance grammar text."""
        import llguidance

        if self.json_object:
            schema: dict[str, Any] = {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.json_schema is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(self.json_schema, defaults=JSON_OPTIONS)
        if self.lark is not None:
            return llguidance.LLMatcher.grammar_from_lark(self.lark)
        return llguidance.LLMatcher.grammar_from_regex(self.regex)


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one tokenizer and vocabulary size. Thread-safe.

    Building llguidance's view of the vocabulary takes about a second, so it happens once, on
    first use. The model's vocabulary may be larger than the tokenizer's (padding rows): those
    ids are never allowed.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], cache_size: int = 64):
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # spec → a pristine matcher

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                import llguidance

                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer; this engine has none")
                if not self.eos_token_ids:
                    raise ValueError("structured output needs an end-of-sequence token id; the tokenizer has none")
                backend = self.tokenizer.backend  # a `tokenizers.Tokenizer`: llguidance reads its JSON
                self._lltokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                           eos_token=self.eos_token_ids)
                self._executor = llguidance.LLExecutor()
            return self._lltokenizer

    @property
    def executor(self) -> llguidance.LLExecutor:
        _ = self.lltokenizer
        return self._executor

    def special_tokens(self, texts: Iterable[str]) -> list[str]:
        """Those of `texts` that are one token llguidance treats as special (every added token, e.g.
        Qwen2.5's `<tool_call>`): a grammar must name them as tokens, not spell them as text."""
        ids = [(text, self.tokenizer.token_to_id(text)) for text in texts]
        return [text for text, i in ids if i is not None and self.lltokenizer.is_special_token(i)]

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence, or ValueError naming what is wrong with the constraint.
        The same spec again (a retry, the engine after the server checked it) copies the cached one."""
        key = json.dumps([spec.json_schema, spec.json_object, spec.lark, spec.regex], sort_keys=True)
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
                return cached.deep_copy()
        matcher = self._compile(spec)
        with self._lock:
            self._compiled[key] = matcher.deep_copy()
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return matcher

    def _compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        import llguidance

        try:
            grammar = spec.grammar()
        except ValueError as e:  # not a JSON object, ...
            raise ValueError(f"invalid structured-output constraint: {e}") from e
        tokenizer = self.lltokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ValueError(f"the constraint cannot be compiled: {messages[0]}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the constraint cannot be compiled: {matcher.get_error()}")
        return matcher


def _bits_to_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, ceil(V/32)) int32 words → (R, V) bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None],
                compiler: GrammarCompiler | None) -> torch.Tensor:
    """(S, V) logits with every token a row's matcher forbids at -inf (a copy if any row has one)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    V = logits.shape[-1]
    words = (V + 31) // 32
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    # llguidance fills row j for matcher j, in parallel across its threads (the GIL released)
    compiler.executor.unsafe_compute_mask_ptr([(matchers[i], j) for j, i in enumerate(rows)],
                                              bitmask.data_ptr(), words * 4, len(rows))
    allowed = _bits_to_mask(bitmask, V).to(logits.device)
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def advance(matcher: llguidance.LLMatcher | None, token: int) -> bool:
    """Feed a sequence's matcher (if it has one) its new token; True when the grammar allows nothing more."""
    if matcher is None:
        return False
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar rejected token {token} it had allowed: {matcher.get_error()}")
    return matcher.is_stopped()

