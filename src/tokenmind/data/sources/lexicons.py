"""Lexicons: the Jargon File, Ambrose Bierce's Devil's Dictionary, WordNet.

Dictionaries and glossaries from Debian, in formats with one entry per line or paragraph; each
extractor groups the entries into page-sized documents (per chapter or initial letter, or per
200 synsets) rather than one tiny document per headword.

WordNet also gives a chat model its simplest definitions: `common_nouns` picks the most frequent
nouns (by the sense-tagged counts WordNet ships) with the gloss of their most frequent sense, read
as one plain sentence ("A dog is a member of the genus Canis ..."), for pre-training
(`wordnet-common`) and as question/answer chats (`wordnet-definitions`).
"""

from __future__ import annotations

import gzip
import random
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from tokenmind.data.sources.archive import decode_text, iter_members
from tokenmind.data.sources.base import Record, Source
from tokenmind.data.sources.facts import chat, with_article
from tokenmind.data.sources.markup import tidy


def extract_jargon(deb: Path) -> Iterator[Record]:
    """The Jargon File 4.4.7: one document per chapter and appendix, and per initial letter of
    the lexicon (the headword index lists between letters are dropped)."""
    (_, data), *_ = iter_members(deb, "usr/share/doc/jargon-text/jargon.txt.gz")
    text = gzip.decompress(data).decode("utf-8", errors="replace").replace("\xa0", " ")
    body = text[text.find("\nChapter 1. ") :]
    lexicon_start, lexicon_end = body.find("\nGlossary\n"), body.find("\nAppendix A. ")
    for part in re.split(r"\n(?=(?:Chapter \d+|Appendix [A-Z])\. )", body[:lexicon_start] + body[lexicon_end:]):
        head = re.match(r"(Chapter \d+|Appendix [A-Z])\. ", part)
        if head:
            yield {"id": head.group(1).lower().replace(" ", "-"), "text": _dedent3(part)}
    letters: dict[str, list[str]] = {}
    paras = [p for p in re.split(r"\n\s*\n", body[lexicon_start:lexicon_end]) if p.strip()]
    short = [len(p.strip()) <= 60 and "\n" not in p.strip() and not p.strip().startswith(":") for p in paras]
    key = None
    for i, para in enumerate(paras):
        if short[i] and sum(short[max(0, i - 2) : i + 3]) >= 3:  # inside a run of index entries
            continue
        headword = re.match(r"\s*:([^:]+):", para)
        if headword:
            first = headword.group(1).lstrip("/(@")[:1].upper()
            key = first if first.isalpha() else "0-9"
        if key is not None:
            letters.setdefault(key, []).append(para)
    for letter, entries in sorted(letters.items()):
        yield {"id": f"lexicon/{letter}", "text": _dedent3("\n\n".join(entries))}


def _dedent3(text: str) -> str:
    return tidy("\n".join(line[3:] if line.startswith("   ") else line for line in text.split("\n")))


def extract_devils_dictionary(deb: Path) -> Iterator[Record]:
    """Ambrose Bierce's *The Devil's Dictionary* (dictd format), one document per initial letter."""
    files = dict(iter_members(deb, lambda n: n.startswith("usr/share/dictd/devil.")))
    body = gzip.decompress(files["usr/share/dictd/devil.dict.dz"]).decode("utf-8", errors="replace")
    letters: dict[str, list[str]] = {}
    for line in decode_text(files["usr/share/dictd/devil.index"]).splitlines():
        head, offset, length = line.split("\t")[:3]
        if head.startswith("00database") or not head[:1].isalpha():
            continue
        start, size = _dict_b64(offset), _dict_b64(length)
        letters.setdefault(head[0].upper(), []).append(body[start : start + size].strip())
    for letter, entries in sorted(letters.items()):
        yield {"id": letter, "text": tidy("\n\n".join(dict.fromkeys(entries)))}


def _dict_b64(value: str) -> int:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    number = 0
    for ch in value:
        number = number * 64 + alphabet.index(ch)
    return number


def extract_wordnet(deb: Path, per_doc: int = 200) -> Iterator[Record]:
    """WordNet 3.0 synsets as `words (pos): gloss; "examples"` lines, 200 synsets per document."""
    pos_names = {"noun": "n.", "verb": "v.", "adj": "adj.", "adv": "adv."}
    for path, data in iter_members(deb, lambda n: re.search(r"usr/share/wordnet/data\.(noun|verb|adj|adv)$", n)):
        pos = path.rsplit(".", 1)[1]
        lines = []
        for line in decode_text(data).splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # license header
            fields, gloss = line.split(" | ", 1)
            parts = fields.split()
            words = [re.sub(r"\([a-z]+\)$", "", w).replace("_", " ") for w in parts[4 : 4 + 2 * int(parts[3], 16) : 2]]
            lines.append(f"{', '.join(dict.fromkeys(words))} ({pos_names[pos]}): {gloss.strip()}")
        for i in range(0, len(lines), per_doc):
            yield {"id": f"{pos}/{i // per_doc:04d}", "text": "\n".join(lines[i : i + per_doc])}


