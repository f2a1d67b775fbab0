"""Fill-in-the-middle (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the Middle").

A left-to-right model can only continue text. To let it fill a gap (the body of a function between
its signature and the code after it), some training documents are cut at two random character
positions into prefix, middle and suffix, and moved so the middle comes last:

    PSM  <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle <eos>
    SPM  <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle <eos>

The model still just predicts the next token, but in a FIM document "the next token" after
`<fim_middle>` is the middle given both sides, and `<eos>` marks where the middle ends. SPM is the
paper's variant for joint training (its appendix D): the sentinels come in PSM's order, so what
the model learns in one layout carries over to the other. At inference a PSM prompt (`infill_prompt`)
is the prefix and suffix with nothing after `<fim_middle>`; the model writes the middle.

The split is at characters, not tokens, and each part is encoded on its own: the prompt at
inference is also encoded part by part, so training sees the token boundaries inference will.
A document's fate (plain or FIM, PSM or SPM, where the cuts fall) is drawn from a generator
seeded by the configured seed and a hash of its text, so it is the same whatever the worker count
or the document's position in the corpus.

The sentinels are special tokens of the tokenizer; `find_fim_tokens` knows the spellings model
families use (StarCoder's `<fim_prefix>`, Qwen2.5-Coder's `<|fim_prefix|>`). SmolLM2's tokenizer has
none; `tokenmind tokenizer train --fim` reserves them in a tokenizer trained here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

# (prefix, suffix, middle) spellings, in the order they are looked for.
FIM_SPELLINGS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder/SantaCoder; what tokenmind reserves
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
)
FIM_TOKENS = FIM_SPELLINGS[0]


class _Vocabulary(Protocol):
    def token_to_id(self, token: str) -> int | None: ...


class FIMTokens(NamedTuple):
    """The ids of the three sentinels."""

    prefix: int
    suffix: int
    middle: int


def find_fim_tokens(tokenizer: _Vocabulary) -> FIMTokens | None:
    """The tokenizer's FIM sentinels, under the first spelling it has all three of; None if it has none."""
    for names in FIM_SPELLINGS:
        ids = [tokenizer.token_to_id(name) for name in names]
        if all(i is not None for i in ids):
            return FIMTokens(*ids)  # type: ignore[arg-type]
    return None


def require_fim_tokens(tokenizer: _Vocabulary) -> FIMTokens:
    """`find_fim_tokens`, or a ValueError saying how to get a tokenizer that has them."""
    tokens = find_fim_tokens(tokenizer)
    if tokens is None:
        spellings = " or ".join(", ".join(names) for names in FIM_SPELLINGS)
        raise ValueError(f"this tokenizer has no fill-in-the-middle tokens ({spellings}); use a model trained "
                         "with them, or train a tokenizer that reserves them: `tokenmind tokenizer train --fim`")
    return tokens


def psm(prefix: Sequence[int], suffix: Sequence[int], middle: Sequence[int], tokens: FIMTokens) -> list[int]:
    """Prefix-suffix-middle layout."""
    return [tokens.prefix, *prefix, tokens.suffix, *suffix, tokens.middle, *middle]


def spm(prefix: Sequence[int], suffix: Sequence[int], middle: Sequence[int], tokens: FIMTokens) -> list[int]:
    """Suffix-prefix-middle layout (the paper's joint-training variant: sentinels in PSM order)."""
    return [tokens.prefix, tokens.suffix, *suffix, tokens.middle, *prefix, *middle]


def infill_prompt(prefix: Sequence[int], suffix: Sequence[int], tokens: FIMTokens) -> list[int]:
    """The PSM prompt whose continuation is the middle (ending with eos)."""
    return psm(prefix, suffix, [], tokens)


@dataclass
class FIMConfig:
    """rate: fraction of documents turned into FIM documents (0 = off; the paper finds 0.5-0.9
    costs no left-to-right quality). spm_rate: of those, the fraction laid out SPM rather than PSM.
    seed: with a document's text, decides its transform."""

    rate: float = 0.0
    spm_rate: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rate", "spm_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"fim {name} must be in [0, 1], got {value}")


@dataclass(frozen=True)
class FIMSplit:
    """How one document is transformed: cut at characters [0, start) [start, end) [end, len)."""

    start: int
    end: int
    spm: bool

    def parts(self, text: str) -> tuple[str, str, str]:
        """(prefix, middle, suffix): they re-join to `text`."""
        return text[: self.start], text[self.start : self.end], text[self.end :]


def choose_split(text: str, cfg: FIMConfig) -> FIMSplit | None:
    """The transform of `text` under `cfg` (None: it stays a plain document); the same on every call."""
    if cfg.rate == 0.0:
        return None
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    rng = np.random.default_rng([cfg.seed, int.from_bytes(digest, "little")])
    if rng.random() >= cfg.rate:
        return None
    start, end = sorted(int(i) for i in rng.integers(0, len(text) + 1, size=2))
    return FIMSplit(start, end, bool(rng.random() < cfg.spm_rate))


def fim_encode(texts: Sequence[str], encode_batch: Callable[[list[str]], list[list[int]]], tokens: FIMTokens,
               cfg: FIMConfig) -> list[list[int]]:
    """Token ids of each text: plain, or (for the `cfg.rate` share of them) a FIM document.

    All pieces go through one `encode_batch` call, so batching stays as fast as without FIM.
    """
    splits = [choose_split(text, cfg) for text in texts]
    pieces: list[str] = []
    for text, split in zip(texts, splits):
        pieces.extend([text] if split is None else split.parts(text))
    encoded = iter(encode_batch(pieces))
    out = []
    for split in splits:
        if split is None:
            out.append(list(next(encoded)))
        else:
            prefix, middle, suffix = next(encoded), next(encoded), next(encoded)
            out.append((spm if split.spm else psm)(prefix, suffix, middle, tokens))
    return out
