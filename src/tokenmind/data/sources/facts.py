"""Simple facts in plain English, from the data files of bsdgames' `quiz(6)`.

Capitals of countries and US states, chemical elements, young animals, collective nouns, male and
female words and the US presidents: what a tiny chat model can learn to answer on topic. Two
sources read the same package: `quiz-facts` states every fact in several phrasings, grouped into
pre-training documents by topic; `quiz-qa` asks for each fact in single-turn chats whose `meta`
(topic, subject, answer) lets a caller hold subjects out of training to evaluate on them.

A quiz file has one entry per line (a trailing `\\` continues it), fields separated by `:`, each
field a pattern of accepted answers (quiz's `rxp.c`): `|` separates alternatives, `{x}` is an
optional part (the same as `[x|]`), `[a|b]` groups alternatives and `\\` escapes a character.
`alternatives` spells each top-level alternative the way quiz spells an answer (its
`rxp_expand`: the first choice of every group, optional parts included), so
`{G{eorge} }Washington` is "George Washington" and `Brussel{s}|Bruxelles` is "Brussels", then
"Bruxelles". Accented letters are terminal overstrikes (`'`, backspace, `e`); the letter is kept.

The files were last revised around 2009 (Obama is the last president with a term): `_RENAMED`
updates names that changed or that English spells another way, and `_DROPPED` leaves out what
would teach something wrong or odd, each with its reason.

`with_article` and `chat` are shared with the WordNet definition chats in `lexicons`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenmind.data.sources.archive import decode_text, iter_members
from tokenmind.data.sources.base import Record, Source

_QUIZ_DIR = "usr/share/games/bsdgames/quiz/"

# ------------------------------------------------------------------------------- the quiz format


def quiz_entries(text: str) -> list[list[str]]:
    """The entries of a quiz file as lists of fields: a line ending in an unescaped `\\`
    continues on the next one, fields are split at unescaped `:`, blank lines are skipped."""
    text = re.sub(r"(.)\x08(.)", lambda m: m[1] if m[1].isalpha() else m[2], text)  # overstrikes: keep the letter
    entries, pending = [], ""
    for line in text.split("\n"):
        pending += line
        if (len(pending) - len(pending.rstrip("\\"))) % 2:
            pending = pending[:-1]
            continue
        if pending.strip():
            entries.append(_fields(pending))
        pending = ""
    if pending.strip():
        entries.append(_fields(pending))
    return entries


def _fields(entry: str) -> list[str]:
    out, field, escaped = [], "", False
    for ch in entry:
        if ch == ":" and not escaped:
            out.append(field)
            field = ""
        else:
            field += ch
        escaped = ch == "\\" and not escaped
    return [*out, field]


def alternatives(pattern: str) -> list[str]:
    """The top-level alternatives of a quiz pattern, each spelled with the first choice of every
    group and its optional parts included: `Rom[e|a]|Roma` -> ["Rome", "Roma"]."""
    alts, _ = _parse(pattern, 0, "")
    return [re.sub(r"\s+", " ", a).strip() for a in alts]


def _parse(s: str, i: int, closer: str) -> tuple[list[str], int]:
    """The alternatives of `s[i:]` up to `closer` (`}`, `]`, or "" for the whole pattern) and the
    index just past it; a group contributes its first alternative."""
    alts, text = [], ""
    while i < len(s):
        ch = s[i]
        if ch == "\\" and i + 1 < len(s):
            text, i = text + s[i + 1], i + 2
            continue
        if ch in "{[":
            group, i = _parse(s, i + 1, "}" if ch == "{" else "]")
            text += group[0]
            continue
        if ch in "}]":
            if ch != closer:
                raise ValueError(f"quiz pattern {s!r}: unmatched {ch!r} at {i}")
            return [*alts, text], i + 1
        if ch == "|":
            alts.append(text)
            text = ""
        else:
            text += ch
        i += 1
    if closer:
        raise ValueError(f"quiz pattern {s!r}: {closer!r} missing at the end")
    return [*alts, text], i


# ------------------------------------------------------------------------------- corrections

_RENAMED = {
    # Renamed since the file was written, or spelled another way in English now.
    "Kiev": "Kyiv", "Swaziland": "Eswatini", "Macedonia": "North Macedonia", "Burma": "Myanmar",
    "Malagasy Republic": "Madagascar", "Ulan Bator": "Ulaanbaatar", "P'yongyang": "Pyongyang", "Berne": "Bern",
    "Kotte": "Sri Jayawardenepura Kotte",
    # The first alternative is an abbreviation or a long official form; English says the short name.
    "Rep. Congo": "Republic of the Congo", "DR Congo": "Democratic Republic of the Congo",
    "Republic of South Africa": "South Africa", "Republic of Yemen": "Yemen", "People's Republic of China": "China",
    "The Gambia": "Gambia", "The Bahamas": "Bahamas", "Washington DC": "Washington, D.C.",
    # Elements: IUPAC's symbol for lawrencium (Lw until 1963) and spelling of sulfur.
    "Lw": "Lr", "Sulphur": "Sulfur",
    # Presidents: "Simpson" was a clerk's error; the Bushes by the names that tell them apart; Carter's own.
    "Ulysses Simpson Grant": "Ulysses S. Grant", "George Herbert Walker Bush": "George H. W. Bush",
    "George Walker Bush, Junior": "George W. Bush", "James Earl Carter, Junior": "Jimmy Carter",
}  # fmt: skip

_DROPPED = {
    ("america", "Netherlands Antilles", "*"),  # dissolved in 2010
    ("america", "SGSSI", "*"),  # South Georgia: a research station, not a city
    ("collectives", "operating companies", "*"),  # a joke about AT&T
    ("collectives", "rubbish", "*"),  # not a group of things
    ("collectives", "wolves", "route"),  # "rout", and archaic
    ("collectives", "mules", "baren"),  # a misspelling the quiz accepts
    ("babies", "fish", "fry"),  # a plural: "a fry" is wrong
    ("sexes", "Y", "*"),  # chromosomes
    ("sexes", "effeminate", "*"), ("sexes", "manly", "*"),  # adjectives, not a male/female pair
    ("sexes", "Oedipus complex", "*"),  # not a male/female pair
    ("sexes", "dog", "*"),  # a slur in chat, and "vixen" is a fox
    ("sexes", "cob", "*"),  # a swan, which the entry does not say; "a pen" misleads
    ("sexes", "ambassador", "*"), ("sexes", "curator", "*"),  # one word for both sexes today
}  # fmt: skip


def _kept(file: str, subject: str, answers: list[str]) -> list[str]:
    if (file, subject, "*") in _DROPPED:
        return []
    return [a for a in answers if (file, subject, a) not in _DROPPED]


# ------------------------------------------------------------------------------- English


def with_article(noun: str) -> str:
    """`noun` after "a" or "an", by sound: an owl, an hour, a unicorn, a ewe, a one-way street."""
    word = noun.lower()
    vowel_sound = word[:1] in set("aeiou") and not re.match(r"u(ni[^nmd]|ni$|s[aeiou]|t[eio]|r[aeiou]|bi|k[aeiu])|"
                                                            r"eu|ewe|one|once", word)  # fmt: skip
    if vowel_sound or re.match(r"(hour|honest|honou?r|heir)", word):
        return f"an {noun}"
    return f"a {noun}"


def _or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _cap(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def chat(record_id: str, question: str, reply: str, **meta: object) -> Record:
    """A single-turn SFT chat; `meta` (topic, subject, answer, ...) travels with it into the JSONL."""
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    return {"id": record_id, "messages": messages, "meta": meta}


@dataclass(frozen=True)
class Fact:
    """One fact: `statements` say it in several phrasings, `questions` ask for it, `replies` answer
    in a full sentence. `answers` are the accepted spellings, the canonical one first."""

    topic: str
    subject: str
    answers: tuple[str, ...]
    statements: tuple[str, ...]
    questions: tuple[str, ...]
    replies: tuple[str, ...]


Templates = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]  # statements, questions, replies


def _fact(topic: str, subject: str, answers: list[str], templates: Templates, **words: str) -> Fact:
    def fill(template: str) -> str:  # "Washington, D.C.." -> "Washington, D.C."
        return _cap(re.sub(r"\.\.$", ".", template.format(**words)))

    statements, questions, replies = (tuple(fill(t) for t in group) for group in templates)
    return Fact(topic, subject, tuple(answers), statements, questions, replies)


# ------------------------------------------------------------------------------- topics

_CAPITAL: Templates = (
    ("The capital of {place} is {city}.", "{city} is the capital city of {place}.", "{places} capital is {city}."),
    ("What is the capital of {place}?", "What is the capital city of {place}?", "Which city is the capital of {place}?",
     "What's the capital of {place}?", "Name the capital of {place}.", "Can you tell me the capital of {place}?",
     "What city is {places} capital?"),
    ("The capital of {place} is {city}.", "{city} is the capital of {place}.",
     "The capital city of {place} is {city}."),
)  # fmt: skip
_STATE_CAPITAL: Templates = (
    ("The capital of {place} is {city}.", "{city} is the capital of the U.S. state of {state}.",
     "{city} is the state capital of {state}."),
    ("What is the capital of {place}?", "What is the state capital of {state}?",
     "Which city is the capital of the U.S. state of {state}?", "What city is the capital of {place}?",
     "Name the capital of the state of {state}."),
    ("The capital of {place} is {city}.", "{city} is the capital of {place}.",
     "The state capital of {state} is {city}."),
)  # fmt: skip
_SYMBOL: Templates = (
    ("The chemical symbol for {name} is {symbol}.", "{name} has the symbol {symbol} and the atomic number {number}.",
     "The symbol {symbol} stands for {name}."),
    ("What is the chemical symbol for {name}?", "What is the symbol of the element {name}?",
     "Which chemical symbol stands for {name}?", "What is {name}'s chemical symbol?",
     "How is {name} written as a chemical symbol?"),
    ("The chemical symbol for {name} is {symbol}.", "{name} has the chemical symbol {symbol}.",
     "The symbol for {name} is {symbol}."),
)  # fmt: skip
_NUMBER: Templates = (
    ("The atomic number of {name} is {number}.", "The element with atomic number {number} is {name}.",
     "{name} is element number {number} in the periodic table."),
    ("What is the atomic number of {name}?", "What is {name}'s atomic number?", "Which atomic number does {name} have?",
     "What number is {name} in the periodic table?"),
    ("The atomic number of {name} is {number}.", "{name} has the atomic number {number}.",
     "{name} is element number {number}."),
)  # fmt: skip
_ELEMENT: Templates = (
    ("The element with the symbol {symbol} is {name}.", "In chemistry, the symbol {symbol} means {name}.",
     "{name} is written {symbol}."),
    ("Which element has the symbol {symbol}?", "What element does the symbol {symbol} stand for?",
     "Which chemical element is written {symbol}?", "What does the chemical symbol {symbol} stand for?"),
    ("The symbol {symbol} stands for {name}.", "{symbol} is the chemical symbol for {name}.",
     "The element with the symbol {symbol} is {name}."),
)  # fmt: skip
_BABY: Templates = (
    ("A baby {adult} is called {babies}.", "A young {adult} is known as {babies}.", "{a_baby} is a young {adult}."),
    ("What is a baby {adult} called?", "What do you call a baby {adult}?", "What is the name for a young {adult}?",
     "What is a young {adult} called?"),
    ("A baby {adult} is called {babies}.", "A young {adult} is called {babies}."),
)  # fmt: skip
_COLLECTIVE: Templates = (
    ("A group of {members} is called {groups}.", "We speak of {a_group} of {members}.",
     'The collective noun for {members} is "{group}".'),
    ("What is a group of {members} called?", "What do you call a group of {members}?",
     "What is the collective noun for {members}?", "What is the word for a group of {members}?"),
    ("A group of {members} is called {groups}.", "We call a group of {members} {groups}."),
)  # fmt: skip
_FEMALE: Templates = (
    ("The female counterpart of {a_male} is {females}.", "{a_male} is male and {a_female} is female.",
     "{a_male} is male; the female is called {a_female}."),
    ("What is the female counterpart of {a_male}?", "What is the female equivalent of {a_male}?",
     "What is the female of {a_male} called?", "If {a_male} is male, what is the female called?"),
    ("The female counterpart of {a_male} is {females}.", "The female equivalent of {a_male} is {females}."),
)  # fmt: skip
_MALE: Templates = (
    ("The male counterpart of {a_female} is {a_male}.", "{a_female} is female and {a_male} is male.",
     "{a_female} is female; the male is called {a_male}."),
    ("What is the male counterpart of {a_female}?", "What is the male equivalent of {a_female}?",
     "What is the male of {a_female} called?", "If {a_female} is female, what is the male called?"),
    ("The male counterpart of {a_female} is {a_male}.", "The male equivalent of {a_female} is {a_male}."),
)  # fmt: skip
_PRESIDENT: Templates = (
    ("{name} was the {nth} president of the United States.",
     "The {nth_word} president of the United States was {name}.", "{before}, {name} became the {nth} president."),
    ("Who was the {nth} president of the United States?", "Who was the {nth_word} president of the United States?",
     "Name the {nth} U.S. president.", "Who was the {nth_word} U.S. president?"),
    ("The {nth} president of the United States was {name}.",
     "{name} was the {nth_word} president of the United States."),
)  # fmt: skip
_TERM: Templates = (
    ("{name} was president of the United States {term}.", "{name} served as president {term}.",
     "{term}, the president of the United States was {name}."),
    ("When was {name} president?", "When did {name} serve as president of the United States?",
     "In which years was {name} president?", "During what years was {name} the U.S. president?"),
    ("{name} was president of the United States {term}.", "{name} served as president {term}."),
)  # fmt: skip

_THE = re.compile(r"(Islands|Republic|Kingdom|States|Emirates|Netherlands|Philippines|Maldives|Bahamas|Gambia|"
                  r"Seychelles|Comoros)$|^(Isle of|Republic of|Democratic Republic)")  # fmt: skip


def _place(name: str) -> str:
    return f"the {name}" if _THE.search(name) else name


def _possessive(name: str) -> str:
    return f"{name}'" if name.endswith("s") else f"{name}'s"


Rows = list[tuple[list[str], ...]]


def _capitals(file: str, rows: Rows, seen: set[str]) -> Iterator[Fact]:
    for country, capital, *_ in rows:
        cities = _kept(file, country[0], capital)
        if cities and country[0] not in seen:
            seen.add(country[0])
            place = _place(country[0])
            yield _fact("capital", country[0], cities, _CAPITAL, place=place, places=_possessive(place), city=cities[0])


def _state_capitals(file: str, rows: Rows, countries: set[str]) -> Iterator[Fact]:
    for state, capital, *_ in rows:
        cities = _kept(file, state[0], capital)
        if cities:
            place = f"the U.S. state of {state[0]}" if state[0] in countries else state[0]  # Georgia
            yield _fact("state-capital", state[0], cities, _STATE_CAPITAL, place=place, state=state[0], city=cities[0])


def _elements(file: str, rows: Rows) -> Iterator[Fact]:
    for symbol, number, _weight, name in rows:  # atomic weights are left out: the file's are from the 1950s
        element = name[0].lower()
        words = {"symbol": symbol[0], "number": number[0], "name": element}
        yield _fact("element-symbol", element, [symbol[0]], _SYMBOL, **words)
        yield _fact("atomic-number", element, [number[0]], _NUMBER, **words)
        yield _fact("element-name", element, [element], _ELEMENT, **words)


def _names_by_subject(file: str, rows: Rows) -> dict[str, list[str]]:
    """Rows of (names, subjects) → each subject's kept names, merged across rows in first-seen order."""
    names: dict[str, list[str]] = {}
    for values, subjects in rows:
        for subject in subjects:
            names.setdefault(subject, [])
            names[subject] += [v for v in _kept(file, subject, values) if v not in names[subject]]
    return names