_WORDNET = "usr/share/wordnet/"
_COUNT_NOUN_GLOSS = re.compile(r"(a|an|any|one|someone|somebody|something|anything|anyone|either|each)\b")
_OFFENSIVE = re.compile(r"offensive|slur|obscene|vulgar|disparaging|derogatory|insulting|abusive", re.IGNORECASE)
# noun.animal, noun.artifact, noun.body, noun.object, noun.person, noun.plant: things counted one by one,
# whose glosses often lack the article ("feline mammal usually having thick soft fur")
_CONCRETE_LEXFILES = {"05", "06", "08", "17", "18", "20"}
_NOT_A_NOUN_PHRASE = re.compile(r"(the|that|this|these|those|all|your|how|what|whatever|its|his|her|their|everything|"
                                r"nothing|in|of|to|for|by|with|from|on|at|as|young of)\b")  # fmt: skip
_PHRASE_END = {"near", "that", "who", "which", "whose", "with", "without", "for", "of", "used", "consisting", "made",
               "to", "in", "on", "at", "from", "where", "by", "as", "when", "or", "and", "than", "since", "usually",
               "especially", "having"}  # fmt: skip
_MASS_HEADS = {"equipment", "footwear", "neckwear", "bedding", "cutlery", "ammunition", "clothing", "merchandise",
               "transport", "art", "ware", "armament", "housing", "furniture", "cattle", "herbage"}  # fmt: skip
# noun.attribute, noun.feeling, noun.food, noun.process, noun.substance: often mass nouns ("a potassium"),
# not always ("particle"), so their glosses are read as 'The word "potassium" means ...'
_MASS_LEXFILES = {"07", "12", "13", "22", "27"}
_PRONOUN = re.compile(r"(some|any|every|no)(one|body|thing)|none")
_QUESTIONS = {  # by how the definition reads: "A dog is ...", "Mars is ...", 'The word "way" means ...'
    "count": ("What is {a_word}?", "What does {word} mean?", 'What does the word "{word}" mean?', "Define {word}.",
              "What is the meaning of {word}?", "Can you explain what {a_word} is?"),
    "name": ("What is {word}?", "What does {word} mean?", "Tell me what {word} is.", "Define {word}."),
    "word": ("What does {word} mean?", 'What does the word "{word}" mean?', "Define {word}.",
             "What is the meaning of {word}?", 'What is meant by "{word}"?'),
}  # fmt: skip


def common_nouns(deb: Path, limit: int = 3000) -> list[tuple[str, str, str, str]]:
    """(word, reading, gloss, sentence) for the `limit` most frequent single-word nouns, most
    frequent first. Frequency is a noun's total count in WordNet's sense-tagged corpus
    (`cntlist.rev`; the `tagsense_cnt` of `index.noun` only counts *how many* senses were seen,
    one for "dog"). The gloss is the first (most frequent) sense's, up to its first ";" (examples
    follow, see `_gloss`); glosses marked offensive are skipped. `reading` says how the sentence
    reads: "count" ("A dog is a member of ..."), "name" for capitalized words ("Mars is a small
    reddish planet ..."), else "word" ('The word "way" means how ...'), which stays grammatical
    whatever the gloss and whether or not the noun takes an article: substances, feelings and
    the like are read so, as some of them take one and some do not ("a potassium", "particle is").
    """
    files = dict(iter_members(deb, lambda n: n in {_WORDNET + f for f in ("cntlist.rev", "index.noun", "data.noun")}))
    counts: Counter[str] = Counter()
    for line in decode_text(files[_WORDNET + "cntlist.rev"]).splitlines():
        lemma, _, sense = line.split(" ", 1)[0].partition("%")
        if sense.startswith("1:"):  # nouns
            counts[lemma] += int(line.rsplit(" ", 1)[1])
    first_sense = {}
    for line in decode_text(files[_WORDNET + "index.noun"]).splitlines():
        if not line.startswith(" "):  # the license header is indented
            parts = line.split()
            first_sense[parts[0]] = int(parts[-int(parts[2])])
    data = files[_WORDNET + "data.noun"]
    out = []
    for lemma in sorted(counts, key=lambda w: (-counts[w], w)):
        if len(out) == limit:
            break
        if not (lemma.isalpha() and len(lemma) >= 3 and lemma in first_sense) or _PRONOUN.fullmatch(lemma):
            continue
        offset = first_sense[lemma]
        fields, raw = data[offset : data.index(b"\n", offset)].decode("utf-8", errors="replace").split(" | ", 1)
        parts = fields.split()
        forms = [re.sub(r"\([a-z]+\)$", "", w) for w in parts[4 : 4 + 2 * int(parts[3], 16) : 2]]
        word = next((w for w in forms if w.lower() == lemma), lemma)
        gloss = _gloss(raw)
        if not gloss or _OFFENSIVE.search(raw) or word.isupper():  # abbreviations ("SOB") read badly
            continue
        if (word[0].isupper() or parts[1] in _CONCRETE_LEXFILES) and _takes_article(word, gloss):
            gloss = with_article(gloss)
        plural = raw.lstrip().startswith("(plural") or _plural(word)
        if word[0].isupper() and (_COUNT_NOUN_GLOSS.match(gloss) or gloss.startswith("the ")):
            reading, sentence = "name", f"{word} is {gloss}."
        elif _COUNT_NOUN_GLOSS.match(gloss) and not plural and parts[1] not in _MASS_LEXFILES:
            a_word = with_article(word)
            reading, sentence = "count", f"{a_word[0].upper()}{a_word[1:]} is {gloss}."
        else:
            reading, sentence = "word", f'The word "{word}" means {gloss}.'
        out.append((word, reading, gloss, sentence))
    return out


