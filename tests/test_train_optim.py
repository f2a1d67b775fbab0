"""Optimizers and schedules: decay groups, Muon's orthogonalization, AdamW parity, LR values."""

from __future__ import annotations

import math

import pytest
import torch
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.train.config import OptimSection, ScheduleSection
from tokenmind.train.optim import Muon, build_optimizer, orthogonalize
from tokenmind.train.schedule import build_scheduler, lr_multiplier


def tiny_model(tied: bool) -> Transformer:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, tie_word_embeddings=tied)
    return Transformer(cfg)


def group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [{names[id(p)] for p in group["params"]} for group in optimizer.param_groups]


def layer_params(*suffixes: str) -> set[str]:
    return {f"layers.{i}.{s}" for i in range(2) for s in suffixes}


MATRICES = layer_params("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                        "mlp.down_proj.weight")
VECTORS = layer_params("input_layernorm.weight", "post_attention_layernorm.weight",
                       "self_attn.qkv_proj.bias") | {"norm.weight"}


@pytest.mark.parametrize("tied", [False, True])
def test_adamw_decays_only_hidden_and_output_matrices(tied: bool) -> None:
    model = tiny_model(tied)
    optimizer = build_optimizer(model, OptimSection(weight_decay=0.1))
    decay, no_decay = group_names(model, optimizer)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert decay == MATRICES | (set() if tied else {"lm_head.weight"})
    assert no_decay == VECTORS | {"embed_tokens.weight"}  # a tied head is the embedding tensor


def test_muon_gets_the_block_matrices_and_adamw_the_rest() -> None:
    model = tiny_model(tied=False)
    optimizer = build_optimizer(model, OptimSection(name="muon", lr=1e-3, muon_lr=0.02))
    assert isinstance(optimizer, Muon)
    head, rest, muon = group_names(model, optimizer)
    assert (head, rest, muon) == ({"lm_head.weight"}, VECTORS | {"embed_tokens.weight"}, MATRICES)
    assert [g["use_muon"] for g in optimizer.param_groups] == [False, False, True]
    assert optimizer.param_groups[0]["lr"] == 1e-3 and optimizer.param_groups[2]["lr"] == 0.02


def spread_matrix(rows: int, cols: int, condition: float = 100.0) -> torch.Tensor:
    """A random matrix whose singular values span `condition`, like a real gradient's."""
    g = torch.Generator().manual_seed(rows * cols)
    u, _, v = torch.linalg.svd(torch.randn(rows, cols, generator=g), full_matrices=False)
    return u @ torch.diag(torch.logspace(0, -math.log10(condition), min(rows, cols))) @ v


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (48, 48)])
def test_newton_schulz_pushes_singular_values_to_one(shape: tuple[int, int]) -> None:
    m = spread_matrix(*shape)
    out = orthogonalize(m)
    assert out.shape == m.shape and out.dtype == m.dtype
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.6 and s.max() < 1.25  # input spans 0.01..1; Keller's coefficients land in ~[0.68, 1.2]
    u, _, v = torch.linalg.svd(m, full_matrices=False)
    cosine = torch.sum(out * (u @ v)) / (out.norm() * (u @ v).norm())
    assert cosine > 0.98  # it is the polar factor U·Vᵀ, approximately


def test_newton_schulz_runs_in_fp32_where_bf16_is_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each iteration maps every singular value through the quintic, so the output's singular values
    are the input's (over its norm) sent through it 5 times. In fp32 they match that scalar map closely;
    bf16 (kept for CUDA and AMX, 30x slower than fp32 on a CPU that emulates it) misses by ~1e-2."""
    from tokenmind.train import optim

    m = spread_matrix(24, 40)
    sigma = torch.linalg.svdvals(m.double()) / m.double().norm()
    a, b, c = optim._NS_COEFFICIENTS
    for _ in range(5):
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    sigma = sigma.sort().values  # the map is not monotonic
    monkeypatch.setattr(optim, "fastest_autocast", lambda device_type: "fp32")
    assert torch.linalg.svdvals(orthogonalize(m)).double().sort().values == pytest.approx(sigma.tolist(), abs=1e-4)
    monkeypatch.setattr(optim, "fastest_autocast", lambda device_type: "bf16")
    bf16_error = (torch.linalg.svdvals(orthogonalize(m)).double().sort().values - sigma).abs().max()
    assert bf16_error > 1e-3


def test_muon_update_is_orthogonal_and_scaled() -> None:
    p = torch.nn.Parameter(torch.zeros(64, 32))
    optimizer = Muon([dict(params=[p], use_muon=True, lr=0.1, momentum=0.0)])
    p.grad = spread_matrix(64, 32)
    optimizer.step()
    update = -p.detach() / 0.1 / math.sqrt(64 / 32)  # tall matrices are scaled by sqrt(rows/cols)
    s = torch.linalg.svdvals(update)
    assert s.min() > 0.6 and s.max() < 1.25


def test_muon_solves_a_least_squares_problem() -> None:
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(256, 32, generator=g), torch.randn(32, 16, generator=g)
    y = x @ target
    w = torch.nn.Parameter(torch.zeros(32, 16))
    optimizer = Muon([dict(params=[w], use_muon=True, lr=0.4)])
    # Every Muon step has the same size (singular values ~1), so convergence needs a decaying lr.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 100)
    losses = []
    for _ in range(100):
        loss = ((x @ w - y) ** 2).mean()
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    assert losses[-1] < 1e-3 * losses[0]


def test_muon_adamw_groups_match_torch_adamw() -> None:
    g = torch.Generator().manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(8, 4, generator=g))
    ref = torch.nn.Parameter(ours.detach().clone())
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    muon = Muon([dict(params=[ours], use_muon=False, **settings)])
    adamw = torch.optim.AdamW([ref], **settings)
    for _ in range(5):
        grad = torch.randn(8, 4, generator=g)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        muon.step()
        adamw.step()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


def test_cosine_schedule_values() -> None:
    cfg = ScheduleSection(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    m = [lr_multiplier(cfg, 100, s) for s in range(100)]
    assert m[0] == pytest.approx(0.1) and m[4] == pytest.approx(0.5)  # (s + 1) / warmup
    assert m[9] == 1.0  # warmup ends exactly at the peak
    assert m[54] == pytest.approx(0.55)  # halfway through the cosine: (1 + min) / 2
    assert m[99] == pytest.approx(0.1)  # the last step trains at min_lr_ratio
    assert all(a >= b for a, b in zip(m[9:], m[10:]))


def test_wsd_schedule_values() -> None:
    cfg = ScheduleSection(name="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.0)
    m = [lr_multiplier(cfg, 100, s) for s in range(100)]
    assert m[9] == 1.0 and set(m[9:80]) == {1.0}  # the stable plateau
    assert m[80] == pytest.approx(1 - 1 / 20) and m[89] == pytest.approx(0.5)  # linear decay
    assert m[99] == pytest.approx(0.0)


def test_constant_schedule_and_scheduler_scale_every_group() -> None:
    cfg = ScheduleSection(name="constant", warmup_steps=4)
    assert [lr_multiplier(cfg, 50, s) for s in (0, 3, 40)] == [0.25, 1.0, 1.0]
    optimizer = build_optimizer(tiny_model(tied=False), OptimSection(name="muon", lr=1e-3, muon_lr=0.02))
    scheduler = build_scheduler(optimizer, cfg, total_steps=50)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([2.5e-4, 2.5e-4, 5e-3])
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-4, 5e-4, 1e-2])
    assert all(fn is None for fn in scheduler.state_dict()["lr_lambdas"])  # nothing pickled but counters
