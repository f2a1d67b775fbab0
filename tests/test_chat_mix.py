"""The speedrun's chat training mix: what it holds, and that the held-out chat prompts never reach it."""

import json
import random

import pytest

from tokenmind.eval.chat_quality import load_chat_prompts
from tokenmind.posttrain.chat_mix import (LITERATURE, ChatMixConfig, HeldOut, build_chat_mix, check_held_out,
                                         fact_documents, literature_text, normalize, template_chats)


def chat(user, answer, **meta):
    return {"id": user, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            "meta": meta}


def test_held_out_prompts_and_subjects_are_refused():
    held = HeldOut()
    assert not held.allows(chat("What is the capital of France?", "Paris."))
    assert not held.allows(chat("what is the CAPITAL of france", "Paris."))  # case and punctuation do not matter
    assert not held.allows(chat("Can you name three days of the week?", "Monday, Tuesday and Friday."))  # holds one
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


def quiz(user, reply, subject, value):
    return {**chat(user, reply, topic="capital", subject=subject), "meta": {"topic": "capital", "subject": subject,
                                                                           "answer": value}}


def test_quiz_answers_keep_the_preferred_word_order_where_a_subject_has_it():
    from tokenmind.posttrain.chat_mix import prefer_answers, restates_subject

    lima_last = quiz("What is the capital of Peru?", "The capital of Peru is Lima.", "Peru", "Lima")
    lima_first = quiz("Name the capital of Peru.", "Lima is the capital of Peru.", "Peru", "Lima")
    au = quiz("What is the chemical symbol for gold?", "The chemical symbol for gold is Au.", "gold", "Au")
    assert restates_subject(lima_last) and not restates_subject(lima_first) and restates_subject(au)
    assert restates_subject(quiz("What is the capital of Luxembourg?", "Luxembourg is the capital of Luxembourg.",
                                 "Luxembourg", "Luxembourg"))
    assert restates_subject(chat("Hello!", "Hello! How can I help?"))  # no subject: nothing to restate
    chats = [lima_last, lima_first, au]
    assert prefer_answers(chats, "all") == chats
    assert prefer_answers(chats, "subject-first") == [lima_last, au]
    assert prefer_answers(chats, "answer-first") == [lima_first, au]  # gold has no answer-first reply: kept
    with pytest.raises(ValueError, match="answer-first"):
        prefer_answers(chats, "first")


def test_qa_documents_render_every_exchange_once_per_repeat_in_new_groupings():
    from tokenmind.posttrain.chat_mix import qa_documents

    chats = [chat(f"What is thing {i}?", f"Thing {i} is a thing.") for i in range(20)]
    two_turns = {"id": "m", "messages": chats[0]["messages"] + chats[1]["messages"]}
    docs = qa_documents([*chats, two_turns], repeats=2, rng=random.Random(0), per_doc=8)
    text = "\n\n".join(d["text"] for d in docs)
    assert len(docs) == 6 and len({d["id"] for d in docs}) == 6
    assert all(text.count(f"Question: What is thing {i}?\nAnswer: Thing {i} is a thing.") == 2 for i in range(20))
    assert docs[0]["text"] != docs[3]["text"]  # the second pass is shuffled anew
    assert qa_documents(chats, repeats=0, rng=random.Random(0)) == []


def test_the_mix_can_put_the_questions_into_pre_training_and_prefer_an_answer_order(tmp_path):
    data = tmp_path / "data"
    (data / "sft").mkdir(parents=True)
    (data / "pretrain").mkdir()
    with open(data / "sft" / "quiz-qa.jsonl", "w") as fh:
        for c in [quiz("What is the capital of Spain?", "The capital of Spain is Madrid.", "Spain", "Madrid"),
                  quiz("Name the capital of Spain.", "Madrid is the capital of Spain.", "Spain", "Madrid"),
                  quiz("Which city is the capital of France?", "The capital of France is Paris.", "France", "Paris")]:
            fh.write(json.dumps(c) + "\n")
    counts = build_chat_mix(data, tmp_path / "mix", ChatMixConfig(qa_repeats=2, quiz_answers="answer-first"))
    assert counts["sft/quiz-qa"] == 1  # Spain's subject-first reply and the held-out France are gone
    pretrain = [json.loads(line)["text"] for line in open(tmp_path / "mix" / "pretrain" / "mix.jsonl")]
    joined = "\n".join(pretrain)
    assert joined.count("Question: Name the capital of Spain.\nAnswer: Madrid is the capital of Spain.") == 2
    assert "The capital of Spain is Madrid" not in joined and "capital of France" not in joined
    assert counts["pretrain/qa"] > 2 and check_held_out(tmp_path / "mix") == []


