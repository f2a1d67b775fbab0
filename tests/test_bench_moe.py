"""Smoke test for benchmarks/bench_moe.py: a minuscule run must produce sane JSON, so it cannot rot."""

import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["--hidden-size", "32", "--layers", "1", "--vocab", "64", "--batch", "2", "--prompt-len", "4",
        "--new-tokens", "3", "--repeats", "1", "--threads", "1"]


def test_bench_moe_tiny(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the benchmark imports its sibling _common
    import bench_moe

    out = tmp_path / "moe.json"
    returned = bench_moe.main(TINY + ["--out", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    for kind in ("mixtral", "qwen2_moe"):
        r = result[kind]
        assert r["active_parameters"] < r["parameters"]
        assert r["flops_per_token"] > 2 * (r["active_parameters"] - 64 * 32)  # matmuls, not the embedding lookup
        for batch in ("batch_1", "batch_2"):
            assert r[batch]["same_tokens"]  # same weights, greedy: the two sides agree token for token
            assert all(v > 0 for v in r[batch]["decode_tok_s"].values()) and r[batch]["ratio_vs_transformers"] > 0
            assert r[batch]["gflop_s"]["tokenmind"] > 0
            assert r[batch]["aten_calls_per_step"] > 10  # a layer's matmuls, norms and attention at least
    assert result["qwen2_moe"]["config"]["shared_expert_intermediate_size"] == 64
