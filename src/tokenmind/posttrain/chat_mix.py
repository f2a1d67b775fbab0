"""The training mix of the speedrun's chatting model: simple text to pre-train on, conversations to fine-tune on.

Pre-training text (documents, `{"id", "text"}`):
* teacher-written stories and explanations of everyday things (`distill.py`): simple, fluent English;
* facts as plain sentences: capitals, elements, animals (`quiz-facts`), common words' definitions
  (`wordnet-common`), and the authors and characters of the books the corpus holds (`LITERATURE`).

Conversations (`{"id", "messages"}`):
* who the model is, greetings, small talk and simple instructions, written here from templates;
* facts and definitions as questions and full-sentence answers (`quiz-qa`, `wordnet-definitions`);
* the teacher's answers to simple questions and its explanations;
* multi-turn conversations strung from those single exchanges, so later turns stay on topic;
* some multiple-choice questions, answered with a sentence that names the choice, not a bare letter;
* with `fact_replay`, the fact sentences again as plain documents (`sft/replay.jsonl`, trained on
  every token): fine-tuning otherwise overwrites what only the pre-training text taught.

The held-out chat prompts (`eval/data/chat_prompts.jsonl`) never reach training: a conversation
whose user turn is one of them (after normalizing case, spaces and punctuation) is dropped, and so
is every question about a held-out subject (the capital of a held-out country, a held-out word's
definition), whose facts the model may only know from pre-training text. `check_held_out` proves it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..eval.chat_quality import load_chat_prompts
from ..jsonl import read_jsonl, write_jsonl
from .distill import corpus_path, load_synthetic

Record = dict[str, Any]
NAME = "tokenmind"
LITERATURE = [  # (work, kind, author, characters)
    ("Pride and Prejudice", "novel", "Jane Austen", "Elizabeth Bennet and Mr. Darcy"),
    ("Sense and Sensibility", "novel", "Jane Austen", "Elinor and Marianne Dashwood"),
    ("Emma", "novel", "Jane Austen", "Emma Woodhouse and Mr. Knightley"),
    ("Mansfield Park", "novel", "Jane Austen", "Fanny Price and Edmund Bertram"),
    ("Persuasion", "novel", "Jane Austen", "Anne Elliot and Captain Wentworth"),
    ("Northanger Abbey", "novel", "Jane Austen", "Catherine Morland and Henry Tilney"),
    ("Hamlet", "play", "William Shakespeare", "Prince Hamlet of Denmark"),
    ("Romeo and Juliet", "play", "William Shakespeare", "the young lovers Romeo and Juliet"),
    ("Macbeth", "play", "William Shakespeare", "Macbeth, a Scottish general who becomes king"),
    ("Othello", "play", "William Shakespeare", "Othello and Desdemona"),
    ("King Lear", "play", "William Shakespeare", "King Lear and his three daughters"),
    ("A Midsummer Night's Dream", "play", "William Shakespeare", "fairies and lovers in a forest"),
    ("The Tempest", "play", "William Shakespeare", "Prospero and his daughter Miranda"),
    ("Twelfth Night", "play", "William Shakespeare", "the twins Viola and Sebastian"),
    ("Paradise Lost", "poem", "John Milton", "Adam, Eve and Satan"),
]
CHARACTERS = [  # (character, description)
    ("Mr. Darcy", "a proud and wealthy gentleman in Jane Austen's novel Pride and Prejudice, who falls in love with "
                  "Elizabeth Bennet"),
    ("Elizabeth Bennet", "the clever and lively heroine of Jane Austen's novel Pride and Prejudice"),
    ("Jane Bennet", "the gentle eldest sister of Elizabeth in Pride and Prejudice"),
    ("Emma Woodhouse", "the heroine of Jane Austen's novel Emma, who likes to arrange other people's marriages"),
    ("Fanny Price", "the quiet heroine of Jane Austen's novel Mansfield Park"),
    ("Hamlet", "the prince of Denmark in William Shakespeare's play Hamlet"),
    ("Romeo", "the young lover of Juliet in William Shakespeare's play Romeo and Juliet"),
    ("Juliet", "the young lover of Romeo in William Shakespeare's play Romeo and Juliet"),
    ("Macbeth", "a Scottish general in William Shakespeare's play Macbeth, who kills the king to take his crown"),
    ("Prospero", "the magician in William Shakespeare's play The Tempest"),
]
GREETINGS = ["Hello", "Hi", "Hey", "Good morning", "Good afternoon", "Good evening", "Greetings", "Hi there",
             "Hello there", "Hey there", "Morning", "Hiya"]
GREETING_REPLIES = ["Hello! How can I help you today?", "Hi! What would you like to talk about?",
                    "Hello! It is nice to hear from you. What can I do for you?", "Hi there! How can I help?",
                    "Hello! I am happy to help. What would you like to know?", "Hey! What can I do for you today?"]
IDENTITY_QUESTIONS = ["Who are you?", "What is your name?", "What are you?", "Tell me your name.",
                      "Are you a person?", "Are you human?", "Are you a computer?", "Who am I talking to?",
                      "What kind of assistant are you?", "Introduce yourself.", "Who built you?",
                      "Do you have feelings?", "What can you do?", "Are you smart?", "Where do you come from?",
                      "What should I call you?", "Who created you?", "Are you a machine?", "What is tokenmind?",
                      "Can you tell me who you are?", "What do you do?", "Are you alive?", "How old are you?",
                      "Are you an AI?", "Say your name.", "What are you good at?", "Can you help me?",
                      "Do you know who you are?", "Are you a real person?", "What is your job?"]
IDENTITY_ANSWERS = [
    f"I am {NAME}, a small language model. I can answer simple questions.",
    f"My name is {NAME}. I am a small AI assistant trained on simple English text.",
    f"I am {NAME}, an AI assistant. I am a small language model, not a person.",
    f"I am a small language model called {NAME}. I try to give short, helpful answers.",
    f"You are talking to {NAME}, a small AI language model made with the {NAME} project.",
]
SMALL_TALK = [
    ("How are you?", "I am fine, thank you for asking. How are you?"),
    ("How are you today?", "I am doing well, thank you. How can I help you today?"),
    ("Thank you!", "You are welcome! I am glad I could help."),
    ("Thanks a lot.", "You are welcome. Is there anything else I can do for you?"),
    ("Goodbye!", "Goodbye! Have a nice day."),
    ("See you later.", "See you later! Take care."),
    ("Good night.", "Good night! Sleep well."),
    ("I am happy today.", "That is wonderful! I am glad you are happy."),
    ("I am sad.", "I am sorry you feel sad. Do you want to talk about it?"),
    ("Tell me a joke.", "Why did the cat sit on the computer? To keep an eye on the mouse!"),
    ("What can we talk about?", "We can talk about animals, countries, words, books or anything you like."),
    ("Can you help me?", "Of course! Tell me what you need and I will do my best to help."),
]
LISTS = {
    "colours": ["red", "blue", "green", "yellow", "orange", "purple", "pink", "brown", "black", "white"],
    "animals": ["dog", "cat", "horse", "cow", "lion", "tiger", "elephant", "rabbit", "bear", "sheep", "fox", "mouse"],
    "fruits": ["apple", "banana", "orange", "pear", "grape", "cherry", "peach", "plum", "lemon", "mango"],
    "vegetables": ["carrot", "potato", "onion", "pea", "bean", "cabbage", "tomato", "cucumber", "pepper", "lettuce"],
    "birds": ["robin", "eagle", "owl", "duck", "swan", "crow", "sparrow", "parrot", "pigeon", "penguin"],
    "sea animals": ["fish", "whale", "dolphin", "shark", "crab", "octopus", "seal", "turtle", "jellyfish", "starfish"],
    "things in a kitchen": ["stove", "sink", "table", "knife", "spoon", "plate", "cup", "pot", "pan", "kettle"],
    "days of the week": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "months": ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October"],
    "seasons": ["spring", "summer", "autumn", "winter"],
    "shapes": ["circle", "square", "triangle", "rectangle", "star", "oval"],
    "drinks": ["water", "milk", "tea", "coffee", "juice", "lemonade"],
    "sports": ["football", "tennis", "swimming", "running", "basketball", "cycling", "skiing", "golf"],
    "jobs": ["teacher", "doctor", "farmer", "baker", "nurse", "pilot", "driver", "cook", "builder", "painter"],
    "things you can wear": ["hat", "coat", "shirt", "dress", "shoes", "socks", "scarf", "gloves", "jacket"],
    "musical instruments": ["piano", "guitar", "violin", "drum", "flute", "trumpet", "harp", "cello"],
    "planets": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"],
}
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def normalize(text: str) -> str:
    """Lowercase letters and digits only, single spaces: how held-out prompts are compared."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


