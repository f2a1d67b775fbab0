"""Progressive distillation (Salimans & Ho 2022): a student that takes ONE deterministic DDIM step
where its teacher takes two, halving the sampling steps per round (8 → 4 → 2 → 1).

For a student step t → t'' on its grid, the teacher steps t → t' → t'' (t' the midpoint of the
teacher's own grid, twice as fine) from x_t = √ᾱ_t·x₀ + σ_t·ε, σ = √(1−ᾱ). A DDIM step is
x_{t''} = √ᾱ_{t''}·x̂₀ + σ_{t''}·(x_t − √ᾱ_t·x̂₀)/σ_t, so the x̂₀ that lands the student where the two
teacher steps land is

    x̃₀ = (x_{t''} − (σ_{t''}/σ_t)·x_t) / (√ᾱ_{t''} − (σ_{t''}/σ_t)·√ᾱ_t),

turned into the student's prediction type (ε̃ = (x_t − √ᾱ_t·x̃₀)/σ_t) and regressed with the usual
MSE. The student starts as a copy of the teacher. v-prediction is the parametrization that works:
an ε-model cannot give x̂₀ at the pure-noise end (√ᾱ ≈ 0), where a 1-step sampler starts.
A guided teacher (guidance_scale ≠ 1) is distilled into a student that samples guided in one
forward per step (Meng et al. 2023's first stage, folded into the first round).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from tokenmind.train.objectives import autocast

from .config import DiffusionConfig
from .data import ImageBatch, class_names
from .objectives import _ImageObjective, regression_loss
from .sampling import guided_output, make_scheduler
from .schedules import DDIMScheduler, NoiseSchedule
from .train import load_diffusion_model, train_diffusion


def student_target(schedule: NoiseSchedule, prediction_type: str, x_t: torch.Tensor, t: torch.Tensor,
                   x_end: torch.Tensor, t_end: torch.Tensor) -> torch.Tensor:
    """What a `prediction_type` model at (x_t, t) must output so that one deterministic DDIM step
    to t_end lands on x_end (per image; t, t_end (B,), t_end = −1 for the clean end)."""
    def coefficients(steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = schedule.alpha_bar(steps).to(x_t.device, x_t.dtype).reshape(-1, *[1] * (x_t.dim() - 1))
        return a.sqrt(), (1 - a).sqrt()

    sqrt_a, sigma = coefficients(t)
    sqrt_a_end, sigma_end = coefficients(t_end)
    ratio = sigma_end / sigma
    x0 = (x_end - ratio * x_t) / (sqrt_a_end - ratio * sqrt_a)
    eps = (x_t - sqrt_a * x0) / sigma
    return schedule.target(prediction_type, x0, eps, t)


class ProgressiveDistillationObjective(_ImageObjective):
    """The student's loss for one round; teacher_grid: the teacher's DDIM points (descending, ending
    at −1), of which the student's grid is every other one. The teacher runs under `precision`."""

    def __init__(self, teacher: nn.Module, scheduler: DDIMScheduler, teacher_grid: torch.Tensor, *, num_classes: int,
                 guidance_scale: float = 1.0, precision: str = "fp32",
                 loss_fn=regression_loss) -> None:
        if scheduler.eta != 0:
            raise ValueError(f"progressive distillation follows deterministic DDIM (eta=0), got eta={scheduler.eta}")
        if len(teacher_grid) < 3 or (len(teacher_grid) - 1) % 2:
            raise ValueError(f"the teacher grid needs an even number (>= 2) of steps to halve, got "
                             f"{len(teacher_grid) - 1}")
        super().__init__(num_classes, 0.0, loss_fn)  # the student is conditional; guidance lives in the teacher
        self.teacher, self.scheduler, self.grid = teacher.eval().requires_grad_(False), scheduler, teacher_grid
        self.guidance_scale, self.precision = guidance_scale, precision

    @torch.no_grad()
    def _teacher_step(self, x: torch.Tensor, t: int, t_next: int, labels: torch.Tensor) -> torch.Tensor:
        model_t = torch.full((len(x),), float(t), device=x.device)
        with autocast(x.device, self.precision):
            out = guided_output(self.teacher, x, model_t, labels, self.guidance_scale, self.num_classes)
        return self.scheduler.step(out.float(), t, t_next, x)

    def inputs(self, batch: ImageBatch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x0, schedule = batch.images, self.scheduler.schedule
        student_steps = (len(self.grid) - 1) // 2
        index = torch.randint(0, student_steps, (len(x0),), generator=generator, device=x0.device)
        grid = self.grid.to(x0.device)
        t, t_end = grid[2 * index], grid[2 * index + 2]
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        x_t = schedule.add_noise(x0, noise, t)
        x_end = torch.empty_like(x_t)
        for i in index.unique().tolist():  # the scheduler steps one time pair at a time
            rows = index == i
            a, b, c = (int(self.grid[2 * i + k]) for k in range(3))
            x_end[rows] = self._teacher_step(self._teacher_step(x_t[rows], a, b, batch.labels[rows]), b, c,
                                             batch.labels[rows])
        return x_t, t.float(), student_target(schedule, self.scheduler.prediction_type, x_t, t, x_end, t_end)

    def compiled(self) -> ProgressiveDistillationObjective:
        return ProgressiveDistillationObjective(self.teacher, self.scheduler, self.grid, num_classes=self.num_classes,
                                                guidance_scale=self.guidance_scale, precision=self.precision,
                                                loss_fn=torch.compile(regression_loss))


def progressive_distillation(teacher_dir: str | Path, out_dir: str | Path, *, start_steps: int = 8, rounds: int = 3,
                             steps_per_round: int = 200, lr: float = 1e-4, guidance_scale: float = 1.0,
                             batch_size: int | None = None) -> list[dict]:
    """Distil the DDPM-objective model in `teacher_dir` from `start_steps` DDIM steps down to
    start_steps / 2**rounds, one trainer run per round (`out_dir/steps_<n>/`, resumable). Returns
    [{"steps": n, "path": ...}] per round. The first round's teacher samples with guidance_scale;
    its students sample with guidance 1 (the guidance is distilled in)."""
    if start_steps % 2**rounds:
        raise ValueError(f"start_steps={start_steps} cannot be halved {rounds} times; use a multiple of {2**rounds}")
    teacher, cfg = load_diffusion_model(teacher_dir)
    if cfg.diffusion.objective != "ddpm":
        raise ValueError("progressive distillation follows DDIM steps; the teacher must have diffusion.objective=ddpm")
    scheduler = make_scheduler(cfg, "ddim")
    num_classes = len(class_names(cfg.data.dataset))
    rounds_done, steps, guidance = [], start_steps, guidance_scale
    for _ in range(rounds):
        grid = scheduler.timesteps(steps)
        if not torch.equal(grid[::2], scheduler.timesteps(steps // 2)):
            raise ValueError(f"the {steps // 2}-step DDIM grid is not every other point of the {steps}-step one "
                             f"(num_train_timesteps={cfg.diffusion.num_train_timesteps}); choose a number of "
                             f"training steps divisible by {steps}")
        round_dir = Path(out_dir) / f"steps_{steps // 2}"
        round_cfg = student_config(cfg, round_dir, steps_per_round, lr, batch_size)
        objective = ProgressiveDistillationObjective(teacher, scheduler, grid, num_classes=num_classes,
                                                     guidance_scale=guidance, precision=cfg.train.precision)
        student = copy.deepcopy(teacher).train().requires_grad_(True)
        train_diffusion(round_cfg, model_factory=lambda _cfg, s=student: s, objective=objective)
        teacher, _ = load_diffusion_model(round_dir)
        steps, guidance = steps // 2, 1.0
        rounds_done.append({"steps": steps, "path": str(round_dir)})
    return rounds_done


def student_config(cfg: DiffusionConfig, out_dir: Path, steps: int, lr: float,
                   batch_size: int | None) -> DiffusionConfig:
    """The teacher's run config, retargeted to a short distillation run (no warm-up, one validation batch)."""
    return replace(cfg, train=replace(cfg.train, steps=steps, out_dir=str(out_dir), eval_every=0, eval_batches=1,
                                            checkpoint_every=0),
                   optim=replace(cfg.optim, lr=lr), schedule=replace(cfg.schedule, warmup_steps=0),
                   data=replace(cfg.data, batch_size=batch_size or cfg.data.batch_size))

