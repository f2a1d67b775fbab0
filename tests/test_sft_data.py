"""SFT data: the loss mask is exactly the assistant tokens, packing keeps conversations apart,
truncation and the val split are counted and seeded, bad files fail with their line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_sft_helpers import conversations, tiny_tokenizer
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.data.loader import IGNORE_INDEX, LoaderConfig, TokenBatch
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.posttrain.data import (
    ChatLoader,
    expand_files,
    pack,
    prepare_chat_data,
    read_conversations,
    to_example,
)
from tokenmind.tokenizer import Tokenizer
from tokenmind.train.objectives import NextTokenObjective

SEQ = 96


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok: Tokenizer) -> Transformer:
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = Transformer(cfg)
    model.init_weights(0.02, torch.Generator().manual_seed(0))
    return model.eval()


def all_rows(tok: Tokenizer, chats: list, seq_len: int = SEQ) -> tuple[ChatLoader, TokenBatch]:
    """Every packed row of `chats` (no val split), in packing order, as one batch."""
    data = prepare_chat_data(tok, chats, seq_len)
    rows = len(pack([len(e.inputs) for e in data.train], seq_len))
    loader = ChatLoader(data.train, LoaderConfig(batch_size=rows, seq_len=seq_len, shuffle=False))
    return loader, next(loader)


def test_collated_targets_are_exactly_the_assistant_tokens(tok: Tokenizer) -> None:
    chats = conversations(repeats=1)
    loader, batch = all_rows(tok, chats)
    seen = 0
    for r, row in enumerate(loader.rows):
        for doc, index in enumerate(row):  # no val split, nothing dropped: example index = chat index
            ids, mask = tok.render_chat(chats[index])
            span = batch.document_ids[r] == doc
            assert batch.input_ids[r][span].tolist() == ids
            targets = batch.targets[r][span].tolist()
            expected = [ids[i + 1] if mask[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)]
            assert targets == expected + [IGNORE_INDEX]
            answers = "".join(m["content"] + "<|im_end|>" for m in chats[index] if m["role"] == "assistant")
            assert tok.decode([t for t in targets if t != IGNORE_INDEX]) == answers  # content + end of turn
            seen += 1
        padding = batch.document_ids[r] == len(row)
        assert (batch.targets[r][padding] == IGNORE_INDEX).all()
    assert seen == len(chats)


def test_plain_documents_are_trained_on_every_token(tok: Tokenizer, tmp_path: Path) -> None:
    """A {"text"} line (pre-training replay) is its tokens and eos, every next token a target,
    beside conversations whose targets stay the assistant's alone."""
    chat = conversations(repeats=1)[0]
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"text": "the cat sat on the mat"}) + "\n")
    read = read_conversations([path])
    assert read[1] == "the cat sat on the mat"
    data = prepare_chat_data(tok, read, SEQ)
    ids = tok.encode("the cat sat on the mat") + [tok.eos_token_id]
    doc = next(e for e in data.train if e.inputs.tolist() == ids)
    assert doc.targets.tolist() == ids[1:] + [IGNORE_INDEX]
    talk = next(e for e in data.train if e is not doc)
    assert (talk.targets == IGNORE_INDEX).sum() > 1  # the user turn and template glue stay context
    assert data.stats["train_trained_tokens"] == len(ids) - 1 + int((talk.targets != IGNORE_INDEX).sum())


def test_only_assistant_targets_move_the_loss(tok: Tokenizer, model: Transformer) -> None:
    ids, mask = tok.render_chat(conversations(repeats=1)[0])  # system, user, assistant
    inputs = to_example(ids, mask, SEQ).inputs

    def loss(labels: list[int]) -> torch.Tensor:
        targets = to_example(labels, mask, SEQ).targets
        row = (inputs, targets, np.zeros_like(inputs), np.arange(len(inputs)))
        return NextTokenObjective()(model, TokenBatch(*(torch.tensor(a)[None] for a in row)), "fp32").loss

    base = loss(ids)
    for i in range(1, len(ids)):
        changed = list(ids)
        changed[i] = (ids[i] + 1) % tok.vocab_size
        if mask[i]:
            assert not torch.equal(loss(changed), base), tok.decode([ids[i]])
        else:
            assert torch.equal(loss(changed), base), tok.decode([ids[i]])

    # The gradient reaches the logits of exactly the positions that predict an assistant token.
    logits = model(torch.from_numpy(inputs)[None]).detach().requires_grad_()
    torch.nn.functional.cross_entropy(logits[0], torch.tensor(to_example(ids, mask, SEQ).targets)).backward()
    assert (logits.grad[0].abs().sum(-1) > 0).tolist() == [bool(m) for m in mask[1:]] + [False]


