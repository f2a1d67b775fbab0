"""Fill-in-the-middle evaluation: single-line infilling of held-out code.

Each example hides one non-blank line of a source file: the prefix is everything before it, the
suffix everything after (from its newline on), and the model sees the PSM prompt
(`Tokenizer.encode_infill`). Two numbers, as in Bavarian et al.'s single-line infilling:

* exact match: the greedy middle, cut at its first newline, equals the hidden line;
* middle loss: the mean negative log-likelihood per token of the hidden line followed by eos,
  given the prompt (eos counts: a model that cannot tell where the middle ends has not learned FIM).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ..engine.sampling import SamplingParams
from .generative import generate_batch
from .loglik import loglikelihoods

Example = dict[str, str]  # prefix, middle, suffix


def line_infill_examples(texts: Sequence[str], per_text: int = 1, seed: int = 0, min_chars: int = 8,
                         context_lines: int | None = None) -> list[Example]:
    """Up to `per_text` examples per text, each hiding a line of at least `min_chars` non-blank
    characters chosen with a seeded generator; `context_lines` keeps only that many lines on each
    side (a small model's window cannot hold a whole module)."""
    rng = random.Random(seed)
    examples = []
    for text in texts:
        lines = text.split("\n")
        candidates = [i for i, line in enumerate(lines) if len(line.strip()) >= min_chars]
        for i in sorted(rng.sample(candidates, min(per_text, len(candidates)))):
            before = lines[:i] if context_lines is None else lines[max(0, i - context_lines):i]
            after = lines[i + 1:] if context_lines is None else lines[i + 1:i + 1 + context_lines]
            examples.append({"prefix": "".join(line + "\n" for line in before), "middle": lines[i],
                             "suffix": "\n" + "\n".join(after)})
    return examples


def evaluate_infill(model, tokenizer, examples: Sequence[Example], *, max_tokens: int = 64,
                    batch_size: int = 16) -> dict[str, Any]:
    """Exact match and middle loss of `model` on `examples`, with every prediction."""
    prompts = [tokenizer.encode_infill(e["prefix"], e["suffix"]) for e in examples]
    middles = [tokenizer.encode(e["middle"]) + [tokenizer.eos_token_id] for e in examples]
    nll = [-score for score in loglikelihoods(model, list(zip(prompts, middles)), batch_size=batch_size)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["\n"],
                            stop_token_ids=tokenizer.infill_stop_token_ids)
    completions = generate_batch(model, tokenizer, prompts, params, batch_size=batch_size)
    predictions = [{**e, "completion": c, "correct": c == e["middle"], "nll": n}
                   for e, c, n in zip(examples, completions, nll)]
    n = len(predictions)
    return {"exact_match": sum(p["correct"] for p in predictions) / max(n, 1),
            "middle_loss": sum(nll) / max(sum(map(len, middles)), 1), "n": n, "predictions": predictions}
