"""DiT, the diffusion transformer (Peebles & Xie, "Scalable Diffusion Models with Transformers").

The image (pixels or VAE latents, (B, C, H, W)) is cut into p×p patches by a strided convolution
(patchify), each patch a token with a fixed 2-D sin-cos (or learned) position; N transformer blocks
attend over all tokens both ways; a final layer maps every token back to a p×p×C_out patch and
the patches are laid back into an image (unpatchify). The timestep and class come in through
adaLN-Zero: one conditioning vector c (`TimestepClassEmbedding`) is turned, per block, by a linear
layer into a shift, scale and gate for the attention and the MLP branches —
x + gate·branch(LayerNorm(x)·(1 + scale) + shift) — and that linear layer starts at zero, so every
block starts as the identity and the network grows its residual branches from there.

What it shares with the LLM `Transformer`: the attention goes through the one attention function
(`model.attention.attend`), with a mask-free `DenseMask(None, causal=False)` — bidirectional, so
SDPA runs its fused kernel — and the q/k/v projections are one fused `qkv_proj` as there. What it
does not share, on purpose: the LLM's RMSNorm (DiT's norms are LayerNorms without a learned affine
— adaLN supplies the scale and shift), its gated SwiGLU MLP (DiT's MLP is fc → GELU(tanh) → fc, and
checkpoints in diffusers' layout hold exactly those two matrices) and RoPE (positions are added to
the patch tokens once). Bending the LLM modules to cover these would add branches to the decode
hot path for no reuse of substance.

Layout and numbers follow diffusers' `DiTTransformer2DModel`, so its checkpoints load
(`dit_from_diffusers`, `load_diffusers_dit`) and ours save back (`dit_to_diffusers`,
`save_diffusers_dit`). Where diffusers departs from the paper's single timestep/class embedder, it
gives every block its own copy (converted official checkpoints hold the same weights in each);
`DiTConfig.shared_conditioning=False` reproduces that layout exactly, True (the default) is the
paper's one embedder, computed once per forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmind.model.attention import DenseMask, attend

from .embeddings import TimestepClassEmbedding, sincos_2d_positions
from .weights import read_weights_dir, save_weights_dir

DIFFUSERS_CLASS = "DiTTransformer2DModel"
_BIDIRECTIONAL = DenseMask(None, causal=False)


@dataclass
class DiTConfig:
    """A DiT's shape.

    sample_size: height = width of the input (28 for Fashion-MNIST pixels, 7 for 4×7×7 latents).
    in_channels: image (1, grayscale) or latent channels. patch_size: p, tokens = (sample_size/p)².
    hidden_size, num_layers, num_heads: the transformer; mlp_ratio: MLP width / hidden_size.
    num_classes: class labels 0..num_classes-1; num_classes itself is the null label.
    learn_sigma: also predict the variance (output channels 2·in_channels, as DiT and diffusers do).
    pos_embed: "sincos" (fixed 2-D sin-cos, the paper's) or "learned" (a trained table).
    shared_conditioning: one timestep/class embedder for all blocks (the paper); False gives each
        block its own, diffusers' layout.
    attention_bias: biases on q/k/v. norm_eps: epsilon of the LayerNorm before each MLP (diffusers'
        `norm_eps`; the norms before attention and the final layer use the paper's 1e-6).
    """

    sample_size: int = 28
    in_channels: int = 1
    patch_size: int = 2
    hidden_size: int = 192
    num_layers: int = 6
    num_heads: int = 3
    mlp_ratio: float = 4.0
    num_classes: int = 10
    learn_sigma: bool = False
    pos_embed: str = "sincos"
    shared_conditioning: bool = True
    attention_bias: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.sample_size % self.patch_size:
            raise ValueError(f"sample_size {self.sample_size} is not a multiple of patch_size {self.patch_size}; "
                             "pick a patch size that divides the image (or latent) side")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.pos_embed not in ("sincos", "learned"):
            raise ValueError(f"pos_embed must be 'sincos' or 'learned', got {self.pos_embed!r}")
        if self.pos_embed == "sincos" and self.hidden_size % 4:
            raise ValueError(f"sin-cos positions need hidden_size divisible by 4, got {self.hidden_size}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")

    @property
    def out_channels(self) -> int:
        return 2 * self.in_channels if self.learn_sigma else self.in_channels

    @property
    def grid_size(self) -> int:
        return self.sample_size // self.patch_size


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm with no learned affine: adaLN provides the scale and shift."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (B, T, D) scaled and shifted per image by (B, D) vectors."""
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTAttention(nn.Module):
    """Bidirectional multi-head self-attention over the patch tokens, through `attend`."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv_proj(x).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)  # each (B, T, H, hd)
        out = attend(q, k, v, _BIDIRECTIONAL, None, 0, scale=self.head_dim ** -0.5, softcap=None, window=None)
        return self.o_proj(out.reshape(B, T, D))


_GELU_2K = 2 * math.sqrt(2 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, 0.5·x·(1 + tanh(u)) with u = √(2/π)·(x + 0.044715·x³), written as
    x·σ(2u) (the same function: 0.5·(1 + tanh u) = σ(2u)). Why: on AVX2 CPUs the vectorized tanh
    of ATen and of inductor's kernels costs about twice the exp behind σ, and this GELU was the
    largest op of the compiled DiT after the matmuls (docs/diffusion.md)."""
    return x * torch.sigmoid(_GELU_2K * x * (1 + 0.044715 * x * x))


class DiTMLP(nn.Module):
    """fc1 → GELU (tanh approximation) → fc2, as in ViT and DiT."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        width = int(cfg.hidden_size * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.hidden_size, width)
        self.fc2 = nn.Linear(width, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))


class DiTBlock(nn.Module):
    """x + gate_msa·attn(modulate(LN(x))), then x + gate_mlp·mlp(modulate(LN(x))); the six vectors
    come from the conditioning through `adaLN_modulation`, zero at init (adaLN-Zero)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm_eps = cfg.norm_eps
        self.attn = DiTAttention(cfg)
        self.mlp = DiTMLP(cfg)
        self.adaLN_modulation = nn.Linear(cfg.hidden_size, 6 * cfg.hidden_size)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(F.silu(c)).chunk(6, 1)
        x = x + gate_msa[:, None] * self.attn(modulate(layer_norm(x, 1e-6), shift_msa, scale_msa))
        return x + gate_mlp[:, None] * self.mlp(modulate(layer_norm(x, self.norm_eps), shift_mlp, scale_mlp))


class DiTFinalLayer(nn.Module):
    """adaLN (shift and scale, no gate) then a linear map of each token to its p·p·C_out patch."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.adaLN_modulation = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size)
        self.linear = nn.Linear(cfg.hidden_size, cfg.patch_size ** 2 * cfg.out_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(F.silu(c)).chunk(2, dim=1)
        return self.linear(modulate(layer_norm(x, 1e-6), shift, scale))


class DiT(nn.Module):
    """model(x (B, C, H, W), t (B,) float, class_labels (B,) long or None) → (B, C_out, H, W).

    class_labels == num_classes (or None for the whole batch) is the null label of classifier-free
    guidance."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        D, p = cfg.hidden_size, cfg.patch_size
        self.patch_embed = nn.Conv2d(cfg.in_channels, D, kernel_size=p, stride=p)
        positions = sincos_2d_positions(D, cfg.grid_size)[None]  # (1, N, D)
        if cfg.pos_embed == "learned":
            self.pos_embed = nn.Parameter(positions)  # starts at the fixed layout, then trains
        else:
            self.register_buffer("pos_embed", positions, persistent=False)
        self.conditioning = nn.ModuleList(TimestepClassEmbedding(D, cfg.num_classes)
                                          for _ in range(1 if cfg.shared_conditioning else cfg.num_layers))
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.num_layers))
        self.final_layer = DiTFinalLayer(cfg)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """The paper's init: Xavier-uniform linears and patch embedding, zero biases, N(0, 0.02)
        conditioning, and zeros for every adaLN modulation and the output layer (adaLN-Zero)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight, generator=generator)
                nn.init.zeros_(module.bias)
        w = self.patch_embed.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1), generator=generator)
        nn.init.zeros_(self.patch_embed.bias)
        for embedder in self.conditioning:
            embedder.init_weights(generator)
        for layer in [*(b.adaLN_modulation for b in self.blocks), self.final_layer.adaLN_modulation,
                      self.final_layer.linear]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        if x.shape[1:] != (cfg.in_channels, cfg.sample_size, cfg.sample_size):
            raise ValueError(f"DiT expects (B, {cfg.in_channels}, {cfg.sample_size}, {cfg.sample_size}) inputs, got "
                             f"{tuple(x.shape)}; check DiTConfig.in_channels/sample_size (pixels or latents?)")
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed  # (B, N, D)
        conds = [embed(t, class_labels) for embed in self.conditioning]
        for i, block in enumerate(self.blocks):
            tokens = block(tokens, conds[i % len(conds)])
        return self.unpatchify(self.final_layer(tokens, conds[0]))

    def unpatchify(self, patches: torch.Tensor) -> torch.Tensor:
        """(B, N, p·p·C) tokens in row-major patch order → (B, C, H, W)."""
        g, p, c = self.cfg.grid_size, self.cfg.patch_size, self.cfg.out_channels
        x = patches.reshape(-1, g, g, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(-1, c, g * p, g * p)


# ---- diffusers' layout ---------------------------------------------------------------------------


def dit_config_from_diffusers(config: dict, shared_conditioning: bool = True) -> DiTConfig:
    """A `DiTConfig` for a diffusers `DiTTransformer2DModel` config.json; refuses what DiT here lacks."""
    unsupported = {"norm_type": "ada_norm_zero", "activation_fn": "gelu-approximate", "norm_elementwise_affine": False}
    for key, wanted in unsupported.items():
        if config.get(key, wanted) != wanted:
            raise ValueError(f"diffusers DiT config has {key}={config[key]!r}; tokenmind's DiT supports only "
                             f"{wanted!r}")
    in_channels = config.get("in_channels", 4)
    out_channels = config.get("out_channels") or in_channels
    if out_channels not in (in_channels, 2 * in_channels):
        raise ValueError(f"out_channels={out_channels} with in_channels={in_channels}: tokenmind's DiT predicts "
                         "in_channels (or 2x with learned sigma)")
    heads = config.get("num_attention_heads", 16)
    return DiTConfig(sample_size=config.get("sample_size", 32), in_channels=in_channels,
                     patch_size=config.get("patch_size", 2), hidden_size=heads * config.get("attention_head_dim", 72),
                     num_layers=config.get("num_layers", 28), num_heads=heads,
                     num_classes=config.get("num_embeds_ada_norm", 1000), learn_sigma=out_channels == 2 * in_channels,
                     shared_conditioning=shared_conditioning, attention_bias=config.get("attention_bias", True),
                     norm_eps=config.get("norm_eps", 1e-5))


def dit_config_to_diffusers(cfg: DiTConfig) -> dict:
    """The diffusers config.json of a DiT with `cfg`'s shape."""
    if cfg.pos_embed != "sincos" or cfg.mlp_ratio != 4.0:
        raise ValueError("diffusers' DiT has fixed sin-cos positions and an MLP 4x wide; this DiT "
                         f"(pos_embed={cfg.pos_embed!r}, mlp_ratio={cfg.mlp_ratio}) has no diffusers layout")
    return {"sample_size": cfg.sample_size, "in_channels": cfg.in_channels,
            "out_channels": cfg.out_channels, "patch_size": cfg.patch_size, "num_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "attention_head_dim": cfg.hidden_size // cfg.num_heads,
            "num_embeds_ada_norm": cfg.num_classes, "attention_bias": cfg.attention_bias, "norm_eps": cfg.norm_eps,
            "activation_fn": "gelu-approximate", "norm_type": "ada_norm_zero", "norm_elementwise_affine": False,
            "dropout": 0.0, "upcast_attention": False, "norm_num_groups": 32}


