"""Supervised fine-tuning: continue training a pretrained model on chats, loss on assistant tokens only.

SFT is pre-training's loop with two things swapped, so `SFTTrainer` subclasses the `Trainer`
and keeps its optimizer, schedule, precision, gradient accumulation, checkpoints with exact
resume, metrics, loss plot and export:

* the model starts from `sft.init_from` — a training run (its `final/`), a Hugging Face
  directory, a `.gguf` file or an alias such as `smollm2` — with that checkpoint's own
  `ModelConfig`, instead of a random init from a `model` section;
* batches come from chat JSONL files (`posttrain.data`): rendered with the tokenizer's chat
  template, packed, targets masked to the assistant's tokens. The trainer divides the summed
  loss by the number of trained targets in the global batch, so each assistant token counts
  the same however many share its micro-batch.

The export (`out_dir/final`) carries the tokenizer and chat template, and its config.json
lists as `eos_token_id` the tokenizer's stop ids plus the special tokens that ended assistant
turns in the data (e.g. ChatML's `<|im_end|>` next to a plain `<|endoftext|>` eos: a saved
tokenizer does not remember extra stop ids, config.json does), so `tokenmind chat --model
<out_dir>/final` ends replies where the fine-tuned model learned to end them.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tokenmind.model.checkpoint import load_hf_dir
from tokenmind.model.transformer import Transformer
from tokenmind.pretrained import Pretrained, load_pretrained, resolve_model_path
from tokenmind.tokenizer import Tokenizer
from tokenmind.train.config import OptimSection, ScheduleSection, TrainSection, check_schedule_fits, load_config
from tokenmind.train.trainer import Trainer, TrainResult

from .data import ChatLoader, expand_files, pack, prepare_chat_data, read_conversations


@dataclass
class SFTSection:
    """What to fine-tune.

    init_from: the starting model: a training run folder or its `final/`, an HF model directory,
        a `.gguf` file or an alias (`smollm2`). Its weights and ModelConfig are used as they are.
    tokenizer: the tokenizer (and chat template) to render chats with (dir, .gguf or alias);
        empty: the one stored with init_from. Needed when init_from was exported without one.
    """

    init_from: str = ""
    tokenizer: str = ""


@dataclass
class ChatDataSection:
    """The conversations and how they become batches.

    files: chat JSONL files (`{"messages": [{"role", "content"}, ...]}` per line), folders of
        them or globs; a single string is a one-item list.
    batch_size/seq_len: packed rows per micro-batch and tokens per row; a longer conversation is
        truncated to seq_len (counted in `sft_data.json`).
    val_fraction: share of conversations held out for validation (0 = none).
    seed: the val split and the per-epoch row order. shuffle: False serves rows in packing order.
    """

    files: list[str] = field(default_factory=list)
    batch_size: int = 8
    seq_len: int = 1024
    val_fraction: float = 0.05
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        self.files = [f for f in self.files if f]  # `--data.files=''` means none, not the current folder
        if self.batch_size < 1 or self.seq_len < 2:
            raise ValueError(f"data.batch_size must be >= 1 and data.seq_len >= 2, got {self.batch_size}, "
                             f"{self.seq_len}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")


@dataclass
class SFTOptimSection(OptimSection):
    """`OptimSection` with fine-tuning defaults (TRL's): a small lr and no weight decay, since
    the starting weights are worth keeping rather than shrinking toward zero."""

    lr: float = 2e-5
    weight_decay: float = 0.0


@dataclass
class SFTTrainSection(TrainSection):
    """`TrainSection` writing to runs/sft by default."""

    out_dir: str = "runs/sft"


@dataclass
class SFTConfig:
    """A whole SFT run: `sft` (starting model), `data` (chats), then the trainer's own sections."""

    sft: SFTSection = field(default_factory=SFTSection)
    data: ChatDataSection = field(default_factory=ChatDataSection)
    optim: SFTOptimSection = field(default_factory=SFTOptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: SFTTrainSection = field(default_factory=SFTTrainSection)

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)


def load_sft_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> SFTConfig:
    """Defaults ← YAML file ← `--section.key=value` overrides, as `tokenmind.train.load_config`."""
    return load_config(path, overrides, schema=SFTConfig)


def load_start(sft: SFTSection) -> Pretrained:
    """The model and tokenizer `sft` names; a run folder stands for its `final/` export."""
    if not sft.init_from:
        raise ValueError("sft.init_from is not set; pass --sft.init_from=MODEL (a run's final/, an HF "
                         "directory, a .gguf file or an alias such as smollm2)")
    path = resolve_model_path(sft.init_from)
    if (path / "final" / "config.json").is_file():
        path = path / "final"
    if sft.tokenizer:
        tokenizer = Tokenizer.from_pretrained(resolve_model_path(sft.tokenizer))
        model = load_hf_dir(path) if path.is_dir() else load_pretrained(path).model
        return Pretrained(model, tokenizer, path)
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json (exported without data.tokenizer?); "
                                "pass --sft.tokenizer=DIR with the tokenizer it was trained with")
    return load_pretrained(path)


