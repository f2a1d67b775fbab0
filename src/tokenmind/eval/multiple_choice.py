"""Multiple-choice accuracy by log-likelihood ("cloze" scoring, as lm-eval-harness and OLMES do it).

The model never writes an answer: each choice is appended to the question as a continuation and
the choice whose tokens the model finds most likely wins. That works for small base models that
cannot yet follow "answer with A, B, C or D", and it needs one forward pass per choice, no decoding.

Three scores per choice, three accuracies:

* `acc`: the summed log-probability of the choice tokens. Favours short choices, since every
  extra token can only lower the sum.
* `acc_per_token`: the sum divided by the number of choice tokens.
* `acc_norm`: the sum divided by the UTF-8 bytes of the choice text (lm-eval-harness's acc_norm
  divides by characters, OLMES by bytes or characters); unlike per-token, it does not depend on
  how the tokenizer splits the text, so it compares models with different tokenizers.

Prompt formats (`FORMATS`), all 0-shot by default:

* ARC-Easy/Challenge, OpenBookQA, PIQA: "Question: {question}\\nAnswer:" + " {choice}".
* HellaSwag: "{context}" + " {ending}" (the extracted context already starts with the activity label).
* MMLU (`mmlu`, cloze): "The following are questions (with answers) about {subject}.\\n\\n"
  + "Question: ...\\nAnswer:" + " {choice text}". `mmlu_mc` is the original lettered format: the
  choices are listed as "A. ...", and " A" / " B" / ... are scored; small models sit near chance
  (25%) on it, which is why the cloze form is what they are usually reported on.
* WinoGrande: partial scoring. The option replaces the blank and becomes part of the context;
  the continuation is the rest of the sentence after the blank, identical for both options. So
  the model judges which option makes the *rest* of the sentence likely, instead of comparing
  the likelihoods of two different names. All three accuracies coincide here.

Few-shot (`num_fewshot` = k > 0): the extracted eval sets have no train or dev split, so the k
examples are other items of the same set (same subject for MMLU), drawn per item with a seeded
RNG, never the item itself, each written as its context followed by its gold continuation.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from .loglik import loglikelihoods

Item = dict[str, Any]
Pair = tuple[str, str]  # (context text, continuation text)
LETTERS = "ABCDEFGHIJ"


def _qa(item: Item) -> list[Pair]:
    return [(f"Question: {item['question']}\nAnswer:", f" {choice}") for choice in item["choices"]]


def _hellaswag(item: Item) -> list[Pair]:
    context = re.sub(r"\s+", " ", item["question"]).strip()
    return [(context, f" {ending.strip()}") for ending in item["choices"]]


def _winogrande(item: Item) -> list[Pair]:
    before, after = item["question"].split("_", 1)
    return [(before + option, f" {after.strip()}") for option in item["choices"]]


def _no_header(item: Item) -> str:
    return ""


def _mmlu_header(item: Item) -> str:
    return f"about {item.get('subject', 'general knowledge').replace('_', ' ')}.\n\n"


def _mmlu_mc(item: Item) -> list[Pair]:
    options = "".join(f"\n{LETTERS[k]}. {choice}" for k, choice in enumerate(item["choices"]))
    return [(f"{item['question']}{options}\nAnswer:", f" {LETTERS[k]}") for k in range(len(item["choices"]))]


# task → (how an item becomes (context, continuation) pairs, the header written once above the examples)
FORMATS: dict[str, tuple[Callable[[Item], list[Pair]], Callable[[Item], str]]] = {
    "arc_easy": (_qa, _no_header),
    "arc_challenge": (_qa, _no_header),
    "openbookqa": (_qa, _no_header),
    "piqa": (_qa, _no_header),
    "hellaswag": (_hellaswag, _no_header),
    "winogrande": (_winogrande, _no_header),
    "mmlu": (_qa, lambda item: "The following are questions (with answers) " + _mmlu_header(item)),
    "mmlu_mc": (_mmlu_mc, lambda item: "The following are multiple choice questions (with answers) "
                + _mmlu_header(item)),
}


def build_prompts(task: str, items: Sequence[Item], pool: Sequence[Item] = (), num_fewshot: int = 0,
                  seed: int = 0) -> list[list[Pair]]:
    """Per item, one (context, continuation) pair per choice, with the header and any few-shot
    examples (drawn from `pool`, same subject where items have one) prepended to every context."""
    if task not in FORMATS:
        raise ValueError(f"unknown multiple-choice task {task!r}; choose one of {', '.join(FORMATS)}")
    pairs_of, header_of = FORMATS[task]
    prompts = []
    for item in items:
        prefix = header_of(item)
        if num_fewshot:
            same = [x for x in pool if x["id"] != item["id"] and x.get("subject") == item.get("subject")]
            shots = random.Random(f"{seed}/{item['id']}").sample(same, min(num_fewshot, len(same)))
            prefix += "".join("".join(pairs_of(shot)[shot["answer"]]) + "\n\n" for shot in shots)
        prompts.append([(prefix + ctx, cont) for ctx, cont in pairs_of(item)])
    return prompts


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of a context and its continuation.

    The continuation's ids are the tail of the whole text's encoding (as lm-eval-harness does), so
    tokenizers that treat a leading space specially (SentencePiece) see it in place; the context's
    ids are its own encoding, identical for every choice, so the choices share one prefill.
    """
    ctx = tokenizer.encode(context, add_special_tokens=True)
    whole = tokenizer.encode(context + continuation, add_special_tokens=True)
    return ctx, whole[len(ctx):] or tokenizer.encode(continuation, add_special_tokens=False)


