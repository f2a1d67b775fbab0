"""Teacher-written text: a larger model writes training data for a small one, through the engine.

A tiny model trained for minutes learns fluent English only from English simple enough to learn
from, and the registries hold no such corpus (no TinyStories, no Wikipedia). So the teacher,
SmolLM2-135M-Instruct, writes it: short stories for children, simple explanations of everyday
things, and answers to simple questions, from prompt sets built out of topic lists (`prompts.py`).
All prompts of a set run as one batch on tokenmind's own paged engine, the high-concurrency
path, sampled with a fixed seed per prompt.

A set is generated once and cached as JSONL (gzip) beside a manifest with its generation config,
record and token counts, the speed, and the file's SHA-256; `synthesize` regenerates it when the
config changes, and `load_synthetic` refuses a file whose checksum does not match its manifest.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..engine.llm import LLM
from ..engine.sampling import SamplingParams
from ..model.load import load_model
from .prompts import PROMPT_SETS, build_prompts, keep_answer


@dataclass
class SynthesisConfig:
    """One generated set: which prompts, how many, and how the teacher samples."""

    kind: str = "stories"  # a prompt set of prompts.py: stories, explanations, answers
    count: int = 1000  # prompts to generate from (each gives one record, unless filtered out)
    teacher: str = "smollm2"
    dtype: str = "bfloat16"  # the fast dtype for batches on CPU
    max_tokens: int = 200
    temperature: float = 0.5  # higher makes SmolLM2 ramble and invent; lower repeats itself
    top_p: float = 0.9
    seed: int = 0
    max_num_seqs: int = 96

    def __post_init__(self) -> None:
        if self.kind not in PROMPT_SETS:
            raise ValueError(f"unknown prompt set {self.kind!r}; choose one of {', '.join(PROMPT_SETS)}")
        if self.count < 1 or self.max_tokens < 1:
            raise ValueError(f"count and max_tokens must be >= 1, got {self.count}, {self.max_tokens}")


CORPORA = Path(__file__).parent / "corpora"


def corpus_path(kind: str) -> Path:
    """Where the packaged set of a prompt set's kind lives (what the speedrun reads)."""
    return CORPORA / f"{kind}.jsonl.gz"


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl.gz") + ".manifest.json")


def synthesize(cfg: SynthesisConfig, out: str | Path, force: bool = False, progress: bool = True) -> Path:
    """Generate `cfg`'s set into `out` (`.jsonl.gz`) unless a file made with the same config is there."""
    out = Path(out)
    if not force and out.is_file() and manifest_path(out).is_file():
        if json.loads(manifest_path(out).read_text())["config"] == asdict(cfg):
            return out
    prompts = build_prompts(cfg.kind, cfg.count, cfg.seed)
    llm = LLM(load_model(cfg.teacher, dtype=cfg.dtype), max_num_seqs=cfg.max_num_seqs,
              max_num_batched_tokens=max(2048, cfg.max_num_seqs), max_model_len=1024)
    tok = llm.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
           for p in prompts]
    params = [SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                             seed=cfg.seed * 1_000_003 + i) for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(ids, params, progress=progress)
    seconds = time.perf_counter() - start
    records, tokens = [], 0
    for p, o in zip(prompts, outputs):
        tokens += len(o.token_ids)
        text = o.text.strip() if o.finish_reason == "stop" else whole_sentences(o.text)
        if keep_answer(p, text):
            records.append({**p, "response": text})
    _write(out, records, {"config": asdict(cfg), "prompts": len(prompts), "records": len(records),
                          "generated_tokens": tokens, "seconds": round(seconds, 1),
                          "tokens_per_s": round(tokens / seconds, 1)})
    return out


def whole_sentences(text: str) -> str:
    """A text cut off by max_tokens, up to the end of its last whole sentence ("" if none)."""
    end = max(text.rfind(". "), text.rfind("! "), text.rfind("? "), text.rfind(".\n"))
    return text[:end + 1].strip() if end > 0 else ""


def _write(out: Path, records: list[dict[str, Any]], manifest: dict[str, Any]) -> None:
    """The records (gzip'd JSONL, fixed mtime so equal content gives equal bytes) and their manifest,
    each through a temporary name."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
        for r in records:
            fh.write((json.dumps(r, ensure_ascii=False) + "\n").encode())
    manifest["sha256"] = hashlib.sha256(tmp.read_bytes()).hexdigest()
    os.replace(tmp, out)
    tmp = manifest_path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, manifest_path(out))


def load_synthetic(path: str | Path) -> list[dict[str, Any]]:
    """The records of a generated set, after checking the file against its manifest's checksum."""
    path = Path(path)
    manifest = json.loads(manifest_path(path).read_text())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != manifest["sha256"]:
        raise ValueError(f"{path} does not match its manifest (sha256 {digest[:12]}..., expected "
                         f"{manifest['sha256'][:12]}...); regenerate it with `tokenmind data synthesize`")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]
