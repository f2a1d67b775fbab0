"""Noise schedules and the samplers' update rules: DDPM, DDIM and flow-matching Euler.

Diffusion (DDPM, Ho et al. 2020) corrupts a clean image x₀ over T steps with Gaussian noise of
variance β_t; in closed form x_t = √ᾱ_t·x₀ + √(1−ᾱ_t)·ε with ᾱ_t = Π_{s≤t}(1−β_s). The network
sees (x_t, t) and predicts one of three equivalent targets (`prediction_type`), which
`NoiseSchedule.split` turns back into the pair (x̂₀, ε̂):

    epsilon:       ε                      x̂₀ = (x_t − √(1−ᾱ)·ε̂) / √ᾱ
    sample:        x₀                     ε̂ = (x_t − √ᾱ·x̂₀) / √(1−ᾱ)
    v_prediction:  v = √ᾱ·ε − √(1−ᾱ)·x₀   x̂₀ = √ᾱ·x_t − √(1−ᾱ)·v̂,  ε̂ = √ᾱ·v̂ + √(1−ᾱ)·x_t

Flow matching / rectified flow (Lipman et al. 2022; Liu et al. 2022) instead moves on the straight
line x_t = (1−t)·x₀ + t·ε, t ∈ [0, 1], and the network predicts its velocity v = ε − x₀; sampling
integrates dx/dt = v from t = 1 (noise) to 0 with Euler steps.

Every scheduler here has the same three-part surface, so one sampling loop drives them all:
`timesteps(n)` gives the n + 1 points of the path (the last is the clean end: −1 for DDPM/DDIM, σ = 0
for flow), `model_time(t)` what the model is told the time is, and `step(out, t, t_next, x)` one move
from t to t_next. The step takes both points explicitly: no step counter, no timestep lookup.
Each `step` matches the corresponding `diffusers` 0.42.1 scheduler on the same inputs
(`tests/test_diffusion_schedules.py`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
PREDICTION_TYPES = ("epsilon", "sample", "v_prediction")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")


def cosine_betas(num_train_timesteps: int, max_beta: float = 0.999) -> torch.Tensor:
    """Nichol & Dhariwal's cosine schedule ("squaredcos_cap_v2"): ᾱ(s) = cos²((s + 0.008)/1.008 · π/2),
    β_i = 1 − ᾱ((i+1)/T) / ᾱ(i/T), capped at max_beta so the last steps do not divide by ~0. Noise
    grows slowly at both ends, where a linear schedule wastes many steps on near-pure noise."""
    def alpha_bar(s: float) -> float:
        return math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2

    T = num_train_timesteps
    return torch.tensor([min(1 - alpha_bar((i + 1) / T) / alpha_bar(i / T), max_beta) for i in range(T)],
                        dtype=torch.float32)


def make_betas(kind: str = "linear", num_train_timesteps: int = 1000, beta_start: float = 1e-4,
               beta_end: float = 0.02) -> torch.Tensor:
    """β_0..β_{T−1} (float32): `linear` from beta_start to beta_end (DDPM), `scaled_linear` linear in
    √β (Stable Diffusion's latents), or the cosine `squaredcos_cap_v2`."""
    _choice("beta_schedule", kind, BETA_SCHEDULES)
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps}")
    if kind == "linear":
        return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)
    if kind == "scaled_linear":
        return torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float32) ** 2
    return cosine_betas(num_train_timesteps)


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) → (B, 1, 1, ...) broadcasting over `like`'s non-batch dims, in its dtype and device."""
    return values.to(like.device, like.dtype).reshape(-1, *[1] * (like.dim() - 1))


def gaussian_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """N(0, I) noise of x's shape, dtype and device, drawn on the generator's own device (a CPU
    generator gives the same numbers whatever device the model runs on)."""
    device = generator.device if generator is not None else x.device
    return torch.randn(x.shape, generator=generator, device=device, dtype=x.dtype).to(x.device)


