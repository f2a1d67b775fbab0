"""Short-answer exact match by generation: GSM8K grade-school math.

Unlike multiple choice, the model has to write the answer: it reasons in text, and the final
number of what it wrote is compared with the gold number. Decoding is greedy, so a score is
reproducible, and batched through the paged engine (`engine.llm.Engine`).

Prompts (`gsm8k_prompt`):

* Chat models (the tokenizer has a chat template): the question as a user turn, with an
  instruction to reason step by step and end with "The answer is N.".
* Base models: plain "Question: ...\\nAnswer:" text after `num_fewshot` worked examples (default
  8). GSM8K ships here with its test split only, so the examples are the first k test problems,
  their solutions with the `<<48/2=24>>` calculator notes removed and the `#### N` line
  rewritten as "The answer is N."; those k problems are then left out of the scored set.

Answer extraction (`extract_answer`): the number after the last "answer is", else the last
number in the text; `$`, thousands commas and a trailing period are dropped, and numbers are
compared by value ("18.00" matches "18").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from ..engine.config import EngineConfig
from ..engine.llm import Engine
from ..engine.sampling import SamplingParams

Item = dict[str, Any]
INSTRUCTION = ('Solve this math problem step by step. End your reply with "The answer is N." where N is the '
               "final number.")
BASE_STOP = ["\n\nQuestion:", "\nQuestion:", "\n\n\n"]
_NUMBER = r"-?\$?\d(?:[\d,]*\d)?(?:\.\d+)?"
_ANSWER_IS = re.compile(r"answer is\D{0,20}?(" + _NUMBER + ")", re.IGNORECASE)


def normalize_number(text: str) -> str | None:
    """'$1,234.50' → '1234.5', '18.00' → '18', '-0' → '0'; None if it is not a number."""
    try:
        value = Decimal(text.replace("$", "").replace(",", "").rstrip("."))
    except InvalidOperation:
        return None
    return format(value.normalize() + 0, "f")  # + 0 turns -0 into 0


def extract_answer(text: str) -> str | None:
    """The model's final number, normalized: after the last "answer is", else the last number."""
    stated = _ANSWER_IS.findall(text)
    numbers = stated or re.findall(_NUMBER, text)
    return normalize_number(numbers[-1]) if numbers else None


def is_correct(completion: str, gold: str) -> bool:
    answer = extract_answer(completion)
    return answer is not None and answer == normalize_number(gold)


def worked_solution(item: Item) -> str:
    """A GSM8K solution as a few-shot answer: calculator notes removed, ending "The answer is N."."""
    body = re.sub(r"<<[^>]*>>", "", item["solution"]).rsplit("####", 1)[0].strip()
    return f"{body}\nThe answer is {item['answer']}."


def gsm8k_prompt(tokenizer, item: Item, shots: Sequence[Item]) -> list[int]:
    """Prompt token ids: a chat for chat models (worked examples as earlier turns), else plain text."""
    if getattr(tokenizer, "chat_template", None):
        messages = []
        for shot in shots:
            messages += [{"role": "user", "content": f"{shot['question']}\n\n{INSTRUCTION}"},
                         {"role": "assistant", "content": worked_solution(shot)}]
        messages.append({"role": "user", "content": f"{item['question']}\n\n{INSTRUCTION}"})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    text = "".join(f"Question: {shot['question']}\nAnswer: {worked_solution(shot)}\n\n" for shot in shots)
    return tokenizer.encode(f"{text}Question: {item['question']}\nAnswer:", add_special_tokens=True)


def default_fewshot(tokenizer) -> int:
    """0 examples for chat models (the instruction says what to do), 8 for base models."""
    return 0 if getattr(tokenizer, "chat_template", None) else 8


def evaluate_gsm8k(model, tokenizer, items: Sequence[Item], shots: Sequence[Item] = (), *,
                   max_tokens: int = 256, batch_size: int = 32,
                   progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Exact-match accuracy on GSM8K `items` (`{"id", "question", "answer"}`), greedy decoding.

    `shots` are the worked examples put before each question. Returns `exact_match`, `n`, and
    `predictions` (id, gold, extracted answer, completion).
    """
    prompts = [gsm8k_prompt(tokenizer, item, shots) for item in items]
    chat = bool(getattr(tokenizer, "chat_template", None))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[] if chat else BASE_STOP)
    completions = generate_batch(model, tokenizer, prompts, params, batch_size, progress)
    predictions = [{"id": item["id"], "answer": item["answer"], "extracted": extract_answer(text),
                    "correct": is_correct(text, item["answer"]), "completion": text}
                   for item, text in zip(items, completions)]
    n = len(predictions)
    return {"exact_match": sum(p["correct"] for p in predictions) / max(n, 1), "n": n, "predictions": predictions}


def generate_batch(model, tokenizer, prompts: Sequence[list[int]], params: SamplingParams, batch_size: int = 32,
                   progress: Callable[[int], None] | None = None) -> list[str]:
    """Completions of token-id prompts through the continuous-batching engine, in prompt order.

    The KV pool is sized for `batch_size` sequences of the longest prompt plus `max_tokens`, not
    for the model's whole context window, so evaluation does not claim gigabytes it never uses.
    """
    longest = max((len(p) for p in prompts), default=1) + params.max_tokens
    max_len = min(longest, model.cfg.max_position_embeddings)
    config = EngineConfig(max_num_seqs=batch_size, max_model_len=max_len,
                          max_num_batched_tokens=max(2048, batch_size))
    engine = Engine(model, tokenizer, config)
    ids = [engine.add_request(list(prompt), params) for prompt in prompts]
    finished: dict[str, str] = {}
    while len(finished) < len(ids):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.text
                if progress is not None:
                    progress(1)
    return [finished[i] for i in ids]
