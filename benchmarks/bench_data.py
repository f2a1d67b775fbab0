"""Data pipeline throughput, local engine vs Ray Data, on a corpus made large by repetition with perturbations.

Base documents (seeded random prose over a Zipf-weighted vocabulary) are each written several more
times: an exact copy with other whitespace, near copies with a few words edited, and a heavily
edited copy that is not a duplicate, so both dedups have real work. The copies are shuffled over
`--files` JSONL files. Both engines run the default stages (normalize, boilerplate, quality rules,
exact and MinHash near dedup, tokenize with a small BPE trained here, shard); the benchmark checks
that their shards are byte-identical, and reports documents/s, per-document CPU cost (the local
engine in one process) and, from that, an estimate for 1 TB of text. Ray's start-up is timed apart.
Prints JSON.

    python benchmarks/bench_data.py [--docs 2000] [--copies 4] [--files 16] [--num-cpus 2]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info  # noqa: E402

from tokenmind.data.pipeline import DataPipelineConfig, run_pipeline  # noqa: E402


class BPETokenizer:
    """A `tokenizers` BPE with the pipeline's tokenizer interface (pickled by value to Ray workers)."""

    def __init__(self, texts: list[str], vocab_size: int = 4096) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        self.tokenizer = Tokenizer(models.BPE())
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        self.tokenizer.train_from_iterator(texts, trainer=trainer)
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.eos_token_id = self.tokenizer.token_to_id("<eos>")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts)]


