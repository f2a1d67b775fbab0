"""`tokenmind embodied speedrun` end to end at toy sizes: expert demonstrations recorded in PushT, a
tiny diffusion policy trained on them, all three policies evaluated in the simulator, the report."""

import json
from pathlib import Path

import pytest
import torch

from tokenmind.cli import main
from tokenmind.embodied.policy_train import load_policy_config
from tokenmind.embodied.speedrun import load_speedrun_config, policy_name, speedrun

torch.set_num_threads(1)

TINY = {"image_size": 96, "crop_size": 88, "vision_channels": [8, 16], "stem_stride": 4, "num_keypoints": 4,
        "obs_feature_dim": 8, "down_dims": [16, 32], "groups": 4, "horizon": 8, "n_action_steps": 4,
        "time_embed_dim": 16, "num_train_timesteps": 20, "num_inference_steps": 4}


def tiny_overrides(tmp_path: Path) -> list[str]:
    return [f"out_dir={tmp_path / 'run'}", f"demos={tmp_path / 'run' / 'demos'}", "demo_episodes=2", "eval_episodes=2",
            "max_steps=16", "n_strips=1",
            *(f"policy.policy.{k}={json.dumps(v)}" for k, v in TINY.items()), "policy.data.batch_size=8",
            "policy.train.steps=3", "policy.schedule.warmup_steps=0", "policy.data.val_episodes=1"]


def test_packaged_configs_load_and_fit_the_policy():
    cfg = load_speedrun_config("cpu-pusht")
    assert cfg.eval_episodes >= 50 and cfg.policy.policy.n_obs_steps == 2 and cfg.policy.policy.horizon == 16
    train = load_policy_config(Path(__file__).resolve().parent.parent / "src/tokenmind/configs/embodied_policy.yaml")
    assert train.policy == cfg.policy.policy  # the speedrun trains the policy `tokenmind embodied train` trains
    with pytest.raises(FileNotFoundError, match="cpu-pusht, cpu-pusht-state"):
        load_speedrun_config("no-such-run")


def test_packaged_state_config_trains_the_state_policy():
    cfg = load_speedrun_config("cpu-pusht-state")
    configs = Path(__file__).resolve().parent.parent / "src/tokenmind/configs"
    train = load_policy_config(configs / "embodied_policy_state.yaml")
    assert cfg.policy.policy == train.policy and train.policy.obs_mode == "state"
    assert cfg.demos == train.data.demos and cfg.eval_episodes >= 50 and cfg.eval_seed == 1000
    assert policy_name(cfg.policy) == ("diffusion policy (state)", "diffusion_policy_state")


@pytest.mark.slow
@pytest.mark.parametrize("config", [None, "cpu-pusht"], ids=["default-state", "pixels"])
def test_speedrun_end_to_end(tmp_path, capsys, config):
    main(["embodied", "speedrun", *(["--config", config] if config else []), *tiny_overrides(tmp_path)])
    cfg = load_speedrun_config(config or "cpu-pusht-state", tiny_overrides(tmp_path))  # the default is the state run
    label, prefix = policy_name(cfg.policy)
    out = tmp_path / "run"
    report = (out / "report.md").read_text()
    assert f"report: {out / 'report.md'}" in capsys.readouterr().out
    for name in (label, "scripted expert", "random"):
        assert f"| {name} | " in report
    assert (out / "policy" / "loss.png").is_file() and "policy/loss.png" in report
    assert (out / "demos" / "data.npz").is_file() and "recorded in this run" in report
    strips = sorted(p.name for p in (out / "strips").glob("*.png"))
    assert strips == [f"{prefix}_seed1000.png", "expert_seed1000.png", "random_seed1000.png"]
    assert all(f"strips/{name}" in report for name in strips)
    stages = json.loads((out / "stages.json").read_text())
    assert list(stages) == ["demos", "train", "eval_policy", "eval_expert", "eval_random"]
    assert stages["eval_policy"]["result"]["n_episodes"] == 2 and stages["train"]["result"]["steps"] == 3
    # a re-run skips every finished stage and writes the same tables
    assert speedrun(cfg).read_text().split("## Results")[1] == report.split("## Results")[1]
