"""In-context copying, the work of induction heads: how much easier a run of random tokens is to
predict the second time it appears in the context.

A model with induction heads attends from a token to the one that followed its earlier occurrence
and copies it, so on a random run repeated once its loss on the second copy falls far below the
first copy's, which no model can predict. A chat model needs the same mechanism to take the subject
of a question into its answer ("What is the capital of Peru?" → "The capital of Peru ..."): the
speedrun's tiny model stored the facts yet answered about another country while this score was 0
(docs/data.md). `induction_gain` is the first copy's mean loss minus the second's, in nats: about 0
without copying, several nats with it (SmolLM2-135M: 14.4 → 2.9; `tokenmind eval --tasks induction`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def copy_losses(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Per-position next-token losses (rows, 2L - 1) of `tokens` (rows, L) followed by themselves."""
    x = torch.cat([tokens, tokens], dim=1)
    with torch.no_grad():
        out = model(x)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), x[:, 1:], reduction="none")


def evaluate_induction(model: torch.nn.Module, vocab_size: int, runs: int = 32, length: int = 40,
                       batch_size: int = 8, seed: int = 0, first_id: int = 100) -> dict[str, Any]:
    """The mean losses of `runs` seeded random runs of `length` ids (from `first_id` up, clear of
    the special tokens most vocabularies start with) on their first and second appearance. The
    first token of the second copy is left out of both: nothing in the context says it comes next."""
    if vocab_size <= first_id + 1 or length < 2:
        raise ValueError(f"the induction probe needs a vocabulary above {first_id + 1} ids and runs of >= 2 tokens; "
                         f"got vocab_size={vocab_size}, length={length}")
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(first_id, vocab_size, (runs, length), generator=generator)
    losses = torch.cat([copy_losses(model, tokens[i:i + batch_size]) for i in range(0, runs, batch_size)])
    first, second = losses[:, :length - 1].mean().item(), losses[:, length:].mean().item()
    return {"n": runs, "length": length, "first_copy_loss": first, "second_copy_loss": second,
            "induction_gain": first - second}
