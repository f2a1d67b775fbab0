"""Smoke test for benchmarks/bench_train.py: a minuscule run must produce sane JSON, so it cannot rot."""

import json
import math
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--intermediate", "64", "--vocab", "64",
        "--batch", "2", "--seq", "16", "--steps", "2", "--repeats", "1", "--warmup", "1", "--device", "cpu",
        "--no-compile"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_bench_train_tiny(dtype, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the benchmark imports its sibling _common
    import bench_train

    out = tmp_path / "train.json"
    returned = bench_train.main(TINY + ["--dtype", dtype, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    for side in ("tokenmind", "reference"):
        assert result[side]["tokens_per_s"] > 0
        assert result[side]["mfu"] > 0
        assert math.isfinite(result[side]["loss_first"]) and math.isfinite(result[side]["loss_last"])
        assert abs(result[side]["loss_first"] - result["loss_ln_vocab"]) < 0.5  # starts near uniform
    assert result["speedup"] > 0 and result["peak_flops"] > 0
    if dtype == "fp32":  # same weights, same batches, same optimizer: the two loss curves agree
        assert result["loss_max_abs_diff"] < 1e-3
    assert "loadavg_start" in result["machine"] and "loadavg_end" in result["machine"]