def test_packed_conversations_get_the_logits_they_get_alone(tok: Tokenizer, model: Transformer) -> None:
    loader, batch = all_rows(tok, conversations(repeats=1))
    assert max(len(row) for row in loader.rows) >= 3  # rows really hold several conversations
    with torch.no_grad():
        packed = model(batch.input_ids, batch.positions, DenseAttentionMetadata(document_ids=batch.document_ids))
        unmasked = model(batch.input_ids, batch.positions)
    for r, row in enumerate(loader.rows):
        docs = batch.document_ids[r]
        assert (docs.diff() >= 0).all() and docs[0] == 0 and docs[-1] <= len(row)
        for doc in range(len(row)):
            span = docs == doc
            inputs = batch.input_ids[r][span]
            assert batch.positions[r][span].tolist() == list(range(len(inputs)))  # restarts per conversation
            with torch.no_grad():
                alone = model(inputs[None])[0]
            torch.testing.assert_close(packed[r][span], alone, rtol=1e-5, atol=1e-5)
            if doc > 0:  # without the document mask, later conversations would see earlier ones
                assert not torch.allclose(unmasked[r][span], alone, atol=1e-3)


def test_pack_is_best_fit_decreasing_and_deterministic() -> None:
    lengths = np.random.default_rng(0).integers(1, 40, size=300).tolist()
    rows = pack(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(300))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert len(rows) <= -(-sum(lengths) // 64) + 1  # within one row of the lower bound
    assert pack(lengths, 64) == rows
    assert pack([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]  # 6+2, 5+3, 4: each into the fullest row it fits


def test_truncation_and_untrainable_conversations_are_counted(tok: Tokenizer) -> None:
    short = [{"role": "user", "content": "apple?"}, {"role": "assistant", "content": "red"}]
    long_prompt = [{"role": "user", "content": "apple " * 100}, {"role": "assistant", "content": "red"}]
    long_answer = [{"role": "user", "content": "lime?"}, {"role": "assistant", "content": "green " * 100}]
    data = prepare_chat_data(tok, [short, long_prompt, long_answer], seq_len=32)
    assert data.stats["truncated"] == 2 and data.stats["dropped_no_assistant_tokens"] == 1
    assert data.stats["train_conversations"] == 2
    ids, mask = tok.render_chat(long_answer)
    kept = data.train[1]
    assert kept.inputs.tolist() == ids[:32]
    assert kept.targets[-1] == ids[32] and mask[32]  # the last position still trains on the next token
    assert data.turn_end_ids == {tok.token_to_id("<|im_end|>")}
    with pytest.raises(ValueError, match="raise data.seq_len"):
        prepare_chat_data(tok, [long_prompt], seq_len=32)


def test_val_split_and_row_order_follow_the_seed(tok: Tokenizer) -> None:
    chats = conversations(repeats=3)
    a, b, c = (prepare_chat_data(tok, chats, SEQ, val_fraction=0.25, seed=s) for s in (0, 0, 1))
    assert len(a.val) == 12 and len(a.train) == 36
    assert [e.inputs.tolist() for e in a.val] == [e.inputs.tolist() for e in b.val]
    assert [e.inputs.tolist() for e in a.val] != [e.inputs.tolist() for e in c.val]

    def loader(seed: int) -> ChatLoader:
        return ChatLoader(a.train, LoaderConfig(batch_size=2, seq_len=SEQ, seed=seed))

    first, same, other = loader(0), loader(0), loader(1)
    epoch = [next(first).input_ids for _ in range(first.batches_per_epoch)]
    assert all(torch.equal(x, next(same).input_ids) for x in epoch)
    assert not all(torch.equal(x, next(other).input_ids) for x in epoch)
    assert not np.array_equal(first.rows_for_epoch(0), first.rows_for_epoch(1))  # a new order each epoch

    resumed = loader(0)
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(next(resumed).targets, next(first).targets)
    with pytest.raises(ValueError, match="does not match this data"):
        ChatLoader(a.train[:-8], LoaderConfig(batch_size=2, seq_len=SEQ)).load_state_dict(first.state_dict())


def test_files_folders_and_globs_and_bad_lines(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    for name in ("b.jsonl", "a.jsonl"):
        (tmp_path / name).write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
    assert expand_files([str(tmp_path)]) == [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    assert expand_files([str(tmp_path / "b*.jsonl")]) == [tmp_path / "b.jsonl"]
    assert len(read_conversations(expand_files([str(tmp_path)]))) == 4
    with pytest.raises(FileNotFoundError, match="matches no .jsonl file"):
        expand_files([str(tmp_path / "missing.jsonl")])

    bad = tmp_path / "bad" / "x.jsonl"
    bad.parent.mkdir()
    for line, message in [
        ("not json", r"x.jsonl:2: not JSON"),
        ("[1, 2]", r"x.jsonl:2: not a JSON object"),
        ('{"text": ""}', r'x.jsonl:2: needs "messages"'),
        ('{"id": 3}', r'x.jsonl:2: needs "messages"'),
        ('{"messages": [{"role": "bot", "content": "hi"}]}', r"x.jsonl:2: bad message .* each needs a role"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', r"x.jsonl:2: no assistant message"),
    ]:
        bad.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=message):
            read_conversations([bad])