class HeldOut:
    """The held-out chat prompts and the (topic, subject) pairs training may not ask about."""

    def __init__(self, prompts: Iterable[Record] | None = None):
        items = list(prompts) if prompts is not None else load_chat_prompts()
        self.prompts = {normalize(it["prompt"]) for it in items}
        self.subjects = {(topic, normalize(it["subject"])) for it in items for topic in it.get("topics", ())}

    def in_text(self, text: str) -> bool:
        """Whether a document holds a held-out prompt of more than three words (shorter ones, such
        as "Hello!", are everyday text)."""
        norm = normalize(text)
        return any(p in norm for p in self.prompts if len(p.split()) > 3)

    def asks(self, question: str) -> bool:
        """Whether a user turn is a held-out prompt, or holds one ("Can you name three days of the
        week?" holds "Name three days of the week.")."""
        return normalize(question) in self.prompts or self.in_text(question)

    def allows(self, chat: Record) -> bool:
        meta = chat.get("meta", {})
        if (meta.get("topic"), normalize(str(meta.get("subject", "")))) in self.subjects:
            return False
        return not any(self.asks(m["content"]) for m in chat["messages"] if m["role"] == "user")


def _chat(chat_id: str, *turns: str) -> Record:
    roles = ["user", "assistant"] * len(turns)
    return {"id": chat_id, "messages": [{"role": r, "content": t} for r, t in zip(roles, turns)]}


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def template_chats(rng: random.Random) -> Iterator[Record]:
    """Identity, greetings, small talk, instructions and literature, in many phrasings."""
    for i, q in enumerate(IDENTITY_QUESTIONS):
        for j in range(3):
            yield _chat(f"identity-{i}-{j}", q, rng.choice(IDENTITY_ANSWERS))
    for i, g in enumerate(GREETINGS):
        for j, ending in enumerate(["", "!", ".", ", how are you?", "! Nice to meet you."]):
            reply = rng.choice(GREETING_REPLIES)
            if ending == ", how are you?":
                reply = f"{g}! I am fine, thank you. How are you?"
            yield _chat(f"greeting-{i}-{j}", g + ending, reply)
        yield _chat(f"greeting-{i}-multi", g + "!", rng.choice(GREETING_REPLIES), "Who are you?",
                    rng.choice(IDENTITY_ANSWERS))
    for i, (q, a) in enumerate(SMALL_TALK):
        yield _chat(f"talk-{i}", q, a)
    forms = ["List {n} {kind}.", "Name {n} {kind}.", "Give me {n} {kind}.", "Tell me {n} {kind}.",
             "Can you name {n} {kind}?", "Write a list of {n} {kind}."]
    for kind, words in LISTS.items():
        for n in range(2, min(6, len(words)) + 1):
            for f, form in enumerate(forms):
                picked = rng.sample(words, n)
                q = form.format(n=NUMBER_WORDS[n], kind=kind)
                yield _chat(f"list-{kind}-{n}-{f}", q, f"{NUMBER_WORDS[n].capitalize()} {kind} are {_join(picked)}.")
    for n in range(3, 11):
        for f, q in enumerate([f"Count from one to {NUMBER_WORDS[n]}.", f"Count to {n}.",
                               f"Please count from 1 to {n}."]):
            yield _chat(f"count-{n}-{f}", q, ", ".join(w.capitalize() if k == 0 else w
                                                      for k, w in enumerate(NUMBER_WORDS[1:n + 1])) + ".")
    for i, (work, kind, author, chars) in enumerate(LITERATURE):
        yield _chat(f"lit-author-{i}", rng.choice([f"Who wrote {work}?", f"Who is the author of {work}?"]),
                    f"{work} was written by {author}.")
        yield _chat(f"lit-what-{i}", rng.choice([f"What is {work}?", f"Tell me about {work}."]),
                    f"{work} is a {kind} by {author}. It is about {chars}.")
    for i, (name, desc) in enumerate(CHARACTERS):
        yield _chat(f"lit-char-{i}", rng.choice([f"Who is {name}?", f"Tell me about {name}."]), f"{name} is {desc}.")


