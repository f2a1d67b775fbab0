"""Pixel vs latent diffusion on Fashion-MNIST: FID and class accuracy of class-conditional samples
from two trained runs, and the VAE's reconstruction and KL on the test split.

    python benchmarks/quality_latent_diffusion.py --runs runs/cmp/pixel runs/cmp/latent \
        --vae runs/cmp/vae --classifier runs/fid-classifier-fashion-mnist --n 1000 --steps 20

Each run draws n samples (n/10 per class) with guided DDIM and is scored with the FID classifier
(`diffusion/fid.py`) against the 10k test images; a latent run's samples are decoded by its VAE
first (`generate`'s own path: `latent.data_shape` and `latent.decoder`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tokenmind.diffusion.data import load_split, to_model_range
from tokenmind.diffusion.fid import class_accuracy, classifier_outputs, fid, load_classifier
from tokenmind.diffusion.latent import data_shape, decoder, find_vae
from tokenmind.diffusion.sampling import make_scheduler, sample
from tokenmind.diffusion.train import load_diffusion_model
from tokenmind.diffusion.vae import load_vae, vae_loss


@torch.no_grad()
def vae_test_metrics(vae_path: str, classifier, test: torch.Tensor, batch_size: int = 500) -> dict[str, float]:
    """Per test image: reconstruction (Σ squared error on [−1, 1]) and KL, as in training; and the
    FID of the reconstructions, the floor a latent model's samples cannot beat."""
    vae = load_vae(find_vae(vae_path))
    generator = torch.Generator().manual_seed(0)
    reconstruction = kl = 0.0
    for i in range(0, len(test), batch_size):
        r, k = vae_loss(vae, test[i:i + batch_size], generator)
        reconstruction, kl = reconstruction + r.item(), kl + k.item()
    decoded = torch.cat([vae.decode(vae.encode(test[i:i + batch_size]).mean) for i in range(0, len(test), batch_size)])
    return {"reconstruction": reconstruction / len(test), "kl": kl / len(test),
            "reconstruction_fid": fid(classifier, decoded.clamp(-1, 1), test),
            "scaling_factor": vae.cfg.scaling_factor}


def run_metrics(run: str, classifier, test: torch.Tensor, n: int, steps: int, guidance: float,
                batch_size: int) -> dict[str, float]:
    model, cfg = load_diffusion_model(run)
    shape = data_shape(cfg.data.dataset, cfg.data.pad_to, cfg.diffusion.latent_vae)
    decode = decoder(cfg.diffusion.latent_vae)
    labels = torch.arange(n) % 10
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    images = torch.cat([decode(sample(model, make_scheduler(cfg, "ddim"), (len(chunk), *shape), chunk, steps,
                                      guidance, generator, num_classes=10)).clamp(-1, 1)
                        for chunk in labels.split(batch_size)])
    seconds = time.perf_counter() - started
    return {"fid": fid(classifier, images, test), "class_accuracy": class_accuracy(classifier, images, labels),
            "sampling_s": seconds, "parameters": sum(p.numel() for p in model.parameters()),
            "latent_vae": cfg.diffusion.latent_vae}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="diffusion run folders to score")
    parser.add_argument("--vae", default=None, help="a train-vae run: also report its test reconstruction and KL")
    parser.add_argument("--classifier", required=True, help="the FID classifier folder (fid.save_classifier)")
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    classifier = load_classifier(args.classifier)
    test_images, test_labels = load_split("fashion-mnist", "test")
    test = to_model_range(test_images)
    accuracy = (classifier_outputs(classifier, test)[1] == test_labels).float().mean().item()
    result = {"classifier_test_accuracy": accuracy,
              "n": args.n, "steps": args.steps, "guidance": args.guidance}
    if args.vae:
        result["vae"] = vae_test_metrics(args.vae, classifier, test)
    for run in args.runs:
        result[run] = run_metrics(run, classifier, test, args.n, args.steps, args.guidance, args.batch_size)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
