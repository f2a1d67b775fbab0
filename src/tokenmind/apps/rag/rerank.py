"""Rerank retrieved passages with the chat model itself: a yes/no judge scored by log-likelihood.

Dense and BM25 retrieval compare a query and a passage each on its own (a vector, a bag of
words); the chat model reads them together. For each candidate it is shown the passage and the
question and asked whether the passage contains the answer, and the candidate's score is the
log-odds of its first reply token: log p(yes) − log p(no). Nothing is generated: one forward pass
over a batch of candidate prompts gives every score (`eval.loglik.loglikelihoods`, the scored
evals' primitive). Candidates are reordered by score; ties keep the retrieval order (they are
common with a quantized model, whose bf16 logits put log-odds on steps of about 1/8).

"yes" and "no" are each a few spellings ("yes", "Yes", "YES"), and a spelling counts through its
first token: the score is log Σ p(first tokens of the yes spellings) − log Σ p(those of the no
spellings), duplicates counted once. A BPE vocabulary has every spelling as one token, so this is
the probability of replying with that word in any case; a tokenizer that splits the words still
gets a defined score, from their first pieces.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...eval.loglik import loglikelihoods
from .chunking import Chunk
from .index import Hit

YES, NO = ("yes", "Yes", "YES"), ("no", "No", "NO")
BATCH = 32  # candidates per forward pass (the whole `candidates` list of a search, by default)


def judge_messages(question: str, chunk: Chunk) -> list[dict[str, str]]:
    """The chat a candidate is judged in: the passage, then the question and the yes/no request.
    (Qwen2.5-Coder-0.5B put the gold SQuAD paragraph first among 8 candidates in 9 of 11 questions
    with the passage first, with or without a system prompt; with the question first, in 2-3 of 11.)"""
    return [{"role": "user", "content": f"Passage:\n{chunk.for_embedding}\n\nQuestion: {question}\n\nDoes the "
                                        "passage contain the answer to the question? Answer yes or no."}]


class LLMReranker:
    """Scores (question, passage) pairs by a chat model's log-odds of replying yes rather than no.

    `model` is a loaded `Pretrained` (its `Transformer` and tokenizer with a chat template), the
    same object `rag ask` generates with, so judging and answering share one copy of the weights.
    """

    def __init__(self, model, batch: int = BATCH):
        self.model, self.tokenizer, self.batch = model.model, model.tokenizer, batch
        self.yes, self.no = self._first_tokens(YES), self._first_tokens(NO)
        if set(self.yes) & set(self.no):
            raise ValueError(f"this tokenizer starts a yes and a no spelling with the same token "
                             f"({sorted(set(self.yes) & set(self.no))}); the reranker cannot tell them apart")

    def _first_tokens(self, spellings: tuple[str, ...]) -> list[int]:
        return list(dict.fromkeys(self.tokenizer.encode(s)[0] for s in spellings))

    def scores(self, question: str, chunks: list[Chunk]) -> list[float]:
        """log p(yes) − log p(no) of the first reply token, per chunk (in nats)."""
        replies = self.yes + self.no
        requests = []
        for chunk in chunks:
            prompt = self.tokenizer.apply_chat_template(judge_messages(question, chunk), add_generation_prompt=True)
            requests += [(prompt, [token]) for token in replies]
        logp = torch.tensor(loglikelihoods(self.model, requests, self.batch * len(replies)),
                            dtype=torch.float64).view(len(chunks), len(replies))
        yes, no = logp[:, :len(self.yes)], logp[:, len(self.yes):]
        return (yes.logsumexp(1) - no.logsumexp(1)).tolist()

    def rerank(self, query: str, hits: list[Hit], k: int) -> list[Hit]:
        """The k hits the model judges most likely to answer `query`, best first, each scored by its
        log-odds (ties keep the retrieval order)."""
        if not hits:
            return []
        scored = [replace(h, score=s) for h, s in zip(hits, self.scores(query, [h.chunk for h in hits]))]
        return sorted(scored, key=lambda h: -h.score)[:k]
