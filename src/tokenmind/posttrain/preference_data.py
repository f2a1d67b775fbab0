"""Preference data: chosen/rejected pairs and labelled single answers, tokenized and packed.

Files are JSONL in the layouts TRL reads, so data made for TRL trains here unchanged:

* paired, conversational: `{"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}`;
  without a "prompt", chosen and rejected are whole conversations and their longest common
  message prefix is the prompt;
* paired, plain text: `{"prompt": str, "chosen": str, "rejected": str}` (the tokenizer's eos text
  is appended to each answer unless it already ends with it);
* unpaired (KTO): `{"prompt": ..., "completion": ..., "label": true|false}`, either layout.

A sequence is tokenized as TRL does: the prompt rendered with the generation prompt, the whole
conversation rendered, and the completion is what follows their common token prefix (so the
end-of-turn tokens the template writes after the answer are part of what is scored). Sequences
longer than `max_length` keep their start; one with no completion token left is dropped.

Every loss of the DPO family and the reward models needs a score per *sequence*, and sequences
come in units whose members must meet in one micro-batch: a pair (chosen, rejected), a KTO
example with its mismatched KL sequence. So units, not sequences, are packed into rows of
`seq_len` (best-fit decreasing, as SFT packs chats), each sequence its own document: positions
restart and attention stays inside it, so a packed sequence scores exactly as it would alone,
and no compute goes to padding. A `SequenceBatch` says, per position, which sequence's
completion the target belongs to, so summing token log-probs per sequence is one `index_add`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmind.data.loader import IGNORE_INDEX, LoaderConfig, RowLoader
from tokenmind.jsonl import located_objects
from tokenmind.tokenizer import Tokenizer

from .data import ROLES, pack

PAIRED, UNPAIRED = "paired", "unpaired"


@dataclass
class Scored:
    """One tokenized sequence: `ids` = prompt + completion; the completion starts at `start`."""

    ids: np.ndarray
    start: int


@dataclass
class Unit:
    """The sequences that must share a micro-batch: (chosen, rejected) for a pair; (answer, KL
    sequence) for a KTO example. label: a KTO answer's desirability (None for pairs). ref_logps:
    the reference model's log-prob of each member's completion, once computed."""

    members: list[Scored]
    label: bool | None = None
    ref_logps: np.ndarray | None = None

    @property
    def shared(self) -> int:
        """Prompt tokens every member has, less the last: packed once, seen by all members, while
        each member re-reads the last prompt token, whose logits predict its own first answer token."""
        if len(self.members) < 2:
            return 0
        first = self.members[0].ids
        n = min(min(m.start for m in self.members), *(common_prefix(first, m.ids) for m in self.members[1:]))
        return max(n - 1, 0)

    @property
    def length(self) -> int:
        """Tokens the unit takes in a packed row."""
        shared = self.shared
        return shared + sum(len(m.ids) - shared for m in self.members)


@dataclass
class SequenceBatch:
    """Packed rows of whole sequences; (B, T) fields as in `TokenBatch`, plus:

    parent_ids: (B, T) the shared-prompt document a member's tokens also attend to, -1 for none
        (`DenseAttentionMetadata.parent_ids`): a unit's common prompt is packed once.
    sequence: (B, T) the index of the sequence whose completion token `targets` holds at that
        position, -1 where nothing is scored (prompts, padding).
    last: (S,) flat index (row × T + column) of each sequence's last token, where a reward
        model reads its score.
    lengths: (S,) completion tokens per sequence. ref_logps: (S,) the reference model's
        completion log-probs (zeros until computed).
    members: (U, k) the sequence indices of each unit's k members, in unit order. labels: (U,)
        1.0 desirable / 0.0 undesirable for KTO units (all 1.0 for pairs). units: (U,) each
        unit's index in its dataset (to store reference log-probs back).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor
    positions: torch.Tensor
    parent_ids: torch.Tensor
    sequence: torch.Tensor
    last: torch.Tensor
    lengths: torch.Tensor
    ref_logps: torch.Tensor
    members: torch.Tensor
    labels: torch.Tensor
    units: torch.Tensor

    def to(self, device: torch.device) -> SequenceBatch:
        return SequenceBatch(*(getattr(self, f).to(device, non_blocking=True) for f in self.__dataclass_fields__))


@dataclass
class PreferenceData:
    """Tokenized train/val units of one kind (`PAIRED` or `UNPAIRED`) and what happened to the records."""

    kind: str
    train: list[Unit]
    val: list[Unit]
    stats: dict[str, Any] = field(default_factory=dict)


# ---- reading ------------------------------------------------------------------------------------


