"""Chat data for SFT: read conversations, render them with the chat template, pack them into rows.

A conversation is trained exactly as the model will later see it in `tokenmind chat`: rendered
by the tokenizer's own chat template (`Tokenizer.render_chat`), which also says which tokens
the assistant produced. Only those — each assistant turn's content and its end-of-turn token —
are targets; system and user turns, role headers and template glue are context the model
reads but is not trained to write. A conversation of L tokens becomes L positions: inputs
ids[0..L), targets ids[1..L) with every non-assistant target set to `IGNORE_INDEX`, and
IGNORE_INDEX after the last token (nothing follows a conversation).

Conversations are short and uneven, so padding each to the row length would waste most of a
batch's compute. They are packed instead, several per row of `seq_len`, with the same
`document_ids`/`positions` the pre-training loader produces: positions restart at 0 in every
conversation and attention never crosses from one conversation into another, so a packed
conversation gets exactly the logits it would get alone. Packing is best-fit decreasing
(longest first, each into the fullest row it still fits), which leaves ~1% of a row empty
where filling rows in reading order leaves about half a conversation per row; the rest of a
row is padding: its own document, never attended to from real tokens and never trained on.

A line may also be a plain document, `{"text": ...}`, trained on every token as in pre-training and
ended with the eos token: replaying some pre-training text during SFT keeps a small model from
forgetting what only that text taught it (facts about subjects no conversation mentions).

A conversation longer than `seq_len` keeps its first `seq_len` positions (the prompt and the
start of the answer) and is counted as truncated; one with no assistant token left to train
on is dropped and counted. Rows are packed once; `ChatLoader` serves them in a seeded order
per epoch and saves its position like `PackedLoader`, so a resumed run sees the same batches.
"""

from __future__ import annotations

import bisect
import glob
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmind.data.loader import IGNORE_INDEX, LoaderConfig, RowLoader, TokenBatch
from tokenmind.jsonl import located_objects
from tokenmind.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")


def expand_files(specs: Sequence[str]) -> list[Path]:
    """JSONL paths from files, directories (their `*.jsonl`, sorted) and glob patterns, in order."""
    paths: list[Path] = []
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
        elif path.is_file():
            found = [path]
        else:
            found = [Path(p) for p in sorted(glob.glob(str(path)))]
        if not found:
            raise FileNotFoundError(f"data.files: {spec!r} matches no .jsonl file; give chat JSONL files, a folder "
                                    "of them or a glob (`tokenmind data fetch sft` writes some under sft/)")
        paths.extend(found)
    return paths


Conversation = list[dict[str, Any]]


