"""Visual instruction data from Fashion-MNIST: (image, question, answer) conversations, rendered
and packed for the VLM, with the loss on the assistant's tokens only.

Each image gets a conversation of 1..max_turns question/answer turns, the image placeholder in
front of the first question (LLaVA's layout). Questions come in three kinds, each with varied
wordings: identify ("What is in this picture?" → "A sneaker."), yes/no about an attribute
("Is it footwear?", "Is it worn on the upper body?", "Is it a bag?", "Is it a coat?" → "Yes." /
"No."), and captions ("Describe the image." → a sentence naming the item and its category).
The answers are functions of the label, so a model that answers them has read the image.
Held-out evaluation uses the test split's images, which training never sees.

Rendering and packing are SFT's (`posttrain/data.py`: `Tokenizer.render_chat` marks the
assistant's tokens, `to_example` masks the rest, `ChatLoader` packs rows and resumes exactly);
`VLMLoader` adds the pixel values of each row's images, in the order of their placeholders.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenmind.data.loader import LoaderConfig, TokenBatch
from tokenmind.posttrain.data import ChatLoader, Example, to_example
from tokenmind.tokenizer import Tokenizer

from .images import to_pixel_values
from .vlm import IMAGE_PLACEHOLDER, VisionLanguageModel, render_vlm_chat

# Fashion-MNIST's labels (`diffusion.data.FASHION_MNIST_CLASSES` order) as words, with an article
NAMES = ["t-shirt", "pair of trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]
KEYWORDS = ["t-shirt", "trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]
CATEGORIES = {  # the yes/no attributes: which labels have them
    "footwear": {5, 7, 9},
    "upper body": {0, 2, 4, 6},
    "bag": {8},
    "legs": {1},
}
ATTRIBUTE_QUESTIONS = {
    "footwear": ["Is it footwear?", "Is this something you wear on your feet?", "Is it a shoe?"],
    "upper body": ["Is it worn on the upper body?", "Is this a top?"],
    "bag": ["Is it a bag?", "Is this a bag?"],
    "legs": ["Is it worn on the legs?", "Are these trousers?"],
}
IDENTIFY_QUESTIONS = ["What is in this picture?", "What is this?", "What item is shown?",
                      "Name the object in the image.", "What do you see?"]
CAPTION_QUESTIONS = ["Describe the image.", "Write a short caption for this picture."]
CAPTIONS = ["A grayscale photo of {a} {name}, {category}.", "A small picture of {a} {name} on a black background.",
            "{A} {name}, {category}, photographed from above."]
CATEGORY_PHRASES = {"footwear": "a piece of footwear", "upper body": "something worn on the upper body",
                    "bag": "an accessory", "legs": "something worn on the legs"}
EVAL_QUESTIONS = ("What is in this picture?", "Is it footwear?", "Describe the image.")


def article(name: str) -> str:
    return "an" if name[0] in "aeiou" else "a"


def identify_answer(label: int) -> str:
    """The short answer to an identify question: "A sneaker."."""
    name = NAMES[label]
    return f"{article(name).capitalize()} {name}."


def category(label: int) -> str:
    return next((c for c, labels in CATEGORIES.items() if label in labels), "")


def caption(label: int, rng: np.random.Generator) -> str:
    name, kind = NAMES[label], category(label)
    template = CAPTIONS[rng.integers(len(CAPTIONS))]
    phrase = CATEGORY_PHRASES.get(kind, "a piece of clothing")
    return template.format(a=article(name), A=article(name).capitalize(), name=name, category=phrase)


def yes_no_question(label: int, rng: np.random.Generator) -> tuple[str, str]:
    """An attribute question (or "Is it a X?" about a random class), half of them true."""
    if rng.random() < 0.3:
        asked = label if rng.random() < 0.5 else int(rng.integers(10))
        name = NAMES[asked]
        return f"Is it {article(name)} {name}?", "Yes." if asked == label else "No."
    kind = list(CATEGORIES)[rng.integers(len(CATEGORIES))]
    if rng.random() < 0.5 and label not in CATEGORIES[kind]:  # balance: ask about its own category
        kind = category(label) or kind
    questions = ATTRIBUTE_QUESTIONS[kind]
    return questions[rng.integers(len(questions))], "Yes." if label in CATEGORIES[kind] else "No."


def answer(question: str, label: int, rng: np.random.Generator) -> str:
    """The reference answer to one of the evaluation questions (or any identify/attribute one)."""
    if question in IDENTIFY_QUESTIONS:
        return identify_answer(label)
    if question in CAPTION_QUESTIONS:
        return caption(label, rng)
    for kind, questions in ATTRIBUTE_QUESTIONS.items():
        if question in questions:
            return "Yes." if label in CATEGORIES[kind] else "No."
    raise ValueError(f"no reference answer for {question!r}")


def conversation(label: int, rng: np.random.Generator, max_turns: int = 3) -> list[dict[str, str]]:
    """1..max_turns question/answer turns about one image; the image opens the first question."""
    messages = []
    for turn in range(int(rng.integers(1, max_turns + 1))):
        kind = rng.choice(3, p=[0.35, 0.45, 0.2])
        if kind == 0:
            question, reply = IDENTIFY_QUESTIONS[rng.integers(len(IDENTIFY_QUESTIONS))], identify_answer(label)
        elif kind == 1:
            question, reply = yes_no_question(label, rng)
        else:
            question, reply = CAPTION_QUESTIONS[rng.integers(len(CAPTION_QUESTIONS))], caption(label, rng)
        prefix = f"{IMAGE_PLACEHOLDER}\n" if turn == 0 else ""
        messages += [{"role": "user", "content": prefix + question}, {"role": "assistant", "content": reply}]
    return messages


@dataclass
class VLMExample(Example):
    """A rendered conversation and the index of its image in the split."""

    image: int = 0


def vlm_examples(tokenizer: Tokenizer, model: VisionLanguageModel, labels: torch.Tensor, count: int, seq_len: int,
                 seed: int, max_turns: int = 3) -> list[VLMExample]:
    """Conversations about the first `count` images of a split, rendered with the chat template;
    targets on the assistant's tokens only."""
    if count > len(labels):
        raise ValueError(f"asked for {count} images but the split has {len(labels)}; lower the image count")
    rng = np.random.default_rng(seed)
    examples = []
    for index in range(count):
        ids, mask, _ = render_vlm_chat(tokenizer, conversation(int(labels[index]), rng, max_turns), model)
        if len(ids) > seq_len:
            raise ValueError(f"a conversation of {len(ids)} tokens does not fit data.seq_len={seq_len}; raise "
                             "data.seq_len (cutting it could cut its image tokens)")
        example = to_example(ids, mask, seq_len)
        examples.append(VLMExample(example.inputs, example.targets, index))
    return examples


