"""Continuation log-likelihoods (shared-prefix batching vs a plain forward pass), perplexity and
bits per byte on models whose distributions are known, and the token-shard val loss."""

import math

import pytest
import torch
from test_eval_fixtures import VOCAB, ByteTokenizer, bigram_model, preferring, random_model, zero_model
from test_train_helpers import one_thread, write_shards  # noqa: F401 (one_thread: autouse fixture)
from test_train_helpers import VOCAB as SHARD_VOCAB

from tokenmind.eval.loglik import loglikelihoods
from tokenmind.eval.perplexity import evaluate_lm, shard_val_loss, windows


def naive_loglik(model, ctx, cont):
    with torch.no_grad():
        logp = model(torch.tensor([ctx + cont])).log_softmax(-1)[0]
    return sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))


def random_requests(n_contexts=5, choices=3, vocab=VOCAB, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    requests = []
    for _ in range(n_contexts):
        ctx = torch.randint(0, vocab, (lengths(1, 12),), generator=g).tolist()
        requests += [(ctx, torch.randint(0, vocab, (lengths(1, 7),), generator=g).tolist()) for _ in range(choices)]
    return requests


@pytest.mark.parametrize("batch_size", [1, 4, 64])
def test_batched_shared_prefix_scores_equal_a_plain_forward_pass(batch_size):
    model, requests = random_model(), random_requests()
    expected = [naive_loglik(model, ctx, cont) for ctx, cont in requests]
    assert loglikelihoods(model, requests, batch_size) == pytest.approx(expected, abs=1e-4)


def test_long_contexts_keep_their_most_recent_tokens():
    model = random_model(context=16)
    ctx, cont = list(range(1, 30)), [5, 6, 7]
    (score,) = loglikelihoods(model, [(ctx, cont)])
    assert score == pytest.approx(naive_loglik(model, ctx[-(16 + 1 - 3):], cont), abs=1e-4)
    with pytest.raises(ValueError, match="empty context"):
        loglikelihoods(model, [([], cont)])


def test_progress_counts_every_request():
    seen = []
    loglikelihoods(random_model(), random_requests(), batch_size=4, progress=seen.append)
    assert sum(seen) == 15


@pytest.mark.parametrize("n,seq_len,stride", [(1, 4, 4), (10, 4, 4), (10, 4, 1), (23, 8, 3), (5, 16, 8)])
def test_windows_score_every_token_once_within_the_window(n, seq_len, stride):
    ids = list(range(100, 101 + n))
    scored = []
    for ctx, cont in windows(ids, seq_len, stride):
        assert len(ctx) + len(cont) - 1 <= seq_len  # the model's inputs
        assert ctx + cont == ids[ids.index(ctx[0]):ids.index(cont[-1]) + 1]  # contiguous
        scored += cont
    assert scored == ids[1:]


def test_uniform_model_has_loss_ln_vocab_and_known_bits_per_byte():
    text = ["héllo world, ", "perplexity is exp(loss)"]  # é: 2 bytes
    result = evaluate_lm(zero_model(), text, ByteTokenizer(), seq_len=8, stride=3)
    num_bytes = sum(len(t.encode()) for t in text)
    assert result["tokens"] == num_bytes and result["bytes"] == num_bytes  # byte tokenizer: one token per byte
    assert result["loss"] == pytest.approx(math.log(VOCAB), rel=1e-5)
    assert result["perplexity"] == pytest.approx(VOCAB, rel=1e-4)
    assert result["bits_per_byte"] == pytest.approx(result["tokens"] * math.log(VOCAB) / (math.log(2) * num_bytes))


def test_sliding_window_matches_one_pass_when_the_text_fits():
    model, text = random_model(context=64), "the quick brown fox"
    whole = evaluate_lm(model, text, ByteTokenizer(), seq_len=64)
    assert evaluate_lm(model, text, ByteTokenizer(), seq_len=64, stride=5)["loss"] == pytest.approx(whole["loss"])
    short = evaluate_lm(model, text, ByteTokenizer(), seq_len=6, stride=2)  # less context → a different loss
    assert short["tokens"] == whole["tokens"] and short["loss"] != pytest.approx(whole["loss"])


def test_token_ids_without_tokenizer_have_no_bits_per_byte():
    model = bigram_model(preferring({"a": 4.0}))
    result = evaluate_lm(model, [ord("a")] * 5)
    p_a = math.exp(4.0) / (math.exp(4.0) + VOCAB - 1)
    assert result["tokens"] == 4 and result["bytes"] is None and result["bits_per_byte"] is None
    assert result["loss"] == pytest.approx(-math.log(p_a), rel=1e-4)
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate_lm(model, "text")
    with pytest.raises(ValueError, match="seq_len"):
        evaluate_lm(model, "text", ByteTokenizer(), seq_len=10_000)


def test_shard_val_loss_of_a_uniform_model(tmp_path):
    shards = write_shards(tmp_path / "shards")
    result = shard_val_loss(zero_model(SHARD_VOCAB), shards, batches=2, seq_len=16, batch_size=2)
    assert result["tokens"] == 2 * 2 * 16
    assert result["loss"] == pytest.approx(math.log(SHARD_VOCAB), rel=1e-5) and result["bits_per_byte"] is None
    with pytest.raises(ValueError, match="another tokenizer"):
        shard_val_loss(zero_model(64), shards)
