"""What the engine hands back: per-token logprobs, per-completion and per-request outputs, statistics.

Plain value types in one module, so the sampler, the sequence bookkeeping, the engine and its
consumers (the server, evaluation) all import them from here and never from each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the `k` most likely tokens at that position, best first.
    Both None for a prompt's first token, which nothing before it predicts."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None


@dataclass
class CompletionOutput:
    """One of a request's n completions: everything so far, plus what is new since the last report."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "abort", "timeout" (queued too long); None while running
    logprobs: list[TokenLogprob] | None
    new_token_ids: list[int]
    new_text: str
    queue_s: float | None  # time waiting for the first step
    ttft_s: float | None  # time to first token
    tpot_s: float | None  # mean time per output token after the first
    score: float | None = None  # beam search: sum of the logprobs / length ** length_penalty (`beam.py`)


@dataclass
class RequestOutput:
    """A request's state after a step. The shortcut properties read completion 0 (the only one if n == 1)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    # log P(prompt token i | tokens < i) (the first has none); set once the prefill is done, if asked for
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def new_token_ids(self) -> list[int]:
        return self.outputs[0].new_token_ids

    @property
    def new_text(self) -> str:
        return self.outputs[0].new_text

    @property
    def metrics(self) -> dict[str, float | None]:
        return {"ttft_s": self.outputs[0].ttft_s, "tpot_s": self.outputs[0].tpot_s}


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by sequences
    prefix_cache_hit_rate: float  # cached prompt tokens / prompt tokens looked up
    num_generated_tokens: int
    num_preemptions: int
    num_steps: int
    num_blocks: int
    oldest_waiting_s: float = 0.0  # how long the head of the queue has waited
    num_queue_timeouts: int = 0  # requests ended after waiting longer than max_queue_wait
    num_drafted_tokens: int = 0  # speculative decoding: draft tokens the target verified
    num_accepted_tokens: int = 0  # ... and kept

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0