def _babies(file: str, rows: Rows) -> Iterator[Fact]:
    for adult, babies in _names_by_subject(file, rows).items():
        if babies:
            listed = _or([with_article(b) for b in babies])
            yield _fact("baby-animal", adult, babies, _BABY, adult=adult, babies=listed,
                        a_baby=with_article(babies[0]))  # fmt: skip


def _collectives(file: str, rows: Rows) -> Iterator[Fact]:
    for members, groups in _names_by_subject(file, [(groups, members) for members, groups in rows]).items():
        if groups:
            yield _fact("collective-noun", members, groups, _COLLECTIVE, members=members, group=groups[0],
                        a_group=with_article(groups[0]), groups=_or([with_article(g) for g in groups]))  # fmt: skip


def _sexes(file: str, rows: Rows) -> Iterator[Fact]:
    for male, female in rows:
        females = _kept(file, male[0], female)
        if females:
            words = {"male": male[0], "female": females[0], "a_male": with_article(male[0]),
                     "a_female": with_article(females[0]),
                     "females": _or([with_article(f) for f in females])}  # fmt: skip
            yield _fact("female-counterpart", male[0], females, _FEMALE, **words)
            yield _fact("male-counterpart", females[0], [male[0]], _MALE, **words)


def _presidents(file: str, rows: Rows) -> Iterator[Fact]:
    """The presidents in order with their terms. The last entry (Biden) has no term and the file
    skips Trump, so entries without a term are left out; the numbering stays right up to Obama."""
    terms: dict[str, list[str]] = {}
    previous = None
    for n, (name, term, *_) in enumerate((r for r in rows if r[1][0]), start=1):
        president = re.sub(r"\s*\(.*?\)", "", name[0])  # "Grover Cleveland (1st term)"
        before = f"After {previous}" if previous else f"In {term[0][:4]}"
        yield _fact("president-by-number", president, [president], _PRESIDENT, name=president, nth=_ordinal(n),
                    nth_word=_ordinal_word(n), before=before)  # fmt: skip
        terms.setdefault(president, []).append(_term(term[0]))
        previous = president
    for president, spans in terms.items():
        yield _fact("president-term", president, [" and ".join(spans)], _TERM, name=president,
                    term=" and ".join(spans))  # fmt: skip


