"""The data pipeline on Ray Data writes the local engine's shards byte for byte; its global near dedup
(band buckets shuffled by key, connected components, greedy replay) makes the local decisions."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from tokenmind.data.clean import CleanConfig
from tokenmind.data.dedup import MinHashConfig, MinHashDeduplicator
from tokenmind.data.fim import FIMConfig
from tokenmind.data.pipeline import DataPipelineConfig, run_pipeline
from tokenmind.data.ray_pipeline import _bucket_batch, _group_batch, connected_components, greedy_replay
from tokenmind.data.shards import ShardConfig

NAV = "Home | News | Sport | Weather | Contact us"
EVAL_PASSAGE = ("In the beginning the universe was created. This has made a lot of people very angry "
                "and been widely regarded as a bad move by most observers.")


class FIMByteTokenizer:
    """UTF-8 bytes as ids, eos 256 and the three FIM sentinels (pickled by value to the Ray workers)."""

    vocab_size = 260
    eos_token_id = 256
    _special = {"<fim_prefix>": 257, "<fim_suffix>": 258, "<fim_middle>": 259}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def token_to_id(self, token: str) -> int | None:
        return self._special.get(token)


def words(rng: random.Random, n: int) -> list[str]:
    vocabulary = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta") for b in range(80)]
    return [rng.choice(vocabulary) for _ in range(n)]


def edit(text: str, positions: list[int], word: str) -> str:
    out = text.split()
    for p in positions:
        out[p] = f"{word}{p}"
    return " ".join(out)


def chain(rng: random.Random) -> list[str]:
    """A ~ B ~ C with A and C not similar, so the greedy order keeps A and C and drops B: B and C each
    replace a run of A's words, drawn until the local deduplicator sees exactly that pattern."""
    while True:
        a = words(rng, 200)
        b = a[:150] + words(rng, 12) + a[162:]
        c = b[:30] + words(rng, 12) + b[42:]
        a_text, b_text, c_text = (" ".join(t) for t in (a, b, c))
        decisions = []
        for first, second in ((a_text, b_text), (b_text, c_text), (a_text, c_text)):
            dedup = MinHashDeduplicator(MinHashConfig())
            decisions.append(not dedup.is_duplicate(first) and dedup.is_duplicate(second))
        if decisions == [True, True, False]:
            return [a_text, b_text, c_text]


def build_corpus(root: Path) -> None:
    """Several files in two folders: boilerplate, exact and near duplicates across files, a chain of
    near duplicates spread over three files, a contaminated document and junk."""
    rng = random.Random(1)
    articles = [" ".join(words(rng, 120)) for _ in range(10)]
    a, b, c = chain(rng)
    files = {
        "web/0.jsonl": [f"{NAV}\n{t}" for t in articles[:6]] + [a],
        "web/1.jsonl": [f"{NAV}\n{t}" for t in articles[6:]] + [b, "  " + articles[2].replace(" ", "\n", 3)],
        "misc/2.jsonl": [c, edit(articles[7], [50], "x"), "buy now!!",
                         " ".join(words(rng, 40)) + " " + EVAL_PASSAGE.lower()],
        "misc/3.jsonl": [articles[0], edit(articles[4], [90], "y"), " ".join(words(rng, 90))],
    }
    for name, texts in files.items():
        (root / "corpus" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "corpus" / name).write_text("".join(json.dumps({"id": f"{name}:{i}", "text": t}) + "\n"
                                                    for i, t in enumerate(texts)))
    (root / "eval.jsonl").write_text(json.dumps({"id": "eval0", "text": EVAL_PASSAGE}) + "\n")