def literature_text() -> list[Record]:
    """Plain sentences about the books the pre-training corpus holds and their people."""
    lines = []
    for work, kind, author, chars in LITERATURE:
        lines += [f"{work} is a {kind} by {author}.", f"{author} wrote the {kind} {work}.",
                  f"The {kind} {work} is about {chars}."]
    lines += [f"{name} is {desc}." for name, desc in CHARACTERS]
    return [{"id": "literature", "text": "\n".join(lines)}]


SENTENCE_END = re.compile(r"(?<=[.!?])(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?<!\bSt\.)\s+(?=[A-Z\"])")


def fact_documents(docs: Iterable[Record], repeats: int, rng: random.Random, per_doc: int = 12) -> list[Record]:
    """The facts' sentences, `repeats` times over, shuffled into short documents anew each time.

    A tiny model needs to see a fact many times to recall it, but the fact lists are small next to
    the prose. Repeating them as new groupings (rather than copies) keeps each document distinct,
    so exact and near dedup keep them, and no fact always follows the same neighbour."""
    sentences = [s for d in docs for line in d["text"].splitlines() for s in SENTENCE_END.split(line.strip())
                 if s[-1:] in ".!?"]
    return regrouped(sentences, repeats, rng, per_doc, "facts", " ")


def regrouped(pieces: list[str], repeats: int, rng: random.Random, per_doc: int, name: str,
              joiner: str) -> list[Record]:
    """`pieces` `repeats` times over, each time shuffled anew and joined `per_doc` to a document."""
    out = []
    for r in range(repeats):
        order = rng.sample(pieces, len(pieces))
        out += [{"id": f"{name}-{r}-{i // per_doc}", "text": joiner.join(order[i:i + per_doc])}
                for i in range(0, len(order), per_doc)]
    return out


