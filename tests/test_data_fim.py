"""Fill-in-the-middle: the PSM/SPM transform, its rates and determinism, the shards it writes, and the
sentinels a tokenizer reserves or lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmind.cli import main
from tokenmind.data.clean import CleanConfig
from tokenmind.data.fim import (FIM_TOKENS, FIMConfig, choose_split, find_fim_tokens, fim_encode, infill_prompt,
                                require_fim_tokens)
from tokenmind.data.pipeline import DataPipelineConfig, run_pipeline
from tokenmind.data.quality import QualityConfig
from tokenmind.data.shards import TokenShards
from tokenmind.model.load import load_tokenizer
from tokenmind.tokenizer import Tokenizer
from tokenmind.tokenizer.train import ENDOFTEXT, train_bpe

CODE = [f"def f{i}(x):\n    y = x * {i} + {i % 7}\n    return y - {i}  # number {i}" for i in range(200)]


def code_tokenizer(fim: bool = True) -> Tokenizer:
    specials = [ENDOFTEXT, *(FIM_TOKENS if fim else ())]
    return train_bpe(CODE, 320, specials, chat_template=None)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return code_tokenizer()


def sections(ids: list[int], tokenizer: Tokenizer) -> list[str | int]:
    """ids as sentinel names and decoded runs of text between them."""
    sentinels = {tokenizer.token_to_id(name): name for name in FIM_TOKENS}
    out: list = []
    run: list[int] = []
    for i in [*ids, None]:
        if i is None or i in sentinels:
            if run:
                out.append(tokenizer.decode(run))
                run = []
            if i is not None:
                out.append(sentinels[i])
        else:
            run.append(i)
    return out


@pytest.mark.parametrize("spm_rate", [0.0, 1.0])
def test_psm_and_spm_layouts_hold_the_three_parts_that_rejoin_to_the_document(tokenizer, spm_rate):
    cfg = FIMConfig(rate=1.0, spm_rate=spm_rate, seed=3)
    encoded = fim_encode(CODE, tokenizer.encode_batch, require_fim_tokens(tokenizer), cfg)
    pre, suf, mid = FIM_TOKENS
    for text, ids in zip(CODE, encoded):
        split = choose_split(text, cfg)
        prefix, middle, suffix = split.parts(text)
        assert prefix + middle + suffix == text and split.spm == bool(spm_rate)
        layout = [p for p in [pre, prefix, suf, suffix, mid, middle] if p] if not spm_rate else \
            [p for p in [pre, suf, suffix, mid, prefix + middle] if p]
        assert sections(ids, tokenizer) == layout
    assert len({choose_split(t, cfg).start for t in CODE}) > 50  # cuts fall all over the documents


def test_rate_zero_leaves_the_data_unchanged_and_rate_one_always_transforms(tokenizer):
    tokens = require_fim_tokens(tokenizer)
    assert fim_encode(CODE, tokenizer.encode_batch, tokens, FIMConfig(rate=0.0)) == tokenizer.encode_batch(CODE)
    always = fim_encode(CODE, tokenizer.encode_batch, tokens, FIMConfig(rate=1.0))
    assert all(ids[0] == tokens.prefix and ids.count(tokens.middle) == 1 for ids in always)


def test_rates_are_met_and_the_transform_is_deterministic_per_seed(tokenizer):
    cfg = FIMConfig(rate=0.5, spm_rate=0.25, seed=1)
    splits = [choose_split(text, cfg) for text in CODE]
    chosen = [s for s in splits if s is not None]
    assert 0.4 < len(chosen) / len(CODE) < 0.6
    assert 0.12 < sum(s.spm for s in chosen) / len(chosen) < 0.38
    assert [choose_split(text, cfg) for text in CODE] == splits  # same seed, same cuts
    again = fim_encode(CODE, tokenizer.encode_batch, require_fim_tokens(tokenizer), cfg)
    assert again == fim_encode(CODE, tokenizer.encode_batch, require_fim_tokens(tokenizer), cfg)
    other = [choose_split(text, FIMConfig(rate=0.5, spm_rate=0.25, seed=2)) for text in CODE]
    assert other != splits
    with pytest.raises(ValueError, match="fim rate must be in"):
        FIMConfig(rate=1.5)


def test_sentinels_are_found_under_each_family_spelling_and_missing_ones_say_how_to_get_them(tokenizer):
    assert find_fim_tokens(tokenizer) == tuple(tokenizer.token_to_id(t) for t in FIM_TOKENS)
    qwen = train_bpe(CODE, 320, [ENDOFTEXT, "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"])
    assert find_fim_tokens(qwen) == (qwen.token_to_id("<|fim_prefix|>"), qwen.token_to_id("<|fim_suffix|>"),
                                     qwen.token_to_id("<|fim_middle|>"))
    assert find_fim_tokens(code_tokenizer(fim=False)) is None
    with pytest.raises(ValueError, match="tokenizer train --fim"):
        require_fim_tokens(code_tokenizer(fim=False))
    tokens = find_fim_tokens(tokenizer)
    assert infill_prompt([5, 6], [7], tokens) == [tokens.prefix, 5, 6, tokens.suffix, 7, tokens.middle]


def test_smollm2_has_no_fim_tokens():
    """SmolLM2's vocabulary starts with StarCoder-style specials but no FIM sentinels (checked, not assumed)."""
    smollm2 = load_tokenizer("smollm2")
    assert smollm2.token_to_id("<file_sep>") is not None and find_fim_tokens(smollm2) is None


