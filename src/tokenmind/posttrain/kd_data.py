"""The batches of knowledge distillation (`kd.py`): packed chats with the teacher's cached top-k
for offline KD, and chats whose answers the live student writes for on-policy GKD.

Offline KD needs the teacher's distribution at every trained position, and the teacher does not
change, so it runs once: `teacher_topk` packs the chats exactly as `ChatLoader` packs the rows
the student trains on (same examples, same `pack`, same documents and positions, so each
position sees the same context) and keeps, per trained target, the teacher's k largest
log-probs and their token ids. A 49k-token vocabulary makes the full distribution 200 KB per
position in fp32; k = 32 is 192 bytes (ids int32, log-probs fp16: a 3-digit log-prob is a
<0.2% relative error on a probability, below what the student can match anyway). On the
speedrun's chat answers SmolLM2's top 1/8/32/64/128 tokens hold 53/82/91/94/96% of its mass
(`benchmarks/bench_kd.py`, the demo's val split): past 32 each doubling buys 2-3 points for twice
the disk and gather work, and the loss keeps the rest as one tail outcome (`kd.topk_kl`) instead
of dropping it.
`kd_data.json` records the share each run's cache holds.

The cache is stored per example (conversation), not per row, so any batch size, row order or
rank split reads the right entries: a row's positions are its examples' positions in order. It
is one safetensors file per split named by a digest of everything the numbers depend on: the
teacher's weights (their bytes, so an edited checkpoint at the same path rebuilds), the rendered
examples (data files, template, truncation at seq_len, val split), k, temperature and precision.
A rerun or a resumed run finds the file and reads it; a changed input has another name and is
built afresh. Files go through a temporary name, so a killed build leaves no half file; one that
does not read back or does not match the examples is refused with the fix (delete it).

On-policy GKD (`OnPolicyLoader`): per micro-batch, each conversation's final assistant turn is,
with probability lmbda, replaced by one the student samples from its current weights through the
engine (`LLM` around the very module the trainer updates; the prefix cache is reset before each
batch so no k/v of older weights is reused). Everything before that turn is the prompt. The
draws are seeded by (seed, epoch, conversation), so a resumed run, whose weights are restored
exactly and whose engine starts fresh, samples the same completions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from tokenmind.data.loader import IGNORE_INDEX, LoaderConfig, RowLoader, TokenBatch
from tokenmind.engine.llm import LLM
from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.load import Pretrained
from tokenmind.model.paged_attention import PagedKVCache
from tokenmind.model.transformer import Transformer
from tokenmind.progress import Bars
from tokenmind.train.objectives import autocast

from .data import ChatLoader, Example, to_example


@dataclass
class KDBatch(TokenBatch):
    """A `TokenBatch` with the teacher's top-k at its trained targets, in row-major order (the
    order `targets != IGNORE_INDEX` selects them): teacher_ids (N, k) int64, teacher_logprobs
    (N, k) float16, N the number of trained targets."""

    teacher_ids: torch.Tensor
    teacher_logprobs: torch.Tensor

    def to(self, device: torch.device) -> KDBatch:
        return KDBatch(*(t.to(device, non_blocking=True) for t in (
            self.input_ids, self.targets, self.document_ids, self.positions, self.teacher_ids,
            self.teacher_logprobs)))


# ---- the teacher's top-k, once ------------------------------------------------------------------


@dataclass
class TeacherTopK:
    """Per trained target of every example: the teacher's k best ids and log-probs. Example e's
    entries are rows offsets[e]:offsets[e + 1] of ids (int32) and logprobs (float16)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    offsets: torch.Tensor

    def of_examples(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries of these examples back to back: (N, k) int64 ids and float16 log-probs."""
        spans = [(int(self.offsets[i]), int(self.offsets[i + 1])) for i in indices]
        return (torch.cat([self.ids[a:b] for a, b in spans]).long(), torch.cat([self.logprobs[a:b] for a, b in spans]))

    @property
    def mean_mass(self) -> float:
        """The teacher's probability mass its top k hold, averaged over positions (at the temperature)."""
        return float(self.logprobs.float().exp().sum(-1).mean()) if len(self.logprobs) else 0.0


def trained_counts(examples: Sequence[Example]) -> list[int]:
    return [int((e.targets != IGNORE_INDEX).sum()) for e in examples]


def cache_key(teacher: Transformer, examples: Sequence[Example], k: int, temperature: float, precision: str) -> str:
    """A digest of what the cached numbers depend on (see the module docstring)."""
    digest = hashlib.blake2b(f"{k}\0{temperature!r}\0{precision}".encode(), digest_size=16)
    for name, tensor in teacher.state_dict().items():
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    for e in examples:
        digest.update(np.int64(len(e.inputs)).tobytes() + e.inputs.tobytes() + e.targets.tobytes())
    return digest.hexdigest()


@torch.no_grad()
def compute_topk(teacher: Transformer, examples: Sequence[Example], seq_len: int, k: int, temperature: float,
                 precision: str, batch_size: int, device: torch.device, progress: bool = True) -> TeacherTopK:
    """Run the teacher over the packed rows of `examples` (every row, batch_size at a time) and
    keep the top k of log_softmax(logits / temperature) at each trained target."""
    packer = ChatLoader(examples, LoaderConfig(batch_size=1, seq_len=seq_len, shuffle=False))
    counts = trained_counts(examples)
    found: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(examples)
    rows = len(packer.rows)
    with Bars(progress) as bars:
        advance = bars.add("teacher top-k", rows)
        for begin in range(0, rows, batch_size):
            chunk = range(begin, min(begin + batch_size, rows))
            batch = packer.batch_for_rows(chunk).to(device)
            with autocast(device, precision):
                hidden = teacher.hidden_states(batch.input_ids, batch.positions,
                                               DenseAttentionMetadata(document_ids=batch.document_ids))
                logits = teacher.logits(hidden[batch.targets != IGNORE_INDEX])
            logprobs, ids = torch.log_softmax(logits.float() / temperature, dim=-1).topk(k, dim=-1)
            order = [i for r in chunk for i in packer.rows[r]]
            for i, these_ids, these_logprobs in zip(order, ids.split([counts[i] for i in order]),
                                                    logprobs.split([counts[i] for i in order])):
                found[i] = (these_ids.int().cpu(), these_logprobs.half().cpu())
            if advance is not None:
                advance(len(chunk))
    offsets = torch.tensor(np.cumsum([0, *counts]), dtype=torch.int64)
    return TeacherTopK(torch.cat([ids for ids, _ in found]), torch.cat([lp for _, lp in found]), offsets)


def write_topk(path: Path, topk: TeacherTopK, key: str, teacher: str) -> None:
    """The cache file, written to a temporary name and renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"ids": topk.ids, "logprobs": topk.logprobs, "offsets": topk.offsets}, str(tmp),
              metadata={"key": key, "teacher": teacher, "mean_topk_mass": f"{topk.mean_mass:.6f}"})
    os.replace(tmp, path)


def read_topk(path: Path, key: str, examples: Sequence[Example], k: int) -> TeacherTopK:
    """The cache at `path`, checked against the key and the examples it must cover."""
    fix = f"delete {path} and rerun to rebuild it"
    try:
        with safe_open(str(path), "pt") as handle:
            saved_key = (handle.metadata() or {}).get("key")
        tensors = load_file(str(path))
        topk = TeacherTopK(tensors["ids"], tensors["logprobs"], tensors["offsets"])
    except (SafetensorError, OSError, KeyError) as e:
        raise ValueError(f"{path} is not a readable teacher top-k cache ({type(e).__name__}: {e}); {fix}") from e
    counts = trained_counts(examples)
    problems = []
    if saved_key != key:
        problems.append(f"its key is {saved_key}, not {key}")
    if topk.offsets.tolist() != np.cumsum([0, *counts]).tolist():
        problems.append(f"it does not cover these {len(examples)} examples' {sum(counts)} trained targets")
    if topk.ids.shape != (sum(counts), k) or topk.logprobs.shape != topk.ids.shape:
        problems.append(f"it holds {tuple(topk.ids.shape)} ids and {tuple(topk.logprobs.shape)} log-probs, "
                        f"not ({sum(counts)}, {k})")
    if problems:
        raise ValueError(f"{path} does not match this run: {'; '.join(problems)}; {fix}")
    return topk


def teacher_topk(teacher: Pretrained, examples: Sequence[Example], cache_dir: Path, split: str, seq_len: int, k: int,
                 temperature: float, precision: str, batch_size: int, device: torch.device, build: bool = True,
                 progress: bool = True) -> tuple[TeacherTopK, Path]:
    """The teacher's top-k over `examples`, read from `cache_dir/{split}-{key}.safetensors` or
    computed and written there first (when `build`: the main rank builds, the others wait and read)."""
    key = cache_key(teacher.model, examples, k, temperature, precision)
    path = Path(cache_dir) / f"{split}-{key}.safetensors"
    if build and not path.is_file():
        topk = compute_topk(teacher.model, examples, seq_len, k, temperature, precision, batch_size, device, progress)
        write_topk(path, topk, key, str(teacher.path))
    return read_topk(path, key, examples, k), path


class TopKChatLoader(ChatLoader):
    """`ChatLoader`'s packed rows (same order, resume and rank split) as `KDBatch`es."""

    def __init__(self, examples: Sequence[Example], cfg: LoaderConfig, topk: TeacherTopK) -> None:
        super().__init__(examples, cfg)
        self.topk = topk

    def batch_for_rows(self, rows: Sequence[int]) -> KDBatch:
        batch = super().batch_for_rows(rows)
        ids, logprobs = self.topk.of_examples([i for r in rows for i in self.rows[r]])
        return KDBatch(batch.input_ids, batch.targets, batch.document_ids, batch.positions, ids, logprobs)


# ---- on-policy samples ----------------------------------------------------------------------------


@dataclass
class Turn:
    """A conversation cut before its final assistant turn: `prompt` (the ids up to the turn's
    first token) and `data`, the conversation trained on that turn only."""

    prompt: list[int]
    data: Example


def final_turns(examples: Sequence[Example], seq_len: int) -> tuple[list[Turn], int]:
    """Each example's final assistant turn (its last run of trained targets) split off, and how
    many examples were dropped because their prompt fills the whole row (no room to sample)."""
    turns, dropped = [], 0
    for e in examples:
        trained = np.flatnonzero(e.targets != IGNORE_INDEX)
        gaps = np.flatnonzero(np.diff(trained) > 1)
        start = int(trained[gaps[-1] + 1] if len(gaps) else trained[0])  # its input is the prompt's last token
        if start + 1 >= seq_len:
            dropped += 1
            continue
        targets = e.targets.copy()
        targets[:start] = IGNORE_INDEX
        turns.append(Turn(e.inputs[:start + 1].tolist(), Example(e.inputs, targets)))
    return turns, dropped


class OnPolicyLoader(RowLoader):
    """GKD batches over conversations: cfg.batch_size conversations per micro-batch (packed into at
    most that many rows), each with its final turn sampled by `student` with probability lmbda,
    else the data's own (see the module docstring). `sampling` should stop on `end_id` alone, the
    chat template's end of turn: the engine leaves the stop token out of its output, so a sample
    that stopped gets it back here, and then holds exactly the tokens drawn; one cut by
    `sampling.max_tokens` or the row length has no end. With lmbda = 0 (validation) nothing is
    sampled and `student` may be None."""

    def __init__(self, turns: Sequence[Turn], cfg: LoaderConfig, lmbda: float, student: Pretrained | None = None,
                 sampling: SamplingParams | None = None, end_id: int | None = None) -> None:
        super().__init__(cfg, len(turns), f"{len(turns)} conversations")
        if lmbda > 0 and (student is None or sampling is None or end_id is None):
            raise ValueError("on-policy batches (lmbda > 0) need the student, its SamplingParams and the end-of-turn "
                             "id")
        self.turns, self.lmbda, self.student, self.sampling, self.end_id = list(turns), lmbda, student, sampling, end_id
        self.llm: LLM | None = None  # built at the first sample, once the trainer has put the model on its device

    def batch_for_rows(self, rows: Sequence[int]) -> TokenBatch:
        examples, requests, slots = [], [], []
        for r in map(int, rows):
            draw = np.random.default_rng([self.cfg.seed, self.epoch, r])  # this conversation's coin and seed
            if draw.random() < self.lmbda:
                requests.append((r, int(draw.integers(2**31))))
                slots.append(len(examples))
            examples.append(self.turns[r].data)
        for slot, sampled in zip(slots, self.sample(requests)):
            examples[slot] = sampled
        packer = ChatLoader(examples, dataclasses.replace(self.cfg, batch_size=1, shuffle=False, rank=0, world_size=1))
        return packer.batch_for_rows(range(len(packer.rows)))

    def sample(self, requests: list[tuple[int, int]]) -> list[Example]:
        """Examples whose final turn the student writes now, one per (conversation, seed)."""
        if not requests:
            return []
        seq_len = self.cfg.seq_len
        if self.llm is None:
            model = self.student.model
            blocks = -(-seq_len // 16) * self.cfg.batch_size  # exactly what the batch can use: a pool independent
            per_block = PagedKVCache.bytes_per_block(model.cfg, 16, model.embed_tokens.weight.dtype)  # of free memory
            self.llm = LLM(self.student, block_size=16, kv_cache_bytes=blocks * per_block,
                           max_num_seqs=self.cfg.batch_size, max_model_len=seq_len,
                           max_num_batched_tokens=max(2048, self.cfg.batch_size))
        self.llm.reset_prefix_cache()  # the weights changed since the last batch
        prompts = [self.turns[r].prompt for r, _ in requests]
        params = [dataclasses.replace(self.sampling, seed=seed, max_tokens=min(self.sampling.max_tokens,
                                                                               seq_len - len(prompt)))
                  for (_, seed), prompt in zip(requests, prompts)]
        outputs = self.llm.generate(prompts, params, progress=False)
        examples = []
        for prompt, out in zip(prompts, outputs):
            done = out.outputs[0]
            completion = list(done.token_ids) + ([self.end_id] if done.finish_reason == "stop" else [])
            examples.append(to_example(prompt + completion, [0] * len(prompt) + [1] * len(completion), seq_len))
        return examples
