"""Online RL's math: advantages, GAE, the clipped policy loss, KL estimates, and `RLObjective`.

Every algorithm of the post-training series is the same loss over one rollout batch (a group of
G completions per prompt, scored by reward functions) with different choices, so one objective
covers them all and `ALGORITHMS` names the choices each paper makes:

* advantage — how a completion's reward becomes a learning signal:
  `batch` (REINFORCE with a baseline: reward − the batch's mean), `rloo` (reward − the mean of
  the other G − 1 completions of its prompt; Ahmadian et al. 2024), `group` (GRPO: (reward −
  group mean) / group std, Shao et al. 2024), `group_mean` (Dr.GRPO: no std division, Liu et al.
  2025), `gae` (PPO: per-token generalized advantage estimation from a learned value function,
  γ and λ, Schulman et al. 2016/2017).
* the surrogate — ratio ρ = π_θ / π_old per token, loss −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A);
  with ε = ∞ (no clip) its gradient at ρ = 1 is REINFORCE's −A ∇log π. DAPO's clip-higher is
  ε_high > ε_low (Yu et al. 2025).
* aggregation — how token losses become the batch loss: `sequence` (mean over each completion's
  tokens, then over completions: GRPO), `token` (mean over all tokens of the batch: DAPO and
  PPO, so long answers are not down-weighted), `constant` (each completion's token sum divided by
  the same max_new_tokens: Dr.GRPO, unbiased in length).
* the KL to the frozen reference, either in the loss (GRPO: β·k3 per token, k3 = e^{ref−logp} −
  (ref − logp) − 1, Schulman's unbiased non-negative estimator) or in the reward (REINFORCE,
  RLOO, PPO: r − β·(logp − ref), per token for PPO, summed over the completion otherwise).

The loss terms go through the trainer's objective seam (`train/objectives.py`): summed over the
aggregation's units (sequences or tokens), which the trainer divides by the global count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.train.objectives import LossTerms, autocast

from .preference_data import SequenceBatch

ADVANTAGES = ("batch", "rloo", "group", "group_mean", "gae")
AGGREGATIONS = ("sequence", "token", "constant")
KL_PLACES = ("loss", "reward")


@dataclass(frozen=True)
class Algorithm:
    """The choices one paper makes (see the module docstring); `RLSection` may override each."""

    advantage: str
    aggregation: str
    clip_low: float  # ε_low; math.inf = no clipping
    clip_high: float
    kl_coef: float
    kl_place: str
    dynamic_sampling: bool = False  # drop groups whose completions all scored the same (DAPO)
    overlong_penalty: bool = False  # DAPO's soft punishment of answers near max_new_tokens


ALGORITHMS: dict[str, Algorithm] = {
    "reinforce": Algorithm("batch", "sequence", math.inf, math.inf, 0.05, "reward"),
    "rloo": Algorithm("rloo", "sequence", math.inf, math.inf, 0.05, "reward"),
    "ppo": Algorithm("gae", "token", 0.2, 0.2, 0.05, "reward"),
    "grpo": Algorithm("group", "sequence", 0.2, 0.2, 0.04, "loss"),
    "dr_grpo": Algorithm("group_mean", "constant", 0.2, 0.2, 0.0, "loss"),
    "dapo": Algorithm("group", "token", 0.2, 0.28, 0.0, "loss", dynamic_sampling=True, overlong_penalty=True),
}


# ---- advantages ---------------------------------------------------------------------------------


def sequence_advantages(rewards: torch.Tensor, kind: str, eps: float = 1e-4) -> torch.Tensor:
    """(P, G) rewards of G completions for each of P prompts → (P, G) advantages (`batch`, `rloo`,
    `group`, `group_mean`; see the module docstring). The group std is the unbiased one, as TRL
    computes it; a group whose completions all scored the same gets advantage 0."""
    if kind == "batch":
        return rewards - rewards.mean()
    mean = rewards.mean(dim=1, keepdim=True)
    if kind == "group_mean":
        return rewards - mean
    if kind == "group":
        std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
        return (rewards - mean) / (std + eps)
    if kind == "rloo":
        g = rewards.shape[1]
        if g < 2:
            raise ValueError("RLOO's leave-one-out baseline needs at least 2 completions per prompt (rl.group_size)")
        return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1)
    raise ValueError(f"unknown advantage {kind!r}; choose one of {', '.join(a for a in ADVANTAGES if a != 'gae')}")


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over one completion: per-token rewards and values (L,) →
    (advantages, returns), δ_t = r_t + γ V_{t+1} − V_t, A_t = δ_t + γλ A_{t+1}, V_L = 0 (the
    completion ends the episode); returns = A + V, the value function's regression target."""
    advantages = torch.zeros_like(rewards)
    running = 0.0
    for t in range(rewards.shape[0] - 1, -1, -1):
        following = values[t + 1] if t + 1 < rewards.shape[0] else 0.0
        running = rewards[t] + gamma * following - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + values


