"""Training: config, optimizers (AdamW, Muon), LR schedules, the loop, objectives, checkpoints, DDP/FSDP, metrics.

`load_config(yaml_path, overrides)` then `pretrain(cfg)` is the whole API a script or the CLI
needs; the modules below are importable on their own for custom loops. Another kind of training
hands `Trainer` its own model, loaders and objective (`objectives.py`), as SFT does.
"""

from .config import RunConfig, load_config, save_resolved
from .objectives import LossTerms, NextTokenObjective, Objective
from .trainer import Trainer, TrainingDiverged, TrainResult, build_pretrainer, pretrain

__all__ = ["LossTerms", "NextTokenObjective", "Objective", "RunConfig", "TrainResult", "Trainer",
           "TrainingDiverged", "build_pretrainer", "load_config", "pretrain", "save_resolved"]