def _messages(value: Any, where: str, name: str) -> list[dict[str, Any]]:
    if not (isinstance(value, list) and value and all(
            isinstance(m, Mapping) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in value)):
        raise ValueError(f'{where}: "{name}" must be a string or a non-empty list of {{"role", "content"}} messages '
                         f"(roles: {', '.join(ROLES)})")
    return [dict(m) for m in value]


def read_preferences(paths: Sequence[Path]) -> tuple[str, list[dict[str, Any]]]:
    """The records of preference JSONL files, checked, and their kind: all paired
    (prompt/chosen/rejected) or all unpaired (prompt/completion/label)."""
    records, kinds = [], set()
    for where, record in located_objects(paths):
        if "chosen" in record and "rejected" in record:
            kinds.add(PAIRED)
            answers = ("chosen", "rejected")
        elif "completion" in record and "label" in record:
            kinds.add(UNPAIRED)
            answers = ("completion",)
            if not isinstance(record["label"], bool):
                raise ValueError(f'{where}: "label" must be true or false, got {record["label"]!r}')
        else:
            raise ValueError(f'{where}: needs "chosen" and "rejected" (a preference pair) or "completion" '
                             f'and "label" (an unpaired, KTO example); it has {", ".join(record) or "nothing"}')
        texts = all(isinstance(record.get(k), str) for k in ("prompt", *answers))
        if not texts:
            for key in ("prompt", *answers):
                if key in record:
                    record[key] = _messages(record[key], where, key)
            if "prompt" not in record:
                if len(answers) == 1:
                    raise ValueError(f'{where}: an unpaired example needs a "prompt"')
                record["prompt"], record["chosen"], record["rejected"] = split_prompt(
                    record["chosen"], record["rejected"], where)
        record["_where"] = where
        records.append(record)
    if not records:
        raise ValueError("no preference records: the data.files hold no JSONL lines")
    if len(kinds) > 1:
        raise ValueError("data.files mix paired (chosen/rejected) and unpaired (completion/label) records; train "
                         "them separately (paired with dpo, ipo, orpo, simpo; unpaired with kto)")
    return kinds.pop(), records


def split_prompt(chosen: list[dict], rejected: list[dict], where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen answer, rejected answer) from two whole conversations: the prompt is their
    longest common message prefix, which must leave each an answer."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        raise ValueError(f'{where}: without a "prompt", chosen and rejected must be conversations that start the '
                         "same and then differ; add a prompt field")
    return chosen[:n], chosen[n:], rejected[n:]


# ---- tokenizing ---------------------------------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tokenize(tokenizer: Tokenizer, prompt: str | list[dict], completion: str | list[dict]) -> Scored:
    """prompt + completion as TRL tokenizes them (see the module docstring), untruncated."""
    if isinstance(prompt, str):
        eos = tokenizer.special_tokens_map.get("eos_token") or ""
        completion = completion if completion.endswith(eos) else completion + eos
        prompt_ids = tokenizer.encode(prompt)
        full = tokenizer.encode(prompt + completion)
    else:
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(prompt + completion)
    # nothing predicts a sequence's first token, so an empty prompt still leaves it unscored
    return Scored(np.asarray(full, dtype=np.int64), max(1, common_prefix(prompt_ids, full)))


def truncate(seq: Scored, max_length: int) -> Scored | None:
    """`seq` cut to its first max_length tokens, or None if no completion token is left."""
    if seq.start >= min(max_length, len(seq.ids)):
        return None
    return Scored(seq.ids[:max_length], seq.start)


def prepare_preferences(tokenizer: Tokenizer, kind: str, records: Sequence[Mapping[str, Any]], max_length: int,
                        val_fraction: float = 0.0, seed: int = 0, kl_group: int = 8) -> PreferenceData:
    """Tokenized units, split train/val by a seeded permutation. Unpaired examples get their KL
    sequence: the prompt with the completion of the previous example in its group of kl_group
    consecutive examples (the first takes the group's last), as TRL builds it."""
    n = len(records)
    n_val = min(max(round(n * val_fraction), 1), n - 1) if val_fraction > 0 else 0
    is_val = np.zeros(n, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n)[:n_val]] = True
    answers = ("chosen", "rejected") if kind == PAIRED else ("completion",)
    train: list[Unit] = []
    val: list[Unit] = []
    dropped = truncated = 0
    for split, out in ((False, train), (True, val)):
        chosen = [r for r, v in zip(records, is_val) if v == split]
        for i, record in enumerate(chosen):
            texts = [record[a] for a in answers]
            if kind == UNPAIRED:
                group = i - i % kl_group
                size = min(kl_group, len(chosen) - group)
                texts.append(chosen[group + (i - group - 1) % size]["completion"])
            full = [tokenize(tokenizer, record["prompt"], t) for t in texts]
            truncated += any(len(s.ids) > max_length for s in full[:len(answers)])
            members = [truncate(s, max_length) for s in full]
            if any(m is None for m in members):
                dropped += 1
                continue
            out.append(Unit(members, label=record["label"] if kind == UNPAIRED else None))
    if not train:
        raise ValueError(f"no preference example left of {n}: every prompt fills max_length={max_length} tokens; "
                         "raise the length limit (data.seq_len)")
    stats = {"records": n, "kind": kind, "train_units": len(train), "val_units": len(val), "truncated": truncated,
             "dropped_prompt_too_long": dropped, "train_tokens": sum(u.length for u in train)}
    if kind == UNPAIRED:
        stats["desirable"] = sum(bool(u.label) for u in train)
    return PreferenceData(kind, train, val, stats)


