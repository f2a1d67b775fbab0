"""The speedrun's chat training mix: what it holds, and that the held-out chat prompts never reach it."""

import json
import random

from tokenmind.eval.chat_quality import load_chat_prompts
from tokenmind.posttrain.chat_mix import (HeldOut, build_chat_mix, check_held_out, fact_documents, literature_text,
                                         normalize, template_chats)


def chat(user, answer, **meta):
    return {"id": user, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            "meta": meta}


def test_held_out_prompts_and_subjects_are_refused():
    held = HeldOut()
    assert not held.allows(chat("What is the capital of France?", "Paris."))
    assert not held.allows(chat("what is the CAPITAL of france", "Paris."))  # case and punctuation do not matter
    assert not held.allows(chat("Name France's capital city.", "Paris.", topic="capital", subject="France"))
    assert held.allows(chat("What is the capital of Spain?", "Madrid.", topic="capital", subject="Spain"))
    assert not held.allows(chat("What is a dog?", "An animal.", topic="definition", subject="dog"))
    assert held.allows(chat("Tell me about dogs.", "Dogs are pets.", topic="animal-facts", subject="dog"))


def test_templates_speak_in_sentences_and_avoid_the_held_out_prompts():
    chats = list(template_chats(random.Random(0)))
    held = {normalize(it["prompt"]) for it in load_chat_prompts()}
    assert len(chats) > 500
    kept = [c for c in chats if HeldOut().allows(c)]
    assert len(kept) < len(chats)  # some template questions coincide with held-out prompts: those are dropped
    assert all(normalize(c["messages"][0]["content"]) not in held for c in kept)
    answers = [c["messages"][1]["content"] for c in chats]
    assert all(a[0].isupper() and a[-1] in ".!?" for a in answers)
    assert any("tokenmind" in a for a in answers)


def test_the_built_mix_holds_no_held_out_prompt(tmp_path):
    data = tmp_path / "data"
    (data / "sft").mkdir(parents=True)
    (data / "pretrain").mkdir()
    with open(data / "sft" / "quiz-qa.jsonl", "w") as fh:
        for c in [chat("Which city is the capital of France?", "The capital of France is Paris.", topic="capital",
                       subject="France"),
                  chat("What is the capital of Spain?", "The capital of Spain is Madrid.", topic="capital",
                       subject="Spain")]:
            fh.write(json.dumps(c) + "\n")
    with open(data / "pretrain" / "quiz-facts.jsonl", "w") as fh:
        fh.write(json.dumps({"id": "f", "text": "The capital of France is Paris."}) + "\n")
    counts = build_chat_mix(data, tmp_path / "mix")
    assert counts["sft/quiz-qa"] == 1 and counts["pretrain/quiz-facts"] == 1  # the fact stays as text
    assert counts["sft/templates"] > 500 and counts["pretrain/stories"] > 400
    assert check_held_out(tmp_path / "mix") == []
    multi = [json.loads(line) for line in open(tmp_path / "mix" / "sft" / "multi-turn.jsonl")]
    assert len(multi) == counts["sft/multi-turn"] > 1000
    assert all(len(c["messages"]) in (4, 6) and [m["role"] for m in c["messages"]][:2] == ["user", "assistant"]
               for c in multi)
    leaked = tmp_path / "mix" / "sft" / "leak.jsonl"
    leaked.write_text(json.dumps(chat("Who wrote Pride and Prejudice?", "Jane Austen.")) + "\n")
    assert check_held_out(tmp_path / "mix") == ["leak.jsonl:Who wrote Pride and Prejudice?"]


def test_facts_repeat_as_new_groupings_of_whole_sentences():
    docs = [{"id": "a", "text": "Heading\n\nThe capital of Spain is Madrid. Mr. Darcy is proud. Rome is in Italy."}]
    out = fact_documents(docs, repeats=4, rng=random.Random(0), per_doc=2)
    sentences = sorted(s for d in out for s in ["The capital of Spain is Madrid.", "Mr. Darcy is proud.",
                                                "Rome is in Italy."] if s in d["text"])
    assert len(sentences) == 12  # every sentence once per repeat, "Mr. Darcy" not split, the heading dropped
    assert not any("Heading" in d["text"] for d in out)
    assert len({d["id"] for d in out}) == len(out)
    many = fact_documents(literature_text(), repeats=3, rng=random.Random(0))
    assert len({d["text"] for d in many}) == len(many)  # no two groupings alike: dedup keeps them all
