"""Pre-training: config, optimizers (AdamW, Muon), LR schedules, the loop, checkpoints, DDP/FSDP, metrics.

`load_config(yaml_path, overrides)` then `pretrain(cfg)` is the whole API a script or the CLI
needs; the modules below are importable on their own for custom loops.
"""

from .config import RunConfig, load_config, save_resolved
from .trainer import Trainer, TrainingDiverged, TrainResult, pretrain

__all__ = ["RunConfig", "Trainer", "TrainResult", "TrainingDiverged", "load_config", "pretrain", "save_resolved"]
