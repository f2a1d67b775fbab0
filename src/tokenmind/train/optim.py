"""Optimizers: AdamW with principled weight-decay groups, and Muon.

Weight decay pulls weights toward zero. That is a useful prior for the matrices that mix
features (attention and MLP projections, an untied LM head), but wrong for gains and offsets:
decaying an RMSNorm weight toward 0 fights the normalization, decaying a bias toward 0 has no
regularizing meaning, and decaying embedding rows penalizes rare tokens, whose rows see few
gradient updates to push back. So every parameter gets a role (`param_roles`) from the module
that owns it, and only "matrix" and "head" parameters decay. A tied LM head *is* the embedding
(one tensor), so it follows the embedding's rule.

Muon (Keller Jordan, 2024, "Muon: An optimizer for hidden layers in neural networks") replaces
Adam's per-coordinate scaling for 2-D hidden matrices: it takes the Nesterov momentum of the
gradient and replaces it by the nearest semi-orthogonal matrix U·Vᵀ (all singular values 1),
computed with a few Newton–Schulz iterations in bf16. Every direction of the update then moves
the same amount, instead of the few dominant directions a raw gradient is made of. Muon is
only defined for matrices in the network's body; embeddings, the LM head, norms and biases
keep AdamW, inside the same optimizer object so there is one state dict and one lr schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..model.cpu import fastest_autocast
from .config import OptimSection

# Quintic Newton–Schulz coefficients from Keller Jordan's Muon: chosen to push singular values
# in (0, 1] toward 1 as fast as possible; they converge to roughly [0.7, 1.2], not exactly 1,
# which costs nothing measurable in training and makes 5 iterations enough.
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def param_roles(model: nn.Module) -> dict[str, str]:
    """Name → "embedding" | "head" | "matrix" | "vector" for every (deduplicated) parameter.

    embedding: weights of `nn.Embedding` modules (and a head tied to them); head: the output
    projection `lm_head` when untied; matrix: other tensors with ≥ 2 dims; vector: norms, biases.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    roles = {}
    for name, p in model.named_parameters():
        if id(p) in embeddings:
            roles[name] = "embedding"
        elif id(p) in head_ids:
            roles[name] = "head"
        else:
            roles[name] = "matrix" if p.ndim >= 2 else "vector"
    return roles


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately U·Vᵀ for g = U·S·Vᵀ (a 2-D matrix), by quintic Newton–Schulz.

    Dividing by the Frobenius norm puts every singular value in (0, 1]; each iteration maps
    a singular value σ to aσ + bσ³ + cσ⁵, which pushes them all toward ~1 while U and V stay.
    Iterating on the wide orientation keeps the Gram matrix x·xᵀ the small one. The iteration
    runs in bf16 where bf16 matmuls are fast (CUDA, AMX) and in fp32 elsewhere: on a CPU that
    emulates bf16 it was 30x slower than fp32 and took four fifths of a small model's step.
    """
    a, b, c = _NS_COEFFICIENTS
    x = g.to(torch.bfloat16 if fastest_autocast(g.device.type) == "bf16" else torch.float32)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(g.dtype)


def _orthogonalize_param(update: torch.Tensor, steps: int) -> torch.Tensor:
    """`orthogonalize`, also for FSDP2-sharded (DTensor) updates: the iteration needs the whole
    matrix, so every rank gathers it, computes the same result, and keeps its own shard."""
    if isinstance(update, DTensor):
        full = orthogonalize(update.full_tensor(), steps)
        return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)
    return orthogonalize(update, steps)


class Muon(torch.optim.Optimizer):
    """Muon for groups with `use_muon=True` (2-D matrices), AdamW for groups with `use_muon=False`.

    Muon group keys: lr, momentum, weight_decay, ns_steps. AdamW group keys: lr, betas, eps,
    weight_decay. Weight decay is decoupled in both (p ← p·(1 − lr·wd) before the update).
    """

    def __init__(self, param_groups: list[dict]) -> None:
        defaults = dict(lr=0.02, momentum=0.95, ns_steps=5, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
        super().__init__(param_groups, defaults)
        for group in self.param_groups:
            if "use_muon" not in group:
                raise ValueError("every Muon param group needs use_muon=True (2-D hidden matrices) or False (AdamW)")
            if group["use_muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon orthogonalizes matrices: use_muon groups may hold only 2-D parameters")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = _orthogonalize_param(p.grad.lerp(buf, momentum), group["ns_steps"])  # Nesterov
            # U·Vᵀ has RMS ~ 1/sqrt(max(rows, cols)); this keeps tall matrices' steps comparable.
            scale = max(1.0, p.size(0) / p.size(1)) ** 0.5
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr * scale)

    def _adamw_step(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = int(state["step"].item())
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(eps)
            p.mul_(1 - lr * wd)
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**t))


def build_optimizer(model: nn.Module, cfg: OptimSection, keep_empty_groups: bool = False) -> torch.optim.Optimizer:
    """AdamW or Muon over `model` (the unwrapped or FSDP2-sharded module, not a DDP wrapper).

    AdamW groups come first in both cases, so `param_groups[0]["lr"]` is always the AdamW lr.
    keep_empty_groups: every group even without parameters (a pipeline stage without the LM head),
    so all stages have the same groups and share one LR-scheduler state.
    """
    roles = param_roles(model)
    params = dict(model.named_parameters())

    def select(*wanted: str) -> list[nn.Parameter]:  # frozen parameters (a LoRA base) are left out
        return [params[name] for name, role in roles.items() if role in wanted and params[name].requires_grad]

    adam = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "adamw":
        groups = [
            dict(params=select("matrix", "head"), weight_decay=cfg.weight_decay),
            dict(params=select("embedding", "vector"), weight_decay=0.0),
        ]
        trained = [p for g in groups for p in g["params"]]
        # one fused kernel over all tensors instead of a Python loop of small ops per tensor (LoRA
        # trains hundreds of small ones); the same update. Sharded (DTensor) parameters keep the loop.
        fused = bool(trained) and all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda")
                                      and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in trained)
        return torch.optim.AdamW([g for g in groups if g["params"] or keep_empty_groups], **adam, fused=fused or None)
    groups = [
        dict(params=select("head"), weight_decay=cfg.weight_decay, use_muon=False, **adam),
        dict(params=select("embedding", "vector"), weight_decay=0.0, use_muon=False, **adam),
        dict(params=select("matrix"), use_muon=True, lr=cfg.muon_lr, momentum=cfg.muon_momentum,
             weight_decay=cfg.muon_weight_decay, ns_steps=cfg.muon_ns_steps),
    ]
    return Muon([g for g in groups if g["params"] or keep_empty_groups])