# ---- batches ------------------------------------------------------------------------------------


class UnitLoader(RowLoader):
    """Packed `SequenceBatch`es of units with `RowLoader`'s contract (seeded order, ranks, exact
    resume). A unit longer than seq_len cannot be packed: truncation to max_length ≤ seq_len / 2
    per member (as `preference_data` callers choose it) rules that out for pairs."""

    def __init__(self, units: Sequence[Unit], cfg: LoaderConfig) -> None:
        self.units = list(units)
        too_long = [u.length for u in self.units if u.length > cfg.seq_len]
        if too_long:
            raise ValueError(f"{len(too_long)} units are longer than seq_len={cfg.seq_len} (up to {max(too_long)} "
                             "tokens); raise data.seq_len or lower the per-sequence max_length")
        self.rows = pack([u.length for u in self.units], cfg.seq_len)
        super().__init__(cfg, len(self.rows), f"{len(self.units)} preference examples")

    def batch_for_rows(self, rows: Sequence[int]) -> SequenceBatch:
        return unit_batch([self.rows[row] for row in rows], self.units, self.cfg.seq_len)


def unit_batch(rows: Sequence[Sequence[int]], units: Sequence[Unit], seq_len: int) -> SequenceBatch:
    """Rows of `seq_len` tokens holding the given units (indices into `units`, one list per row),
    each unit's shared prompt once and each member its own document (see the module docstring)."""
    shape = (len(rows), seq_len)
    inputs, docs, positions = (np.zeros(shape, dtype=np.int64) for _ in range(3))
    targets = np.full(shape, IGNORE_INDEX, dtype=np.int64)
    sequence, parents = np.full(shape, -1, dtype=np.int64), np.full(shape, -1, dtype=np.int64)
    last, lengths, ref, members, labels, unit_ids = [], [], [], [], [], []
    for r, row in enumerate(rows):
        start = doc = 0
        for index in row:
            unit = units[index]
            unit_ids.append(index)
            labels.append(1.0 if unit.label is None else float(unit.label))
            ref.extend(unit.ref_logps if unit.ref_logps is not None else [0.0] * len(unit.members))
            members.append(list(range(len(last), len(last) + len(unit.members))))
            shared, parent = unit.shared, -1
            if shared:  # the common prompt, once
                inputs[r, start:start + shared], docs[r, start:start + shared] = unit.members[0].ids[:shared], doc
                positions[r, start:start + shared] = np.arange(shared)
                start, parent, doc = start + shared, doc, doc + 1
            for seq in unit.members:
                end = start + len(seq.ids) - shared
                inputs[r, start:end], docs[r, start:end], parents[r, start:end] = seq.ids[shared:], doc, parent
                positions[r, start:end] = np.arange(shared, len(seq.ids))
                # the target at a position is the next token: the answer's tokens are targets from its
                # start - 1 on (shared <= start - 1, so that position is in this member's own part)
                first = start + seq.start - 1 - shared
                targets[r, first:end - 1] = seq.ids[seq.start:]
                sequence[r, first:end - 1] = len(last)
                last.append(r * shape[1] + end - 1)
                lengths.append(len(seq.ids) - seq.start)
                start, doc = end, doc + 1
        docs[r, start:], positions[r, start:] = doc, np.arange(shape[1] - start)
    tensor = torch.from_numpy
    return SequenceBatch(
        *(tensor(a) for a in (inputs, targets, docs, positions, parents, sequence)),
        torch.tensor(last), torch.tensor(lengths, dtype=torch.float32), torch.tensor(ref, dtype=torch.float32),
        torch.tensor(members, dtype=torch.long).reshape(len(members), -1),
        torch.tensor(labels, dtype=torch.float32), torch.tensor(unit_ids))
