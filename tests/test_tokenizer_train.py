"""Byte-level BPE training (`tokenmind.tokenizer.train`): ids, round trips, transformers
compatibility of what we save, and compression against the SmolLM2 tokenizer."""

from __future__ import annotations

import inspect
import json
import random

import pytest

from tokenmind.tokenizer import Tokenizer
from tokenmind.tokenizer.train import (
    CHATML_TEMPLATE,
    DEFAULT_SPECIAL_TOKENS,
    TokenizerTrainConfig,
    bytes_per_token,
    compare_bytes_per_token,
    train_bpe,
    train_tokenizer,
)

transformers = pytest.importorskip("transformers")

ROUND_TRIP = [
    "",
    " ",
    "\n",
    "Hello, world!",
    "Héllo wörld, ça va? Ñandú, naïve façade, Zürich, Ελληνικά, кириллица",
    "日本語のテキストと中文文本，한국어도。",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🫠",
    "def f(x):\n\tif x:\n\t\treturn x ** 2  # comment\n    else:\n        pass\n",
    "lots   of    spaces\n\n\n\nand\r\nnewlines \t\t tabs   ",
    "Numbers: 1234567 3.14159 -42 1,000,000 0x1F",
    "special mid<|endoftext|>text<|im_start|>x<|im_end|>",
    "I'm sure they'll say it's John's, won't they? WE'RE",
    "a\u200bb\u00a0c\u2028d \x00\x7f",
]


def _corpus() -> list[str]:
    """A few hundred KB of English and code: stdlib docstrings plus generated sentences."""
    import argparse
    import collections
    import json as json_mod
    import pathlib
    import textwrap

    texts = []
    for module in (argparse, collections, json_mod, pathlib, textwrap, inspect, random, str, dict, list):
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40:
                texts.append(doc)
    rng = random.Random(0)
    subjects = ["The model", "A tokenizer", "Every function", "This server", "The old library", "Our data"]
    verbs = ["reads", "writes", "returns", "encodes", "compresses", "checks", "splits"]
    objects = ["the input text", "a list of numbers", "each document", "bytes from the file", "the final answer"]
    for i in range(3000):
        sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} in {rng.randint(1, 999)} steps."
        code = f"def step_{i}(x):\n    return x * {rng.randint(2, 9)} + {rng.randint(0, 99)}\n"
        texts.append(sentence if i % 3 else sentence + "\n" + code)
    return texts


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    texts = _corpus()
    assert sum(map(len, texts)) > 200_000
    return [t for i, t in enumerate(texts) if i % 10], [t for i, t in enumerate(texts) if i % 10 == 0]


@pytest.fixture(scope="module")
def tok(corpus) -> Tokenizer:
    return train_bpe(corpus[0], vocab_size=512)