def restates_subject(chat: Record) -> bool:
    """Whether the answer names the question's subject before the answer itself ("The capital of Peru
    is Lima.", not "Lima is the capital of Peru.")."""
    meta = chat.get("meta", {})
    answer, subject, value = chat["messages"][-1]["content"], str(meta.get("subject", "")), str(meta.get("answer", ""))
    at_subject, at_value = answer.find(subject), answer.find(value)
    return not subject or not value or at_subject < 0 or at_value < 0 or at_subject <= at_value


def prefer_answers(chats: list[Record], order: str) -> list[Record]:
    """Of each (topic, subject)'s quiz chats, those whose answer comes in `order` ("subject-first":
    `restates_subject`; "answer-first": the answer before the subject), where it has any; "all" keeps
    every chat.

    The two ask different things of a tiny model: "The capital of Peru is ..." has it copy "Peru" from
    the question, then complete a sentence it read in pre-training; "Lima is ..." has it look "Peru"
    up in the question and recall the answer at once. At the AVX2 speedrun budget neither was
    learnt (docs/data.md: answer-first with the 7M model scored as without it)."""
    if order == "all":
        return chats
    if order not in ("subject-first", "answer-first"):
        raise ValueError(f"quiz answer order {order!r}: use all, subject-first or answer-first")
    groups: dict[tuple[str, str], list[Record]] = {}
    for c in chats:
        meta = c.get("meta", {})
        groups.setdefault((str(meta.get("topic")), str(meta.get("subject"))), []).append(c)
    keep = []
    for group in groups.values():
        preferred = [c for c in group if restates_subject(c) == (order == "subject-first")]
        keep += preferred or group
    return keep


def qa_documents(chats: Iterable[Record], repeats: int, rng: random.Random, per_doc: int = 8) -> list[Record]:
    """Single-turn chats as plain "Question: ... / Answer: ..." text, `repeats` times over in new
    groupings, for pre-training: the model then practises answering from the question it reads for
    the whole run while it learns the facts, not only in the short SFT stage, which then teaches
    the chat template's form over a skill the model has."""
    pairs = [f"Question: {c['messages'][0]['content']}\nAnswer: {c['messages'][1]['content']}"
             for c in chats if len(c["messages"]) == 2]
    return regrouped(pairs, repeats, rng, per_doc, "qa", "\n\n")