def _gloss(raw: str) -> str:
    """A synset's gloss up to its first ";" or quote (examples follow them), and up to a ":"
    unless that leaves a dangling word ("distinguished ... by: low density"), asides in
    parentheses dropped: "a member of the genus Canis (probably descended from the common
    wolf) that has been domesticated ..." -> "a member of the genus Canis that has been ..."."""
    gloss = re.split(r'[;"]', raw)[0]
    while re.search(r"\([^()]*\)", gloss):
        gloss = re.sub(r"\s*\([^()]*\)", "", gloss)
    head = gloss.split(":")[0]
    if not re.search(r"\b(by|of|to|as|in|on|at|with|for|from|and|or|the|a|an|than|like)\s*$", head):
        gloss = head
    return re.sub(r"\s+", " ", gloss).strip().rstrip(".,: ")


def _takes_article(word: str, gloss: str) -> bool:
    """Whether a gloss without a determiner is a singular noun phrase that reads right after "a":
    "feline mammal usually having thick soft fur" (cat), not "commodities offered for sale"
    (product), "writes professionally" (author) or "footwear shaped to fit the foot" (shoe). The
    words up to the phrase's end ("that", "with", "of", ...) must not look plural or be mass nouns."""
    words = [w.strip(",") for w in gloss.split()]
    if (_COUNT_NOUN_GLOSS.match(gloss) or _NOT_A_NOUN_PHRASE.match(gloss) or not words[0][0].isalpha()
            or "'" in words[0] or words[0].endswith("ly")):  # fmt: skip
        return False
    if _plural(word):
        return False  # clothes, arms
    end = next((i for i, w in enumerate(words) if i and w in _PHRASE_END), len(words))
    if end == 1 and words[0].endswith(("ed", "ing")):
        return False  # "located near the base of the neck"
    return not any(_plural(w) or w in _MASS_HEADS for w in words[:end])


def _plural(word: str) -> bool:
    """Looks like a plural (clothes, hours), not a singular in -ss, -us, -is (glass, bus, axis)."""
    return word.islower() and word.endswith("s") and not word.endswith(("ss", "us", "is"))


def extract_wordnet_common(deb: Path, per_doc: int = 100) -> Iterator[Record]:
    """The common nouns' definitions as sentences, one per line, `per_doc` per document."""
    nouns = common_nouns(deb)
    for i in range(0, len(nouns), per_doc):
        yield {"id": f"{i // per_doc:03d}", "text": "\n".join(n[3] for n in nouns[i : i + per_doc])}


def extract_wordnet_definitions(deb: Path) -> Iterator[Record]:
    """A chat per common noun: a question in a seeded choice of phrasing, the definition as the
    reply; `meta` is {"topic": "definition", "subject": the word, "answer": the gloss}."""
    for word, reading, gloss, sentence in common_nouns(deb):
        question = random.Random(f"definition/{word}").choice(_QUESTIONS[reading])
        yield chat(word, question.format(word=word, a_word=with_article(word)), sentence, topic="definition",
                   subject=word, answer=gloss)  # fmt: skip


SOURCES = [
    Source("jargon-file", "debian", "jargon-text", "4.4.7-4.1", "public domain", "public domain", "pretrain",
           extract_jargon, "The Jargon File 4.4.7 (hacker lexicon and essays)", ("pretrain",)),
    Source("devils-dictionary", "debian", "dict-devil", "1.0-13.1", "public domain", "public domain", "pretrain",
           extract_devils_dictionary, "Ambrose Bierce, The Devil's Dictionary", ("pretrain",)),
    Source("wordnet", "debian", "wordnet-base", "1:3.0-37", "WordNet-3.0 (BSD-like)", "WordNet-3.0 (BSD-like)",
           "pretrain", extract_wordnet, "WordNet 3.0 synsets with glosses and examples", ("pretrain",)),
    Source("wordnet-common", "debian", "wordnet-base", "1:3.0-37", "WordNet-3.0 (BSD-like)", "WordNet-3.0 (BSD-like)",
           "pretrain", extract_wordnet_common, "The 3,000 most common nouns defined in one plain sentence each",
           ("pretrain", "chat-pretrain")),
    Source("wordnet-definitions", "debian", "wordnet-base", "1:3.0-37", "WordNet-3.0 (BSD-like)",
           "WordNet-3.0 (BSD-like)", "sft", extract_wordnet_definitions,
           "What-is questions on the 3,000 most common nouns, answered with their definition", ("sft", "chat-sft")),
]  # fmt: skip
