"""End to end: files -> cleaned, deduplicated, decontaminated token shards, with a report."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenmind.data.clean import CleanConfig
from tokenmind.data.decontaminate import DecontaminationConfig
from tokenmind.data.pipeline import DataPipelineConfig, run_pipeline, tokenizer_identity
from tokenmind.data.shards import ShardConfig, TokenShards

NAV = "Home | News | Sport | Weather | Contact us"
FOOTER = "\u00a9 2024 Example News Ltd. All rights reserved."
EVAL_PASSAGE = (
    "In the beginning the universe was created. This has made a lot of people very angry "
    "and been widely regarded as a bad move by most observers."
)


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus an eos id; module level so worker processes can load it."""

    vocab_size = 257
    eos_token_id = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]


class HFTokenizer:
    """Adapts a `tokenizers.Tokenizer` to the pipeline's tokenizer interface."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_token_id = tokenizer.token_to_id("<eos>")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts)]


def article(rng: random.Random, words: int = 80) -> str:
    vocabulary = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po") for b in range(60)]
    sentences = []
    for _ in range(words // 10):
        sentence = " ".join(rng.choice(vocabulary) for _ in range(10))
        sentences.append(sentence.capitalize() + ".")
    return " ".join(sentences)


def build_corpus(root: Path) -> dict[str, str]:
    """A small corpus with one planted example of everything the pipeline should remove."""
    rng = random.Random(0)
    articles = [article(rng) for _ in range(12)]
    web = root / "corpus" / "1_web"  # read first: folders are walked in sorted order
    web.mkdir(parents=True)
    with open(web / "pages.jsonl", "w", encoding="utf-8") as handle:
        for i, text in enumerate(articles):
            handle.write(json.dumps({"id": f"page{i}", "text": f"{NAV}\n{text}\n{FOOTER}"}) + "\n")
    near = articles[3].split()
    near[40] = "edited"
    extras = {
        "exact_copy": "  " + articles[5].replace(". ", ".\n"),  # same text, other whitespace
        "near_copy": " ".join(near),
        "junk": "buy now!!",
        "contaminated": article(rng) + " " + EVAL_PASSAGE.lower() + " " + article(rng, 20),
        "kept": article(rng),
    }
    misc = root / "corpus" / "2_misc"
    misc.mkdir()
    with open(misc / "extra.jsonl", "w", encoding="utf-8") as handle:
        for name, text in extras.items():
            handle.write(json.dumps({"id": name, "text": text}) + "\n")
    (root / "eval.jsonl").write_text(json.dumps({"id": "eval0", "text": EVAL_PASSAGE}) + "\n")
    return {"articles": articles, "kept": extras["kept"]}  # type: ignore[dict-item]


def config(root: Path, **overrides: object) -> DataPipelineConfig:
    cfg = DataPipelineConfig(
        clean=CleanConfig(boilerplate_min_docs=5),
        eval_paths=[root / "eval.jsonl"],
        shards=ShardConfig(tokens_per_shard=2_000),
        num_workers=1,
        print_report=False,
    )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def test_end_to_end_with_byte_tokenizer(tmp_path: Path) -> None:
    expected = build_corpus(tmp_path)
    report = run_pipeline(tmp_path / "corpus", tmp_path / "out", ByteTokenizer(), config(tmp_path))

    removed = {stage["name"]: stage["docs_removed"] for stage in report["stages"]}
    assert removed["filter:min_chars"] == 1  # "buy now!!"
    assert removed["exact_dedup"] == 1 and removed["near_dedup"] == 1 and removed["decontaminate"] == 1
    assert sum(removed.values()) == 4
    boilerplate = next(stage for stage in report["stages"] if stage["name"] == "boilerplate")
    assert boilerplate["chars_removed"] == 12 * (len(NAV) + len(FOOTER) + 2)
    assert report["documents_read"] == 17 and report["output"]["documents"] == 13
    assert report["contaminated"] == [
        {"id": "contaminated", "source": str(tmp_path / "corpus"), "eval_id": "eval0"}
    ]

    shards = TokenShards(tmp_path / "out")
    decoded = [bytes(shards.document(i).tolist()).decode("utf-8") for i in range(len(shards))]
    assert decoded == expected["articles"] + [expected["kept"]]  # boilerplate gone, order kept
    assert shards.manifest["tokenizer"] == tokenizer_identity(ByteTokenizer())
    assert report["output"]["tokens"] == shards.num_tokens == sum(len(t.encode()) + 1 for t in decoded)
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report


def test_report_mode_keeps_contaminated_documents(tmp_path: Path) -> None:
    build_corpus(tmp_path)
    cfg = config(tmp_path, decontamination=DecontaminationConfig(action="report"))
    report = run_pipeline(tmp_path / "corpus", tmp_path / "out", ByteTokenizer(), cfg)
    assert [entry["id"] for entry in report["contaminated"]] == ["contaminated"]
    assert report["output"]["documents"] == 14


def train_bpe(texts: list[str]) -> HFTokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tokenizer)


def test_parallel_workers_write_identical_shards(tmp_path: Path) -> None:
    expected = build_corpus(tmp_path)
    tokenizer = train_bpe(expected["articles"])
    outputs = {}
    for workers in (1, 2):
        cfg = config(tmp_path, num_workers=workers, docs_per_task=2)
        run_pipeline(tmp_path / "corpus", tmp_path / f"out{workers}", tokenizer, cfg)
        outputs[workers] = {
            path.relative_to(tmp_path / f"out{workers}").as_posix(): path.read_bytes()
            for path in (tmp_path / f"out{workers}").rglob("shard_*")
        }
    assert outputs[1] == outputs[2] and len(outputs[1]) >= 2
    shards = TokenShards(tmp_path / "out2")
    assert tokenizer.tokenizer.decode(shards.document(0).tolist()) == expected["articles"][0]


def test_val_split_and_printed_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_corpus(tmp_path)
    cfg = config(tmp_path, shards=ShardConfig(val_tokens=600), print_report=True)
    report = run_pipeline(tmp_path / "corpus", tmp_path / "out", ByteTokenizer(), cfg)
    splits = report["output"]["splits"]
    assert splits["val"]["tokens"] >= 600 and splits["train"]["documents"] + splits["val"]["documents"] == 13
    printed = capsys.readouterr().out
    assert "near_dedup" in printed and "decontaminate" in printed and "val:" in printed


def test_refuses_finished_output_and_missing_inputs(tmp_path: Path) -> None:
    build_corpus(tmp_path)
    run_pipeline(tmp_path / "corpus", tmp_path / "out", ByteTokenizer(), config(tmp_path))
    with pytest.raises(FileExistsError, match="manifest.json already exists"):
        run_pipeline(tmp_path / "corpus", tmp_path / "out", ByteTokenizer(), config(tmp_path))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        run_pipeline(tmp_path / "nowhere", tmp_path / "out2", ByteTokenizer(), config(tmp_path))


def test_worker_imports_stay_light() -> None:
    """Spawned tokenization workers import the pipeline module; it must not drag in torch."""
    code = "import sys, tokenmind.data.pipeline; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