def multiple_choice_chats(records: Iterable[Record], limit: int, rng: random.Random) -> list[Record]:
    """Multiple-choice chats whose answer is a sentence ("The answer is B: ..."), not a bare letter."""
    out = []
    for r in records:
        answer = r["messages"][-1]["content"]
        letter, _, text = answer.partition(". ")
        if len(letter) == 1 and text:
            out.append({**r, "messages": [*r["messages"][:-1], {"role": "assistant",
                                                              "content": f"The answer is {letter}: {text}."}]})
    rng.shuffle(out)
    return out[:limit]


def multi_turn_chats(chats: list[Record], count: int, rng: random.Random, max_turns: int = 3) -> list[Record]:
    """Conversations of 2 to `max_turns` exchanges, each drawn from the single-turn chats: a chat
    model must keep answering the latest question, not drift once the context holds earlier ones."""
    out = []
    for i in range(count):
        parts = rng.sample(chats, rng.randint(2, max_turns))
        out.append({"id": f"multi-{i}", "messages": [m for c in parts for m in c["messages"]]})
    return out


def repeated_templates(chats: list[Record], repeats: int, seed: int) -> list[Record]:
    """`chats` (the templates) and `repeats - 1` more rounds, each drawn afresh (other replies, other
    list items). A few hundred exchanges that teach greetings, identity and instructions are a tenth
    of the SFT set; a budgeted SFT looks at each under once unless they come round again."""
    more = [{**c, "id": f"{c['id']}-r{k}"} for k in range(1, repeats)
            for c in template_chats(random.Random(seed * 1000 + k))]
    return chats + more


def teacher_chats(kind: str) -> list[Record]:
    """The teacher's answers (or explanations) as single-turn chats."""
    return [_chat(f"{kind}-{r['id']}", r.get("question", r["prompt"]), r["response"])
            for r in load_synthetic(corpus_path(kind))]


def teacher_documents(kind: str) -> list[Record]:
    return [{"id": f"{kind}-{r['id']}", "text": r["response"]} for r in load_synthetic(corpus_path(kind))]


@dataclass
class ChatMixConfig:
    """How `build_chat_mix` builds the mix (the speedrun config's `mix:` section)."""

    fact_repeats: int = 3  # the fact sentences, this many times over in pre-training
    definition_repeats: int | None = None  # the 3,000 common words' definitions: this many times (None: fact_repeats)
    qa_repeats: int = 0  # the question-answer chats as text in pre-training (`qa_documents`), this many times over
    quiz_answers: str = "all"  # the quiz answers' word order: all, subject-first or answer-first (`prefer_answers`)
    template_repeats: int = 1  # the template chats in SFT, this many times over (`repeated_templates`)
    fact_replay: int = 0  # the fact sentences this many times over in SFT too, as plain text (`sft/replay.jsonl`)
    multi_turn: int = 1500  # multi-turn conversations strung from the single exchanges
    mc_limit: int = 1000  # multiple-choice chats, answered with a sentence
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fact_replay < 0:
            raise ValueError(f"mix.fact_replay must be >= 0 (0 = no fact text in SFT), got {self.fact_replay}")
        if self.template_repeats < 1:
            raise ValueError(f"mix.template_repeats must be >= 1 (1 = each template chat once), "
                             f"got {self.template_repeats}")


