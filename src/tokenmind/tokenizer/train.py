"""Train a byte-level BPE tokenizer on a corpus, and measure how well it compresses text.

The recipe is GPT-2/GPT-4's: text is first split by a regex into words, numbers (at most three
digits per piece), punctuation runs and whitespace, so merges never cross those boundaries;
each piece is then spelled as bytes mapped to 256 printable characters (the ByteLevel
alphabet), and BPE merges the most frequent adjacent pairs until the vocabulary is full.
Because all 256 bytes are in the initial alphabet, any string encodes and decodes exactly:
there is no unknown token. The Rust `tokenizers` library does the counting and merging.

Special tokens (end-of-text and the ChatML role markers) get the first ids, in the order
given, and are matched in text before the regex runs, so they are never split. The result is
a `tokenmind.tokenizer.Tokenizer` with a ChatML chat template in SmolLM2's format; `save()`
writes a directory that `transformers.AutoTokenizer.from_pretrained` loads.

Compression is reported as bytes per token (UTF-8 bytes of held-out text / tokens): higher
means fewer tokens per text, hence more text per context window and per training FLOP.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from tokenmind.data.fim import FIM_TOKENS
from tokenmind.tokenizer.tokenizer import Tokenizer

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
DEFAULT_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# GPT-4's (cl100k) split, without possessive quantifiers, as Llama 3's tokenizer.json writes it:
# contractions, letter runs with one optional leading non-letter, 1-3 digit numbers, punctuation
# runs, newlines, and whitespace (a trailing space stays with the following word).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML exactly as SmolLM2 renders it (`<|im_start|>role\ncontent<|im_end|>\n` per message,
# `<|im_start|>assistant\n` as the generation prompt), minus SmolLM2's default system prompt.
# `{% generation %}` marks what the assistant produces, for SFT loss masks.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class _Encoder(Protocol):
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    min_frequency: int = 2,
    *,
    eos_token: str = ENDOFTEXT,
    bos_token: str | None = ENDOFTEXT,
    pad_token: str | None = ENDOFTEXT,
    chat_template: str | None = CHATML_TEMPLATE,
    split_pattern: str = SPLIT_PATTERN,
    max_token_length: int | None = None,
    show_progress: bool = False,
) -> Tokenizer:
    """A byte-level BPE tokenizer with `vocab_size` ids (special tokens included) learned from `texts`.

    `special_tokens` take ids 0..n-1 in order; `eos_token`/`bos_token`/`pad_token` must be among
    them. `min_frequency` is the fewest occurrences a pair needs to be merged, so a small
    corpus may end below `vocab_size`. `max_token_length` caps a token's length in characters.
    `<|im_end|>` also stops generation when it is a special token (it ends every chat turn).
    """
    special_tokens = list(dict.fromkeys(special_tokens))
    for name, token in (("eos_token", eos_token), ("bos_token", bos_token), ("pad_token", pad_token)):
        if token is not None and token not in special_tokens:
            raise ValueError(f"{name}={token!r} is not in special_tokens {special_tokens}; add it there")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the 256 byte tokens and {len(special_tokens)} special "
            f"tokens need {len(alphabet) + len(special_tokens)}; use a larger vocab_size"
        )
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    backend.decoder = decoders.ByteLevel()
    # Adds nothing around sequences (as SmolLM2: chat templates write the special tokens) and
    # keeps encoding offsets on the original text.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens,
        initial_alphabet=alphabet,
        max_token_length=max_token_length,
        show_progress=show_progress,
    )
    backend.train_from_iterator(_nonempty(texts), trainer=trainer)
    stops = [backend.token_to_id(IM_END)] if IM_END in special_tokens else []
    return Tokenizer(
        backend,
        special_tokens={"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token},
        chat_template=chat_template,
        extra_eos_token_ids=stops,
    )


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"train_bpe needs strings, got {type(text).__name__}")
        if text:
            yield text


def bytes_per_token(tokenizer: _Encoder, texts: Iterable[str]) -> float:
    """UTF-8 bytes per token over `texts` (encoded without added special tokens); higher is better."""
    n_bytes, n_tokens = _count(tokenizer, texts)
    if n_tokens == 0:
        raise ValueError("bytes_per_token needs at least one non-empty text")
    return n_bytes / n_tokens


def _count(tokenizer: _Encoder, texts: Iterable[str], batch: int = 256) -> tuple[int, int]:
    n_bytes = n_tokens = 0
    chunk: list[str] = []
    for text in [*texts, None]:
        if text is not None:
            chunk.append(text)
        if chunk and (text is None or len(chunk) == batch):
            n_bytes += sum(len(t.encode("utf-8")) for t in chunk)
            n_tokens += sum(len(ids) for ids in tokenizer.encode_batch(chunk))
            chunk = []
    return n_bytes, n_tokens


def compare_bytes_per_token(trained: _Encoder, reference: _Encoder, heldout_texts: Iterable[str]) -> dict[str, Any]:
    """Bytes per token of both tokenizers on the same held-out texts, and their vocabulary sizes.

    `ratio` = trained / reference: above 1 means ours compresses this text better.
    """
    texts = list(heldout_texts)
    n_bytes, trained_tokens = _count(trained, texts)
    _, reference_tokens = _count(reference, texts)
    if not trained_tokens or not reference_tokens:
        raise ValueError("compare_bytes_per_token needs at least one non-empty held-out text")
    ours, theirs = n_bytes / trained_tokens, n_bytes / reference_tokens
    return {
        "bytes": n_bytes,
        "texts": len(texts),
        "trained": ours,
        "reference": theirs,
        "ratio": ours / theirs,
        "trained_tokens": trained_tokens,
        "reference_tokens": reference_tokens,
        "trained_vocab_size": getattr(trained, "vocab_size", None),
        "reference_vocab_size": getattr(reference, "vocab_size", None),
    }


# --------------------------------------------------------------------- from a corpus on disk


@dataclass
class TokenizerTrainConfig:
    """Train a tokenizer on document files (as `tokenizer train` does) and report its compression.

    data: files/folders readable by `tokenmind.data.read_documents` (txt, jsonl, parquet), e.g.
        the `pretrain/` folder `tokenmind data fetch` writes; out: the tokenizer directory.
    max_chars: stop reading the corpus once this many training characters are read (0 = all).
    heldout_every: every n-th document read (chosen by a hash of its id, so stable across runs)
        is held out of training to measure bytes per token, up to max_heldout_chars; 0 = none.
    fim: also reserve the fill-in-the-middle sentinels (`<fim_prefix>`, `<fim_suffix>`,
        `<fim_middle>`) as special tokens, after `special_tokens`, for `data.fim`.
    """

    data: list[str] = field(default_factory=list)
    out: str = "tokenizer"
    vocab_size: int = 8192
    min_frequency: int = 2
    special_tokens: list[str] = field(default_factory=lambda: list(DEFAULT_SPECIAL_TOKENS))
    max_chars: int = 0
    heldout_every: int = 50
    max_heldout_chars: int = 2_000_000
    fim: bool = False

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("TokenizerTrainConfig.data is empty: give the corpus files or folders to train on")
        if self.heldout_every < 0 or self.max_chars < 0:
            raise ValueError("heldout_every and max_chars must be >= 0 (0 disables them)")


def train_tokenizer(cfg: TokenizerTrainConfig, reference: _Encoder | None = None) -> dict[str, Any]:
    """Train on `cfg.data`, save to `cfg.out`, and write/return a report with bytes per token, compared
    with `reference`'s on the same held-out text if given (e.g. `load_tokenizer("smollm2")`)."""
    from tokenmind.data.readers import read_documents  # local: keeps `import tokenmind.tokenizer` light

    heldout: list[str] = []
    stats = {"train_docs": 0, "train_chars": 0}

    def training_texts() -> Iterator[str]:
        held_chars = 0
        for doc in read_documents(cfg.data):
            if cfg.heldout_every and _bucket(doc.id, cfg.heldout_every) == 0:
                if held_chars < cfg.max_heldout_chars:
                    heldout.append(doc.text)
                    held_chars += len(doc.text)
                continue
            if cfg.max_chars and stats["train_chars"] >= cfg.max_chars:
                return
            stats["train_docs"] += 1
            stats["train_chars"] += len(doc.text)
            yield doc.text

    t0 = time.perf_counter()
    special_tokens = [*cfg.special_tokens, *(FIM_TOKENS if cfg.fim else ())]
    tokenizer = train_bpe(training_texts(), cfg.vocab_size, special_tokens, cfg.min_frequency)
    report: dict[str, Any] = {"config": asdict(cfg), **stats, "seconds": time.perf_counter() - t0,
                              "vocab_size": tokenizer.vocab_size}  # fmt: skip
    tokenizer.save(cfg.out)
    if heldout:
        report["heldout_docs"] = len(heldout)
        report["bytes_per_token"] = bytes_per_token(tokenizer, heldout)
        if reference is not None:
            report["comparison"] = compare_bytes_per_token(tokenizer, reference, heldout)
    (Path(cfg.out) / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _bucket(doc_id: str, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little") % n