def test_template_repeats_add_fresh_rounds_to_sft_only(tmp_path):
    data = tmp_path / "data"
    (data / "sft").mkdir(parents=True)
    once = build_chat_mix(data, tmp_path / "once")
    thrice = build_chat_mix(data, tmp_path / "thrice", ChatMixConfig(template_repeats=3))
    # a fresh round may phrase a question as a held-out prompt does ("Who wrote Romeo and Juliet?"): dropped
    assert 3 * once["sft/templates"] - len(LITERATURE) <= thrice["sft/templates"] <= 3 * once["sft/templates"]
    rows = [json.loads(line) for line in open(tmp_path / "thrice" / "sft" / "templates.jsonl")]
    assert len({r["id"] for r in rows}) == len(rows)
    first, later = rows[:once["sft/templates"]], rows[once["sft/templates"]:]
    template_ids = {c["id"] for c in template_chats(random.Random(0))}
    assert {r["id"].rsplit("-r", 1)[0] for r in later} <= template_ids
    replies = lambda chats: [r["messages"][1]["content"] for r in chats]  # noqa: E731
    assert replies(later[:len(first)]) != replies(first)  # drawn afresh: other replies, other list items
    for part in ("pretrain/mix.jsonl", "sft/multi-turn.jsonl", "sft/multiple-choice.jsonl"):
        assert (tmp_path / "once" / part).read_text() == (tmp_path / "thrice" / part).read_text()
    assert check_held_out(tmp_path / "thrice") == []
    with pytest.raises(ValueError, match="template_repeats"):
        ChatMixConfig(template_repeats=0)


def test_fact_replay_puts_the_facts_into_sft_as_plain_text(tmp_path):
    data = tmp_path / "data"
    (data / "pretrain").mkdir(parents=True)
    facts = ["The capital of France is Paris.", "The chemical symbol for gold is Au."]
    (data / "pretrain" / "quiz-facts.jsonl").write_text(json.dumps({"id": "f", "text": " ".join(facts)}) + "\n")
    (data / "pretrain" / "wordnet-common.jsonl").write_text(
        json.dumps({"id": "w", "text": "A dog is a domestic animal."}) + "\n")
    none = build_chat_mix(data, tmp_path / "none")
    twice = build_chat_mix(data, tmp_path / "twice", ChatMixConfig(fact_replay=2))
    assert "sft/replay" not in none and not (tmp_path / "none" / "sft" / "replay.jsonl").exists()
    rows = [json.loads(line) for line in open(tmp_path / "twice" / "sft" / "replay.jsonl")]
    assert len(rows) == twice["sft/replay"] and all(set(r) == {"id", "text"} for r in rows)
    text = " ".join(r["text"] for r in rows)
    for sentence in [*facts, "A dog is a domestic animal.", "Jane Austen wrote the novel Emma."]:
        assert text.count(sentence) == 2, sentence  # the facts, the definitions and the books, twice each
    for part in ("pretrain/mix.jsonl", "sft/templates.jsonl", "sft/multi-turn.jsonl"):  # the rest as without it
        assert (tmp_path / "none" / part).read_text() == (tmp_path / "twice" / part).read_text()
    assert check_held_out(tmp_path / "twice") == []
    with pytest.raises(ValueError, match="fact_replay"):
        ChatMixConfig(fact_replay=-1)


