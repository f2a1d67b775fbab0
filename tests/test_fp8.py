"""FP8 training simulated on CPU: the casts land on the fp8 grids, delayed scaling follows the amax
history, gradients go through e5m2, and a tiny model trains with FP8 as it does in bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from test_train_helpers import (  # noqa: F401 (one_thread: autouse fixture)
    crash_in_step_5,
    one_thread,
    pretrainer,
    tiny_config,
    write_shards,
)

from tokenmind.jsonl import read_jsonl
from tokenmind.model.config import ModelConfig
from tokenmind.model.fp8 import E4M3, E5M2, Fp8Linear, Fp8Recipe, enable_fp8, quantize, scale_from_amax
from tokenmind.model.transformer import Transformer
from tokenmind.train import pretrain


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shards(tmp_path_factory.mktemp("shards"))


def fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an fp8 format, from its 256 bit patterns, sorted."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return values[values.isfinite()].unique()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() / scale


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_cast_round_trip_lands_on_the_nearest_fp8_value(dtype: torch.dtype) -> None:
    grid = fp8_grid(dtype)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    scale = scale_from_amax(x.abs().max(), dtype, margin=0)
    q = quantize(x, scale, dtype)
    assert q.dtype == dtype
    assert torch.equal(q.float(), (x * scale).to(dtype).float())  # torch's own float8 conversion
    nearest = grid[((x * scale)[:, None] - grid[None]).abs().argmin(dim=1)]
    assert torch.equal(q.float(), nearest)  # round to nearest on the format's grid
    assert q.float().abs().max() == torch.finfo(dtype).max  # the amax maps to the top of the range
    big = quantize(torch.tensor([1e9, -1e9]), torch.tensor(1.0), dtype)
    assert big.float().tolist() == [torch.finfo(dtype).max, -torch.finfo(dtype).max]  # saturating, not NaN


def test_delayed_scaling_follows_the_amax_history() -> None:
    torch.manual_seed(0)
    layer = Fp8Linear(nn.Linear(16, 8, bias=False), Fp8Recipe(amax_history_len=2))
    amaxes = [1.0, 4.0, 0.5, 0.25]
    outputs = []
    for amax in amaxes:
        x = torch.randn(5, 16)
        x = x / x.abs().max() * amax
        outputs.append((x, layer(x)))
    assert layer.amax_history[0].tolist() == [0.25, 0.5]  # newest first, two remembered
    max_e4m3 = torch.finfo(E4M3).max
    w_scale = scale_from_amax(layer.weight.abs().max(), E4M3, 0)
    # the scale each call used: its own amax first, then the max of the previous two calls'
    for (x, y), used in zip(outputs, [1.0, 1.0, 4.0, 4.0]):
        x_scale = torch.tensor(max_e4m3 / used)
        expected = dequantize(quantize(x, x_scale, E4M3), x_scale) @ dequantize(quantize(layer.weight, w_scale, E4M3),
                                                                               w_scale).T
        torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    history = layer.amax_history.clone()
    layer.eval()
    layer(torch.randn(5, 16) * 100)
    assert torch.equal(layer.amax_history, history)  # evaluation does not move the histories


def test_gradients_flow_through_e5m2() -> None:
    torch.manual_seed(0)
    reference = nn.Linear(32, 24)
    layer = Fp8Linear(reference, Fp8Recipe())
    x = torch.randn(3, 7, 32, requires_grad=True)
    grad_out = torch.randn(3, 7, 24)
    layer(x).backward(grad_out)
    fp8_grads = x.grad.clone(), reference.weight.grad.clone(), reference.bias.grad.clone()
    x.grad, reference.weight.grad, reference.bias.grad = None, None, None
    reference(x).backward(grad_out)
    # exactly the FP8 GEMMs: dy in e5m2, x and W as saved in e4m3
    g = grad_out.reshape(-1, 24)
    g_scale = scale_from_amax(g.abs().max(), E5M2, 0)
    x_scale = scale_from_amax(x.abs().max(), E4M3, 0)
    w_scale = scale_from_amax(reference.weight.abs().max(), E4M3, 0)
    gd = dequantize(quantize(g, g_scale, E5M2), g_scale)
    wd = dequantize(quantize(reference.weight, w_scale, E4M3), w_scale)
    xd = dequantize(quantize(x.reshape(-1, 32), x_scale, E4M3), x_scale)
    torch.testing.assert_close(fp8_grads[0], (gd @ wd).reshape(3, 7, 32), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fp8_grads[1], gd.T @ xd, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fp8_grads[2], reference.bias.grad)  # the bias gradient stays exact
    for fp8, exact in zip(fp8_grads, (x.grad, reference.weight.grad)):
        assert (fp8 - exact).norm() / exact.norm() < 0.15  # e5m2 keeps 2 mantissa bits
    assert layer.amax_history[2, 0] == g.abs().max()


def test_enable_fp8_swaps_the_projections_and_keeps_the_weight_names() -> None:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = Transformer(cfg)
    keys = list(model.state_dict())
    swapped = enable_fp8(model)
    assert swapped == [f"layers.{i}.{p}" for i in range(2) for p in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                      "mlp.gate_up_proj", "mlp.down_proj")]
    assert type(model.lm_head) is nn.Linear
    assert list(model.state_dict()) == keys  # checkpoints and exports are unchanged


def train_records(out_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(out_dir / "metrics.jsonl") if "loss" in r]


def test_a_tiny_model_trains_in_fp8_close_to_bf16(shards: Path, tmp_path: Path) -> None:
    curves = {}
    for precision in ("bf16", "fp8"):
        result = pretrain(tiny_config(shards, tmp_path / precision, f"--train.precision={precision}",
                                      "--train.steps=16"))
        curves[precision] = result.losses
    assert curves["fp8"][-1] < curves["fp8"][0] - 0.2  # it learns
    gaps = [abs(a - b) for a, b in zip(curves["fp8"], curves["bf16"])]
    assert max(gaps) < 0.05, gaps  # step for step within a few hundredths of a nat


def test_an_fp8_resume_restores_the_amax_histories(shards: Path, tmp_path: Path) -> None:
    args = ["--train.precision=fp8", "--train.fp8_amax_history=4", "--train.checkpoint_every=4", "--train.keep_last=0"]
    pretrain(tiny_config(shards, tmp_path / "straight", *args))
    crashed = tiny_config(shards, tmp_path / "crashed", *args)
    crash_in_step_5(pretrainer(crashed))
    pretrain(crashed)
    a, b = train_records(tmp_path / "straight"), train_records(tmp_path / "crashed")
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key
