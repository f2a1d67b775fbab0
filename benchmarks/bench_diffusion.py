"""DiT training steps/s and sampling images/s: tokenmind vs diffusers on the same weights, in one process.

Both sides run the same DiT (tokenmind's `DiT` of the shipped config `diffusion_fashion.yaml`,
its weights copied into diffusers' `DiTTransformer2DModel` with `dit_to_diffusers`), the same
batch of 28×28 images, the same step counts and AdamW hyperparameters.

* training, tokenmind: the real `DiffusionTrainer.train_step` (`DenoisingObjective`: ε-MSE at
  uniform timesteps, 10% label dropout; gradient clipping, AdamW, LR schedule) at
  `train.precision=auto` (bf16 autocast on CUDA and AMX CPUs, fp32 on other CPUs, where bf16 is the
  slower), `train.compile` as `--compile` says. diffusers: the loop its training examples write —
  `DDPMScheduler.add_noise`, `transformer(x_t, t, labels).sample`, MSE, backward, clip,
  `torch.optim.AdamW` — in fp32 (the diffusers default; `--reference-bf16` runs it under the
  same bf16 autocast, for the like-for-like number).
* sampling, tokenmind: `sampling.sample` with DDIM, classifier-free guidance in ONE forward of
  2B rows, precision auto; with `--compile` the DiT goes through `compile_for_sampling` (inductor,
  weights frozen into the graph). diffusers: `DiTPipeline.__call__`'s loop without its VAE (this DiT is
  in pixel space): it too batches CFG in one forward of 2B rows, but keeps the latents
  duplicated (2B) and runs `DDIMScheduler.step` on all of them; in fp32 (the pipeline's dtype).

Sides alternate over `--repeats` (order flipped every repeat) so machine noise hits both;
medians are reported.

    python benchmarks/bench_diffusion.py [--batch 32] [--sample-batch 32] [--steps 20] [--compile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import emit, machine_info, timed
from tokenmind.diffusion.config import load_config
from tokenmind.diffusion.data import ImageLoader
from tokenmind.diffusion.dit import dit_config_to_diffusers, dit_to_diffusers
from tokenmind.diffusion.sampling import compile_for_sampling, make_scheduler, sample
from tokenmind.diffusion.train import DiffusionTrainer, build_model, build_objective
from tokenmind.train.distributed import init_distributed
from tokenmind.train.objectives import autocast

TARGET_SPEEDUP = 1.5
CONFIG = Path(__file__).resolve().parent.parent / "src/tokenmind/configs/diffusion_fashion.yaml"


def random_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (n, 28, 28) images and labels 0..9 (speed does not depend on the pixels)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g), torch.randint(0, 10, (n,), generator=g)


def reference_train_step(model, optimizer, scheduler, loader, precision: str, grad_clip: float) -> float:
    batch = next(loader)
    g = torch.Generator().manual_seed(batch.noise_seed)
    x0, labels = batch.images, batch.labels
    t = torch.randint(0, scheduler.config.num_train_timesteps, (len(x0),), generator=g)
    noise = torch.randn(x0.shape, generator=g)
    labels = labels.masked_fill(torch.rand(len(labels), generator=g) < 0.1, 10)
    with autocast(x0.device, precision):
        pred = model(scheduler.add_noise(x0, noise, t), timestep=t, class_labels=labels).sample
    loss = torch.nn.functional.mse_loss(pred.float(), noise)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


@torch.no_grad()
def reference_sample(model, scheduler, n: int, steps: int, guidance: float, seed: int, precision: str) -> torch.Tensor:
    """`DiTPipeline.__call__`'s denoising loop (diffusers 0.42), minus the VAE decode."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn((n, 1, 28, 28), generator=g)
    labels = torch.full((n,), 7)
    latent_model_input = torch.cat([latents] * 2)
    class_labels = torch.cat([labels, torch.full((n,), 10)])
    scheduler.set_timesteps(steps)
    for t in scheduler.timesteps:
        half = latent_model_input[: len(latent_model_input) // 2]
        latent_model_input = torch.cat([half, half], dim=0)
        timesteps = t.expand(latent_model_input.shape[0])
        with autocast(latents.device, precision):
            noise_pred = model(latent_model_input, timestep=timesteps, class_labels=class_labels).sample.float()
        cond_eps, uncond_eps = torch.split(noise_pred, len(noise_pred) // 2, dim=0)
        half_eps = uncond_eps + guidance * (cond_eps - uncond_eps)
        noise_pred = torch.cat([half_eps, half_eps], dim=0)
        latent_model_input = scheduler.step(noise_pred, t, latent_model_input).prev_sample
    return latent_model_input.chunk(2)[0]


def run(args: argparse.Namespace) -> dict:
    import diffusers

    load_start = os.getloadavg()
    started = time.perf_counter()
    overrides = [f"data.batch_size={args.batch}", "train.precision=auto", f"train.compile={args.compile}",
                 "schedule.warmup_steps=0", f"train.steps={args.warmup + args.train_steps * args.repeats + 1}",
                 "train.eval_every=0", "train.checkpoint_every=0"]
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = load_config(CONFIG, [*overrides, f"train.out_dir={out_dir}"])
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg)
        images, labels = random_images(args.batch * 8, seed=0)
        trainer = DiffusionTrainer(cfg, init_distributed("none", "cpu"), model,
                                   ImageLoader(images, labels, args.batch, seed=1), objective=build_objective(cfg))
        reference = diffusers.DiTTransformer2DModel(**dit_config_to_diffusers(model.cfg))
        reference.load_state_dict(dit_to_diffusers(model))  # the same initial weights
        reference.train()
        d, o = cfg.diffusion, cfg.optim
        ref_noise = diffusers.DDPMScheduler(num_train_timesteps=d.num_train_timesteps, beta_schedule=d.beta_schedule)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                    weight_decay=o.weight_decay)
        ref_loader = ImageLoader(images, labels, args.batch, seed=1)
        ref_precision = "bf16" if args.reference_bf16 else "fp32"
        losses = {"tokenmind": [], "diffusers": []}
        train = {"tokenmind": lambda: losses["tokenmind"].append(trainer.train_step()["loss"]),
                 "diffusers": lambda: losses["diffusers"].append(
                     reference_train_step(reference, ref_opt, ref_noise, ref_loader, ref_precision, o.grad_clip))}
        train_s = alternate(train, args.warmup, args.train_steps, args.repeats)

        model.eval()
        reference.eval()
        ddim = make_scheduler(cfg, "ddim")
        ref_ddim = diffusers.DDIMScheduler(num_train_timesteps=d.num_train_timesteps, beta_schedule=d.beta_schedule,
                                           clip_sample=d.clip_sample, timestep_spacing=d.timestep_spacing,
                                           set_alpha_to_one=False)
        n = args.sample_batch
        sampler_model = compile_for_sampling(model) if args.compile else model
        draw = {"tokenmind": lambda: sample(sampler_model, ddim, (n, 1, 28, 28), torch.full((n,), 7), args.steps,
                                            args.guidance, torch.Generator().manual_seed(0), num_classes=10,
                                            precision=cfg.train.precision),
                "diffusers": lambda: reference_sample(reference, ref_ddim, n, args.steps, args.guidance, 0,
                                                      ref_precision)}
        sample_s = alternate(draw, 1, 1, args.repeats)

    def side(name: str) -> dict:
        steps_per_s = [args.train_steps / s for s in train_s[name]]
        images_per_s = [n / s for s in sample_s[name]]
        return {"train_steps_per_s": round(statistics.median(steps_per_s), 3),
                "train_steps_per_s_repeats": [round(x, 3) for x in steps_per_s],
                "sample_images_per_s": round(statistics.median(images_per_s), 3),
                "sample_images_per_s_repeats": [round(x, 3) for x in images_per_s],
                "loss_first": round(losses[name][0], 4), "loss_last": round(losses[name][-1], 4)}

    sides = {name: side(name) for name in ("tokenmind", "diffusers")}
    sides["tokenmind"]["runs"] = (f"DiffusionTrainer.train_step ({cfg.train.precision}, compile={args.compile}); "
                                  f"sampling.sample DDIM, CFG in one 2B forward, {cfg.train.precision}"
                                  + (", compile_for_sampling" if args.compile else ""))
    sides["diffusers"]["runs"] = (f"diffusers {diffusers.__version__} DiTTransformer2DModel, {ref_precision}; "
                                  "training: add_noise + MSE + torch AdamW; sampling: DiTPipeline's loop (CFG in one "
                                  "2B forward, DDIMScheduler.step on 2B latents)")
    t, r = sides["tokenmind"], sides["diffusers"]
    return {
        "benchmark": "diffusion",
        "config": {"model": "DiT of diffusion_fashion.yaml (28x28, patch 4, 192 wide, 6 blocks, 3 heads)",
                   "parameters": sum(p.numel() for p in model.parameters()), "train_batch": args.batch,
                   "sample_batch": n, "sampling_steps": args.steps, "guidance_scale": args.guidance,
                   "train_steps_per_repeat": args.train_steps, "repeats": args.repeats, "compile": args.compile,
                   "precision": cfg.train.precision, "reference_precision": ref_precision},
        "tokenmind": t, "diffusers": r,
        "train_speedup": round(t["train_steps_per_s"] / r["train_steps_per_s"], 3),
        "sample_speedup": round(t["sample_images_per_s"] / r["sample_images_per_s"], 3),
        "target_speedup": TARGET_SPEEDUP,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "machine": machine_info(loadavg_start=[round(x, 2) for x in load_start],
                                loadavg_end=[round(x, 2) for x in os.getloadavg()],
                                note="shared, busy 2-core machine; both sides timed side by side in one run"),
    }


def alternate(work: dict, warmup: int, count: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of `count` calls per side and repeat, after `warmup` calls each; order flips every repeat."""
    for fn in work.values():
        for _ in range(warmup):
            fn()
    seconds: dict[str, list[float]] = {name: [] for name in work}
    for r in range(repeats):
        for name in (list(work) if r % 2 == 0 else list(reversed(work))):
            seconds[name].append(timed(lambda: [work[name]() for _ in range(count)]))
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32, help="training images per step")
    p.add_argument("--sample-batch", type=int, default=32, help="images sampled together")
    p.add_argument("--steps", type=int, default=20, help="sampling steps")
    p.add_argument("--guidance", type=float, default=4.0)
    p.add_argument("--train-steps", type=int, default=5, help="training steps per timed repeat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="train.compile=true and a compiled sampler for tokenmind")
    p.add_argument("--reference-bf16", action="store_true", help="run diffusers under the same bf16 autocast")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/bench_diffusion.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
