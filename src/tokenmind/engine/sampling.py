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
    # Beam search (`beam.py`), on when num_beams > 1: the group keeps the num_beams likeliest continuations,
    # a finished beam scores sum(logprobs) / (output length incl. its stop token) ** length_penalty, and
    # `early_stopping` ends the search as transformers does (True: once num_beams beams finished; False:
    # once no live beam can beat the worst finished one at its current length; "never": ... at max_tokens
    # when length_penalty > 0). The n best finished beams are returned, best first. Deterministic:
    # temperature and seed do not apply.
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

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
        if self.num_beams < 1:
            raise ValueError(f"num_beams must be >= 1 (1 = no beam search), got {self.num_beams}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or \"never\", got {self.early_stopping!r}")
        if self.use_beam_search:
            self._check_beam_search()

    def _check_beam_search(self) -> None:
        """Beam search ranks continuations by the model's own log-probabilities; settings that would
        reshape or constrain them, or report per-token detail the group does not keep, are refused."""
        if self.n > self.num_beams:
            raise ValueError(f"beam search returns at most num_beams={self.num_beams} beams but n={self.n}; "
                             "lower n or raise num_beams")
        if self.max_tokens < 1:
            raise ValueError("beam search needs max_tokens >= 1; to only score the prompt, drop num_beams")
        unsupported = {"top_k": self.top_k, "top_p": self.top_p < 1.0, "min_p": self.min_p,
                       "repetition_penalty": self.repetition_penalty != 1.0, "presence_penalty": self.presence_penalty,
                       "frequency_penalty": self.frequency_penalty, "stop": self.stop,
                       "logprobs": self.logprobs is not None, "structured": self.structured is not None}
        if any(unsupported.values()):
            names = ", ".join(name for name, on in unsupported.items() if on)
            raise ValueError(f"beam search (num_beams > 1) does not combine with {names}; drop them, or sample "
                             "with num_beams=1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def use_beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs at once: its beams, else its n completions."""
        return self.num_beams if self.use_beam_search else self.n


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """An explicit RNG per request, so a seed reproduces the same text whatever else runs."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