def _term(span: str) -> str:
    """"1861-1865" -> "from 1861 to 1865"; "1841" (a month in office) -> "in 1841"; "2009-" (the
    file's last term, open) -> "starting in 2009"."""
    start, dash, end = span.partition("-")
    if end:
        return f"from {start} to {end}"
    return f"starting in {start}" if dash else f"in {start}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _ordinal_word(n: int) -> str:
    """1-99 in words: first, twelfth, twentieth, forty-fourth."""
    ones = ["", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"]
    teens = ["tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
             "eighteenth", "nineteenth"]  # fmt: skip
    if n < 20:
        return ones[n] if n < 10 else teens[n - 10]
    tens = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"][n // 10 - 2]
    return f"{tens[:-1]}ieth" if n % 10 == 0 else f"{tens}-{ones[n % 10]}"


_READERS: dict[str, Callable[[str, Rows], Iterator[Fact]]] = {
    "elements": _elements, "babies": _babies, "collectives": _collectives, "sexes": _sexes, "pres": _presidents,
}  # fmt: skip

# The files worth learning from, in the order their facts are read (country capitals first, so the
# states know which names are also countries) with the title of their documents.
_TOPICS: dict[str, str] = {
    "europe": "Countries and their capitals", "asia": "Countries and their capitals",
    "africa": "Countries and their capitals", "america": "Countries and their capitals",
    "state": "The capitals of the U.S. states", "elements": "The chemical elements",
    "babies": "Names for young animals", "collectives": "Names for groups of animals and people",
    "sexes": "Male and female words", "pres": "Presidents of the United States",
}  # fmt: skip


def quiz_facts(deb: Path) -> dict[str, list[Fact]]:
    """File name -> its facts, for the quiz files in `_TOPICS` that the package has; a country
    listed in two files (Russia in Europe and Asia) keeps its first entry."""
    files = dict(iter_members(deb, lambda n: n.startswith(_QUIZ_DIR)))
    seen: set[str] = set()
    out: dict[str, list[Fact]] = {}
    for file in _TOPICS:
        if _QUIZ_DIR + file not in files:
            continue
        rows = [tuple(list(dict.fromkeys(_RENAMED.get(a, a) for a in alternatives(f))) for f in entry)
                for entry in quiz_entries(decode_text(files[_QUIZ_DIR + file]))]  # fmt: skip
        if file in _READERS:
            out[file] = list(_READERS[file](file, rows))
        elif file == "state":
            out[file] = list(_state_capitals(file, rows, countries=seen))
        else:
            out[file] = list(_capitals(file, rows, seen))
    return out


# ------------------------------------------------------------------------------- extractors


def extract_quiz_facts(deb: Path, per_doc: int = 50) -> Iterator[Record]:
    """Pre-training documents, one per topic file or per `per_doc` facts. Each states every fact
    once per phrasing, a paragraph per round: the first in the file's order, the others shuffled,
    each fact in a different phrasing each round, so a fact is met in varied contexts."""
    for file, facts in quiz_facts(deb).items():
        chunks = -(-len(facts) // per_doc)
        size = -(-len(facts) // max(chunks, 1))
        for c in range(chunks):
            chunk = facts[c * size : (c + 1) * size]
            doc_id = f"{file}/{c:02d}"
            offsets = [random.Random(f"{f.topic}/{f.subject}").randrange(len(f.statements)) for f in chunk]
            paragraphs = []
            for r in range(max(len(f.statements) for f in chunk)):
                order = list(range(len(chunk)))
                if r:
                    random.Random(f"{doc_id}/{r}").shuffle(order)
                paragraphs.append(" ".join(chunk[i].statements[(offsets[i] + r) % len(chunk[i].statements)]
                                           for i in order))  # fmt: skip
            yield {"id": doc_id, "text": "\n\n".join([_TOPICS[file], *paragraphs])}


def extract_quiz_qa(deb: Path, per_fact: int = 2) -> Iterator[Record]:
    """`per_fact` single-turn chats per fact, each with another question phrasing (a seeded
    choice) and a full-sentence reply; `meta` holds topic, subject, answer and all `answers`."""
    for file, facts in quiz_facts(deb).items():
        for i, fact in enumerate(facts):
            rng = random.Random(f"{fact.topic}/{fact.subject}/{fact.answers[0]}")
            for k, question in enumerate(rng.sample(fact.questions, min(per_fact, len(fact.questions)))):
                yield chat(f"{file}/{i:03d}/{k}", question, rng.choice(fact.replies), topic=fact.topic,
                           subject=fact.subject, answer=fact.answers[0], answers=list(fact.answers))  # fmt: skip


SOURCES = [
    Source("quiz-facts", "debian", "bsdgames", "2.17-29+b1", "BSD-3-Clause", "BSD-3-Clause", "pretrain",
           extract_quiz_facts, "Capitals, elements, animal words, US presidents from bsdgames' quiz, as sentences",
           ("pretrain", "chat-pretrain")),
    Source("quiz-qa", "debian", "bsdgames", "2.17-29+b1", "BSD-3-Clause", "BSD-3-Clause", "sft", extract_quiz_qa,
           "Questions on the quiz facts with full-sentence answers", ("sft", "chat-sft")),
]  # fmt: skip
