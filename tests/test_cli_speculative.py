"""`--speculative` on `tokenmind generate` / `chat`: n-gram, draft-model and MTP drafting give the same
greedy text as plain decoding, report their acceptance, and a draft model with another
vocabulary is refused with the reason."""

import re

import pytest
import torch
from test_eval_fixtures import config
from test_serve_fixtures import byte_tokenizer
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.cli import main
from tokenmind.model.checkpoint import save_hf_dir
from tokenmind.model.transformer import Transformer

PROMPT = "abcabcabcabcabcabc"


def tiny_dir(root, name, vocab=260, layers=2, seed=0):
    torch.manual_seed(seed)
    model = Transformer(config(vocab=vocab, context=512, layers=layers)).eval()
    model.init_weights(std=0.5)
    return save_hf_dir(model, root / name, tokenizer=byte_tokenizer())


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_dir(tmp_path_factory.mktemp("models"), "target")


def generate(capsys, model, *flags):
    assert main(["generate", "--model", str(model), "--max-tokens", "24", *flags, PROMPT]) == 0
    out = capsys.readouterr()
    return out.out, out.err


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_speculative_greedy_text_equals_plain_decoding(capsys, target, tmp_path, drafter):
    plain, plain_err = generate(capsys, target)
    spec = "ngram" if drafter == "ngram" else str(tiny_dir(tmp_path, "draft", layers=1, seed=1))
    text, err = generate(capsys, target, "--speculative", spec)
    assert text == plain and plain.strip()
    assert "drafts accepted" in err and "drafts accepted" not in plain_err


def test_chat_accepts_speculative(capsys, target, monkeypatch):
    assert main(["chat", "--model", str(target), "--max-tokens", "8", "-m", "hi"]) == 0
    plain = capsys.readouterr().out
    assert main(["chat", "--model", str(target), "--max-tokens", "8", "--speculative", "ngram", "--stats",
                 "-m", "hi"]) == 0
    out, err = capsys.readouterr()
    assert out == plain
    assert re.search(r"\[\d+ tokens in [\d.]+ s; time to first token \d+ ms \(\d+ prompt tokens", err), err


def test_draft_model_with_another_vocabulary_is_refused(capsys, target, tmp_path):
    other = tiny_dir(tmp_path, "other", vocab=300)
    assert main(["generate", "--model", str(target), "--speculative", str(other), PROMPT]) == 2
    assert "must share the target's tokenizer" in capsys.readouterr().err


def test_mtp_drafting_gives_the_same_text_and_a_model_without_depths_is_refused(capsys, target, tmp_path):
    from test_mtp import TINY

    from tokenmind.model.config import ModelConfig

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, "vocab_size": 260, "max_position_embeddings": 512,
                                       "num_nextn_predict_layers": 1})).eval()
    model.init_weights(std=0.3)
    path = save_hf_dir(model, tmp_path / "mtp", tokenizer=byte_tokenizer())
    plain, _ = generate(capsys, path)
    text, err = generate(capsys, path, "--speculative", "mtp")
    assert text == plain and plain.strip()
    assert "drafts accepted" in err
    assert main(["generate", "--model", str(target), "--speculative", "mtp", PROMPT]) == 2
    assert "num_nextn_predict_layers=0" in capsys.readouterr().err
