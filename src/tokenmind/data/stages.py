"""What both engines of the data pipeline share (`pipeline.py` runs here, `ray_pipeline.py` on Ray):
the configuration, the tokenizer interface and `DocumentEncoder`, the keep-or-drop checks with their
per-stage accounting, the shard-writing loop and the report. Whatever an engine computes, documents
pass through these same functions in input order, which is why the engines write the same shards.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tokenmind.data.clean import CleanConfig
from tokenmind.data.decontaminate import DecontaminationConfig, Decontaminator
from tokenmind.data.dedup import MinHashConfig
from tokenmind.data.fim import FIMConfig, fim_encode, require_fim_tokens
from tokenmind.data.mixture import Mixer
from tokenmind.data.readers import Document, ReaderConfig, read_documents
from tokenmind.data.report import StageStats, print_report
from tokenmind.data.shards import ShardConfig, ShardWriter

REPORT_NAME = "report.json"

# Encoded once to fingerprint a tokenizer: two tokenizers that split this text differently
# (or map pieces to different ids) are different tokenizers, whatever their class or name.
_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. 1234567890 +-*/=<>()[]{}\n"
    "\tdef f(x):\n\t\treturn x ** 2  # code\n"
    "Größe, naïve café; Ελληνικά; Русский; 中文文本; 日本語; 한국어; العربية; हिन्दी 🙂"
)


class Tokenizer(Protocol):
    """What the pipeline needs from a tokenizer (it must also be picklable for workers)."""

    vocab_size: int
    eos_token_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


@dataclass
class DataPipelineConfig:
    """Settings of every stage. near_dedup=None disables near-dedup; eval_paths are files or
    folders of evaluation texts to decontaminate against (read with the same reader settings);
    num_workers <= 1 tokenizes in this process; docs_per_task is the unit of work sent to a
    worker; start_method is the multiprocessing start method ("spawn" is safe with threads and
    Rust tokenizers in the parent, "fork" starts faster). fim: the fill-in-the-middle rates (off by
    default; needs a tokenizer with FIM tokens). mixture: a weight per input (`mixture.py`); empty
    takes every input whole, in order. engine: "local" runs here (this module); "ray" runs the same
    stages as Ray Data operations across a cluster (`ray_pipeline.py`, `pip install 'tokenmind[ray]'`)
    and writes byte-identical shards; ray_address is the cluster to join (None: the one this
    process already joined, else a new local instance with ray_num_cpus CPUs)."""

    reader: ReaderConfig = field(default_factory=ReaderConfig)
    clean: CleanConfig = field(default_factory=CleanConfig)
    exact_dedup: bool = True
    near_dedup: MinHashConfig | None = field(default_factory=MinHashConfig)
    eval_paths: list[str | Path] = field(default_factory=list)
    decontamination: DecontaminationConfig = field(default_factory=DecontaminationConfig)
    shards: ShardConfig = field(default_factory=ShardConfig)
    num_workers: int = 2
    docs_per_task: int = 256
    start_method: str = "spawn"
    print_report: bool = True
    fim: FIMConfig = field(default_factory=FIMConfig)
    mixture: dict[str, float] = field(default_factory=dict)
    engine: str = "local"
    ray_address: str | None = None
    ray_num_cpus: int | None = None

    def __post_init__(self) -> None:
        if self.engine not in ("local", "ray"):
            raise ValueError(f"engine must be 'local' or 'ray', got {self.engine!r}")


def tokenizer_identity(tokenizer: Tokenizer) -> dict[str, Any]:
    """What the manifest records about the tokenizer, next to its vocabulary size and eos id:
    enough for a training run to refuse shards made by a different tokenizer."""
    probe_ids = [int(i) for i in tokenizer.encode_batch([_PROBE_TEXT])[0]]
    identity: dict[str, Any] = {
        "class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
        "fingerprint": hashlib.sha256(json.dumps(probe_ids).encode()).hexdigest(),
    }
    name = getattr(tokenizer, "name_or_path", None) or getattr(tokenizer, "name", None)
    if isinstance(name, str):
        identity["name"] = name
    return identity


# --- tokenization workers --------------------------------------------------------------------


class DocumentEncoder:
    """Document texts -> token id arrays: the tokenizer, through the FIM transform when its rate is
    above 0. Picklable, so each worker process gets the whole thing once."""

    def __init__(self, tokenizer: Tokenizer, fim: FIMConfig) -> None:
        self.tokenizer, self.fim = tokenizer, fim
        self.fim_tokens = require_fim_tokens(tokenizer) if fim.rate > 0 else None  # type: ignore[arg-type]

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        if self.fim_tokens is None:
            ids = self.tokenizer.encode_batch(texts)
        else:
            ids = fim_encode(texts, self.tokenizer.encode_batch, self.fim_tokens, self.fim)
        # Arrays pickle back from workers far faster than lists of Python ints.
        return [np.asarray(i, dtype=np.int64) for i in ids]


# --- keep-or-drop checks, writing, the report ------------------------------------------------------


@dataclass
class Check:
    """A stage that keeps or drops whole documents; `drops(doc)` is True to drop."""

    stats: StageStats
    drops: Callable[[Document], bool]


def eval_set(cfg: DataPipelineConfig) -> tuple[list[Document], Decontaminator | None]:
    """The evaluation documents to decontaminate against and their n-gram index (None without any)."""
    if not cfg.eval_paths:
        return [], None
    eval_docs = list(read_documents(cfg.eval_paths, cfg.reader))
    return eval_docs, Decontaminator((doc.text for doc in eval_docs), cfg.decontamination)


def document_checks(
    cfg: DataPipelineConfig,
    contaminated: list[dict[str, str]],
    eval_ids: list[str],
    exact: Callable[[Document], bool],
    near: Callable[[Document], bool],
    match: Callable[[Document], int | None],
) -> list[Check]:
    """The keep-or-drop stages that `cfg` enables, in order, deciding through the given functions:
    exact and near duplicate or not, and the index of the evaluation text a document overlaps.
    Decontamination lists what it finds in `contaminated`. The local engine decides as documents
    stream past; the Ray engine looks up what its global passes decided."""
    checks: list[Check] = []
    if cfg.exact_dedup:
        checks.append(Check(StageStats("exact_dedup"), exact))
    if cfg.near_dedup is not None:
        checks.append(Check(StageStats("near_dedup"), near))
    if cfg.eval_paths:

        def contaminated_doc(doc: Document) -> bool:
            found = match(doc)
            if found is None:
                return False
            contaminated.append({"id": doc.id, "source": doc.source, "eval_id": eval_ids[found]})
            return cfg.decontamination.action == "remove"

        checks.append(Check(StageStats("decontaminate"), contaminated_doc))
    return checks


def passes_checks(doc: Document, checks: list[Check]) -> bool:
    """Run a cleaned document through the checks in order, counting it in each stage it reaches."""
    for check in checks:
        dropped = check.drops(doc)
        check.stats.record(len(doc.text), None if dropped else len(doc.text))
        if dropped:
            return False
    return True


def open_writer(output_dir: Path, tokenizer: Tokenizer, cfg: DataPipelineConfig) -> ShardWriter:
    """The shard writer; opened before any work, since it refuses an already-finished output_dir."""
    return ShardWriter(
        output_dir,
        vocab_size=tokenizer.vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        tokenizer=tokenizer_identity(tokenizer),
        cfg=cfg.shards,
    )


def write_documents(
    writer: ShardWriter, streams: list[Iterator[tuple[Document, np.ndarray]]], mixer: Mixer, cfg: DataPipelineConfig
) -> tuple[StageStats, dict[str, int]]:
    """Write (document, token ids) pairs, taking each next one from the stream the mixer picks,
    until a stream ends; returns the tokenize stage's stats and what was written."""
    tokenize_stats = StageStats("tokenize")
    output = {"documents": 0, "characters": 0}
    while True:
        stream = mixer.next_stream()
        item = next(streams[stream], None)
        if item is None:
            if mixer.weights is not None:
                mixer.ended_by = mixer.names[stream]
            break
        doc, ids = item
        tokenize_stats.record(len(doc.text), len(doc.text) if len(ids) else None)
        if len(ids):
            writer.add(ids)
            mixer.record(doc.source, len(ids) + 1)  # + the eos the writer appends
            output["documents"] += 1
            output["characters"] += len(doc.text)
    writer.describe(sources=mixer.report(), fim=asdict(cfg.fim))
    return tokenize_stats, output


def finish_report(
    inputs: list[str | Path],
    output_dir: Path,
    cfg: DataPipelineConfig,
    manifest: dict[str, Any] | None,
    totals: dict[str, int],
    stages: list[StageStats],
    output: dict[str, int],
    mixer: Mixer,
    contaminated: list[dict[str, str]],
    started: float,
) -> dict[str, Any]:
    """The run's report, written to `output_dir/report.json` and printed if `cfg.print_report`."""
    assert manifest is not None
    report: dict[str, Any] = {
        "inputs": [str(path) for path in inputs],
        "output_dir": str(output_dir),
        "documents_read": totals["documents"],
        "characters_read": totals["characters"],
        "stages": [stage.to_dict() for stage in stages],
        "output": {
            **output,
            "tokens": manifest["total_tokens"],
            "splits": {
                name: {"documents": split["documents"], "tokens": split["tokens"]}
                for name, split in manifest["splits"].items()
            },
        },
        "sources": mixer.report(),
        "contaminated": contaminated,
        "seconds": round(time.perf_counter() - started, 3),
        "config": json.loads(json.dumps(asdict(cfg), default=str)),
    }
    (output_dir / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if cfg.print_report:
        print_report(report)
    return report
