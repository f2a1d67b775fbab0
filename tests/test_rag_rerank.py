"""The retrieval stages after the first ranking: maximal marginal relevance over the index's vectors,
and the chat model's yes/no judge that reranks candidates, in search, evaluation and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_encoder import write_tiny_bert
from test_eval_fixtures import config
from test_rag import ScriptedLLM, tiny_encoder, write_corpus  # noqa: F401 (tiny_encoder is a fixture)
from test_serve_fixtures import byte_tokenizer, tiny_pretrained
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.apps.rag import LLMReranker, RagIndex, ask, maximal_marginal_relevance
from tokenmind.apps.rag import index as index_module
from tokenmind.apps.rag.chunking import Chunk
from tokenmind.apps.rag.index import Hit
from tokenmind.apps.rag.rerank import judge_messages
from tokenmind.cli import main
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.checkpoint import save_hf_dir
from tokenmind.model.load import load_model
from tokenmind.model.transformer import Transformer


def unit(*xs: float) -> np.ndarray:
    v = np.array(xs, np.float32)
    return v / np.linalg.norm(v)


# ----------------------------------------------------------------- maximal marginal relevance

def test_mmr_takes_a_diverse_second_pick_over_a_near_duplicate():
    scores = np.array([0.9, 0.85, 0.5, 0.1])
    vectors = np.stack([unit(1, 0, 0), unit(1, 0.1, 0), unit(0, 1, 0), unit(0, 0, 1)])
    assert maximal_marginal_relevance(scores, vectors, 4, 1.0) == [0, 1, 2, 3]  # λ = 1: the relevance order
    # λ = 0.5: after 0, its near copy 1 gains 0.5·0.875 − 0.5·0.995 < 0, the unrelated 2 gains 0.5·0.5 − 0
    assert maximal_marginal_relevance(scores, vectors, 2, 0.5) == [0, 2]
    assert maximal_marginal_relevance(scores * 40 + 3, vectors, 2, 0.5) == [0, 2]  # any score scale
    assert maximal_marginal_relevance(scores[:0], vectors[:0], 3, 0.5) == []
    with pytest.raises(ValueError, match=r"MMR lambda must be in \[0, 1\]"):
        maximal_marginal_relevance(scores, vectors, 2, 1.5)


def test_search_with_mmr_passes_over_a_near_copy_of_the_best_chunk():
    chunks = [Chunk(text, "doc.md", "", n) for n, text in enumerate([
        "cats purr and cats hunt mice", "cats purr and cats hunt rats", "cats sleep all day", "dogs bark",
        "cats, dogs, birds and fish live in many homes"])]  # the weakest match: relevance 0 after rescaling
    vectors = np.stack([unit(1, 0, 0, 0), unit(1, 0.05, 0, 0), unit(0, 1, 0, 0), unit(0, 0, 1, 0), unit(0, 0, 0, 1)])
    index = RagIndex(chunks, vectors, {}, {})  # BM25 ranks; MMR reads the vectors
    plain = [h.id for h in index.search("cats purr", 3, "bm25")]
    assert plain == [0, 1, 2]
    assert [h.id for h in index.search("cats purr", 3, "bm25", mmr=1.0)] == plain
    diverse = index.search("cats purr", 2, "bm25", mmr=0.5)
    assert [h.id for h in diverse] == [0, 2]
    assert [h.score for h in diverse] == [h.score for h in index.search("cats purr", 3, "bm25")[::2]]  # kept scores


# ----------------------------------------------------------------- the yes/no judge

PASSAGES = ["the new movie is awesome", "a man is eating food.", "def f(x): return x ** 2", "1 2 3 4 5"]


def direct_log_odds(pretrained, question: str, chunk: Chunk) -> float:
    """log p(yes) − log p(no) of the first reply token, from one unbatched forward pass: the first
    bytes of yes/Yes/YES and no/No/NO are y, Y and n, N for the byte-level tokenizer."""
    ids = pretrained.tokenizer.apply_chat_template(judge_messages(question, chunk), add_generation_prompt=True)
    with torch.inference_mode():
        hidden = pretrained.model.hidden_states(torch.tensor([ids]), torch.arange(len(ids))[None],
                                                DenseAttentionMetadata())
        logp = pretrained.model.logits(hidden[0, -1]).float().log_softmax(-1)
    yes, no = logp[[ord("y"), ord("Y")]], logp[[ord("n"), ord("N")]]
    return float(yes.logsumexp(0) - no.logsumexp(0))


def test_reranker_scores_are_the_models_log_odds_of_yes_and_it_reorders_by_them(monkeypatch):
    pretrained = tiny_pretrained(context=1024)
    reranker = LLMReranker(pretrained)
    assert (reranker.yes, reranker.no) == ([ord("y"), ord("Y")], [ord("n"), ord("N")])  # first tokens, once each
    chunks = [Chunk(text, f"doc{n}.md", "Heading" if n % 2 else "", 0) for n, text in enumerate(PASSAGES)]
    passes = []
    real = type(pretrained.model).hidden_states
    monkeypatch.setattr(type(pretrained.model), "hidden_states",
                        lambda self, *a, **kw: passes.append(a[0].shape) or real(self, *a, **kw))
    scores = reranker.scores("is the movie good?", chunks)
    assert len(passes) == 1 and passes[0][0] == len(chunks)  # one forward pass, one row per candidate
    monkeypatch.undo()
    want = [direct_log_odds(pretrained, "is the movie good?", c) for c in chunks]
    assert scores == pytest.approx(want, abs=1e-4)
    assert len(set(np.round(want, 4))) == len(want)  # distinct: the order below is decided by the scores

    hits = [Hit(c, 1.0 - n / 10, n) for n, c in enumerate(chunks)]
    reranked = reranker.rerank("is the movie good?", hits, 3)
    order = sorted(range(len(chunks)), key=lambda i: -want[i])[:3]
    assert [h.id for h in reranked] == order
    assert [h.score for h in reranked] == pytest.approx([want[i] for i in order], abs=1e-4)
    assert [h.chunk for h in reranked] == [chunks[i] for i in order]
    assert reranker.rerank("q", [], 3) == []


class Oracle:
    """A reranker that knows the answers: each question's gold passage first, the others in their order."""

    def __init__(self, gold_of: dict[str, str]):
        self.gold_of, self.judged = gold_of, []

    def rerank(self, query, hits, k):
        self.judged.append(len(hits))
        return sorted(hits, key=lambda h: h.chunk.source != self.gold_of[query])[:k]


