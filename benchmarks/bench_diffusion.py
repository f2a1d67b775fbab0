"""DiT training steps/s and sampling images/s: tokenmind vs diffusers on the same weights, each in its own process.

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

Each repeat runs each side in a fresh child process (warm-up and compilation, then the timed
training steps and one timed sampling run), the order flipped every repeat so machine noise hits
both; medians are reported. Separate processes because of one more difference between the sides:
`import tokenmind` makes MKL run its Intel kernels on AMD CPUs (`model/cpu.py:take_mkl_intel_kernels`,
~1.2-1.3x faster fp32 matmuls there; nothing changes on Intel CPUs), which a diffusers user does not
get, so the diffusers child runs with `TOKENMIND_MKL_INTEL_PATH=0`; `--peer-mkl-intel` gives it the
same kernels, for the ratio with equal matmuls.

    python benchmarks/bench_diffusion.py [--batch 32] [--sample-batch 32] [--steps 20] [--compile] [--peer-mkl-intel]
"""

from __future__ import annotations

import tokenmind  # noqa: F401  (first, before torch: on AMD CPUs it picks MKL's fast kernels, see the docstring)

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import child_env, emit, machine_info, timed, timed_call
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


def measure_side(args: argparse.Namespace) -> dict:
    """One side in this process: `warmup` training steps (compiling, if asked), `train_steps` timed ones, then
    one warm-up and one timed sampling run; the seconds, losses and which MKL kernels this process runs."""
    import diffusers

    from tokenmind.model.cpu import mkl_intel_kernels_taken

    torch.set_num_threads(args.threads)
    overrides = [f"data.batch_size={args.batch}", "train.precision=auto", f"train.compile={args.compile}",
                 "schedule.warmup_steps=0", f"train.steps={args.warmup + args.train_steps + 1}",
                 "train.eval_every=0", "train.checkpoint_every=0"]
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = load_config(CONFIG, [*overrides, f"train.out_dir={out_dir}"])
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg)
        images, labels = random_images(args.batch * 8, seed=0)
        loader = ImageLoader(images, labels, args.batch, seed=1)
        d, o = cfg.diffusion, cfg.optim
        n = args.sample_batch
        if args.side == "tokenmind":
            trainer = DiffusionTrainer(cfg, init_distributed("none", "cpu"), model, loader,
                                       objective=build_objective(cfg))
            train_step = lambda: trainer.train_step()["loss"]  # noqa: E731
        else:
            reference = diffusers.DiTTransformer2DModel(**dit_config_to_diffusers(model.cfg))
            reference.load_state_dict(dit_to_diffusers(model))  # the same initial weights
            reference.train()
            ref_noise = diffusers.DDPMScheduler(num_train_timesteps=d.num_train_timesteps,
                                                beta_schedule=d.beta_schedule)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                        weight_decay=o.weight_decay)
            precision = "bf16" if args.reference_bf16 else "fp32"
            train_step = lambda: reference_train_step(reference, ref_opt, ref_noise, loader, precision,  # noqa: E731
                                                      o.grad_clip)
        losses = [train_step() for _ in range(args.warmup)]
        train_s, timed_losses = timed_call(lambda: [train_step() for _ in range(args.train_steps)])
        losses += timed_losses

        if args.side == "tokenmind":
            model.eval()
            ddim = make_scheduler(cfg, "ddim")
            sampler_model = compile_for_sampling(model) if args.compile else model
            draw = lambda: sample(sampler_model, ddim, (n, 1, 28, 28), torch.full((n,), 7), args.steps,  # noqa: E731
                                  args.guidance, torch.Generator().manual_seed(0), num_classes=10,
                                  precision=cfg.train.precision)
            runs = (f"DiffusionTrainer.train_step ({cfg.train.precision}, compile={args.compile}); "
                    f"sampling.sample DDIM, CFG in one 2B forward, {cfg.train.precision}"
                    + (", compile_for_sampling" if args.compile else ""))
        else:
            reference.eval()
            ref_ddim = diffusers.DDIMScheduler(num_train_timesteps=d.num_train_timesteps,
                                               beta_schedule=d.beta_schedule, clip_sample=d.clip_sample,
                                               timestep_spacing=d.timestep_spacing, set_alpha_to_one=False)
            draw = lambda: reference_sample(reference, ref_ddim, n, args.steps, args.guidance, 0,  # noqa: E731
                                            precision)
            runs = (f"diffusers {diffusers.__version__} DiTTransformer2DModel, {precision}; training: add_noise + MSE "
                    "+ torch AdamW; sampling: DiTPipeline's loop (CFG in one 2B forward, DDIMScheduler.step on 2B "
                    "latents)")
        draw()
        sample_s = timed(draw)
    return {"train_s": train_s, "sample_s": sample_s, "losses": losses, "runs": runs,
            "precision": cfg.train.precision, "parameters": sum(p.numel() for p in model.parameters()),
            "mkl_intel_kernels": mkl_intel_kernels_taken()}