def evaluate_mc(model, tokenizer, task: str, items: Sequence[Item], *, pool: Sequence[Item] = (),
                num_fewshot: int = 0, seed: int = 0, batch_size: int = 32,
                progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Accuracies of `model` on multiple-choice `items` (`{"id", "question", "choices", "answer"}`).

    Returns `acc`, `acc_norm` (per byte), `acc_per_token`, `acc_stderr` (binomial standard error
    of acc), `n`, and `predictions`: per item its id, gold answer, the three picks and the summed
    log-likelihood of each choice.
    `progress(n)` advances as n more choices are scored (there are `num_choices(items)`).
    """
    prompts = build_prompts(task, items, pool, num_fewshot, seed)
    flat = [pair for pairs in prompts for pair in pairs]
    encoded = [encode_pair(tokenizer, ctx, cont) for ctx, cont in flat]
    scores = iter(loglikelihoods(model, encoded, batch_size, progress))
    lengths = iter((len(cont_ids), len(cont.encode("utf-8"))) for (_, cont_ids), (_, cont) in zip(encoded, flat))
    predictions = []
    for item, pairs in zip(items, prompts):
        ll, sizes = [next(scores) for _ in pairs], [next(lengths) for _ in pairs]
        predictions.append({
            "id": item["id"], "answer": item["answer"], "pred": _argmax(ll),
            "pred_per_token": _argmax([s / t for s, (t, _) in zip(ll, sizes)]),
            "pred_norm": _argmax([s / b for s, (_, b) in zip(ll, sizes)]), "loglik": ll,
        })
    n = len(predictions)
    metrics: dict[str, Any] = {"n": n}
    for name, key in (("acc", "pred"), ("acc_norm", "pred_norm"), ("acc_per_token", "pred_per_token")):
        metrics[name] = sum(p[key] == p["answer"] for p in predictions) / max(n, 1)
    metrics["acc_stderr"] = math.sqrt(metrics["acc"] * (1 - metrics["acc"]) / max(n - 1, 1))
    metrics["predictions"] = predictions
    return metrics


def num_choices(items: Sequence[Item]) -> int:
    return sum(len(item["choices"]) for item in items)


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)