def test_search_reranks_its_first_candidates_and_the_eval_reports_hybrid_rerank(tmp_path, tiny_encoder):  # noqa: F811
    from tokenmind.apps.rag import index_documents
    from tokenmind.apps.rag.evaluate import QAItem, passages, retrieval_metrics

    texts = ["the new movie is awesome", "a man is eating food.", "a man is eating a piece of bread.",
             "def f(x):\n    return x ** 2  # squares", "1 2 3 4 5 6 7 8 9 10", "naïve café — déjà vu?"]
    items = [QAItem(str(n), f"question {n}", ["x"], text) for n, text in enumerate(texts)]  # words it cannot match
    docs, gold = passages(items)
    index, _ = index_documents(docs, tiny_encoder, tmp_path / "idx", progress=False)
    plain = [h.id for h in index.search("question 0", 6, "hybrid")]
    assert len(plain) == len(index.chunks) == 6
    oracle = Oracle({"question 0": index.chunks[plain[3]].source})
    assert [h.id for h in index.search("question 0", 2, rerank=oracle, candidates=5)] == [plain[3], plain[0]]
    assert [h.id for h in index.search("question 0", 2, rerank=oracle, candidates=3)] == plain[:2]  # not a candidate
    assert oracle.judged == [5, 3]
    llm = ScriptedLLM(byte_tokenizer(), ["It is [1]."])  # `ask` retrieves the same way
    answer, stream = ask(llm, index, "question 0", None, k=2, rerank=oracle, candidates=5)
    assert "".join(stream) == "It is [1]." and [h.id for h in answer.hits] == [plain[3], plain[0]]

    oracle = Oracle({item.question: gold[item.id] for item in items})
    metrics = retrieval_metrics(index, items, gold, k=2, modes=("hybrid",), reranker=oracle, candidates=6)
    assert set(metrics) == {"hybrid", "hybrid+rerank"} and oracle.judged == [6] * len(items)
    assert metrics["hybrid+rerank"]["recall@1"] == metrics["hybrid+rerank"]["mrr@2"] == 1.0
    assert metrics["hybrid"]["recall@1"] < 0.5


# ----------------------------------------------------------------- the command line

def tiny_chat_dir(path):
    """A random chat model on disk, byte-level, with room for a grounded prompt of a few passages."""
    torch.manual_seed(0)
    model = Transformer(config(vocab=260, context=2048)).eval()
    model.init_weights(std=0.5)
    return save_hf_dir(model, path, tokenizer=byte_tokenizer())


