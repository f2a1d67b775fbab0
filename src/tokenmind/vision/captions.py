"""Captions made from class labels, for CLIP-style training without a captioned data set.

Fashion-MNIST has labels, not captions. A caption here is a template ("a photo of {a} {adj}
{noun}", "{adj} {plural} on black", ...) filled with one of the class's nouns (synonyms: "sneaker",
"trainer shoe", "running shoe") and an attribute that is true of every image of the set (grey,
low-resolution, centred, on a black background), with the article and the plural made to agree. Varying the
wording makes the text side learn the class, not one string: the sentence encoder maps "a grey
sweater on black" and "pullovers, low-res" near each other, and the projection learns which
direction in its space is "pullover".

`caption_bank` draws `per_class` distinct captions for every class, seeded, so a run's captions (and
their cached embeddings) are a function of its config. `zero_shot_prompts` gives the one prompt
per class that zero-shot classification matches images against; its template is kept out of the
training templates, so the evaluation reads a wording the model never trained on.
"""

from __future__ import annotations

import itertools
import random
import re

from tokenmind.diffusion.data import class_names

# singular, plural for each Fashion-MNIST class (diffusion.data.FASHION_MNIST_CLASSES order)
FASHION_NOUNS: dict[str, list[tuple[str, str]]] = {
    "t-shirt": [("t-shirt", "t-shirts"), ("tee", "tees"), ("top", "tops")],
    "trouser": [("pair of trousers", "pairs of trousers"), ("pair of pants", "pairs of pants"),
                ("trouser", "trousers")],
    "pullover": [("pullover", "pullovers"), ("sweater", "sweaters"), ("jumper", "jumpers")],
    "dress": [("dress", "dresses"), ("frock", "frocks")],
    "coat": [("coat", "coats"), ("jacket", "jackets"), ("overcoat", "overcoats")],
    "sandal": [("sandal", "sandals"), ("summer sandal", "summer sandals")],
    "shirt": [("shirt", "shirts"), ("button-up shirt", "button-up shirts"), ("blouse", "blouses")],
    "sneaker": [("sneaker", "sneakers"), ("running shoe", "running shoes"), ("trainer shoe", "trainer shoes")],
    "bag": [("bag", "bags"), ("handbag", "handbags"), ("purse", "purses")],
    "ankle-boot": [("ankle boot", "ankle boots"), ("boot", "boots"), ("short boot", "short boots")],
}
_DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]

ADJECTIVES = ["grey", "gray", "white", "light grey", "pale", "small", "low-resolution", "blurry", "centred",
              "grayscale", "monochrome", "simple"]
TEMPLATES = [
    "a photo of {a} {adj} {noun}",
    "{a} {adj} {noun} on black",
    "{a} {adj} {noun} on a black background",
    "a picture of {a} {noun}, {adj}",
    "an image showing {a} {adj} {noun}",
    "{adj} {plural} on a dark background",
    "a product photo of {a} {noun}",
    "this is {a} {noun}",
    "{a} {noun} in {adj} tones",
    "{a} {adj} thumbnail of {a} {noun}",
    "one of many {plural}",
    "a close-up of {a} {adj} {noun}",
    "{plural}: {a} {adj} example",
    "a drawing of {a} {noun}",
    "the {noun} is {adj}",
]
ZERO_SHOT_TEMPLATE = "a photo of {a} {noun}."  # not among TEMPLATES: zero-shot reads an unseen wording
_ARTICLE = "\0"


def article(word: str) -> str:
    """ "a" or "an" by the next word's first letter (good enough for these nouns and adjectives)."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def class_nouns(dataset: str) -> list[list[tuple[str, str]]]:
    """For each label of `dataset`, its (singular, plural) nouns; the first is the canonical one."""
    names = class_names(dataset)
    if dataset == "digits":
        return [[(f"digit {d}", f"digits {d}"), (f"handwritten {_DIGIT_WORDS[int(d)]}",
                                                  f"handwritten {_DIGIT_WORDS[int(d)]}s"),
                 (f"number {_DIGIT_WORDS[int(d)]}", f"numbers {_DIGIT_WORDS[int(d)]}")] for d in names]
    return [FASHION_NOUNS[name] for name in names]


def fill(template: str, noun: tuple[str, str], adj: str = "") -> str:
    """One caption: `template` with {noun}, {plural} and {adj} filled and each {a} made the
    article that agrees with the word after it."""
    text = template.format(noun=noun[0], plural=noun[1], adj=adj, a=_ARTICLE)
    return re.sub(_ARTICLE + r" (\S)", lambda m: f"{article(m.group(1))} {m.group(1)}", text)


def caption_bank(dataset: str, per_class: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """(captions, their labels): `per_class` distinct captions for each class of `dataset`, drawn
    without replacement from every template × noun × adjective combination with a seeded RNG."""
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    captions, labels = [], []
    for label, nouns in enumerate(class_nouns(dataset)):
        every = sorted({fill(t, n, a) for t, n, a in itertools.product(TEMPLATES, nouns, ADJECTIVES)})
        if per_class > len(every):
            raise ValueError(f"class {label} has {len(every)} distinct captions, fewer than per_class={per_class}; "
                             "lower clip.captions_per_class")
        chosen = random.Random(seed * 1009 + label).sample(every, per_class)
        captions += chosen
        labels += [label] * per_class
    return captions, labels


def zero_shot_prompts(dataset: str, template: str = ZERO_SHOT_TEMPLATE) -> list[str]:
    """One prompt per class: the canonical noun in `template` ({noun}, {plural}, {a} as in TEMPLATES)."""
    if "{noun}" not in template and "{plural}" not in template:
        raise ValueError(f"the zero-shot template {template!r} needs a {{noun}} or {{plural}} where the class goes")
    return [fill(template, nouns[0]) for nouns in class_nouns(dataset)]