def read_conversations(paths: Sequence[Path]) -> list[Conversation | str]:
    """The `messages` of every line of the JSONL files, checked: each message has a known role
    and string content, and each conversation has an assistant turn to learn from; a line with
    `text` instead is a plain document (see the module docstring), kept as its string."""
    conversations: list[Conversation | str] = []
    for where, record in located_objects(paths):
        messages = record.get("messages")
        if messages is None and isinstance(record.get("text"), str) and record["text"].strip():
            conversations.append(record["text"])
            continue
        if not isinstance(messages, list) or not messages:
            raise ValueError(f'{where}: needs "messages": a non-empty list of {{"role", "content"}} objects '
                             '(or "text": a plain document, trained on every token)')
        for m in messages:
            if not (isinstance(m, Mapping) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise ValueError(f"{where}: bad message {m!r}; each needs a role ({', '.join(ROLES)}) "
                                 "and string content")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: no assistant message, so nothing to train on")
        conversations.append(messages)
    return conversations


@dataclass
class Example:
    """One rendered conversation: `inputs` and `targets` of the same length (at most seq_len)."""

    inputs: np.ndarray
    targets: np.ndarray


def to_example(ids: Sequence[int], assistant_mask: Sequence[int], seq_len: int) -> Example:
    """Next-token targets of a rendered chat, IGNORE_INDEX except on assistant tokens; cut to seq_len."""
    ids = np.asarray(ids, dtype=np.int64)
    keep = np.asarray(assistant_mask[1:], dtype=bool)
    targets = np.append(np.where(keep, ids[1:], IGNORE_INDEX), IGNORE_INDEX)
    return Example(ids[:seq_len], targets[:seq_len])


@dataclass
class ChatData:
    """Rendered train/val examples, what happened to the conversations (`stats`), and the special
    tokens that end assistant turns (`turn_end_ids`, e.g. ChatML's `<|im_end|>`): the model is
    trained to stop with them, so generation must stop on them."""

    train: list[Example]
    val: list[Example]
    stats: dict[str, Any] = field(default_factory=dict)
    turn_end_ids: set[int] = field(default_factory=set)


def render_document(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[int]]:
    """A plain document as pre-training sees it: its tokens and the eos token, every one a target."""
    if tokenizer.eos_token_id is None:
        raise ValueError("a plain-text SFT document needs the tokenizer's eos token to end it; this tokenizer "
                         "has none: give the document as a conversation instead")
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    return ids, [1] * len(ids)


def prepare_chat_data(tokenizer: Tokenizer, conversations: Sequence[Sequence[Mapping[str, Any]] | str],
                      seq_len: int, val_fraction: float = 0.0, seed: int = 0) -> ChatData:
    """Split conversations into train/val by a seeded permutation (val gets round(n × val_fraction),
    at least one when val_fraction > 0), render each (a string: `render_document`), truncate to
    seq_len, drop the untrainable."""
    n = len(conversations)
    if n == 0:
        raise ValueError("no conversations to train on: the data.files hold no JSONL lines")
    n_val = min(max(round(n * val_fraction), 1), n - 1) if val_fraction > 0 else 0
    is_val = np.zeros(n, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n)[:n_val]] = True
    train, val = [], []
    truncated = dropped = 0
    turn_ends: set[int] = set()
    for messages, in_val in zip(conversations, is_val):
        if isinstance(messages, str):
            ids, mask = render_document(tokenizer, messages)
        else:
            ids, mask = tokenizer.render_chat(messages)
            turn_ends.update(ids[i] for i in range(len(ids)) if mask[i] and (i + 1 == len(ids) or not mask[i + 1]))
        truncated += len(ids) > seq_len
        example = to_example(ids, mask, seq_len)
        if (example.targets == IGNORE_INDEX).all():
            dropped += 1
            continue
        (val if in_val else train).append(example)
    if not train:
        raise ValueError(f"no trainable conversation left of {n}: every one lost its assistant tokens to "
                         f"truncation at data.seq_len={seq_len}; raise data.seq_len")
    tokens = sum(len(e.inputs) for e in train)
    stats = {"conversations": n, "train_conversations": len(train), "val_conversations": len(val),
             "truncated": truncated, "dropped_no_assistant_tokens": dropped, "train_tokens": tokens,
             "train_trained_tokens": int(sum((e.targets != IGNORE_INDEX).sum() for e in train))}
    special = {i for i, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special}
    return ChatData(train, val, stats, turn_ends & special)


def pack(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Rows of example indices, each row's lengths summing to at most seq_len (best-fit decreasing;
    ties keep input order, so the packing is deterministic)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row), sorted: the fullest row that fits comes first
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = bisect.bisect_left(free, (lengths[i], -1))
        if slot == len(free):
            rows.append([i])
            space, row = seq_len - lengths[i], len(rows) - 1
        else:
            space, row = free.pop(slot)
            rows[row].append(i)
            space -= lengths[i]
        if space > 0:
            bisect.insort(free, (space, row))
    return rows


class ChatLoader(RowLoader):
    """Packed chat `TokenBatch`es with `RowLoader`'s contract (seeded order, ranks, exact resume)."""

    def __init__(self, examples: Sequence[Example], cfg: LoaderConfig) -> None:
        self.examples = list(examples)
        self.rows = pack([len(e.inputs) for e in self.examples], cfg.seq_len)
        super().__init__(cfg, len(self.rows), f"{len(self.examples)} conversations")

    def batch_for_rows(self, rows: Sequence[int]) -> TokenBatch:
        """The batch of the given packed rows; the tail of each row is one padding document
        (input id 0, targets IGNORE_INDEX)."""
        shape = (len(rows), self.cfg.seq_len)
        inputs, docs, positions = (np.zeros(shape, dtype=np.int64) for _ in range(3))
        targets = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        for r, row in enumerate(rows):
            start = 0
            for doc, index in enumerate(self.rows[row]):
                example = self.examples[index]
                end = start + len(example.inputs)
                inputs[r, start:end], targets[r, start:end] = example.inputs, example.targets
                docs[r, start:end], positions[r, start:end] = doc, np.arange(end - start)
                start = end
            docs[r, start:], positions[r, start:] = len(self.rows[row]), np.arange(shape[1] - start)
        return TokenBatch(*(torch.from_numpy(a) for a in (inputs, targets, docs, positions)))