def test_rerank_and_mmr_flags_on_rag_search_ask_and_eval(tmp_path, capsys):
    encoder = write_tiny_bert(tmp_path / "tiny-bert")
    model = tiny_chat_dir(tmp_path / "chat")
    docs = write_corpus(tmp_path / "docs")
    assert main(["rag", "index", str(docs), "--out", str(tmp_path / "idx"), "--encoder", str(encoder),
                 "--chunk-tokens", "8", "--overlap", "2"]) == 0
    capsys.readouterr()
    idx, query = str(tmp_path / "idx"), "the movie is awesome"

    def search(*flags):
        assert main(["rag", "search", idx, query, "-k", "3", "--json", *flags]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    plain = search()
    assert search("--mmr", "1") == plain
    assert [r["rank"] for r in search("--mmr", "0.3")] == [1, 2, 3]
    reranked = search("--rerank", "--model", str(model), "--candidates", "6")
    want = RagIndex.load(idx).search(query, 3, rerank=LLMReranker(load_model(model)), candidates=6)
    assert [(r["text"], r["score"]) for r in reranked] == [(h.chunk.text, round(h.score, 4)) for h in want]
    assert main(["rag", "search", idx, query, "--rerank"]) == 2
    assert "add --model" in capsys.readouterr().err
    assert main(["rag", "search", idx, query, "--mmr", "2"]) == 2
    assert "MMR lambda must be in [0, 1]" in capsys.readouterr().err

    assert main(["rag", "ask", idx, query, "--model", str(model), "--rerank", "--mmr", "0.7", "-k", "2",
                 "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()

    rows = [{"id": "a", "question": query, "answers": ["x"], "context": "the new movie is awesome"},
            {"id": "b", "question": "a man is eating food.", "answers": ["y"], "context": "a man is eating food."}]
    (tmp_path / "qa.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    eval_args = ["rag", "eval", "--data", str(tmp_path / "qa.jsonl"), "--encoder", str(encoder), "-k", "2"]
    assert main([*eval_args, "--rerank", "--model", str(model), "--answer-limit", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["retrieval"]) == {"dense", "bm25", "hybrid", "hybrid+rerank"} and "answers" not in result
    assert main([*eval_args, "--rerank"]) == 2
    assert "add --model" in capsys.readouterr().err
    assert main([*eval_args, "--corpus", str(docs), "--limit", "1"]) == 0  # cats.md holds both gold passages
    result = json.loads(capsys.readouterr().out)
    assert (result["questions"], result["passages"]) == (1, 2)
    assert result["corpus"] == {"documents": 2, "left_out": [str(docs / "cats.md")]}

    from tokenmind.cli import RAG_CANDIDATES

    assert RAG_CANDIDATES == index_module.CANDIDATES  # the CLI's --candidates default


# ----------------------------------------------------------------- the Python FAQ set

def test_faq_chats_load_as_questions_and_corpus_copies_of_an_answer_are_left_out(tmp_path, tiny_encoder):  # noqa: F811
    from tokenmind.apps.rag import index_documents, read_documents
    from tokenmind.apps.rag.evaluate import QAItem, distractors, load_qa, passages, retrieval_metrics, spread

    answer = "Use the  new movie\nis awesome."
    faq = {"id": "faq/q1", "messages": [{"role": "user", "content": "Is the movie good?"},
                                        {"role": "assistant", "content": answer}]}
    (tmp_path / "faq.jsonl").write_text(json.dumps(faq) + "\n")
    (item,) = load_qa(tmp_path / "faq.jsonl")
    assert (item.id, item.question, item.answers, item.context) == ("faq/q1", "Is the movie good?", [answer], answer)
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps(d) for d in [
        {"id": "faq/page", "text": "Is the movie good?\n==================\n\nUse the new movie is awesome.\n"},
        {"id": "other", "text": "a man is eating food."}]) + "\n")
    docs, gold = passages([item])
    kept, dropped = distractors(read_documents([tmp_path / "docs.jsonl"]), docs)
    assert [d.source.split("#")[1] for d in kept] == ["other"] and [d.source.split("#")[1] for d in dropped] == [
        "faq/page"]  # the page holds the answer (whitespace aside): a second copy of the gold passage
    index, _ = index_documents(docs + kept, tiny_encoder, tmp_path / "idx", progress=False)
    assert retrieval_metrics(index, [item], gold, k=2, modes=("bm25",))["bm25"]["recall@2"] == 1.0
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: .*messages with a user and an assistant turn"):
        load_qa(tmp_path / "bad.jsonl")
    many = [QAItem(str(n), "q", ["a"], "c") for n in range(10)]
    assert [i.id for i in spread(many, 3)] == ["0", "3", "6"] and spread(many, None) == spread(many, 10) == many