# diffusers name (after `transformer_blocks.{i}.`) → ours (after `blocks.{i}.`)
_BLOCK_KEYS = {"norm1.linear": "adaLN_modulation", "attn1.to_out.0": "attn.o_proj", "ff.net.0.proj": "mlp.fc1",
               "ff.net.2": "mlp.fc2"}
_CONDITIONING_KEYS = {"timestep_embedder.linear_1": "linear_1", "timestep_embedder.linear_2": "linear_2",
                      "class_embedder.embedding_table": "class_embedder"}
_TOP_KEYS = {"pos_embed.proj": "patch_embed", "proj_out_1": "final_layer.adaLN_modulation",
             "proj_out_2": "final_layer.linear"}


def blocks_share_conditioning(state_dict: dict[str, torch.Tensor]) -> bool:
    """Whether every block of a diffusers DiT state dict holds the same timestep/class embedder
    (true of checkpoints converted from the paper's code; false of one trained in diffusers)."""
    embedders = [(k.split(".", 2)[1], k.split(".emb.", 1)[1], v) for k, v in state_dict.items() if ".norm1.emb." in k]
    first = {name: v for block, name, v in embedders if block == "0"}
    return all(torch.equal(first[name], v) for _, name, v in embedders)


def dit_from_diffusers(state_dict: dict[str, torch.Tensor], cfg: DiTConfig) -> dict[str, torch.Tensor]:
    """A diffusers `DiTTransformer2DModel` state dict → a state dict for `DiT(cfg)` (q/k/v fused;
    with shared conditioning, block 0's embedder, after checking that the others equal it)."""
    if cfg.shared_conditioning and not blocks_share_conditioning(state_dict):
        raise ValueError("the blocks of this diffusers DiT have different timestep/class embedders; "
                         "load it with DiTConfig(shared_conditioning=False)")
    ours, rest = {}, dict(state_dict)

    def take(name: str) -> torch.Tensor:
        if name not in rest:
            raise ValueError(f"the diffusers DiT state dict lacks {name}; check that the config "
                             f"(num_layers={cfg.num_layers}) belongs to these weights")
        return rest.pop(name)

    for theirs, mine in _TOP_KEYS.items():
        for suffix in ("weight", "bias"):
            ours[f"{mine}.{suffix}"] = take(f"{theirs}.{suffix}")
    for i in range(cfg.num_layers):
        pre = f"transformer_blocks.{i}."
        for suffix in ("weight", "bias"):
            for theirs, mine in _BLOCK_KEYS.items():
                ours[f"blocks.{i}.{mine}.{suffix}"] = take(f"{pre}{theirs}.{suffix}")
            parts = [rest.pop(f"{pre}attn1.to_{n}.{suffix}", None) for n in "qkv"]
            if all(part is not None for part in parts):
                ours[f"blocks.{i}.attn.qkv_proj.{suffix}"] = torch.cat(parts)
        for theirs, mine in _CONDITIONING_KEYS.items():
            for suffix in ("weight", "bias"):
                tensor = rest.pop(f"{pre}norm1.emb.{theirs}.{suffix}", None)
                if tensor is not None and (i == 0 or not cfg.shared_conditioning):
                    ours[f"conditioning.{i}.{mine}.{suffix}"] = tensor
    if rest:
        raise ValueError(f"diffusers DiT tensors with no place in DiT({cfg}): {sorted(rest)[:5]}; "
                         "check num_layers and attention_bias against the checkpoint's config.json")
    return ours