def outputs(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name != "report.json"}


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    import ray.cloudpickle

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_engine_writes_the_local_shards(tmp_path: Path, ray_instance) -> None:
    build_corpus(tmp_path)
    inputs = [tmp_path / "corpus" / "web", tmp_path / "corpus" / "misc"]
    reports = {}
    for engine in ("local", "ray"):
        cfg = DataPipelineConfig(clean=CleanConfig(boilerplate_min_docs=5), eval_paths=[tmp_path / "eval.jsonl"],
                                 shards=ShardConfig(tokens_per_shard=1500, val_fraction=0.2), num_workers=1,
                                 docs_per_task=8, print_report=False, fim=FIMConfig(rate=0.5), engine=engine)
        reports[engine] = run_pipeline(inputs, tmp_path / engine, FIMByteTokenizer(), cfg)
    local, distributed = reports["local"], reports["ray"]
    removed = {stage["name"]: stage["docs_removed"] for stage in local["stages"]}
    # The planted cases all happened: three exact copies, B of the chain and two edited copies, one
    # contaminated document, boilerplate stripped; C of the chain survives (its only similar document was dropped).
    assert removed["exact_dedup"] == 2 and removed["near_dedup"] == 3 and removed["decontaminate"] == 1
    assert next(s for s in local["stages"] if s["name"] == "boilerplate")["chars_removed"] > 0
    assert len(outputs(tmp_path / "local")) >= 5  # several shards in both splits, plus the manifest
    for key in ("documents_read", "characters_read", "stages", "output", "sources", "contaminated"):
        assert distributed[key] == local[key], key
    assert outputs(tmp_path / "ray") == outputs(tmp_path / "local")


def test_global_near_dedup_makes_the_local_decisions() -> None:
    """Buckets from many 'workers' (batches), grouped, components and replay: the documents the
    streaming `MinHashDeduplicator` drops, on clusters of near copies and chains."""
    rng = random.Random(0)
    texts = []
    for _ in range(12):
        texts += chain(rng)
        base = " ".join(words(rng, 150))
        texts += [edit(base, rng.sample(range(150), rng.randint(0, 12)), "z") for _ in range(rng.randint(1, 4))]
    rng.shuffle(texts)
    local = MinHashDeduplicator(MinHashConfig())
    expected = [i for i, text in enumerate(texts) if local.is_duplicate(text)]

    near = MinHashDeduplicator(MinHashConfig())
    orders = np.arange(len(texts), dtype=np.int64)
    parts = [_bucket_batch({"order": orders[s:s + 7], "kept": np.ones(len(orders[s:s + 7]), bool),
                            "text": np.array(texts[s:s + 7], dtype=object)}, exact=False, near=near)
             for s in range(0, len(texts), 7)]
    rows = {name: np.concatenate([part[name].to_numpy(zero_copy_only=False) for part in parts])
            for name in ("bucket", "order", "signature")}
    grouped = _group_batch(rows, near.cfg.threshold)
    edges = np.stack([grouped["a"].to_numpy(), grouped["b"].to_numpy()], axis=1)
    assert len(edges) and (edges[:, 0] < edges[:, 1]).all()
    nodes, labels = connected_components(np.unique(edges, axis=0))
    assert len(set(labels.tolist())) < len(nodes)  # some components hold several documents
    assert greedy_replay(np.unique(edges, axis=0)).tolist() == expected
    assert len(expected) >= 12


def test_connected_components_and_replay_on_a_chain() -> None:
    edges = np.array([[1, 2], [2, 3], [7, 9], [3, 4]], dtype=np.int64)
    nodes, labels = connected_components(edges)
    assert dict(zip(nodes.tolist(), labels.tolist())) == {1: 1, 2: 1, 3: 1, 4: 1, 7: 7, 9: 7}
    # 1 kept drops 2; 3's only earlier neighbour (2) was dropped, so 3 stays and drops 4.
    assert greedy_replay(edges).tolist() == [2, 4, 9]


def test_missing_ray_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_corpus(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'tokenmind\[ray\]'"):
        run_pipeline(tmp_path / "corpus", tmp_path / "out", FIMByteTokenizer(),
                     DataPipelineConfig(engine="ray", print_report=False))


def test_ray_engine_refuses_a_mixture_and_unknown_engines(tmp_path: Path) -> None:
    build_corpus(tmp_path)
    cfg = DataPipelineConfig(engine="ray", mixture={"web": 0.5, "misc": 0.5}, print_report=False)
    with pytest.raises(ValueError, match="mixture needs the local engine"):
        run_pipeline([tmp_path / "corpus" / "web", tmp_path / "corpus" / "misc"], tmp_path / "out",
                     FIMByteTokenizer(), cfg)
    with pytest.raises(ValueError, match="engine must be 'local' or 'ray'"):
        DataPipelineConfig(engine="spark")