def run(args: argparse.Namespace) -> dict:
    load_start = os.getloadavg()
    started = time.perf_counter()
    sides: dict[str, list[dict]] = {"tokenmind": [], "diffusers": []}
    for r in range(args.repeats):
        for name in (("tokenmind", "diffusers") if r % 2 == 0 else ("diffusers", "tokenmind")):
            out = subprocess.run([sys.executable, __file__, *side_arguments(args), "--side", name],
                                 env=child_env(peer=name != "tokenmind" and not args.peer_mkl_intel), capture_output=True,
                                 text=True)
            if out.returncode:
                raise SystemExit(f"the {name} side failed:\n{out.stderr[-3000:]}")
            sides[name].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def summary(name: str) -> dict:
        runs = sides[name]
        steps_per_s = [args.train_steps / x["train_s"] for x in runs]
        images_per_s = [args.sample_batch / x["sample_s"] for x in runs]
        return {"train_steps_per_s": round(statistics.median(steps_per_s), 3),
                "train_steps_per_s_repeats": [round(x, 3) for x in steps_per_s],
                "sample_images_per_s": round(statistics.median(images_per_s), 3),
                "sample_images_per_s_repeats": [round(x, 3) for x in images_per_s],
                "loss_first": round(runs[0]["losses"][0], 4), "loss_last": round(runs[0]["losses"][-1], 4),
                "mkl_intel_kernels": runs[0]["mkl_intel_kernels"], "runs": runs[0]["runs"]}

    t, r = summary("tokenmind"), summary("diffusers")
    return {
        "benchmark": "diffusion",
        "config": {"model": "DiT of diffusion_fashion.yaml (28x28, patch 4, 192 wide, 6 blocks, 3 heads)",
                   "parameters": sides["tokenmind"][0]["parameters"], "train_batch": args.batch,
                   "sample_batch": args.sample_batch, "sampling_steps": args.steps, "guidance_scale": args.guidance,
                   "train_steps_per_repeat": args.train_steps, "repeats": args.repeats, "compile": args.compile,
                   "precision": sides["tokenmind"][0]["precision"],
                   "reference_precision": "bf16" if args.reference_bf16 else "fp32",
                   "peer_mkl": "tokenmind's Intel-kernel choice too" if args.peer_mkl_intel else "stock (as its users "
                               "run it)"},
        "tokenmind": t, "diffusers": r,
        "train_speedup": round(t["train_steps_per_s"] / r["train_steps_per_s"], 3),
        "sample_speedup": round(t["sample_images_per_s"] / r["sample_images_per_s"], 3),
        "target_speedup": TARGET_SPEEDUP,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "machine": machine_info(loadavg_start=[round(x, 2) for x in load_start],
                                loadavg_end=[round(x, 2) for x in os.getloadavg()],
                                note="each side in a fresh process per repeat, alternating"),
    }


def side_arguments(args: argparse.Namespace) -> list[str]:
    """The command-line arguments a side's child process repeats from the parent's."""
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}"
             for name in ("batch", "sample_batch", "steps", "guidance", "train_steps", "warmup", "threads")]
    return flags + ["--compile"] * args.compile + ["--reference-bf16"] * args.reference_bf16


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
    p.add_argument("--peer-mkl-intel", action="store_true",
                   help="give diffusers tokenmind's MKL kernel choice too (AMD CPUs; the like-for-like-kernels ratio)")
    p.add_argument("--side", choices=["tokenmind", "diffusers"], help=argparse.SUPPRESS)
    p.add_argument("--out", default="benchmarks/results/bench_diffusion.json")
    args = p.parse_args()
    if args.side:
        print(json.dumps(measure_side(args)))
        return
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
