"""The prompt sets a teacher model writes training text from (`distill.py`), and what to keep of it.

Three sets, each built from topic lists by a seeded shuffle, so a set of `count` prompts is the
same on every machine:

* `stories`: short stories for young children: a character, a place, something that happens;
* `explanations`: what everyday things, animals, places and jobs are, in a few simple sentences;
* `answers`: simple questions a user might ask a small assistant (what animals eat, what a
  thing is used for, lists of things of a kind), answered by the teacher.

The topics are everyday English: what a model trained for minutes can learn to talk about.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

CHARACTERS = [
    "a little cat", "a brave mouse", "a kind girl named Lily", "a boy named Tom", "an old dog", "a small bird",
    "a friendly bear", "a shy rabbit", "a curious fox", "a happy frog", "a little duck", "a young horse",
    "a clever owl", "a sleepy lion", "a girl named Mia", "a boy named Sam", "a baby elephant", "a busy bee",
    "a tiny fish", "a kind farmer", "a little robot", "a silly goat", "a gentle cow", "a grandmother",
    "two best friends", "a lost puppy", "a little turtle", "a proud rooster", "a happy pig", "a young teacher",
]
PLACES = [
    "in a big forest", "by the sea", "on a farm", "in a small town", "in the garden", "at school", "in the park",
    "near a river", "on a snowy mountain", "in a busy city", "at the beach", "in a quiet village", "in the kitchen",
    "on a rainy day", "under a tall tree", "at the market", "in the desert", "on an island", "at night",
    "in the spring",
]
EVENTS = [
    "finds a shiny stone", "wants to make a new friend", "loses a favourite toy", "learns to share",
    "helps someone in trouble", "is afraid of the dark", "plants a seed", "bakes a cake", "goes on a trip",
    "finds a lost key", "learns to swim", "builds a little house", "sees the first snow", "has a birthday",
    "gets lost and finds the way home", "meets a new neighbour", "wants to fly", "cleans up a mess",
    "waits for the rain to stop", "tells the truth",
]
THINGS = [
    "a dog", "a cat", "a horse", "a cow", "a sheep", "a pig", "a chicken", "a duck", "a lion", "a tiger", "an elephant",
    "a giraffe", "a monkey", "a bear", "a wolf", "a fox", "a rabbit", "a mouse", "a bee", "a butterfly", "an ant",
    "a spider", "a snake", "a frog", "a fish", "a whale", "a shark", "a dolphin", "an owl", "an eagle", "a penguin",
    "a tree", "a flower", "grass", "a leaf", "a seed", "a mountain", "a river", "a lake", "the sea", "a beach",
    "an island", "a desert", "a forest", "a cloud", "rain", "snow", "the wind", "a storm", "the sun", "the moon",
    "a star", "the sky", "a rainbow", "fire", "water", "ice", "a stone", "sand", "the earth", "a house", "a school",
    "a hospital", "a library", "a shop", "a market", "a farm", "a city", "a village", "a road", "a bridge",
    "a train", "a car", "a bus", "a bicycle", "a boat", "a ship", "an airplane", "a door", "a window", "a table",
    "a chair", "a bed", "a lamp", "a clock", "a book", "a pen", "a pencil", "a letter", "a computer", "a phone",
    "a cup", "a plate", "a spoon", "a knife", "a fork", "a bowl", "a kettle", "an oven", "a key", "a bag", "a coat",
    "a hat", "shoes", "a ball", "a toy", "a kite", "a drum", "a guitar", "a piano", "a song", "a game",
    "bread", "milk", "cheese", "an egg", "an apple", "a banana", "an orange", "a pear", "grapes", "a carrot",
    "a potato", "rice", "soup", "a cake", "honey", "tea", "coffee", "sugar", "salt", "a doctor", "a nurse",
    "a teacher", "a farmer", "a baker", "a cook", "a pilot", "a driver", "a police officer", "a firefighter",
    "a friend", "a family", "a baby", "a neighbour", "a birthday", "a holiday", "a week", "a year", "morning",
    "night", "spring", "summer", "autumn", "winter", "happiness", "sadness", "kindness", "a dream", "music",
    "a picture", "a map", "money", "a gift", "a garden", "a park", "a zoo", "a museum", "a kitchen", "a bathroom",
]
ANIMALS = ["dogs", "cats", "horses", "cows", "sheep", "pigs", "chickens", "ducks", "lions", "tigers", "elephants",
           "giraffes", "monkeys", "bears", "wolves", "foxes", "rabbits", "mice", "bees", "butterflies", "ants",
           "snakes", "frogs", "fish", "whales", "dolphins", "owls", "eagles", "penguins", "squirrels", "goats"]
USES = ["a hammer", "a spoon", "a key", "a clock", "a map", "a pencil", "an umbrella", "a ladder", "a bucket",
        "a towel", "a broom", "soap", "a candle", "a rope", "a needle", "a wallet", "a mirror", "a blanket",
        "a backpack", "a calendar", "a thermometer", "a compass", "a calculator", "a fridge", "a washing machine"]
KINDS = ["vegetables", "birds", "sea animals", "insects", "musical instruments", "sports", "jobs", "vehicles",
         "things you can wear", "things in a classroom", "things in a bathroom", "farm animals", "wild animals",
         "flowers", "trees", "drinks", "shapes", "numbers", "months of the year", "body parts", "toys", "tools",
         "planets", "things that are cold", "things that are hot", "kinds of weather", "school subjects",
         "things you can read", "things that fly", "things in a park"]
NUMBERS = ["two", "three", "four", "five"]
QUESTION_TEMPLATES = [
    ("What do {animal} eat?", "animal"), ("Where do {animal} live?", "animal"), ("Can you tell me about {animal}?",
                                                                                 "animal"),
    ("What is {use} used for?", "use"), ("How do you use {use}?", "use"),
    ("Name {number} {kind}.", "kind"), ("List {number} {kind}.", "kind"), ("Give me {number} examples of {kind}.",
                                                                           "kind"),
    ("Tell me something about {thing}.", "thing"), ("Why is {thing} useful?", "thing"),
]


def _stories(rng: random.Random) -> list[dict[str, Any]]:
    combos = list(itertools.product(CHARACTERS, PLACES, EVENTS))
    rng.shuffle(combos)
    return [{"kind": "stories", "topic": f"{c} {p} {e}",
             "prompt": f"Write a short story for a young child about {c} {p} who {e}. Use simple words and short "
                       "sentences."} for c, p, e in combos]


def _explanations(rng: random.Random) -> list[dict[str, Any]]:
    forms = ["Explain what {t} is in three short, simple sentences.", "Describe {t} for a child in a few sentences.",
             "What is {t}? Answer in simple words."]
    items = [{"kind": "explanations", "topic": t, "prompt": form.format(t=t)} for t in THINGS for form in forms]
    rng.shuffle(items)
    return items


def _answers(rng: random.Random) -> list[dict[str, Any]]:
    slots = {"animal": ANIMALS, "use": USES, "kind": KINDS, "thing": THINGS}
    items = []
    for template, slot in QUESTION_TEMPLATES:
        for value in slots[slot]:
            number = NUMBERS[len(items) % len(NUMBERS)]
            question = template.format(**{slot: value}, number=number)
            items.append({"kind": "answers", "topic": value, "question": question,
                          "prompt": f"{question} Answer in one to three short, simple sentences."})
    rng.shuffle(items)
    return items


PROMPT_SETS = {"stories": _stories, "explanations": _explanations, "answers": _answers}


def build_prompts(kind: str, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` prompts of a set (cycling through it if it has fewer), in a seeded order."""
    items = PROMPT_SETS[kind](random.Random(seed))
    return [dict(items[i % len(items)], id=f"{kind}-{i:05d}") for i in range(count)]


_REFUSAL = re.compile(r"\b(as an ai|i'm sorry|i am sorry|i cannot|i can't|smollm|language model|hugging ?face)\b",
                      re.IGNORECASE)


def keep_answer(prompt: dict[str, Any], text: str) -> bool:
    """Keep a teacher's text if it is a real answer: long enough, plain text, no refusal or talk of
    itself (the student learns its own identity elsewhere), not stuck repeating a line."""
    if len(text.split()) < (40 if prompt["kind"] == "stories" else 5):
        return False
    if _REFUSAL.search(text) or "```" in text or "http" in text:
        return False
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != len(set(lines)):
        return False
    words = text.lower().split()
    trigrams = list(zip(words, words[1:], words[2:]))
    if trigrams and len(set(trigrams)) < 0.85 * len(trigrams):  # a text that loops on itself
        return False
    letters = sum(ch.isalpha() for ch in text)
    return letters > 0.6 * len(text) and all(ord(ch) < 0x2500 for ch in text)