def write_corpus(root: Path, per_document: int = 1) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "code.jsonl", "w") as f:
        for i in range(0, 60, per_document):
            f.write(json.dumps({"id": f"f{i}", "text": "\n\n".join(CODE[i : i + per_document])}) + "\n")
    return root / "code.jsonl"


def test_the_pipeline_writes_fim_documents_and_records_the_settings(tokenizer, tmp_path):
    corpus = write_corpus(tmp_path)
    cfg = DataPipelineConfig(clean=CleanConfig(quality=QualityConfig.disabled()), near_dedup=None, num_workers=1,
                             print_report=False, fim=FIMConfig(rate=0.5, seed=4))
    run_pipeline(corpus, tmp_path / "out", tokenizer, cfg)
    shards = TokenShards(tmp_path / "out")
    assert shards.manifest["fim"] == {"rate": 0.5, "spm_rate": 0.5, "seed": 4}
    docs = [shards.document(i).tolist() for i in range(len(shards))]
    expected = fim_encode(CODE[:60], tokenizer.encode_batch, find_fim_tokens(tokenizer), cfg.fim)
    assert docs == expected
    assert 15 < sum(find_fim_tokens(tokenizer).middle in d for d in docs) < 45
    with pytest.raises(ValueError, match="no fill-in-the-middle tokens"):
        run_pipeline(corpus, tmp_path / "plain", code_tokenizer(fim=False), cfg)


def test_tokenizer_train_and_data_prepare_from_the_cli(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", per_document=10)  # long enough for the quality filters
    assert main(["tokenizer", "train", "--data", str(corpus), "--out", str(tmp_path / "tok"), "--vocab-size", "300",
                 "--reference", "", "--fim"]) == 0
    assert find_fim_tokens(Tokenizer.from_pretrained(tmp_path / "tok")) is not None
    assert main(["data", "prepare", str(corpus), "--out", str(tmp_path / "shards"), "--tokenizer",
                 str(tmp_path / "tok"), "--workers", "1", "--val-fraction", "0", "--fim-rate", "1",
                 "--spm-rate", "0"]) == 0
    shards = TokenShards(tmp_path / "shards")
    tokens = find_fim_tokens(Tokenizer.from_pretrained(tmp_path / "tok"))
    assert all(shards.document(i)[0] == tokens.prefix for i in range(len(shards)))