def dit_to_diffusers(model: DiT) -> dict[str, torch.Tensor]:
    """`model`'s weights in diffusers' `DiTTransformer2DModel` layout (a shared embedder copied
    into every block, as diffusers' conversion of the paper's checkpoints does)."""
    cfg, state = model.cfg, {k: v.detach() for k, v in model.state_dict().items()}
    dit_config_to_diffusers(cfg)  # refuses what diffusers cannot hold
    theirs = {}
    for their_name, mine in _TOP_KEYS.items():
        for suffix in ("weight", "bias"):
            theirs[f"{their_name}.{suffix}"] = state[f"{mine}.{suffix}"]
    for i in range(cfg.num_layers):
        pre, j = f"transformer_blocks.{i}.", i if not cfg.shared_conditioning else 0
        for suffix in ("weight", "bias"):
            for their_name, mine in _BLOCK_KEYS.items():
                theirs[f"{pre}{their_name}.{suffix}"] = state[f"blocks.{i}.{mine}.{suffix}"]
            qkv = state.get(f"blocks.{i}.attn.qkv_proj.{suffix}")
            if qkv is not None:
                for n, part in zip("qkv", qkv.chunk(3)):
                    theirs[f"{pre}attn1.to_{n}.{suffix}"] = part
        for their_name, mine in _CONDITIONING_KEYS.items():
            for suffix in ("weight", "bias"):
                tensor = state.get(f"conditioning.{j}.{mine}.{suffix}")
                if tensor is not None:
                    theirs[f"{pre}norm1.emb.{their_name}.{suffix}"] = tensor.clone()  # safetensors refuses aliases
    return {k: v.contiguous() for k, v in theirs.items()}


def load_diffusers_dit(path: str | Path, dtype: torch.dtype = torch.float32) -> DiT:
    """A DiT from a diffusers-layout directory (config.json + diffusion_pytorch_model.safetensors),
    as `DiTTransformer2DModel.save_pretrained` or `save_diffusers_dit` writes it; shared conditioning
    when every block holds the same embedder."""
    config, state = read_weights_dir(path, DIFFUSERS_CLASS)
    cfg = dit_config_from_diffusers(config, shared_conditioning=blocks_share_conditioning(state))
    model = DiT(cfg)
    model.load_state_dict(dit_from_diffusers(state, cfg))
    return model.to(dtype).eval()


def save_diffusers_dit(model: DiT, path: str | Path) -> Path:
    """Write `model` so diffusers' `DiTTransformer2DModel.from_pretrained(path)` (and
    `load_diffusers_dit`) loads it; atomic."""
    return save_weights_dir(path, DIFFUSERS_CLASS, dit_config_to_diffusers(model.cfg), dit_to_diffusers(model))

