"""Data mixtures: realised token shares follow the weights, a zero weight drops a source, bad weights are
refused by name, and the per-source counts land in the report and the manifest."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_data_pipeline import ByteTokenizer

from tokenmind.data.clean import CleanConfig
from tokenmind.data.mixture import Mixer, mixture_weights
from tokenmind.data.pipeline import DataPipelineConfig, run_pipeline
from tokenmind.data.quality import QualityConfig
from tokenmind.data.shards import TokenShards


def write_source(root: Path, name: str, docs: int, length: range, seed: int) -> Path:
    """`docs` documents of random lengths in `length`, each starting with the source's name."""
    rng = random.Random(seed)
    path = root / f"{name}.jsonl"
    with open(path, "w") as f:
        for i in range(docs):
            body = " ".join(f"{name}{rng.randrange(10**6)}" for _ in range(rng.choice(length) // 8))
            f.write(json.dumps({"id": f"{name}{i}", "text": f"{name}: {body}"}) + "\n")
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("sources")
    return [write_source(root, "prose", 300, range(200, 2000), 0),  # long documents
            write_source(root, "code", 400, range(40, 400), 1),
            write_source(root, "facts", 200, range(40, 120), 2)]


def pipeline(**overrides) -> DataPipelineConfig:
    return DataPipelineConfig(clean=CleanConfig(quality=QualityConfig.disabled()), near_dedup=None, num_workers=1,
                              print_report=False, **overrides)


def test_realised_token_fractions_match_the_weights(sources, tmp_path):
    weights = {"prose": 0.5, "code": 0.3, "facts": 0.2}
    report = run_pipeline(sources, tmp_path / "out", ByteTokenizer(), pipeline(mixture=weights))
    shares = {Path(name).stem: row for name, row in report["sources"]["sources"].items()}
    total = sum(row["tokens"] for row in shares.values())
    assert total == report["output"]["tokens"] == TokenShards(tmp_path / "out").num_tokens
    for name, weight in weights.items():
        assert shares[name]["weight"] == pytest.approx(weight)
        assert shares[name]["fraction"] == pytest.approx(weight, abs=0.01)
        assert shares[name]["tokens"] / total == shares[name]["fraction"]
    assert Path(report["sources"]["ended_by"]).stem == "facts"  # the smallest source for its weight
    assert shares["facts"]["documents"] == 200  # used whole; the others only as far as the mix needed
    assert shares["prose"]["documents"] < 300
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["sources"] == report["sources"]


def test_shares_hold_at_every_point_of_the_stream():
    """Each next document comes from the source most below its share, so no prefix drifts."""
    rng = random.Random(0)
    mixer = Mixer(["a", "b"], [0.25, 0.75])
    lengths = {"a": lambda: rng.randrange(10, 200), "b": lambda: rng.randrange(1, 50)}
    for step in range(1, 2001):
        name = mixer.names[mixer.next_stream()]
        mixer.record(name, lengths[name]())
        if step >= 100:
            assert abs(mixer.tokens["a"] / sum(mixer.tokens.values()) - 0.25) < 200 / sum(mixer.tokens.values())


def test_a_zero_weight_drops_the_source(sources, tmp_path):
    report = run_pipeline(sources, tmp_path / "out", ByteTokenizer(),
                          pipeline(mixture={"prose": 0, "code": 1, "facts": 1}))
    shards = TokenShards(tmp_path / "out")
    texts = [bytes(shards.document(i).tolist()).decode() for i in range(len(shards))]
    assert not any(text.startswith("prose:") for text in texts)
    assert {t.split(":")[0] for t in texts} == {"code", "facts"}
    prose = next(row for name, row in report["sources"]["sources"].items() if name.endswith("prose.jsonl"))
    assert prose == {"weight": 0.0, "documents": 0, "tokens": 0, "fraction": 0.0}


def test_without_a_mixture_every_input_is_taken_whole_and_counted(sources, tmp_path):
    report = run_pipeline(sources, tmp_path / "out", ByteTokenizer(), pipeline())
    rows = list(report["sources"]["sources"].values())
    assert [row["documents"] for row in rows] == [300, 400, 200]
    assert all(row["weight"] is None for row in rows) and report["sources"]["ended_by"] is None
    assert sum(row["fraction"] for row in rows) == pytest.approx(1.0)


@pytest.mark.parametrize("weights, message", [
    ({"prose": -1, "code": 1, "facts": 1}, "finite numbers >= 0"),
    ({"prose": float("nan"), "code": 1, "facts": 1}, "finite numbers >= 0"),
    ({"prose": "half", "code": 1, "facts": 1}, "finite numbers >= 0"),
    ({"prose": 0, "code": 0, "facts": 0}, "every mixture weight is 0"),
    ({"prose": 1, "code": 1}, "no mixture weight for .*facts.jsonl"),
    ({"prose": 1, "code": 1, "facts": 1, "poetry": 1}, "'poetry', which is not an input; the inputs are: code, facts"),
])
def test_bad_weights_are_refused_by_name(sources, weights, message):
    with pytest.raises(ValueError, match=message):
        mixture_weights(sources, weights)


def test_weights_name_inputs_as_given_or_by_their_short_name(sources):
    assert mixture_weights(sources, {str(sources[0]): 2, "code": 1, "facts.jsonl": 1}) == [0.5, 0.25, 0.25]
    with pytest.raises(ValueError, match="two mixture weights"):
        mixture_weights(sources, {str(sources[0]): 1, "prose": 1, "code": 1, "facts": 1})


def test_mixed_shards_are_identical_with_worker_processes(sources, tmp_path):
    outputs = []
    for workers in (1, 2):
        cfg = pipeline(mixture={"prose": 1, "code": 1, "facts": 1})
        cfg.num_workers, cfg.docs_per_task = workers, 16
        run_pipeline(sources, tmp_path / f"out{workers}", ByteTokenizer(), cfg)
        outputs.append(sorted(p.read_bytes() for p in (tmp_path / f"out{workers}").rglob("shard_*")))
    assert outputs[0] == outputs[1]