@pytest.fixture(scope="module")
def saved(tok, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    tok.save(directory)
    return directory, transformers.AutoTokenizer.from_pretrained(directory)


def test_vocabulary_and_special_tokens(tok):
    assert tok.vocab_size == 512
    assert [tok.token_to_id(t) for t in DEFAULT_SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0
    assert tok.eos_token_ids == {0, 2}  # <|im_end|> ends chat turns
    assert tok.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>")[:1] == [1]
    assert tok.encode("<|im_end|>") == [2] and tok.encode("<|endoftext|>") == [0]
    ids = tok.encode("x<|im_end|>y")
    assert ids.count(2) == 1 and tok.decode(ids) == "x<|im_end|>y"
    # The pieces of a special token in plain text never produce its id: only the exact string does.
    assert not {0, 1, 2} & set(tok.encode("<|im_end |> <| endoftext|> <|im_start"))


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_all_bytes_are_in_the_vocabulary(tok):
    data = bytes(range(256)).decode("latin-1")
    assert tok.decode(tok.encode(data)) == data
    assert len(tok.encode("\U0001fae0")) <= 4  # a rare emoji: at most one token per UTF-8 byte


def test_transformers_loads_the_saved_tokenizer(tok, saved):
    directory, theirs = saved
    assert json.loads((directory / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    assert theirs.eos_token == theirs.bos_token == theirs.pad_token == "<|endoftext|>"
    assert len(theirs) == tok.vocab_size
    for text in ROUND_TRIP:
        ids = tok.encode(text)
        assert theirs.encode(text) == ids, text  # transformers adds no special tokens either
        assert theirs.decode(ids) == text
    assert Tokenizer.from_pretrained(directory).encode("héllo 😀 code()") == tok.encode("héllo 😀 code()")


def test_chat_template_matches_transformers_and_smollm2_format(tok, saved):
    _, theirs = saved
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]  # fmt: skip
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    for gen in (False, True):
        ours_text = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert ours_text == theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        ours_ids = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert ours_ids == theirs.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False)
    # SFT masks: ours and transformers' agree, and cover the reply and its end-of-turn token.
    ids, mask = tok.render_chat(messages[:3])
    hf = theirs.apply_chat_template(messages[:3], return_assistant_tokens_mask=True, return_dict=True, tokenize=True)
    assert hf["input_ids"] == ids and hf["assistant_masks"] == mask
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello!<|im_end|>"


def test_bytes_per_token_and_reference_comparison(tok, corpus):
    heldout = corpus[1]
    bpt = bytes_per_token(tok, heldout)
    assert 1.5 < bpt < 4  # a 512-token vocabulary: better than bytes, far from a large vocabulary
    assert bytes_per_token(tok, ["aaaa"]) == pytest.approx(4 / len(tok.encode("aaaa")))
    with pytest.raises(ValueError, match="non-empty"):
        bytes_per_token(tok, [""])

    from tokenmind.model.load import load_tokenizer

    try:
        reference = load_tokenizer("smollm2")
    except FileNotFoundError as err:
        pytest.skip(str(err))
    report = compare_bytes_per_token(tok, reference, heldout)
    assert report["trained"] == pytest.approx(bpt)
    assert report["reference"] > report["trained"]  # 49,152 tokens beat 512
    assert report["ratio"] == pytest.approx(report["trained"] / report["reference"])
    assert report["bytes"] == sum(len(t.encode()) for t in heldout)
    assert (report["trained_vocab_size"], report["reference_vocab_size"]) == (512, 49152)


def test_training_is_deterministic_and_validates_arguments(corpus):
    texts = corpus[0][:300]
    a, b = train_bpe(texts, 300), train_bpe(iter(texts), 300)
    assert a.backend.to_str() == b.backend.to_str()
    with pytest.raises(ValueError, match="too small"):
        train_bpe(texts, 200)
    with pytest.raises(ValueError, match="eos_token='<eos>' is not in special_tokens"):
        train_bpe(texts, 300, eos_token="<eos>")
    with pytest.raises(TypeError, match="strings"):
        train_bpe([b"bytes"], 300)
    custom = train_bpe(texts, 300, special_tokens=("<eos>", "<pad>"), eos_token="<eos>", bos_token=None,
                       pad_token="<pad>", chat_template=None)  # fmt: skip
    assert (custom.eos_token_id, custom.pad_token_id, custom.bos_token_id) == (0, 1, None)
    assert custom.chat_template is None and CHATML_TEMPLATE


def test_train_tokenizer_from_jsonl_files(tmp_path, corpus):
    data = tmp_path / "pretrain"
    data.mkdir()
    with open(data / "docs.jsonl", "w") as fh:
        for i, text in enumerate(corpus[0] + corpus[1]):
            fh.write(json.dumps({"text": text, "id": f"doc{i}"}) + "\n")
    cfg = TokenizerTrainConfig(data=[str(data)], out=str(tmp_path / "tok"), vocab_size=400, heldout_every=10)
    report = train_tokenizer(cfg)
    assert (tmp_path / "tok/tokenizer.json").is_file()
    assert json.loads((tmp_path / "tok/train_report.json").read_text())["bytes_per_token"] == report["bytes_per_token"]
    assert report["vocab_size"] == 400 and report["heldout_docs"] > 0
    assert report["train_docs"] + report["heldout_docs"] == len(corpus[0]) + len(corpus[1])
    assert 1.5 < report["bytes_per_token"] < 4
    again = train_tokenizer(TokenizerTrainConfig(data=[str(data)], out=str(tmp_path / "tok2"), vocab_size=400,
                                                 heldout_every=10, max_chars=50_000))  # fmt: skip
    assert 0 < again["heldout_docs"] < report["heldout_docs"]  # held out from the part that was read
    assert 50_000 <= again["train_chars"] < 51_000 + max(map(len, corpus[0]))
    with pytest.raises(ValueError, match="data is empty"):
        TokenizerTrainConfig()


def test_saved_tokenizer_keeps_every_stop_id(tmp_path):
    """`<|im_end|>` ends chat turns: it must still stop generation after save → load."""
    from tokenmind.tokenizer import Tokenizer
    from tokenmind.tokenizer.train import train_bpe

    texts = [f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(200)]
    tok = train_bpe(texts, vocab_size=300)
    end_of_turn = tok.token_to_id("<|im_end|>")
    assert end_of_turn in tok.eos_token_ids
    tok.save(tmp_path)
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == tok.eos_token_ids
