"""Sample quality: the Fréchet distance between feature distributions (FID), and class accuracy.

FID (Heusel et al. 2017) embeds real and generated images with a trained classifier's penultimate
layer, fits a Gaussian to each set of features and measures the Fréchet (2-Wasserstein) distance
between the two Gaussians:

    FID = ‖μ₁ − μ₂‖² + Tr(Σ₁ + Σ₂ − 2·(Σ₁Σ₂)^½)

The first term compares where the samples lie, the second how they spread: a model that draws
one perfect image over and over has a good mean and a collapsed covariance, and pays for it.
The standard FID uses ImageNet's Inception-v3; that is a hub download, and its features know
nothing about 28×28 grayscale clothes, so the features here come from a small CNN tokenmind
trains on the Fashion-MNIST train split (`train_classifier`; report its test accuracy next to any
FID). Numbers are comparable only under the same classifier, and only for the same sample count
(the estimate is biased upward for small sets).

The same classifier answers "does 'sneaker' give sneakers?": `class_accuracy` on class-
conditional samples is the share the classifier assigns to the class they were asked for.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import scipy.linalg
import torch
import torch.nn.functional as F
from torch import nn

from .weights import read_weights_dir, save_weights_dir

CLASS_NAME = "TokenmindFeatureClassifier"


@dataclass
class ClassifierConfig:
    """in_channels, sample_size: the images (float, [−1, 1]). channels: widths of the two conv
    stages (each two 3×3 convolutions then a 2×2 max-pool). feature_dim: the penultimate layer,
    the FID features. num_classes: the labels."""

    in_channels: int = 1
    sample_size: int = 28
    channels: tuple[int, int] = (16, 32)
    feature_dim: int = 128
    num_classes: int = 10

    def __post_init__(self) -> None:
        self.channels = tuple(self.channels)
        if len(self.channels) != 2 or self.sample_size % 4:
            raise ValueError(f"the classifier has two conv stages (channels={self.channels}) that halve the image "
                             f"twice; sample_size {self.sample_size} must be a multiple of 4")


class FeatureClassifier(nn.Module):
    """(B, C, H, W) images in [−1, 1] → class logits; `features` gives the penultimate layer."""

    def __init__(self, cfg: ClassifierConfig):
        super().__init__()
        self.cfg = cfg
        a, b = cfg.channels

        def stage(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                    nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

        self.body = nn.Sequential(*stage(cfg.in_channels, a), *stage(a, b), nn.Flatten(),
                                  nn.Linear(b * (cfg.sample_size // 4) ** 2, cfg.feature_dim), nn.ReLU())
        self.dropout = nn.Dropout(0.3)
        self.head = nn.Linear(cfg.feature_dim, cfg.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if x.shape[1:] != (cfg.in_channels, cfg.sample_size, cfg.sample_size) or not x.is_floating_point():
            raise ValueError(f"the classifier takes float (B, {cfg.in_channels}, {cfg.sample_size}, {cfg.sample_size})"
                             f" images in [-1, 1], got {x.dtype} {tuple(x.shape)}")
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x)))


def train_classifier(images: torch.Tensor, labels: torch.Tensor, cfg: ClassifierConfig | None = None, *,
                     epochs: int = 2, batch_size: int = 128, lr: float = 2e-3, seed: int = 0) -> FeatureClassifier:
    """A classifier trained on `images` (float (N, C, H, W) in [−1, 1]) and int `labels` with AdamW
    and a cosine learning rate over `epochs` passes; returned in eval mode."""
    cfg = cfg or ClassifierConfig(in_channels=images.shape[1], sample_size=images.shape[-1])
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    torch.manual_seed(seed)
    model = FeatureClassifier(cfg)
    steps = epochs * (len(images) // batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.15)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(images), generator=generator)
        for i in range(len(images) // batch_size):
            rows = order[i * batch_size:(i + 1) * batch_size]
            loss = F.cross_entropy(model(images[rows]), labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    return model.eval()


@torch.no_grad()
def classifier_outputs(model: FeatureClassifier, images: torch.Tensor,
                       batch_size: int = 500) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (N, feature_dim), predicted class (N,)) of `images`, in eval mode and batches."""
    model.eval()
    features, predicted = [], []
    for i in range(0, len(images), batch_size):
        f = model.features(images[i:i + batch_size])
        features.append(f)
        predicted.append(model.head(f).argmax(dim=1))
    return torch.cat(features), torch.cat(predicted)


def class_accuracy(model: FeatureClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    """The share of `images` the classifier assigns to their `labels` (for samples: the class asked for)."""
    return (classifier_outputs(model, images)[1] == labels.to(torch.long)).float().mean().item()


def gaussian_stats(features: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean (D,), covariance (D, D)) of (N, D) features, in float64."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise ValueError(f"need (N >= 2, D) features for a mean and covariance, got shape {x.shape}")
    return x.mean(axis=0), np.cov(x, rowvar=False)


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """‖μ₁ − μ₂‖² + Tr(Σ₁ + Σ₂ − 2·(Σ₁Σ₂)^½), the matrix square root by `scipy.linalg.sqrtm`.

    Σ₁Σ₂ is not symmetric, and with few samples or rank-deficient features sqrtm can return tiny
    imaginary parts or fail; then the covariances get a small ridge (1e-6·I), as the reference FID
    code does. Imaginary parts that remain are rounding noise and dropped; large ones are an error."""
    diff = mu1 - mu2
    with warnings.catch_warnings():  # "Matrix is singular": rank-deficient features; the checks below decide
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        covmean = scipy.linalg.sqrtm(sigma1 @ sigma2)
        if not np.isfinite(covmean).all():
            ridge = np.eye(len(sigma1)) * 1e-6
            covmean = scipy.linalg.sqrtm((sigma1 + ridge) @ (sigma2 + ridge))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"the covariance product's square root has imaginary parts up to "
                             f"{np.abs(covmean.imag).max():.3g}; use more samples than feature dimensions")
        covmean = covmean.real
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def fid(model: FeatureClassifier, images_a: torch.Tensor, images_b: torch.Tensor) -> float:
    """FID between two image sets under `model`'s features (e.g. 10k samples vs the test split)."""
    stats_a = gaussian_stats(classifier_outputs(model, images_a)[0].numpy())
    stats_b = gaussian_stats(classifier_outputs(model, images_b)[0].numpy())
    return frechet_distance(*stats_a, *stats_b)


def save_classifier(model: FeatureClassifier, path: str | Path) -> Path:
    """config.json (the `ClassifierConfig`) + weights (BatchNorm statistics included), atomically."""
    return save_weights_dir(path, CLASS_NAME, asdict(model.cfg), model.state_dict())


def load_classifier(path: str | Path) -> FeatureClassifier:
    config, state = read_weights_dir(path, CLASS_NAME)
    model = FeatureClassifier(ClassifierConfig(**config))
    model.load_state_dict(state)
    return model.eval()
