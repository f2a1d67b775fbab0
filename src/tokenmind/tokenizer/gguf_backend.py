"""Turn the vocabulary a GGUF file carries into a Hugging Face `tokenizers.Tokenizer`.

A GGUF has no `tokenizer.json`: it stores tokens, token types, merges (or scores) and a
pre-tokenizer *name*. The pipeline around the BPE model (how text is split before merging, how
ids turn back into text) is implied by `tokenizer.ggml.model` and `tokenizer.ggml.pre`. We rebuild
it so that encoding matches what `transformers.AutoTokenizer.from_pretrained(..., gguf_file=...)`
produces, which in turn follows the original Hub `tokenizer.json` of the model.

Supported: `model == "gpt2"` (byte-level BPE) with the GPT-2 split or the Llama-3 / Qwen2 /
GPT-4o split families, and `model == "llama"` (SentencePiece-style BPE with byte fallback).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


@dataclass
class GGUFTokenizer:
    """The tokenizer a GGUF file carries in its `tokenizer.ggml.*` / `tokenizer.chat_template` keys."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)
    pre: str | None  # pre-tokenizer name, e.g. "smollm", "llama-bpe", "qwen2"
    tokens: list[str]
    token_types: list[int]  # 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    merges: list[str]  # "a b" strings; empty for SentencePiece vocabularies
    scores: list[float] | None
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    extra: dict = field(default_factory=dict)  # the other `tokenizer.*` keys, e.g. add_space_prefix

# Split regexes of the pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`. They are the
# `Split` patterns of the models' original tokenizer.json files. Names not listed here (e.g.
# "default", "gpt-2", "smollm") use GPT-2's own regex, built into `pre_tokenizers.ByteLevel`.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is Llama-3's pattern with every digit on its own.
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "smaug-bpe", "dbrx", "lfm2", "pixtral"], _LLAMA3
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "kormo"], _QWEN2),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], _GPT4O),
}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens.

    Printable Latin-1 bytes stand for themselves; the remaining 68 bytes (controls, space, ...)
    are shifted to code points 256+ in byte order, so every token is a visible string.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return table


def build_backend(gguf: GGUFTokenizer) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the one `gguf` describes (no post-processor yet)."""
    if gguf.model == "gpt2":
        backend = _byte_level_bpe(gguf)
    elif gguf.model == "llama":
        backend = _sentencepiece_bpe(gguf)
    else:
        raise ValueError(
            f"Unsupported GGUF tokenizer model {gguf.model!r}; supported are 'gpt2' (byte-level BPE) and 'llama'."
        )
    _register_added_tokens(backend, gguf)
    return backend


def _byte_level_bpe(gguf: GGUFTokenizer) -> Tokenizer:
    """Byte-level BPE: every token is spelled in the byte alphabet, text is split by a regex first.

    llama.cpp writes added tokens (`<|im_end|>`, `<think>`) literally, and occasionally a normal
    token in plain UTF-8; the latter is respelled so the merges, which are in the byte alphabet,
    can reach it. Control and user-defined tokens keep their literal spelling: they are matched
    whole in the text as added tokens and must keep their id.
    """
    table = byte_alphabet()
    alphabet = set(table.values())
    vocab = {}
    for index, (token, kind) in enumerate(zip(gguf.tokens, _types(gguf))):
        if kind not in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(table[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [tuple(merge.split(" ", 1)) for merge in gguf.merges]
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(gguf.pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(gguf: GGUFTokenizer) -> Tokenizer:
    """SentencePiece BPE (Llama 1/2, Mistral): spaces become "▁", unknown bytes fall back to <0xXX>.

    Files usually hold scores instead of merges; the merges are then recovered from them (see
    `merges_from_scores`). `add_space_prefix` (llama.cpp's flag, default on) prepends "▁" to the
    first word, and the decoder strips it again.
    """
    vocab = {token: index for index, token in enumerate(gguf.tokens)}
    if gguf.merges:
        merges = [tuple(merge.split(" ", 1)) for merge in gguf.merges]
    else:
        merges = merges_from_scores(gguf.tokens, gguf.scores or [0.0] * len(gguf.tokens))
    unk = gguf.tokens[gguf.unk_token_id] if gguf.unk_token_id is not None else None
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix_space = bool(gguf.extra.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every way to cut a token into two tokens.

    SentencePiece merges the pair whose *result* scores best, so a pair is ranked by the score of
    the token it forms. Ties are broken longer-left-piece first, then longer right piece, then vocab
    order of the result and of the pieces -- the order transformers uses, so ids agree with it.
    """
    index = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for position, (token, score) in enumerate(zip(tokens, scores)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                ranked.append(((-score, -len(left), -len(right), position, index[left], index[right]), (left, right)))
    ranked.sort(key=lambda item: item[0])
    return [pair for _, pair in ranked]


def _register_added_tokens(backend: Tokenizer, gguf: GGUFTokenizer) -> None:
    """Make control tokens special and user-defined tokens plain added tokens.

    Without this `<|im_end|>` in text would be cut into `<`, `|`, `im`, ... instead of staying one
    token, and `skip_special_tokens` would not know what to skip. The bos/eos/unk/pad tokens are
    special whatever type the file gives them, as in transformers.
    """
    named = {gguf.bos_token_id, gguf.eos_token_id, gguf.unk_token_id, gguf.pad_token_id} - {None}
    special, plain = [], []
    for index, (token, kind) in enumerate(zip(gguf.tokens, _types(gguf))):
        if kind == TOKEN_CONTROL or index in named:
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _types(gguf: GGUFTokenizer) -> list[int]:
    """Token types, defaulting to "normal" for files that omit them."""
    return gguf.token_types or [1] * len(gguf.tokens)
