"""`tokenmind embodied speedrun`: PushT demonstrations to a measured diffusion policy in one command,
ending in `report.md` with the results table, the loss curve and frame strips.

record demonstrations with the scripted expert (or reuse the folder when it holds some) → train the
diffusion policy by behaviour cloning (from pixels, `cpu-pusht`, or from the low-dimensional state,
`cpu-pusht-state`) → evaluate it, the scripted expert and a random policy on the
same seeded episodes (success rate and mean coverage with standard errors) → report. Each stage is a
library call; `tokenmind.progress.Stages` records finished stages in `stages.json`, so a re-run
resumes (training also resumes from its checkpoints).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tokenmind.config import Overrides, load_config, save_resolved
from tokenmind.jsonl import atomic_open
from tokenmind.progress import Stages

from .diffusion_policy import DiffusionPolicyConfig
from .policy import load_policy
from .policy_train import PolicyTrainConfig, train_policy

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
PACKAGED = {"cpu-pusht": "embodied_speedrun.yaml", "cpu-pusht-state": "embodied_speedrun_state.yaml"}


@dataclass
class EmbodiedSpeedrunConfig:
    """A named embodied speedrun.

    demos: the demonstrations folder; reused when it holds a recording, else demo_episodes successful
        expert episodes (seeds demo_seed, demo_seed + 1, …) are recorded into it ("" = out_dir/demos).
    policy: the behaviour-cloning run (`PolicyTrainConfig`; its out_dir is set to out_dir/policy and its
        data.demos to `demos`). eval_episodes/eval_seed/max_steps: every policy meets episodes seeded
        eval_seed, eval_seed + 1, …, each at most max_steps steps. n_strips: frame strips saved per policy.
    baselines: also evaluate the scripted expert and a random policy. threads: torch.set_num_threads
        (0 = torch's default).
    """

    name: str = "cpu-pusht"
    description: str = ""
    out_dir: str = "runs/embodied"
    threads: int = 0
    demos: str = ""
    demo_episodes: int = 100
    demo_seed: int = 0
    policy: PolicyTrainConfig = field(default_factory=PolicyTrainConfig)
    eval_episodes: int = 50
    eval_seed: int = 1000
    max_steps: int = 300
    n_strips: int = 3
    baselines: bool = True

    def __post_init__(self) -> None:
        for name in ("demo_episodes", "eval_episodes", "max_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_strips < 0:
            raise ValueError(f"n_strips must be >= 0, got {self.n_strips}")


def load_speedrun_config(name_or_path: str = "cpu-pusht-state", overrides: Overrides = ()) -> EmbodiedSpeedrunConfig:
    """A packaged config (`cpu-pusht-state` → configs/embodied_speedrun_state.yaml, the state policy, the
    default: it solves PushT in a third of the episodes within 30 minutes on 2 cores; `cpu-pusht` →
    embodied_speedrun.yaml, the pixel policy) or a YAML path, then `key=value` overrides such as
    `policy.train.steps=10`."""
    path = Path(name_or_path)
    if not path.exists():
        if name_or_path not in PACKAGED:
            raise FileNotFoundError(f"no embodied speedrun config {name_or_path!r}: not a file, and not one of "
                                    f"{', '.join(PACKAGED)}")
        path = CONFIG_DIR / PACKAGED[name_or_path]
    return load_config(EmbodiedSpeedrunConfig, path, overrides)


def ensure_demos(path: Path, n_episodes: int, seed: int) -> dict[str, Any]:
    """The demonstrations at `path`, recorded with the scripted expert first if there are none."""
    from .demos import Demonstrations, record_demonstrations

    reused = (path / "data.npz").is_file()
    t0 = time.perf_counter()
    demos = Demonstrations.load(path) if reused else record_demonstrations(path, n_episodes, seed=seed)
    return {"path": str(path), "reused": reused, "episodes": demos.n_episodes, "frames": len(demos),
            "seconds": round(time.perf_counter() - t0, 1),
            "expert_success_rate": demos.meta.get("success_rate_tried"),
            "mean_length": round(len(demos) / max(demos.n_episodes, 1), 1)}


def speedrun(cfg: EmbodiedSpeedrunConfig) -> Path:
    """Run every stage of `cfg` and return the path of `report.md`."""
    from .evaluate import RandomPolicy, evaluate_policy
    from .expert import ScriptedExpert

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    demos_dir = Path(cfg.demos or out / "demos")
    policy_cfg = replace(cfg.policy, data=replace(cfg.policy.data, demos=str(demos_dir)),
                         train=replace(cfg.policy.train, out_dir=str(out / "policy")))
    save_resolved(replace(cfg, demos=str(demos_dir), policy=policy_cfg), out / "speedrun.yaml")
    stages = Stages(out)

    def train() -> dict[str, Any]:
        result = train_policy(policy_cfg)
        return {"steps": result.steps, "samples": result.tokens_seen, "final_loss": result.final_loss,
                "final_val_loss": result.final_val_loss, "samples_per_s": result.tokens_per_s,
                "path": str(result.final_model_path)}

    def evaluate(policy, name: str) -> dict[str, Any]:
        return evaluate_policy(policy, cfg.eval_episodes, cfg.eval_seed, cfg.max_steps, strip_dir=out / "strips",
                               n_strips=cfg.n_strips, progress=True, name=name)

    data = stages.run("demos", lambda: ensure_demos(demos_dir, cfg.demo_episodes, cfg.demo_seed))
    trained = stages.run("train", train)
    label, name = policy_name(policy_cfg)
    results = {label: stages.run("eval_policy", lambda: evaluate(
        load_policy(trained["path"], seed=cfg.policy.train.seed), name))}
    if cfg.baselines:
        results["scripted expert"] = stages.run("eval_expert", lambda: evaluate(ScriptedExpert(), "expert"))
        results["random"] = stages.run("eval_random", lambda: evaluate(RandomPolicy(cfg.eval_seed), "random"))
    return write_report(cfg, policy_cfg, out, stages.timings, data, trained, results)


def observation_text(p: DiffusionPolicyConfig) -> str:
    """What one observation of the policy `p` is, for the report."""
    parts = []
    if p.uses_pixels:
        parts.append(f"a {p.image_size}² frame through the CNN {p.vision_channels} (stem stride {p.stem_stride}, "
                     f"crop {p.crop_size}, {p.num_keypoints} keypoints)")
    parts.append("the agent position")
    if p.uses_block_pose:
        parts.append("the block pose (x, y, sin θ, cos θ)")
    return " + ".join(parts)


def policy_name(cfg: PolicyTrainConfig) -> tuple[str, str]:
    """(the report's label, the strips' file prefix) of the trained policy: its observation mode shows."""
    mode = cfg.policy.obs_mode
    if mode == "pixels":
        return "diffusion policy", "diffusion_policy"
    return f"diffusion policy ({mode})", "diffusion_policy_" + mode.replace("+", "_")


def write_report(cfg: EmbodiedSpeedrunConfig, policy_cfg: PolicyTrainConfig, out: Path, timings: dict[str, float],
                 data: dict, trained: dict, results: dict[str, dict]) -> Path:
    """report.md: time per stage, the data, the training run, the results table, loss curve and strips."""
    p, t = policy_cfg.policy, policy_cfg.train

    def f(x, digits=3):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    lines = [f"# tokenmind embodied speedrun: {cfg.name}", "",
             *([cfg.description.strip(), ""] if cfg.description.strip() else []),
             f"Total time: **{sum(timings.values()) / 60:.1f} min** (wall, torch threads: {torch.get_num_threads()}). "
             "Config: `speedrun.yaml`.", "",
             "| stage | seconds |", "| --- | ---: |", *[f"| {k} | {v} |" for k, v in timings.items()], "",
             "## Results", "",
             f"{cfg.eval_episodes} episodes per policy, seeds {cfg.eval_seed}–{cfg.eval_seed + cfg.eval_episodes - 1} "
             f"(the demonstrations used seeds from {cfg.demo_seed}), at most {cfg.max_steps} steps each. Success: "
             "coverage of the goal above 95% at some step; coverage: the episode's maximum; ± one standard error.", "",
             "| policy | success rate | mean max coverage | mean final coverage | mean steps | eval seconds |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        lines.append(f"| {name} | {100 * r['success_rate']:.1f}% ± {100 * r['success_se']:.1f}% | "
                     f"{f(r['mean_coverage'])} ± {f(r['coverage_se'])} | {f(r['mean_final_coverage'])} | "
                     f"{r['mean_steps']:.1f} | {r['seconds']} |")
    lines += ["", "## Data and training", "",
              f"- demonstrations `{data['path']}` ({'reused' if data['reused'] else 'recorded in this run'}): "
              f"{data['episodes']} successful expert episodes, {data['frames']:,} frames "
              f"(mean length {data['mean_length']})",
              f"- policy: T_o={p.n_obs_steps} observations ({observation_text(p)}), T_p={p.horizon}-action chunks, "
              f"T_a={p.n_action_steps} executed per plan; U-Net {p.down_dims}; {p.objective} ({p.prediction_type}, "
              f"{p.beta_schedule}, {p.num_train_timesteps} steps), sampled by {p.sampler} in {p.num_inference_steps} "
              "steps",
              f"- training: {trained['steps']} steps of batch {policy_cfg.data.batch_size} ({trained['samples']:,} "
              f"samples, {f(trained['samples_per_s'], 1)} samples/s), {t.precision}, EMA decay up to {t.ema_decay}; "
              f"final train loss {f(trained['final_loss'], 4)}, validation loss {f(trained['final_val_loss'], 4)}", "",
              "![loss curve](policy/loss.png)", "", "## Frame strips", "",
              "Each strip: frames evenly spaced over one evaluation episode, first to last (the first episodes, "
              "and a policy's first solved episode when none of those was).", ""]
    for name, r in results.items():
        for strip in r.get("strips", []):
            rel = Path(strip).relative_to(out) if Path(strip).is_relative_to(out) else Path(strip)
            episode = next((e for e in r.get("episodes", []) if strip.endswith(f"_seed{e['seed']}.png")), None)
            outcome = "" if episode is None else (f" (solved in {episode['steps']} steps)" if episode["success"] else
                                                  f" (not solved; max coverage {episode['max_coverage']:.2f})")
            lines += [f"{name}, `{rel.stem}`{outcome}:", "", f"![{name}]({rel})", ""]
    path = out / "report.md"
    with atomic_open(path) as handle:
        handle.write("\n".join(lines) + "\n")
    return path
