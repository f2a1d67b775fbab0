"""The diffusion speedrun end to end, progressive distillation and the FID curves: on scikit-learn's
8×8 digits with a tiny DiT, in seconds."""

import copy
import json

import pytest
import torch
from PIL import Image

from tokenmind.diffusion import speedrun as speedrun_module
from tokenmind.diffusion.config import load_config
from tokenmind.diffusion.data import ImageLoader, load_split
from tokenmind.diffusion.distill import ProgressiveDistillationObjective, student_target
from tokenmind.diffusion.sampling import make_scheduler
from tokenmind.diffusion.speedrun import load_speedrun_config, plot_curves, speedrun
from tokenmind.diffusion.train import build_model

torch.set_num_threads(1)
TINY_DIT = ["model.model.kind=dit", "model.model.options={patch_size: 2, hidden_size: 32, num_layers: 1, num_heads: 2}"]


def tiny_speedrun_config(tmp_path):
    return load_speedrun_config("full-diffusion", [
        f"out_dir={tmp_path / 'run'}", f"classifier_dir={tmp_path / 'classifier'}", "threads=0", "classifier_epochs=1",
        *TINY_DIT, "model.data.dataset=digits", "model.data.batch_size=32", "model.train.steps=3",
        "model.train.checkpoint_every=0", "model.train.precision=fp32", "model.schedule.warmup_steps=0",
        "fid_samples=150", "curve_samples=150", "sample_steps=2", "steps_grid=[1, 2]", "guidance_grid=[1.0, 2.0]",
        "distill_start_steps=2", "distill_rounds=1", "distill_steps=2", "grid_per_class=2"])


def test_speedrun_on_digits_writes_report_and_resumes(tmp_path, monkeypatch):
    cfg = tiny_speedrun_config(tmp_path)
    report = speedrun(cfg)
    out = tmp_path / "run"
    text = report.read_text()
    for figure in ("fid_vs_steps.png", "fid_vs_guidance.png", "samples_ddpm.png", "samples_flow.png",
                   "samples_distilled.png"):
        assert (out / figure).is_file() and f"({figure})" in text, figure
        Image.open(out / figure).verify()
    with Image.open(out / "samples_ddpm.png") as grid:  # one row per class, 2 samples each, 3× scale
        assert grid.size == ((2 * 10 + 2) * 3, (10 * 10 + 2) * 3)
    done = json.loads((out / "stages.json").read_text())
    assert list(done) == ["fetch", "classifier", "train_ddpm", "train_flow", "distill", "evaluate", "fid_vs_steps",
                          "fid_vs_guidance"]
    headline = done["evaluate"]["result"]
    assert headline["n"] == 150 and headline["fid"] > 0 and 0 <= headline["class_accuracy"] <= 1
    assert 0 < done["classifier"]["result"]["test_accuracy"] <= 1
    series = {p["series"] for p in done["fid_vs_steps"]["result"]}
    assert series == {"DDPM", "DDIM", "flow Euler", "distilled (DDIM)"}
    assert "fewer than the 10k" in text  # a reduced sample count is said, not hidden

    # a re-run resumes: no stage trains or samples again, and the report is rewritten from the records
    def fail(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    monkeypatch.setattr(speedrun_module, "train_diffusion", fail)
    monkeypatch.setattr(speedrun_module, "measure", fail)
    monkeypatch.setattr(speedrun_module, "progressive_distillation", fail)
    report.unlink()
    assert speedrun(cfg).read_text() == text


def test_packaged_configs_budget_run_and_full_run():
    budget, full = load_speedrun_config("cpu-diffusion"), load_speedrun_config("full-diffusion")
    assert budget.name == "cpu-diffusion" and not budget.compare_flow and budget.distill_rounds == 0
    assert full.name == "full-diffusion" and full.compare_flow and full.distill_rounds == 3
    assert full.fid_samples == 10_000 > budget.fid_samples
    assert full.model == budget.model  # the same network, objective and training budget
    assert full.out_dir != budget.out_dir  # one run does not resume the other's stages


def test_speedrun_config_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="cpu-diffusion"):
        load_speedrun_config("gpu-nonexistent")
    with pytest.raises(ValueError, match="compare_flow"):
        load_speedrun_config("cpu-diffusion", ["model.diffusion.objective=flow"])
    with pytest.raises(ValueError, match="fid_samples"):
        load_speedrun_config("cpu-diffusion", ["fid_samples=1"])


def test_student_target_lands_one_ddim_step_on_the_given_point():
    cfg = load_config(None, ["data.dataset=digits", "diffusion.prediction_type=v_prediction",
                             "diffusion.clip_sample=false"])
    scheduler = make_scheduler(cfg, "ddim")
    g = torch.Generator().manual_seed(0)
    x_t, x_end = torch.randn(4, 1, 8, 8, generator=g), torch.randn(4, 1, 8, 8, generator=g)
    for t, t_end in ((999, 499), (499, -1), (250, 120)):
        target = student_target(scheduler.schedule, "v_prediction", x_t, torch.full((4,), t), x_end,
                                torch.full((4,), t_end))
        assert torch.allclose(scheduler.step(target, t, t_end, x_t), x_end, atol=1e-4)


def test_progressive_distillation_student_learns_two_teacher_steps_in_one():
    cfg = load_config(None, ["data.dataset=digits", "diffusion.prediction_type=v_prediction", *[
        o.removeprefix("model.") for o in TINY_DIT]])
    torch.manual_seed(0)
    teacher = build_model(cfg)
    with torch.no_grad():  # adaLN-Zero starts as the zero function: give the teacher something to teach
        for p in teacher.parameters():
            p.add_(0.2 * torch.randn_like(p))
    scheduler = make_scheduler(cfg, "ddim")
    objective = ProgressiveDistillationObjective(teacher, scheduler, scheduler.timesteps(2), num_classes=10)
    student = copy.deepcopy(teacher).train().requires_grad_(True)
    images, labels = load_split("digits", "train")
    loader = ImageLoader(images, labels, 32, seed=0)
    held_out = next(ImageLoader(images, labels, 64, seed=1))

    def held_out_loss():
        with torch.no_grad():
            return objective(student, held_out, "fp32").loss.item() / 64

    before = held_out_loss()
    optimizer = torch.optim.Adam(student.parameters(), lr=3e-3)
    for _ in range(40):
        loss = objective(student, next(loader), "fp32").loss / 32
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert held_out_loss() < 0.5 * before


def test_plot_curves_writes_a_png_atomically(tmp_path):
    path = plot_curves({"DDIM": [(8, 30.0), (1, 90.0), (2, 60.0)], "flow Euler": [(1, 80.0), (8, 20.0)]},
                       "sampling steps", tmp_path / "figs" / "fid_vs_steps.png", log_x=True)
    with Image.open(path) as picture:
        assert picture.format == "PNG" and picture.size[0] > 300
    assert [p.name for p in path.parent.iterdir()] == ["fid_vs_steps.png"]  # no temp file left