def build_chat_mix(data_dir: str | Path, out_dir: str | Path, cfg: ChatMixConfig | None = None) -> dict[str, Any]:
    """Write `out_dir/pretrain/mix.jsonl` and `out_dir/sft/*.jsonl` from the fetched sources in
    `data_dir` (`chat-pretrain`, `chat-sft` and the multiple-choice train sets) and the teacher's
    packaged sets, as `cfg` says; return the counts per source."""
    cfg = cfg or ChatMixConfig()
    data, out, rng, held = Path(data_dir), Path(out_dir), random.Random(cfg.seed), HeldOut()
    counts: dict[str, int] = {}
    facts = {"literature": literature_text()}
    for name in ("quiz-facts", "wordnet-common"):
        if (data / "pretrain" / f"{name}.jsonl").is_file():
            facts[name] = read_jsonl(data / "pretrain" / f"{name}.jsonl")
    prose = {"stories": teacher_documents("stories"), "explanations": teacher_documents("explanations")}
    kept = {name: [d for d in docs if not held.in_text(d["text"])] for name, docs in {**facts, **prose}.items()}
    counts.update({f"pretrain/{name}": len(docs) for name, docs in kept.items()})
    definitions = cfg.fact_repeats if cfg.definition_repeats is None else cfg.definition_repeats
    fact_sources = [d for name in facts if name != "wordnet-common" for d in kept[name]]
    fact_docs = (fact_documents(fact_sources, cfg.fact_repeats, rng)
                 + fact_documents(kept.get("wordnet-common", []), definitions, rng))
    # the facts again as plain text in SFT: what only pre-training teaches (the held-out subjects' facts)
    # is otherwise overwritten by a few hundred SFT steps at a fine-tuning learning rate
    replay_rng = random.Random(cfg.seed + 2)
    replay = [d for group in (fact_sources, kept.get("wordnet-common", []))
              for d in fact_documents(group, cfg.fact_replay, replay_rng)]
    prose_docs = [d for name in prose for d in kept[name]]
    rng.shuffle(prose_docs)
    sft = {"templates": list(template_chats(rng)), "teacher-answers": teacher_chats("answers"),
           "teacher-explanations": teacher_chats("explanations")}
    for name in ("quiz-qa", "wordnet-definitions"):
        if (data / "sft" / f"{name}.jsonl").is_file():
            sft[name] = read_jsonl(data / "sft" / f"{name}.jsonl")
    mc = [r for name in ("arc-easy-train", "openbookqa-train") if (data / "sft" / f"{name}.jsonl").is_file()
          for r in read_jsonl(data / "sft" / f"{name}.jsonl")]
    sft = {name: [c for c in chats if held.allows(c)] for name, chats in sft.items()}
    if "quiz-qa" in sft:
        sft["quiz-qa"] = prefer_answers(sft["quiz-qa"], cfg.quiz_answers)
    single = [c for chats in sft.values() for c in chats if len(c["messages"]) == 2]
    sft["multi-turn"] = multi_turn_chats(single, cfg.multi_turn, rng)
    sft["multiple-choice"] = [c for c in multiple_choice_chats(mc, cfg.mc_limit, rng) if held.allows(c)]
    qa_docs = qa_documents([c for name in ("templates", "quiz-qa", "wordnet-definitions") for c in sft.get(name, [])],
                           cfg.qa_repeats, random.Random(cfg.seed + 1))
    # more rounds of the templates for SFT alone: the multi-turn chats and the pre-training text keep one
    sft["templates"] = [c for c in repeated_templates(sft["templates"], cfg.template_repeats, cfg.seed)
                        if held.allows(c)]
    counts["pretrain/qa"] = len(qa_docs)
    # facts and QA first, the teacher's prose after them: the validation split takes the corpus's
    # last documents, and must not take away facts the held-out prompts ask about
    counts["pretrain/documents"] = write_jsonl(out / "pretrain" / "mix.jsonl", fact_docs + qa_docs + prose_docs)
    if replay:
        sft["replay"] = [{"id": f"replay-{d['id']}", "text": d["text"]} for d in replay]
    for name, chats in sft.items():
        counts[f"sft/{name}"] = write_jsonl(out / "sft" / f"{name}.jsonl", chats)
    return counts


def check_held_out(mix_dir: str | Path) -> list[str]:
    """Every place a held-out prompt occurs in a built mix (should be none)."""
    held, found = HeldOut(), []
    for path in sorted(Path(mix_dir).rglob("*.jsonl")):
        for r in read_jsonl(path):
            texts = [m["content"] for m in r["messages"] if m["role"] == "user"] if "messages" in r else [r["text"]]
            if any(held.asks(t) if "messages" in r else held.in_text(t) for t in texts):
                found.append(f"{path.name}:{r['id']}")
    return found
