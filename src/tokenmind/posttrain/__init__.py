"""Post-training on top of `tokenmind.train`: supervised fine-tuning on chats (`sft`).

`load_sft_config(yaml_path, overrides)` then `sft(cfg)` is the whole API a script or the CLI needs.
"""

from .sft import SFTConfig, build_sft_trainer, load_sft_config, sft

__all__ = ["SFTConfig", "build_sft_trainer", "load_sft_config", "sft"]
