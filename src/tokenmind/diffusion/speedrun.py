"""`tokenmind diffusion speedrun`: Fashion-MNIST to a measured class-conditional image model in one
command, ending in `report.md` with sample grids and FID curves.

fetch the data → train (or reuse the cached) FID classifier and state its test accuracy → train the
DDPM-objective model → [train the flow-matching model at the same model, batch and steps] →
progressive distillation to few steps → headline FID and class accuracy → FID vs sampling steps
(DDPM, DDIM, flow Euler, distilled) and vs guidance scale → sample grids → report. Each stage is a
library call of its own module; `tokenmind.progress.Stages` records finished stages in
`stages.json`, so a re-run resumes (training stages also resume from their checkpoints).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from torch import nn

from tokenmind.config import Overrides, load_config, save_resolved
from tokenmind.data.fetch import default_cache_dir
from tokenmind.jsonl import atomic_open
from tokenmind.progress import Stages

from .config import DiffusionConfig
from .data import IMAGE_SIZES, class_names, load_split, to_model_range
from .distill import progressive_distillation
from .fid import FeatureClassifier, class_accuracy, fid, load_classifier, save_classifier, train_classifier
from .sampling import make_scheduler, sample, save_grid
from .train import load_diffusion_model, train_diffusion

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class DiffusionSpeedrunConfig:
    """A named diffusion speedrun.

    model: the DDPM-objective run (`DiffusionConfig`; its out_dir is set to out_dir/ddpm).
    compare_flow: also train model with diffusion.objective=flow, same network, batch and steps.
    classifier_epochs/classifier_dir: the FID classifier's training, and where it is cached ("" = the
        data cache's models/ folder, shared by every run with the same data set and epochs).
    fid_samples: samples for the headline FID and class accuracy (the issue: 10k). curve_samples:
        samples per point of the curves. sampler/sample_steps/guidance: the headline sampling.
    steps_grid/guidance_grid: the curves' x values. distill_*: progressive distillation from
        distill_start_steps DDIM steps, halved distill_rounds times, distill_steps optimizer steps of
        distill_batch_size images each.
    threads: torch.set_num_threads (0 = torch's default).
    """

    name: str = "cpu-diffusion"
    description: str = ""
    out_dir: str = "runs/diffusion-speedrun"
    threads: int = 0
    seed: int = 0
    model: DiffusionConfig = field(default_factory=DiffusionConfig)
    compare_flow: bool = True
    classifier_epochs: int = 2
    classifier_dir: str = ""
    fid_samples: int = 10_000
    curve_samples: int = 1_000
    sampler: str = "ddim"
    sample_steps: int = 8
    guidance: float = 2.0
    steps_grid: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    guidance_grid: list[float] = field(default_factory=lambda: [1.0, 1.5, 2.0, 3.0, 4.0])
    distill_start_steps: int = 8
    distill_rounds: int = 3
    distill_steps: int = 200
    distill_lr: float = 1e-4
    distill_batch_size: int = 0  # 0 = the model's batch size
    grid_per_class: int = 10

    def __post_init__(self) -> None:
        if self.model.diffusion.objective != "ddpm":
            raise ValueError("model.diffusion.objective must be ddpm (DDPM/DDIM curves, distillation); the flow "
                             "model is trained beside it with compare_flow: true")
        if self.sampler not in ("ddpm", "ddim"):
            raise ValueError(f"sampler={self.sampler!r} must be ddpm or ddim (the headline model is DDPM-objective)")
        for name in ("fid_samples", "curve_samples"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 (FID needs a covariance), got {getattr(self, name)}")


def load_speedrun_config(name_or_path: str = "cpu-diffusion", overrides: Overrides = ()) -> DiffusionSpeedrunConfig:
    """A packaged config by name (`cpu-diffusion` → configs/diffusion_speedrun_cpu.yaml) or a YAML
    path, then `key=value` overrides such as `model.train.steps=10`."""
    path = Path(name_or_path)
    if not path.exists():
        path = CONFIG_DIR / f"diffusion_speedrun_{name_or_path.removesuffix('-diffusion').replace('-', '_')}.yaml"
        if not path.exists():
            known = sorted(p.stem.removeprefix("diffusion_speedrun_") + "-diffusion"
                           for p in CONFIG_DIR.glob("diffusion_speedrun_*.yaml"))
            raise FileNotFoundError(f"no diffusion speedrun config {name_or_path!r}: not a file, and not one of "
                                    f"{', '.join(known)}")
    return load_config(DiffusionSpeedrunConfig, path, overrides)


def real_images(dataset: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A split as float (N, 1, H, W) in [−1, 1] at the data set's own size (what the classifier sees)."""
    images, labels = load_split(dataset, split)
    return to_model_range(images), labels


def unpad(images: torch.Tensor, size: int) -> torch.Tensor:
    """The centre size × size crop: generated images padded for the model, back at the classifier's size."""
    p = (images.shape[-1] - size) // 2
    return images[..., p:p + size, p:p + size]


def ensure_classifier(cfg: DiffusionSpeedrunConfig) -> dict[str, Any]:
    """The cached FID classifier, trained on the train split first if there is none; its test accuracy."""
    dataset = cfg.model.data.dataset
    cached = default_cache_dir() / "models" / f"fid-classifier-{dataset}-e{cfg.classifier_epochs}"
    path = Path(cfg.classifier_dir or cached)
    trained = not (path / "config.json").is_file()
    if trained:
        images, labels = real_images(dataset, "train")
        save_classifier(train_classifier(images, labels, epochs=cfg.classifier_epochs, seed=cfg.seed), path)
    test_images, test_labels = real_images(dataset, "test")
    return {"path": str(path), "trained_now": trained,
            "test_accuracy": class_accuracy(load_classifier(path), test_images, test_labels)}


def generate_samples(model: nn.Module, cfg: DiffusionConfig, sampler: str, steps: int, guidance: float, n: int,
                     seed: int, batch_size: int = 250) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples (labels cycling over the classes) in batches, at the data set's own size, in [−1, 1]."""
    num_classes = len(class_names(cfg.data.dataset))
    labels = torch.arange(n) % num_classes
    scheduler = make_scheduler(cfg, sampler)
    generator = torch.Generator().manual_seed(seed)
    size = IMAGE_SIZES[cfg.data.dataset]
    shape = (1, cfg.data.pad_to or size, cfg.data.pad_to or size)
    out = [sample(model, scheduler, (len(rows), *shape), rows, steps, guidance, generator, num_classes=num_classes,
                  precision=cfg.train.precision) for rows in labels.split(batch_size)]
    return unpad(torch.cat(out).clamp(-1, 1), size), labels


def measure(classifier: FeatureClassifier, reference: torch.Tensor, model: nn.Module, cfg: DiffusionConfig,
            sampler: str, steps: int, guidance: float, n: int, seed: int) -> dict[str, Any]:
    """FID against `reference` and the classifier's accuracy on the asked-for classes, for n samples."""
    t0 = time.perf_counter()
    images, labels = generate_samples(model, cfg, sampler, steps, guidance, n, seed)
    return {"sampler": sampler, "steps": steps, "guidance": guidance, "n": n,
            "fid": fid(classifier, images, reference), "class_accuracy": class_accuracy(classifier, images, labels),
            "sampling_s": round(time.perf_counter() - t0, 1)}


def plot_curves(series: dict[str, list[tuple[float, float]]], xlabel: str, png_path: str | Path,
                log_x: bool = False) -> Path:
    """FID (y) against `xlabel` for each named series of (x, fid) points, one PNG written atomically."""
    figure = Figure(figsize=(6.5, 4), layout="tight")  # no pyplot: no global figure state
    axes = figure.add_subplot()
    for name, points in series.items():
        if points:
            axes.plot(*zip(*sorted(points)), "o-", label=name, markersize=4)
    if log_x:
        axes.set_xscale("log", base=2)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("FID (lower is better)")
    axes.grid(alpha=0.3)
    if any(series.values()):
        axes.legend()
    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    figure.savefig(tmp, dpi=110, format="png")
    tmp.replace(path)
    return path


def class_grid(model: nn.Module, cfg: DiffusionConfig, sampler: str, steps: int, guidance: float, per_class: int,
               path: Path, seed: int) -> Path:
    """A PNG with one row per class, per_class samples each."""
    num_classes = len(class_names(cfg.data.dataset))
    images, _ = generate_samples(model, cfg, sampler, steps, guidance, num_classes * per_class, seed)
    order = torch.arange(num_classes * per_class).reshape(per_class, num_classes).T.flatten()  # class-major
    return save_grid(images[order], path, nrow=per_class, scale=3)


def speedrun(cfg: DiffusionSpeedrunConfig) -> Path:
    """Run every stage of `cfg` and return the path of `report.md`."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, out / "speedrun.yaml")
    stages = Stages(out)
    dataset = cfg.model.data.dataset
    ddpm_cfg = replace(cfg.model, train=replace(cfg.model.train, out_dir=str(out / "ddpm")))
    flow_cfg = replace(ddpm_cfg, diffusion=replace(ddpm_cfg.diffusion, objective="flow"),
                       train=replace(ddpm_cfg.train, out_dir=str(out / "flow")))

    def fetch():
        return {split: len(load_split(dataset, split)[0]) for split in ("train", "test")}

    def train(run_cfg: DiffusionConfig):
        result = train_diffusion(run_cfg)
        return {"steps": result.steps, "images": result.tokens_seen, "final_loss": result.final_loss,
                "final_val_loss": result.final_val_loss, "images_per_s": result.tokens_per_s,
                "path": str(result.final_model_path)}

    counts = stages.run("fetch", fetch)
    classifier_info = stages.run("classifier", lambda: ensure_classifier(cfg))
    trained = {"ddpm": stages.run("train_ddpm", lambda: train(ddpm_cfg))}
    if cfg.compare_flow:
        trained["flow"] = stages.run("train_flow", lambda: train(flow_cfg))
    distilled = stages.run("distill", lambda: progressive_distillation(
        out / "ddpm", out / "distill", start_steps=cfg.distill_start_steps, rounds=cfg.distill_rounds,
        steps_per_round=cfg.distill_steps, lr=cfg.distill_lr, guidance_scale=cfg.guidance,
        batch_size=cfg.distill_batch_size or None)) \
        if cfg.distill_rounds else []

    classifier = load_classifier(classifier_info["path"])
    reference = real_images(dataset, "test")[0]
    models = {name: load_diffusion_model(out / name) for name in trained}

    def headline():
        model, model_cfg = models["ddpm"]
        result = measure(classifier, reference, model, model_cfg, cfg.sampler, cfg.sample_steps, cfg.guidance,
                         cfg.fid_samples, cfg.seed)
        save_grid_files = {"ddpm": class_grid(model, model_cfg, cfg.sampler, cfg.sample_steps, cfg.guidance,
                                              cfg.grid_per_class, out / "samples_ddpm.png", cfg.seed)}
        if "flow" in models:
            save_grid_files["flow"] = class_grid(*models["flow"], "euler", cfg.sample_steps, cfg.guidance,
                                                 cfg.grid_per_class, out / "samples_flow.png", cfg.seed)
        if distilled:
            student, student_cfg = load_diffusion_model(distilled[-1]["path"])
            save_grid_files["distilled"] = class_grid(student, student_cfg, "ddim", distilled[-1]["steps"], 1.0,
                                                      cfg.grid_per_class, out / "samples_distilled.png", cfg.seed)
        return {**result, "grids": {k: str(v.relative_to(out)) for k, v in save_grid_files.items()}}

    def steps_curve():
        points = []
        runs = [("DDPM", "ddpm", "ddpm"), ("DDIM", "ddpm", "ddim")] + ([("flow Euler", "flow", "euler")]
                                                                       if "flow" in models else [])
        for label, name, sampler in runs:
            for steps in cfg.steps_grid:
                points.append({"series": label, **measure(classifier, reference, *models[name], sampler, steps,
                                                          cfg.guidance, cfg.curve_samples, cfg.seed)})
        for student in distilled:
            model, model_cfg = load_diffusion_model(student["path"])
            points.append({"series": "distilled (DDIM)", **measure(classifier, reference, model, model_cfg, "ddim",
                                                                   student["steps"], 1.0, cfg.curve_samples,
                                                                   cfg.seed)})
        return points

    def guidance_curve():
        return [measure(classifier, reference, *models["ddpm"], cfg.sampler, cfg.sample_steps, w, cfg.curve_samples,
                        cfg.seed) for w in cfg.guidance_grid]

    main = stages.run("evaluate", headline)
    by_steps = stages.run("fid_vs_steps", steps_curve)
    by_guidance = stages.run("fid_vs_guidance", guidance_curve)
    series: dict[str, list[tuple[float, float]]] = {}
    for p in by_steps:
        series.setdefault(p["series"], []).append((p["steps"], p["fid"]))
    plot_curves(series, "sampling steps", out / "fid_vs_steps.png", log_x=True)
    plot_curves({f"{cfg.sampler.upper()}, {cfg.sample_steps} steps": [(p["guidance"], p["fid"]) for p in by_guidance]},
                "guidance scale", out / "fid_vs_guidance.png")
    return write_report(cfg, out, stages.timings, counts, classifier_info, trained, main, by_steps, by_guidance)


def write_report(cfg: DiffusionSpeedrunConfig, out: Path, timings: dict[str, float], counts: dict, classifier: dict,
                 trained: dict, main: dict, by_steps: list[dict], by_guidance: list[dict]) -> Path:
    """report.md: the config, time per stage, the classifier, the headline figures, curves and grids."""
    m = cfg.model

    def f(x, digits=3):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    lines = [f"# tokenmind diffusion speedrun: {cfg.name}", "",
             *([cfg.description.strip(), ""] if cfg.description.strip() else []),
             f"Total time: **{sum(timings.values()) / 60:.1f} min** (wall). Config: `speedrun.yaml`.", "",
             "| stage | seconds |", "| --- | ---: |", *[f"| {k} | {v} |" for k, v in timings.items()], "",
             "## Data and FID classifier", "",
             f"- {m.data.dataset}: {counts['train']:,} train images, {counts['test']:,} test images "
             "(the FID reference)",
             f"- classifier `{classifier['path']}` "
             f"({'trained in this run' if classifier['trained_now'] else 'cached'}): "
             f"test accuracy **{100 * classifier['test_accuracy']:.2f}%**", "",
             "## Models", "",
             f"- network: `{m.model.kind}` {m.model.options}; {m.train.steps} steps of batch {m.data.batch_size}, "
             f"{m.train.precision}; DDPM objective: {m.diffusion.prediction_type}, {m.diffusion.beta_schedule}"]
    for name, r in trained.items():
        lines.append(f"- {name}: {r['images']:,} images seen, {f(r['images_per_s'], 1)} images/s, final train loss "
                     f"{f(r['final_loss'])}, validation loss {f(r['final_val_loss'])} ([loss]({name}/loss.png))")
    lines += ["", "## Headline", "",
              f"{main['n']:,} samples ({main['sampler'].upper()}, {main['steps']} steps, guidance {main['guidance']}) "
              f"against the {counts['test']:,} test images"
              + ("" if main["n"] >= 10_000 else " (fewer than the 10k of the standard protocol, for time: FID "
                                                  "grows as the sample count shrinks)") + ":", "",
              f"- FID **{f(main['fid'], 2)}**",
              f"- class accuracy of the samples (the classifier agrees with the asked-for class): "
              f"**{100 * main['class_accuracy']:.1f}%**", ""]
    for name, grid in main["grids"].items():
        lines += [f"Samples, {name} (one row per class: {', '.join(class_names(m.data.dataset))}):", "",
                  f"![{name} samples]({grid})", ""]
    lines += ["## FID vs sampling steps", "", f"{cfg.curve_samples:,} samples per point, guidance {cfg.guidance} "
              "(the distilled students: guidance distilled in, sampled at 1).", "",
              "![FID vs steps](fid_vs_steps.png)", "",
              "| series | steps | FID | class accuracy | sampling s |", "| --- | ---: | ---: | ---: | ---: |",
              *[f"| {p['series']} | {p['steps']} | {f(p['fid'], 2)} | {100 * p['class_accuracy']:.1f}% | "
                f"{p['sampling_s']} |" for p in by_steps],
              "", "## FID vs guidance scale", "", "![FID vs guidance](fid_vs_guidance.png)", "",
              "| guidance | FID | class accuracy |", "| ---: | ---: | ---: |",
              *[f"| {p['guidance']} | {f(p['fid'], 2)} | {100 * p['class_accuracy']:.1f}% |" for p in by_guidance], ""]
    path = out / "report.md"
    with atomic_open(path) as handle:
        handle.write("\n".join(lines) + "\n")
    return path