class SFTTrainer(Trainer):
    """The pre-training `Trainer` fed with packed chats and started from `cfg.sft.init_from`."""

    cfg: SFTConfig

    def __init__(self, cfg: SFTConfig) -> None:
        self.start = load_start(cfg.sft)  # the data needs its tokenizer, the base trainer its model
        super().__init__(cfg)

    def _build_data(self) -> None:
        data, model_cfg, tokenizer = self.cfg.data, self.start.model.cfg, self.start.tokenizer
        if data.seq_len > model_cfg.max_position_embeddings:
            raise ValueError(f"data.seq_len={data.seq_len} exceeds the model's max_position_embeddings="
                             f"{model_cfg.max_position_embeddings}; lower --data.seq_len")
        if tokenizer.vocab_size > model_cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only {model_cfg.vocab_size} "
                             "embeddings; use the tokenizer the model was trained with (--sft.tokenizer)")
        tokenizer.get_chat_template()  # fails now, naming the fix, if there is none
        if not data.files:
            raise ValueError("data.files is not set; pass --data.files=PATH (chat JSONL files, a folder or a glob)")
        files = expand_files(data.files)
        chats = prepare_chat_data(tokenizer, read_conversations(files), data.seq_len, data.val_fraction, data.seed)
        self.turn_end_ids = chats.turn_end_ids
        self.loader = ChatLoader(chats.train, self._loader_config(data.seed, data.shuffle))
        self.val_loader = None
        if chats.val:  # a val split too small for one batch is evaluated in smaller ones
            rows = len(pack([len(e.inputs) for e in chats.val], data.seq_len)) // self.ctx.world_size
            val_cfg = dataclasses.replace(self._loader_config(0, False), batch_size=max(1, min(data.batch_size, rows)))
            self.val_loader = ChatLoader(chats.val, val_cfg)
            self.val_start = self.val_loader.state_dict()
        self.data_stats = {"files": [str(f) for f in files], **chats.stats, "train_rows": len(self.loader.rows),
                           "val_rows": len(self.val_loader.rows) if self.val_loader else 0,
                           "packing_efficiency": chats.stats["train_tokens"] / (len(self.loader.rows) * data.seq_len)}
        if self.ctx.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "sft_data.json").write_text(json.dumps(self.data_stats, indent=2) + "\n")
        if chats.stats["truncated"]:
            warnings.warn(f"{chats.stats['truncated']} of {chats.stats['conversations']} conversations are longer "
                          f"than data.seq_len={data.seq_len} and were truncated (see {self.out_dir / 'sft_data.json'})")

    def _build_model(self) -> Transformer:
        model = self.start.model
        stops = self.start.tokenizer.eos_token_ids | self.turn_end_ids
        declared = model.cfg.extra.get("eos_token_id")
        stops.update([declared] if isinstance(declared, int) else declared or [])
        if stops:  # exported in config.json, where `Tokenizer.from_pretrained` reads stop ids
            model.cfg.extra["eos_token_id"] = sorted(stops) if len(stops) > 1 else stops.pop()
        return model

    def _tokenizer(self) -> Tokenizer:
        return self.start.tokenizer


def sft(cfg: SFTConfig) -> TrainResult:
    """Fine-tune (or resume) the run `cfg` describes; the library entry point behind `tokenmind sft`."""
    trainer = SFTTrainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()
