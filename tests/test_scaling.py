"""Scaling laws: the fit recovers a known law, the compute-optimal split is the iso-FLOP minimum,
FLOPs are counted as a real step does them, and `tokenmind scaling` runs a grid end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_train_helpers import VOCAB, one_thread, write_shards  # noqa: F401 (one_thread: autouse)

from tokenmind.model.transformer import Transformer
from tokenmind.train.metrics import flops_per_token, matmul_parameters
from tokenmind.train.scaling import (ScalingConfig, ScalingLaw, fit_scaling_law, load_scaling_config,
                                     measured_flops_per_token, model_config, scaling)

TRUE = ScalingLaw(E=1.7, A=400.0, alpha=0.34, B=410.0, beta=0.28)


def test_the_fit_recovers_a_known_law_from_noisy_points() -> None:
    g = torch.Generator().manual_seed(0)
    points = []
    for n in (1e4, 3e4, 1e5, 3e5, 1e6):
        for d in (1e5, 3e5, 1e6, 3e6):
            noise = 1 + 0.003 * float(torch.randn((), generator=g))
            points.append((n, d, TRUE.loss(n, d) * noise))
    law = fit_scaling_law(points)
    assert law.E == pytest.approx(TRUE.E, rel=0.1)
    assert law.alpha == pytest.approx(TRUE.alpha, abs=0.05) and law.beta == pytest.approx(TRUE.beta, abs=0.05)
    # and it predicts a point outside the grid (10x more data) to within 1%
    assert law.loss(3e6, 3e7) == pytest.approx(TRUE.loss(3e6, 3e7), rel=0.01)


def test_the_compute_optimal_split_is_the_minimum_along_the_iso_flop_curve() -> None:
    flops = 1e18
    n_opt, d_opt = TRUE.compute_optimal(flops)
    assert 6 * n_opt * d_opt == pytest.approx(flops)
    grid = [10 ** (4 + i / 200) for i in range(1600)]
    best = min(grid, key=lambda n: TRUE.loss(n, flops / (6 * n)))
    assert n_opt == pytest.approx(best, rel=0.02)
    # more compute: a bigger model and more tokens, in the exponents' proportions
    n2, d2 = TRUE.compute_optimal(flops * 10)
    assert math.log10(n2 / n_opt) == pytest.approx(TRUE.beta / (TRUE.alpha + TRUE.beta))
    assert math.log10(d2 / d_opt) == pytest.approx(TRUE.alpha / (TRUE.alpha + TRUE.beta))


def test_parameter_and_flop_counts_agree_with_the_model() -> None:
    cfg = model_config(64, 2, VOCAB, 32)
    model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert matmul_parameters(cfg) == total  # tied: the one table counts once, as the LM head
    # torch's FLOP counter on a real step vs the analytic count (6N + LM head + attention, no causal halving)
    measured, counted = measured_flops_per_token(cfg, 32), flops_per_token(cfg, 32)
    assert measured == pytest.approx(counted, rel=0.1)
    # attention's share grows with the sequence, as the count says
    assert measured_flops_per_token(cfg, 256) - measured == pytest.approx(flops_per_token(cfg, 256) - counted, rel=0.1)


def test_a_frozen_base_counts_no_weight_gradients() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from tokenmind.model.lora import LoRAConfig, add_lora

    cfg = model_config(64, 2, VOCAB, 32)
    model = add_lora(Transformer(cfg), LoRAConfig(rank=1))  # every projection adapted: the base is frozen
    ids = torch.randint(0, cfg.vocab_size, (1, 32))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    frozen = flops_per_token(cfg, 32, frozen_base=True)
    assert counter.get_total_flops() / 32 == pytest.approx(frozen, rel=0.1)
    assert frozen < 0.8 * flops_per_token(cfg, 32)


def test_bad_grids_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        ScalingConfig(sizes=[[48, 2]])
    with pytest.raises(ValueError, match="at least 6 grid points"):
        ScalingConfig(sizes=[[32, 1]], tokens=[40_000, 80_000])
    with pytest.raises(ValueError, match="at least 4 steps"):
        load_scaling_config(None, ["--tokens=[100,200,300]", "--sizes=[[32,1],[64,1]]"])


def test_a_tiny_grid_runs_end_to_end_and_reuses_finished_runs(tmp_path: Path) -> None:
    shards = write_shards(tmp_path / "shards")
    cfg = load_scaling_config(None, [f"--shards={shards}", f"--out_dir={tmp_path / 'scaling'}",
                                     "--sizes=[[32,1],[64,1],[96,1]]", "--tokens=[512,1024]",
                                     "--holdout=[64,2,1024]", "--seq_len=32", "--batch_size=4", "--lr=1e-2"])
    summary = scaling(cfg)
    out = tmp_path / "scaling"
    assert {p.name for p in out.iterdir()} >= {"scaling.json", "scaling.png", "report.md"}
    assert len(summary["points"]) == 6 and all(p["loss"] < math.log(VOCAB) + 1 for p in summary["points"])
    assert json.loads((out / "scaling.json").read_text())["holdout"]["hidden"] == 64
    assert "Held-out run 64×2" in (out / "report.md").read_text()
    stamp = (out / "h32_l1_t512" / "scaling_point.json").stat().st_mtime_ns
    assert scaling(cfg)["points"] == summary["points"]  # the second call trains nothing
    assert (out / "h32_l1_t512" / "scaling_point.json").stat().st_mtime_ns == stamp