def make_corpus(root: Path, docs: int, copies: int, files: int, words: int, seed: int) -> dict:
    """Write the corpus; returns its size and how many copies of each kind were planted."""
    rng = random.Random(seed)
    vocabulary = [f"{a}{b}{c}" for a in "bcdfgklmnprstvz" for b in "aeiou" for c in ("", "n", "r", "s", "th", "l")]
    weights = [1.0 / (rank + 1) for rank in range(len(vocabulary))]

    def prose(n: int) -> str:
        chosen = rng.choices(vocabulary, weights, k=n)
        sentences = [" ".join(chosen[i:i + 12]).capitalize() + "." for i in range(0, n, 12)]
        return "\n".join(" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5))

    def edited(text: str, edits: int) -> str:
        out = text.split(" ")
        for i in rng.sample(range(len(out)), edits):
            out[i] = rng.choice(vocabulary)
        return " ".join(out)

    texts, kinds = [], {"base": 0, "exact": 0, "near": 0, "far": 0}
    for _ in range(docs):
        base = prose(words)
        texts.append(base)
        kinds["base"] += 1
        for _ in range(copies):
            kind = rng.choices(("exact", "near", "far"), (1, 2, 1))[0]
            kinds[kind] += 1
            texts.append(base.replace(" ", "  ", 3) if kind == "exact"
                         else edited(base, max(1, words // 100)) if kind == "near" else edited(base, words // 2))
    rng.shuffle(texts)
    handles = [open(root / f"part-{i:04d}.jsonl", "w", encoding="utf-8") for i in range(files)]
    for i, text in enumerate(texts):
        handles[i % files].write(json.dumps({"text": text}) + "\n")
    for handle in handles:
        handle.close()
    return {"documents": len(texts), "bytes": sum(len(t.encode()) for t in texts), "files": files, "planted": kinds}


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name != "report.json"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=2000, help="base documents")
    ap.add_argument("--copies", type=int, default=4, help="perturbed copies of each base document")
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--words", type=int, default=300, help="words per base document")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray instance and local workers")
    ap.add_argument("--object-store-mb", type=int, default=1024)
    ap.add_argument("--usd-per-core-hour", type=float, default=0.04,
                    help="price assumed for the 1 TB estimate (a cloud vCPU-hour, on demand, order of magnitude)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import ray
    import ray.cloudpickle

    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        (work / "corpus").mkdir()
        corpus = make_corpus(work / "corpus", args.docs, args.copies, args.files, args.words, args.seed)
        sample = [line for path in sorted((work / "corpus").glob("*.jsonl"))[:2]
                  for line in path.read_text().splitlines()[:200]]
        tokenizer = BPETokenizer([json.loads(line)["text"] for line in sample])
        runs: dict[str, dict] = {}
        reports = {}

        files = sorted((work / "corpus").glob("*.jsonl"))

        def run(name: str, inputs: list[Path] = files, **overrides) -> None:
            cfg = DataPipelineConfig(print_report=False, **overrides)
            t0 = time.perf_counter()
            reports[name] = report = run_pipeline(inputs, work / name, tokenizer, cfg)
            seconds = time.perf_counter() - t0
            runs[name] = {"documents": report["documents_read"], "seconds": round(seconds, 2),
                          "docs_per_s": round(report["documents_read"] / seconds, 1),
                          "mb_per_s": round(report["characters_read"] / seconds / 1e6, 3)}

        run("local_1_process", num_workers=1)
        run("local", num_workers=args.num_cpus)
        t0 = time.perf_counter()
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, object_store_memory=args.object_store_mb * 2**20,
                 log_to_driver=False)
        ray_start = time.perf_counter() - t0
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this script
        try:
            run("ray", engine="ray")
            run("ray_half_the_files", files[: len(files) // 2], engine="ray")
        finally:
            ray.shutdown()
        runs["ray"]["ray_init_seconds"] = round(ray_start, 2)
        identical = shard_bytes(work / "ray") == shard_bytes(work / "local") == shard_bytes(work / "local_1_process")
        removed = {s["name"]: s["docs_removed"] for s in reports["local"]["stages"] if s["docs_removed"]}

        # 1 TB from the measured per-document costs. The local engine in one process is the CPU cost of
        # the stages themselves. Ray's time is a fixed part (scheduling, shuffle actors) plus a part per
        # document; two corpus sizes separate them, and only the per-document part scales to 1 TB.
        seconds_per_byte = runs["local_1_process"]["seconds"] / corpus["bytes"]
        full, half = runs["ray"], runs["ray_half_the_files"]
        ray_per_doc = (full["seconds"] - half["seconds"]) / (full["documents"] - half["documents"])
        runs["ray"]["fixed_seconds_fitted"] = round(full["seconds"] - ray_per_doc * full["documents"], 2)
        runs["ray"]["cpu_ms_per_document_fitted"] = round(1e3 * ray_per_doc * args.num_cpus, 2)
        local_per_doc = runs["local_1_process"]["seconds"] / corpus["documents"]
        runs["local_1_process"]["cpu_ms_per_document"] = round(1e3 * local_per_doc, 2)
        ray_overhead = ray_per_doc * args.num_cpus / local_per_doc
        core_hours = 1e12 * seconds_per_byte / 3600
        estimate = {
            "documents": round(1e12 / (corpus["bytes"] / corpus["documents"])),
            "core_hours_one_process_cost": round(core_hours),
            "ray_cpu_per_document_over_local_measured_here": round(ray_overhead, 2),
            "core_hours_on_ray_at_that_overhead": round(core_hours * ray_overhead),
            "usd_per_core_hour_assumed": args.usd_per_core_hour,
            "usd_one_process_cost": round(core_hours * args.usd_per_core_hour),
            "usd_on_ray_at_that_overhead": round(core_hours * ray_overhead * args.usd_per_core_hour),
            "hours_on_100_nodes_of_32_cores": round(core_hours * ray_overhead / 3200, 2),
        }
        result = {
            "benchmark": "data_pipeline_local_vs_ray",
            "machine": machine_info(note="shared with other jobs; Ray and local runs on the same cores"),
            "corpus": corpus,
            "removed": removed,
            "kept_documents": reports["local"]["output"]["documents"],
            "tokens": reports["local"]["output"]["tokens"],
            "runs": runs,
            "shards_identical": identical,
            "estimate_1tb": estimate,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
