"""Text in, streamed text out: plain completion and a multi-turn chat session over a loaded model.

The CLI's `generate` and `chat` are thin shells over `complete` and `ChatSession`.
"""

from __future__ import annotations

from collections.abc import Iterator

from .engine.generate import Generated, stream_tokens
from .engine.sampling import SamplingParams
from .engine.speculative import Drafter, ModelDrafter, NgramDrafter, SpecStats, speculative_stream
from .pretrained import Pretrained, load_pretrained

MAX_DRAFT_TOKENS = 8  # the ceiling of the adaptive draft length (bench_speculative: best on 2 cores)


def make_drafter(spec: str, target: Pretrained) -> Drafter:
    """`--speculative` value → drafter: "ngram" (prompt lookup, no second model) or a draft model
    reference (path or alias) whose tokenizer must be the target's."""
    if spec == "ngram":
        return NgramDrafter()
    draft = load_pretrained(spec)
    if draft.model.cfg.vocab_size != target.model.cfg.vocab_size:
        raise ValueError(f"draft model {spec!r} has a vocabulary of {draft.model.cfg.vocab_size} tokens but the "
                         f"target has {target.model.cfg.vocab_size}; a draft model must share the target's tokenizer")
    return ModelDrafter(draft.model)


def stream_text(pretrained: Pretrained, prompt_ids: list[int], params: SamplingParams,
                result: Generated | None = None, drafter: Drafter | None = None,
                stats: SpecStats | None = None) -> Iterator[str]:
    """Generate from token ids, yielding text pieces that never split a multi-byte character.

    With a `drafter`, tokens come from speculative decoding (same greedy output, same sampling
    distribution; `stats` collects its acceptance numbers)."""
    tok = pretrained.tokenizer
    decoder = tok.stream_decoder(skip_special_tokens=True)
    if drafter is None:
        tokens = stream_tokens(pretrained.model, prompt_ids, params, tok.eos_token_ids, result)
    else:
        tokens = speculative_stream(pretrained.model, prompt_ids, params, drafter, MAX_DRAFT_TOKENS,
                                    tok.eos_token_ids, result, stats, adaptive=True)
    for token in tokens:
        piece = decoder.push(token)
        if piece:
            yield piece
    tail = decoder.flush()
    if tail:
        yield tail


def complete(pretrained: Pretrained, prompt: str, params: SamplingParams, result: Generated | None = None,
             drafter: Drafter | None = None, stats: SpecStats | None = None) -> Iterator[str]:
    """Continue `prompt` as plain text (no chat template)."""
    ids = pretrained.tokenizer.encode(prompt, add_special_tokens=True)
    if not ids:
        bos = pretrained.tokenizer.bos_token_id
        if bos is None:
            raise ValueError("the prompt is empty and the tokenizer has no BOS token to start from; give a prompt")
        ids = [bos]
    return stream_text(pretrained, ids, params, result, drafter, stats)


class ChatSession:
    """A conversation: keeps the messages, renders them with the model's chat template each turn."""

    def __init__(self, pretrained: Pretrained, params: SamplingParams, system: str | None = None,
                 drafter: Drafter | None = None):
        pretrained.tokenizer.get_chat_template()  # fail now, with the fix named, if there is no template
        self.pretrained, self.params, self.system, self.drafter = pretrained, params, system, drafter
        self.messages: list[dict[str, str]] = []

    def reset(self) -> None:
        self.messages.clear()

    def _prompt_ids(self) -> list[int]:
        """Render the conversation, dropping the oldest turns while it does not fit the context."""
        tok, context = self.pretrained.tokenizer, self.pretrained.model.cfg.max_position_embeddings
        while True:
            system = [{"role": "system", "content": self.system}] if self.system else []
            ids = tok.apply_chat_template(system + self.messages, add_generation_prompt=True)
            if len(ids) + min(self.params.max_tokens, 64) <= context or len(self.messages) <= 1:
                return ids
            self.messages = self.messages[2:] if len(self.messages) > 2 else self.messages[1:]

    def send(self, user_text: str) -> Iterator[str]:
        """Add a user turn and stream the assistant's reply; the reply joins the history when done."""
        self.messages.append({"role": "user", "content": user_text})
        pieces: list[str] = []
        try:
            for piece in stream_text(self.pretrained, self._prompt_ids(), self.params, drafter=self.drafter):
                pieces.append(piece)
                yield piece
        finally:  # also when the caller stops early (Ctrl-C): keep what was said
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
