"""Supervised fine-tuning: continue training a pretrained model on chats, loss on assistant tokens only.

SFT is pre-training's loop given other inputs: `build_sft_trainer` hands the `Trainer` (with its
optimizer, schedule, precision, gradient accumulation, checkpoints with exact resume, metrics,
loss plot and export) the same `NextTokenObjective` and

* the model `sft.init_from` names — a training run (its `final/`), a Hugging Face directory,
  a `.gguf` file or an alias such as `smollm2` — with that checkpoint's own `ModelConfig`,
  instead of a random init from a `model` section;
* loaders of chat JSONL files (`posttrain.data`): rendered with the tokenizer's chat template,
  packed, targets masked to the assistant's tokens. The trainer divides the summed loss by the
  number of trained targets in the global batch, so each assistant token counts the same
  however many share its micro-batch.

The export (`out_dir/final`) carries the tokenizer and chat template, and its config.json
lists as `eos_token_id` the tokenizer's stop ids plus the special tokens that ended assistant
turns in the data (e.g. ChatML's `<|im_end|>` next to a plain `<|endoftext|>` eos: a saved
tokenizer does not remember extra stop ids, config.json does), so `tokenmind chat --model
<out_dir>/final` ends replies where the fine-tuned model learned to end them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from tokenmind.config import Overrides, load_config
from tokenmind.data.loader import LoaderConfig
from tokenmind.model.load import QUANTIZATIONS, Pretrained, load_model
from tokenmind.model.lora import TARGETS, LoRAConfig, add_lora
from tokenmind.model.transformer import Transformer
from tokenmind.train.config import OptimSection, ScheduleSection, TrainSection, check_schedule_fits
from tokenmind.train.distributed import DistContext, init_distributed
from tokenmind.train.trainer import Trainer, TrainResult, loader_config

from .data import ChatData, ChatLoader, expand_files, pack, prepare_chat_data, read_conversations


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
class LoRASection:
    """Parameter-efficient fine-tuning (`model/lora.py`). rank 0 trains every weight; rank > 0
    freezes the model and trains LoRA adapters on `targets` (HF module names), exported as a PEFT
    adapter directory that names init_from as its base. quantize: "int8" or "int4" keeps the
    frozen base quantized (QLoRA; a GGUF's Q4 blocks stay as they are). Adapters want a larger
    lr than full fine-tuning (1e-4 to 1e-3)."""

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.05
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    quantize: str | None = None

    def __post_init__(self) -> None:
        if self.quantize not in (None, "", *QUANTIZATIONS):
            raise ValueError(f"lora.quantize={self.quantize!r}: choose one of {', '.join(QUANTIZATIONS)}, or leave it "
                             "unset for a float base")
        if self.rank:
            self.adapter_config()  # fails now on bad targets, alpha or dropout
        if self.quantize and not self.rank:
            raise ValueError(f"lora.quantize={self.quantize!r} needs lora.rank > 0 (a quantized base only trains "
                             "through adapters)")

    def adapter_config(self) -> LoRAConfig:
        return LoRAConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=list(self.targets))


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
    lora: LoRASection = field(default_factory=LoRASection)
    optim: SFTOptimSection = field(default_factory=SFTOptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: SFTTrainSection = field(default_factory=SFTTrainSection)

    def __post_init__(self) -> None:
        check_schedule_fits(self.schedule, self.train)


def load_sft_config(path: str | Path | None = None, overrides: Overrides = ()) -> SFTConfig:
    """Defaults ← YAML file ← `--section.key=value` overrides (`tokenmind.config.load_config` with `SFTConfig`)."""
    return load_config(SFTConfig, path, overrides)


def load_start(sft: SFTSection, lora: LoRASection | None = None) -> Pretrained:
    """The model and tokenizer `sft` names (a run folder stands for its `final/` export), with
    fresh LoRA adapters on a frozen (possibly quantized) copy when lora.rank > 0."""
    if not sft.init_from:
        raise ValueError("sft.init_from is not set; pass --sft.init_from=MODEL (a run's final/, an HF "
                         "directory, a .gguf file or an alias such as smollm2)")
    lora = lora or LoRASection()
    start = load_model(sft.init_from, tokenizer=sft.tokenizer or None, quantize=lora.quantize or None)
    if lora.rank:
        add_lora(start.model, lora.adapter_config())
    return start


def adapter_base(init_from: str) -> str:
    """How an adapter records its base: an absolute path, or the alias as given."""
    path = Path(init_from).expanduser()
    return str(path.resolve()) if path.exists() else init_from


def chat_data(data: ChatDataSection, start: Pretrained) -> ChatData:
    """The conversations of data.files rendered with the start's tokenizer, checked against its model."""
    model_cfg, tokenizer = start.model.cfg, start.tokenizer
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
    chats.stats = {"files": [str(f) for f in files], **chats.stats}
    return chats


def chat_loaders(chats: ChatData, data: ChatDataSection, ctx: DistContext) -> tuple[ChatLoader, ChatLoader | None]:
    """This rank's train loader and val loader (None without val conversations); a val split too
    small for one batch of data.batch_size rows is evaluated in smaller ones."""
    loader = ChatLoader(chats.train, loader_config(data, ctx, data.seed, data.shuffle))
    if not chats.val:
        return loader, None
    rows = pack([len(e.inputs) for e in chats.val], data.seq_len)
    return loader, ChatLoader(chats.val, val_loader_config(data, ctx, len(rows)))


def val_loader_config(data: ChatDataSection, ctx: DistContext, rows: int) -> LoaderConfig:
    """This rank's unshuffled val loader config for a split that packs into `rows` rows: batches of
    data.batch_size, or smaller when the split is too small for one."""
    per_rank = rows // ctx.world_size
    return dataclasses.replace(loader_config(data, ctx, 0, False), batch_size=max(1, min(data.batch_size, per_rank)))


def add_stop_ids(model: Transformer, stops: set[int]) -> None:
    """Declare `stops` (and the ids the model declares already) as eos_token_id in the model's
    config, which the export writes to config.json, where `Tokenizer.from_pretrained` reads stop ids."""
    declared = model.cfg.extra.get("eos_token_id")
    stops = stops | set([declared] if isinstance(declared, int) else declared or [])
    if stops:
        model.cfg.extra["eos_token_id"] = sorted(stops) if len(stops) > 1 else stops.pop()


def build_sft_trainer(cfg: SFTConfig, ctx: DistContext) -> Trainer:
    """The `Trainer` of an SFT run: chat loaders and the model `cfg.sft.init_from` names, for
    next-token loss on assistant tokens. Writes the data's statistics to out_dir/sft_data.json."""
    start = load_start(cfg.sft, cfg.lora)
    data, out_dir = cfg.data, Path(cfg.train.out_dir)
    chats = chat_data(data, start)
    loader, val_loader = chat_loaders(chats, data, ctx)
    stats = {**chats.stats, "train_rows": len(loader.rows), "val_rows": len(val_loader.rows) if val_loader else 0,
             "packing_efficiency": chats.stats["train_tokens"] / (len(loader.rows) * data.seq_len)}
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "sft_data.json").write_text(json.dumps(stats, indent=2) + "\n")
    if stats["truncated"]:
        warnings.warn(f"{stats['truncated']} of {stats['conversations']} conversations are longer than "
                      f"data.seq_len={data.seq_len} and were truncated (see {out_dir / 'sft_data.json'})")
    add_stop_ids(start.model, start.tokenizer.eos_token_ids | chats.turn_end_ids)
    return Trainer(cfg, ctx, start.model, loader, val_loader, tokenizer=start.tokenizer,
                   adapter_base=adapter_base(cfg.sft.init_from))


def sft(cfg: SFTConfig) -> TrainResult:
    """Fine-tune (or resume) the run `cfg` describes; the library entry point behind `tokenmind sft`."""
    with contextlib.closing(init_distributed(cfg.train.distributed, cfg.train.device)) as ctx:
        return build_sft_trainer(cfg, ctx).train()