# ---- per-token terms ----------------------------------------------------------------------------


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from the sampled token (Schulman's k3): unbiased,
    never negative, low variance."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def clipped_surrogate(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A) and whether the clip was active
    (the gradient is zero there)."""
    ratio = torch.exp(logps - old_logps)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """Per-token clipped value loss ½·max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


# ---- the batch and the objective ----------------------------------------------------------------


@dataclass
class RolloutBatch:
    """Packed completions (`SequenceBatch`: each prompt once, its G completions as documents that
    also see it) and, at every scored position (B, T), what the loss needs of the rollout:
    advantages, the sampling policy's log-probs (old_logps; NaN where the learner's own detached
    log-probs stand in: one update per rollout), the reference's (ref_logps), and for PPO the
    rollout-time values and their GAE returns. tokens: the tokens packed (prompts once, completions)."""

    seq: SequenceBatch
    advantages: torch.Tensor
    old_logps: torch.Tensor
    ref_logps: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    tokens: int = 0

    def to(self, device: torch.device) -> RolloutBatch:
        return RolloutBatch(self.seq.to(device), *(getattr(self, f).to(device) for f in
                                                   ("advantages", "old_logps", "ref_logps", "old_values", "returns")),
                            self.tokens)


def scored_positions(batch: SequenceBatch) -> torch.Tensor:
    """Flat indices of the positions whose target is a completion token, in sequence order."""
    return (batch.sequence.flatten() >= 0).nonzero().squeeze(1)


def policy_outputs(model: nn.Module, batch: SequenceBatch, precision: str, temperature: float,
                   with_values: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(token log-probs, token entropies, values or None) at the scored positions, in fp32, of the
    policy softmax(logits / temperature) (the distribution the rollout sampled from). Values come
    from the model's `value_head` on the same hidden states."""
    scored = scored_positions(batch)
    attn = DenseAttentionMetadata(document_ids=batch.document_ids, parent_ids=batch.parent_ids)
    with autocast(batch.input_ids.device, precision):
        hidden = model.hidden_states(batch.input_ids, batch.positions, attn).flatten(0, 1)[scored]
        logits = model.logits(hidden)
        values = model.value_head(hidden).squeeze(-1).float() if with_values else None
    logps, entropy = sampled_logps(logits.float(), batch.targets.flatten()[scored], temperature)
    return logps, entropy, values


ROWS_PER_CHUNK = 256  # rows per slice: few enough passes, few enough thread barriers


class _SampledLogProbs(torch.autograd.Function):
    """log softmax(z / T)[target] and the entropy of softmax(z / T), row by row of (N, V) logits z.

    Autograd of the plain expression keeps z / T, the log-sum-exp's softmax, the gather's scattered
    one-hot and their sum, each a full (N, V) tensor; here the forward makes one pass over each
    slice of rows (log-sum-exp, entropy, target) and the backward writes the gradient
    (one-hot − softmax) · g / T straight into its buffer, a slice at a time."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float):
        n = logits.shape[0]
        lse, logps, entropy = (logits.new_empty(n) for _ in range(3))
        for a in range(0, n, ROWS_PER_CHUNK):
            z = logits[a:a + ROWS_PER_CHUNK]
            z = z / temperature if temperature != 1.0 else z
            m = torch.logsumexp(z, dim=-1)
            p = torch.exp(z - m[:, None])  # H = log Z − Σ p·z
            entropy[a:a + ROWS_PER_CHUNK] = m - p.mul_(z).sum(-1)
            logps[a:a + ROWS_PER_CHUNK] = z.gather(1, targets[a:a + ROWS_PER_CHUNK, None])[:, 0] - m
            lse[a:a + ROWS_PER_CHUNK] = m
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor, _grad_entropy: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(logits)
        g = grad_logps / t
        for a in range(0, logits.shape[0], ROWS_PER_CHUNK):
            z, out = logits[a:a + ROWS_PER_CHUNK], grad[a:a + ROWS_PER_CHUNK]
            torch.sub(z / t if t != 1.0 else z, lse[a:a + ROWS_PER_CHUNK, None], out=out)
            out.exp_().mul_(-g[a:a + ROWS_PER_CHUNK, None])
            out.scatter_add_(1, targets[a:a + ROWS_PER_CHUNK, None], g[a:a + ROWS_PER_CHUNK, None])
        return grad, None, None


def sampled_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """(N,) log-probs of `targets` under softmax(logits / temperature), differentiable, and (N,)
    entropies (no gradient), from fp32 (N, V) logits (`_SampledLogProbs`)."""
    return _SampledLogProbs.apply(logits, targets, temperature)


class RLObjective:
    """The policy-gradient loss of one `RolloutBatch` (see the module docstring), plus PPO's value
    loss when `vf_coef` > 0. kl_coef: β of the KL term *in the loss* (0 when the KL goes into the
    reward; the KL is still measured whenever the batch has reference log-probs). Metrics (per
    unit): KL to the reference, entropy, clip fraction, value loss."""

    def __init__(self, aggregation: str, clip_low: float, clip_high: float, kl_coef: float, temperature: float,
                 max_new_tokens: int, vf_coef: float = 0.0, value_clip: float = 0.2) -> None:
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation {aggregation!r}; choose one of {', '.join(AGGREGATIONS)}")
        self.aggregation, self.clip_low, self.clip_high, self.kl_coef = aggregation, clip_low, clip_high, kl_coef
        self.temperature, self.max_new_tokens, self.vf_coef, self.value_clip = (temperature, max_new_tokens, vf_coef,
                                                                                 value_clip)

    def __call__(self, model: nn.Module, batch: RolloutBatch, precision: str) -> LossTerms:
        seq = batch.seq
        scored = scored_positions(seq)
        logps, entropy, values = policy_outputs(model, seq, precision, self.temperature, self.vf_coef > 0)
        old = batch.old_logps.flatten()[scored]
        old = torch.where(torch.isnan(old), logps.detach(), old)
        advantages = batch.advantages.flatten()[scored]
        token_loss, clipped = clipped_surrogate(logps, old, advantages, self.clip_low, self.clip_high)
        ref = batch.ref_logps.flatten()[scored]
        kl = torch.zeros_like(logps) if torch.isnan(ref).any() else kl_k3(logps, ref)  # NaN: no reference run
        token_loss = token_loss + self.kl_coef * kl
        metrics = {"kl": kl.detach(), "entropy": entropy, "clip_fraction": clipped.float()}
        if values is not None:
            v_loss = value_loss(values, batch.old_values.flatten()[scored], batch.returns.flatten()[scored],
                                self.value_clip)
            token_loss = token_loss + self.vf_coef * v_loss
            metrics["value_loss"] = v_loss.detach()
        owner = seq.sequence.flatten()[scored]
        lengths = seq.lengths.to(logps.dtype)
        if self.aggregation == "token":
            return LossTerms(token_loss.sum(), logps.numel(), {k: v.sum() for k, v in metrics.items()})
        per_token = 1.0 / (lengths[owner] if self.aggregation == "sequence" else float(self.max_new_tokens))
        loss = (token_loss * per_token).sum()
        weights = 1.0 / lengths[owner]  # metrics: each completion's token mean
        return LossTerms(loss, lengths.numel(), {k: (v * weights).sum() for k, v in metrics.items()})

    def compiled(self) -> RLObjective:
        return self  # rollout batches change shape every step; compiling would recompile every time