@dataclass
class VLMBatch(TokenBatch):
    """Packed chat rows plus pixel_values (n, C, H, W) of their images, in placeholder order."""

    pixel_values: torch.Tensor | None = None

    def to(self, device: torch.device) -> VLMBatch:
        tokens = super().to(device)
        return VLMBatch(tokens.input_ids, tokens.targets, tokens.document_ids, tokens.positions,
                        self.pixel_values.to(device, non_blocking=True))


class VLMLoader(ChatLoader):
    """`ChatLoader` over `VLMExample`s whose images (uint8 (N, H, W)) become each batch's pixel values."""

    def __init__(self, examples: Sequence[VLMExample], images: torch.Tensor, cfg: LoaderConfig, image_size: int,
                 channels: int) -> None:
        super().__init__(examples, cfg)
        self.images, self.image_size, self.channels = images, image_size, channels

    def batch_for_rows(self, rows: Sequence[int]) -> VLMBatch:
        tokens = super().batch_for_rows(rows)
        order = [self.examples[i].image for row in rows for i in self.rows[row]]  # row-major = placeholder order
        pixels = to_pixel_values(self.images[order], self.image_size, self.channels)
        return VLMBatch(tokens.input_ids, tokens.targets, tokens.document_ids, tokens.positions, pixels)


# ---- scoring answers ---------------------------------------------------------------------------------


def _normalize(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s-]", " ", text.lower()).split())


def exact_match(prediction: str, reference: str) -> bool:
    """Equal up to case, punctuation and spacing."""
    return _normalize(prediction) == _normalize(reference)


def mentioned_class(text: str) -> int | None:
    """The label whose keyword the text names first (whole words: "t-shirt" is not "shirt"), or None."""
    text, found = text.lower(), []
    for label, word in enumerate(KEYWORDS):
        match = re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text)
        if match:
            found.append((match.start(), label))
    return min(found)[1] if found else None


def yes_no(text: str) -> str | None:
    """"yes" or "no" when the reply starts with it, else None."""
    first = _normalize(text).split(" ", 1)[0] if text.strip() else ""
    return first if first in ("yes", "no") else None

