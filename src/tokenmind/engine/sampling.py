"""`SamplingParams`: how a request picks its tokens, checked once; and the per-request RNG.

The batched logits → token step they control is `sampler.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .structured import StructuredOutput


# Below this a temperature means greedy and a top_p means "the top token only": logits are divided
# by the temperature and top_p is compared in float32, where a tiny value overflows to inf or rounds
# to 0 and the draw fails with NaN probabilities (found by the server's fuzz test).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick each next token. temperature 0 means greedy (argmax).

    max_tokens 0 only reads the prompt: with `prompt_logprobs` that scores it without generating.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0  # 0 = off; else keep the k most likely tokens
    top_p: float = 1.0  # nucleus: keep the smallest set with this much probability mass
    min_p: float = 0.0  # 0 = off; else drop tokens less likely than min_p × the top token's probability
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the tokenizer's EOS ids
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # HF/CTRL: seen (prompt or output) tokens' logits /p if > 0 else *p
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often the token is in the output
    stop: list[str] = field(default_factory=list)  # stop strings; the text ends before the first one
    n: int = 1  # completions per prompt (they share the prompt's KV cache blocks)
    logprobs: int | None = None  # None = off; k = the chosen token's logprob plus the top k alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (from the prefill)
    structured: StructuredOutput | None = None  # a grammar the output must match (`structured.py`)

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (0 = only read the prompt), got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        self.top_p = max(self.top_p, SAMPLING_EPS)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty; remove the empty string from `stop`")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= 20:
                raise ValueError(f"{name} must be None (off) or in [0, 20], got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """An explicit RNG per request, so a seed reproduces the same text whatever else runs."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