class NoiseSchedule:
    """The DDPM forward process q(x_t | x₀) = N(√ᾱ_t·x₀, (1−ᾱ_t)·I), t = 0..T−1, and the conversions
    between what a model predicts and (x̂₀, ε̂). Time −1 is the clean end (ᾱ = 1)."""

    def __init__(self, kind: str = "linear", num_train_timesteps: int = 1000, beta_start: float = 1e-4,
                 beta_end: float = 0.02) -> None:
        self.betas = make_betas(kind, num_train_timesteps, beta_start, beta_end)
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)
        self.num_train_timesteps = num_train_timesteps

    def alpha_bar(self, t: int | torch.Tensor) -> torch.Tensor:
        """ᾱ_t for a step index or a tensor of them; 1 where t < 0 (no noise at all)."""
        t = torch.as_tensor(t, dtype=torch.long)
        table = self.alphas_cumprod.to(t.device)
        return torch.where(t >= 0, table[t.clamp(min=0)], torch.ones((), dtype=torch.float32, device=t.device))

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_t = √ᾱ_t·x₀ + √(1−ᾱ_t)·ε for a (B,) tensor of steps."""
        a = _per_sample(self.alpha_bar(t), x0)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def target(self, prediction_type: str, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What a model of `prediction_type` should output for x_t built from (x0, noise) at steps t."""
        _choice("prediction_type", prediction_type, PREDICTION_TYPES)
        if prediction_type == "epsilon":
            return noise
        if prediction_type == "sample":
            return x0
        a = _per_sample(self.alpha_bar(t), x0)
        return a.sqrt() * noise - (1 - a).sqrt() * x0

    def split(self, prediction_type: str, model_output: torch.Tensor, x_t: torch.Tensor,
              t: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x̂₀, ε̂) from a model output of `prediction_type` at x_t (see the module docstring)."""
        _choice("prediction_type", prediction_type, PREDICTION_TYPES)
        a = self.alpha_bar(t)
        a = _per_sample(a, x_t) if a.dim() else a.to(x_t.device)
        sqrt_a, sqrt_1ma = a.sqrt(), (1 - a).sqrt()
        if prediction_type == "epsilon":
            return (x_t - sqrt_1ma * model_output) / sqrt_a, model_output
        if prediction_type == "sample":
            return model_output, (x_t - sqrt_a * model_output) / sqrt_1ma
        return sqrt_a * x_t - sqrt_1ma * model_output, sqrt_a * model_output + sqrt_1ma * x_t


def spaced_timesteps(num_train_timesteps: int, num_inference_steps: int, spacing: str = "leading") -> torch.Tensor:
    """`num_inference_steps` of the T training steps, descending, as diffusers picks them (Lin et al.
    2023, table 2): `leading` k·⌊T/n⌋ (never reaches T−1), `trailing` round(T − k·T/n) − 1 (starts at
    T−1, the pure-noise end, which matters for few steps), `linspace` evenly from T−1 to 0."""
    _choice("timestep_spacing", spacing, TIMESTEP_SPACINGS)
    T, n = num_train_timesteps, num_inference_steps
    if not 1 <= n <= T:
        raise ValueError(f"steps={n} must be between 1 and the {T} training timesteps")
    if spacing == "leading":
        steps = (np.arange(0, n) * (T // n)).round()[::-1]
    elif spacing == "trailing":
        steps = np.round(np.arange(T, 0, -T / n)) - 1
    else:
        steps = np.linspace(0, T - 1, n).round()[::-1]
    return torch.from_numpy(steps.astype(np.int64).copy())


class DDPMScheduler:
    """Ancestral sampling (Ho et al. 2020): each step draws x_{t'} from the Gaussian posterior
    q(x_{t'} | x_t, x̂₀) with the "fixed_small" variance σ² = (1−ᾱ_{t'})/(1−ᾱ_t)·β, where β = 1 − ᾱ_t/ᾱ_{t'}
    is the noise added between t' and t (so skipping steps stays a proper posterior)."""

    def __init__(self, schedule: NoiseSchedule, prediction_type: str = "epsilon", clip_sample: bool = True,
                 clip_sample_range: float = 1.0, timestep_spacing: str = "leading") -> None:
        _choice("prediction_type", prediction_type, PREDICTION_TYPES)
        _choice("timestep_spacing", timestep_spacing, TIMESTEP_SPACINGS)
        self.schedule, self.prediction_type = schedule, prediction_type
        self.clip_sample, self.clip_sample_range = clip_sample, clip_sample_range
        self.timestep_spacing = timestep_spacing

    def timesteps(self, num_inference_steps: int) -> torch.Tensor:
        """The steps visited, descending, then −1 (the clean sample)."""
        steps = spaced_timesteps(self.schedule.num_train_timesteps, num_inference_steps, self.timestep_spacing)
        return torch.cat([steps, torch.tensor([-1])])

    def model_time(self, t: torch.Tensor | int) -> float:
        return float(t)

    def predict_x0(self, model_output: torch.Tensor, t: int, sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x̂₀ clipped to ±clip_sample_range if clip_sample, ε̂ from the unclipped x̂₀)."""
        x0, eps = self.schedule.split(self.prediction_type, model_output, sample, t)
        if self.clip_sample:
            x0 = x0.clamp(-self.clip_sample_range, self.clip_sample_range)
        return x0, eps

    def step(self, model_output: torch.Tensor, t: int | torch.Tensor, t_next: int | torch.Tensor,
             sample: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """x_{t_next} from x_t = `sample` and the model's output at t."""
        t, t_next = int(t), int(t_next)
        # 1. cumulative and per-step noise between t_next and t
        a_t, a_next = self.schedule.alpha_bar(t), self.schedule.alpha_bar(t_next)
        alpha, beta = a_t / a_next, 1 - a_t / a_next
        # 2. the model's estimate of the clean sample
        x0, _ = self.predict_x0(model_output, t, sample)
        # 3. posterior mean μ̃(x_t, x̂₀) (DDPM eq. 7)
        mean = (a_next.sqrt() * beta / (1 - a_t)) * x0 + (alpha.sqrt() * (1 - a_next) / (1 - a_t)) * sample
        # 4. add σ·z, except at the last step into t = 0's clean sample
        if t > 0:
            noise = gaussian_like(model_output, generator)
            variance = ((1 - a_next) / (1 - a_t) * beta).clamp(min=1e-20)
            mean = mean + variance.sqrt() * noise
        return mean


class DDIMScheduler(DDPMScheduler):
    """DDIM (Song et al. 2020): the same trained model, a non-Markovian path that jumps
    x_{t'} = √ᾱ_{t'}·x̂₀ + √(1−ᾱ_{t'}−σ²)·ε̂ + σ·z with σ = η·√((1−ᾱ_{t'})/(1−ᾱ_t)·(1−ᾱ_t/ᾱ_{t'})): η = 0 is
    deterministic (an ODE, good in few steps), η = 1 has DDPM's variance."""

    def __init__(self, schedule: NoiseSchedule, prediction_type: str = "epsilon", clip_sample: bool = True,
                 clip_sample_range: float = 1.0, timestep_spacing: str = "leading", eta: float = 0.0) -> None:
        super().__init__(schedule, prediction_type, clip_sample, clip_sample_range, timestep_spacing)
        if eta < 0:
            raise ValueError(f"eta must be >= 0 (0 = deterministic DDIM, 1 = DDPM's variance), got {eta}")
        self.eta = eta

    def step(self, model_output: torch.Tensor, t: int | torch.Tensor, t_next: int | torch.Tensor,
             sample: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        t, t_next = int(t), int(t_next)
        # 1. cumulative noise at both ends of the jump
        a_t, a_next = self.schedule.alpha_bar(t), self.schedule.alpha_bar(t_next)
        # 2. x̂₀ (clipped) and ε̂ (from the model output as predicted)
        x0, eps = self.predict_x0(model_output, t, sample)
        # 3. the noise kept on the path, σ_t (DDIM eq. 16)
        std = self.eta * ((1 - a_next) / (1 - a_t) * (1 - a_t / a_next)).sqrt()
        # 4. point at x̂₀, re-noised along ε̂ to t_next's level, plus fresh noise when η > 0
        prev = a_next.sqrt() * x0 + (1 - a_next - std**2).sqrt() * eps
        if self.eta > 0:
            prev = prev + std * gaussian_like(model_output, generator)
        return prev


def shift_sigmas(sigmas: torch.Tensor | np.ndarray, shift: float):
    """σ' = s·σ / (1 + (s−1)·σ) (SD3's timestep shift): s > 1 spends more steps at high noise, which
    larger images need because neighbouring pixels stay correlated under the same σ."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x₀ + t·ε for a (B,) tensor of times in [0, 1] (rectified flow's straight path)."""
    t = _per_sample(t, x0)
    return (1 - t) * x0 + t * noise


def flow_velocity(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """dx_t/dt = ε − x₀: the flow-matching target, the same at every t."""
    return noise - x0


class FlowMatchEulerScheduler:
    """Euler integration of dx/dt = v̂(x, t) from σ = 1 (noise) down to σ = 0 (the image).

    The grid is diffusers' `FlowMatchEulerDiscreteScheduler`: n times evenly from 1 down to the
    training grid's smallest noise level (σ = 1/T after its shift) and then shifted, which shifts that
    end point twice when shift ≠ 1; the model is told t = σ·T."""

    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0) -> None:
        if shift <= 0:
            raise ValueError(f"shift must be > 0 (1 = no shift), got {shift}")
        self.num_train_timesteps, self.shift = num_train_timesteps, shift

    def timesteps(self, num_inference_steps: int) -> torch.Tensor:
        """σ for each step, descending, then 0."""
        if num_inference_steps < 1:
            raise ValueError(f"steps must be >= 1, got {num_inference_steps}")
        T = self.num_train_timesteps
        sigma_min = shift_sigmas(1 / T, self.shift)
        sigmas = shift_sigmas(np.linspace(T, sigma_min * T, num_inference_steps) / T, self.shift)
        return torch.cat([torch.from_numpy(sigmas).float(), torch.zeros(1)])

    def model_time(self, sigma: torch.Tensor | float) -> float:
        return float(sigma) * self.num_train_timesteps

    def step(self, model_output: torch.Tensor, sigma: torch.Tensor | float, sigma_next: torch.Tensor | float,
             sample: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """x at σ_next = x + (σ_next − σ)·v̂ (deterministic: `generator` is unused)."""
        dt = torch.as_tensor(sigma_next, dtype=torch.float32) - torch.as_tensor(sigma, dtype=torch.float32)
        return (sample.float() + dt * model_output).to(model_output.dtype)
