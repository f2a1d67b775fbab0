"""A small vision-language-action model (VLA) for PushT with two action heads.

The SmolVLA / π0 pattern (Shukor et al. 2025; Black et al. 2024): a vision encoder turns the frame
into image tokens, a language model reads them with a language instruction ("push the T onto the
target") and a state token (the agent's position, projected), and an action head turns what the
LM read into a chunk of T_p future actions. The vision side and the splice are the LLaVA-style
VLM's (`vision/vlm.py`: `ViT` → `Projector` → image tokens written over placeholder ids); the
LM is SmolLM2-135M cut to its first `lm_layers` blocks (SmolVLA also keeps only the lower half:
those layers' features suit control as well, and each cut layer is a CPU second saved), frozen,
with optional LoRA (`model/lora.py`).

Prefix (causal, as the LM was trained): [image tokens, instruction tokens, state token].

Heads (`VLAConfig.head`):

* "flow" — π0's flow-matching action expert: a small transformer (the project's `Block`s) over
  [the LM's prefix hidden states projected to its width, the noisy action chunk's T_p tokens + a
  timestep embedding] under π0's blockwise-causal mask (`pi0_block_mask`); it predicts the
  velocity ε − x₀ of rectified flow,
  trained with the image flow-matching objective (`policy_train.ChunkDenoisingObjective`) and
  sampled with `num_inference_steps` Euler steps (`FlowMatchEulerScheduler`).
* "tokens" — RT-2 / OpenVLA's action tokenization: every action dimension, normalised to
  [−1, 1] by the demonstrations' min/max, is cut into n_bins equal bins, and bin b is the LM's
  token id vocab_size − n_bins + b (OpenVLA's choice: the last, least-frequent BPE merges of the
  vocabulary; for SmolLM2 ids 48896..49151). Those tokens' input-embedding and LM-head rows are
  copied out and trained (OpenVLA fine-tunes the whole LM; here the LM is frozen or LoRA'd, so the
  action rows are what is free to move). The LM predicts the chunk's T_p·A tokens one after
  another (time-major: x₀, y₀, x₁, …) with next-token cross-entropy on the action tokens only;
  acting decodes greedily over those n_bins tokens, so the answer is always an action.

`VLA` has `DiffusionPolicy`'s interface (`cfg.n_obs_steps`/`n_action_steps`, `normalizer`,
`encode_obs`, `forward(x_t, t, cond)`, `predict_action_chunk`), so `policy.ChunkingPolicy` runs
it with receding-horizon action chunking and the one evaluation harness scores it.

On disk: config.json ({"kind": "vla", "policy": the `VLAConfig`, "lm_config": the truncated LM's
HF config, "image_token_id", "instruction_ids"}) + model.safetensors (all weights, the frozen LM
rows included, so a saved VLA needs nothing else), written atomically (`save_vla`, `load_vla`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tokenmind.config import build_config, config_dict
from tokenmind.diffusion.embeddings import timestep_embedding
from tokenmind.diffusion.objectives import T_SAMPLINGS
from tokenmind.diffusion.sampling import sample
from tokenmind.diffusion.schedules import FlowMatchEulerScheduler
from tokenmind.model.attention import DenseMask
from tokenmind.model.config import ModelConfig
from tokenmind.model.lora import LoRAConfig, add_lora
from tokenmind.model.transformer import Block, Transformer, rms_norm
from tokenmind.tokenizer import Tokenizer
from tokenmind.vision.vit import ViT, ViTConfig
from tokenmind.vision.vlm import VisionLanguageModel, choose_image_token

from .diffusion_policy import Normalizer, crop, read_policy_config, write_policy_dir

KIND = "vla"  # config.json's "kind": what `policy.load_policy` builds
HEADS = ("flow", "tokens")
INSTRUCTION = "push the T onto the target"

def pi0_block_mask(block_sizes: list[int], device: torch.device | None = None) -> DenseMask:
    """π0's blockwise-causal attention (Black et al. 2024): the sequence is cut into blocks and a
    token sees every token of its own block and of the blocks before it. For the action expert the
    blocks are [image + instruction], [state], [actions]: the image and text attend bidirectionally
    among themselves and never to the state or the actions, the state sees them and itself, the action
    tokens see everything, each other included. So the prefix's rows are the same at every flow step
    (whatever x_t and t), and what the expert reads of the observation cannot be shaped by the noise."""
    sizes = torch.tensor(block_sizes, device=device)
    block = torch.repeat_interleave(torch.arange(len(block_sizes), device=device), sizes)
    return DenseMask((block[None, :] <= block[:, None])[None, None], causal=False)  # (1, 1, T, T): query row, key col


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class VLAConfig:
    """The VLA's parts.

    head: flow (π0-style action expert) or tokens (RT-2/OpenVLA action tokens). lm: the language
    model `load_model` reads (training only; a saved VLA carries its LM). lm_layers: how many of its
    lowest blocks are kept. lora_rank: 0 freezes the kept LM; > 0 adds LoRA of that rank (alpha
    2·rank) to every kept block. instruction: the language prompt.
    n_obs_steps must be 1 (one frame and position per decision); horizon (T_p) actions out,
    n_action_steps (T_a) executed before re-planning. Vision: the crop_size crop (random in
    training, central when acting) of the image_size frame, cut into patch_size patches by a ViT of
    vision_hidden/vision_layers/vision_heads trained from scratch, pooled to pool_grid² image tokens
    (0: every patch). Flow head: expert_hidden/expert_layers/expert_heads; t_sampling,
    num_train_timesteps (the model's time scale), num_inference_steps (Euler steps), noise_draws
    (noisy copies per sample). Tokens head: n_bins per action dimension.
    """

    head: str = "flow"
    lm: str = "smollm2"
    lm_layers: int = 4
    lora_rank: int = 0
    instruction: str = INSTRUCTION
    n_obs_steps: int = 1
    horizon: int = 16
    n_action_steps: int = 8
    action_dim: int = 2
    state_dim: int = 2
    image_size: int = 96
    crop_size: int = 84
    patch_size: int = 12
    vision_hidden: int = 128
    vision_layers: int = 2
    vision_heads: int = 4
    pool_grid: int = 3
    expert_hidden: int = 128
    expert_layers: int = 3
    expert_heads: int = 4
    t_sampling: str = "uniform"
    num_train_timesteps: int = 1000
    num_inference_steps: int = 10
    noise_draws: int = 1
    n_bins: int = 256

    def __post_init__(self) -> None:
        _check(self.head in HEADS, f"policy.head={self.head!r} is not one of {', '.join(HEADS)}")
        _check(self.lm_layers >= 1, f"policy.lm_layers must be >= 1, got {self.lm_layers}")
        _check(self.lora_rank >= 0, f"policy.lora_rank must be >= 0 (0 = frozen LM), got {self.lora_rank}")
        _check(self.n_obs_steps == 1, f"policy.n_obs_steps must be 1 (the VLA reads one frame), got {self.n_obs_steps}")
        _check(1 <= self.n_action_steps <= self.horizon,
               f"policy.n_action_steps={self.n_action_steps} must be in [1, horizon={self.horizon}]")
        _check(0 < self.crop_size <= self.image_size and self.crop_size % self.patch_size == 0,
               f"policy.crop_size={self.crop_size} must be in (0, image_size={self.image_size}] and a multiple of "
               f"patch_size={self.patch_size}")
        _check(self.t_sampling in T_SAMPLINGS, f"policy.t_sampling={self.t_sampling!r} is not one of "
               f"{', '.join(T_SAMPLINGS)}")
        _check(self.num_inference_steps >= 1 and self.noise_draws >= 1,
               "policy.num_inference_steps and policy.noise_draws must be >= 1")
        _check(2 <= self.n_bins, f"policy.n_bins must be >= 2, got {self.n_bins}")

    @property
    def objective(self) -> str:
        """What `ChunkDenoisingObjective` trains: always rectified flow (π0's)."""
        return "flow"

    def vit_config(self) -> ViTConfig:
        return ViTConfig(image_size=self.crop_size, patch_size=self.patch_size, in_channels=3,
                         hidden_size=self.vision_hidden, num_layers=self.vision_layers, num_heads=self.vision_heads,
                         intermediate_size=4 * self.vision_hidden, pool="mean")


class ActionExpert(nn.Module):
    """(x_t (B, T_p, A), t (B,), context (B, L, D_lm)) → velocity (B, T_p, A): `Block`s over the
    projected context (the LM's rows over image + instruction tokens, then the state token's row
    last) followed by the action tokens (each: its noisy action, its position in the chunk, the
    timestep), under `pi0_block_mask`; RoPE is the identity, positions are learned (as in the ViT)."""

    def __init__(self, cfg: VLAConfig, context_dim: int):
        super().__init__()
        e = cfg.expert_hidden
        mcfg = ModelConfig(vocab_size=1, hidden_size=e, intermediate_size=4 * e, num_hidden_layers=cfg.expert_layers,
                           num_attention_heads=cfg.expert_heads, max_position_embeddings=cfg.horizon,
                           rms_norm_eps=1e-6)
        self.context_proj = nn.Linear(context_dim, e)
        self.action_in = nn.Linear(cfg.action_dim, e)
        self.time_mlp = nn.Sequential(nn.Linear(e, e), nn.SiLU(), nn.Linear(e, e))
        self.pos = nn.Parameter(torch.randn(1, cfg.horizon, e) * 0.02)
        self.layers = nn.ModuleList(Block(mcfg, i) for i in range(cfg.expert_layers))
        self.norm = rms_norm(mcfg)
        self.out = nn.Linear(e, cfg.action_dim)
        self.register_buffer("rope_cos", torch.ones(1, 1, 1, mcfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.zeros(1, 1, 1, mcfg.head_dim), persistent=False)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden_states(x_t, t, context)[:, -x_t.shape[1]:])

    def hidden_states(self, x_t: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The final-normed rows (B, L + T_p, expert_hidden) of the context and the action tokens."""
        e = self.pos.shape[-1]
        time = self.time_mlp(timestep_embedding(t, e).to(self.pos.dtype))
        actions = self.action_in(x_t.to(self.pos.dtype)) + self.pos + time[:, None]
        h = torch.cat([self.context_proj(context.to(self.pos.dtype)), actions], dim=1)
        mask = pi0_block_mask([context.shape[1] - 1, 1, x_t.shape[1]], h.device)
        cos, sin = self.rope_cos.to(h.dtype), self.rope_sin.to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)


class VLA(nn.Module):
    """normalizer + vlm (ViT, projector, the truncated LM) + state_proj + the head's parts (the
    flow head's `expert`; the tokens head uses the LM's own embedding and output rows)."""

    def __init__(self, cfg: VLAConfig, language_model: Transformer, image_token_id: int, instruction_ids: list[int]):
        super().__init__()
        _check(len(language_model.layers) == cfg.lm_layers,
               f"the language model has {len(language_model.layers)} blocks, policy.lm_layers={cfg.lm_layers}; build "
               "it with build_vla (which cuts the LM)")
        vocab = language_model.cfg.vocab_size
        _check(cfg.n_bins <= vocab, f"policy.n_bins={cfg.n_bins} exceeds the LM's vocabulary of {vocab}")
        self.cfg = cfg
        self.normalizer = Normalizer(cfg.state_dim, cfg.action_dim)
        self.vlm = VisionLanguageModel(ViT(cfg.vit_config()), language_model, image_token_id, cfg.pool_grid)
        self.instruction_ids = list(instruction_ids)
        prompt = [image_token_id] * self.vlm.tokens_per_image + self.instruction_ids
        self.register_buffer("prompt_ids", torch.tensor(prompt, dtype=torch.long)[None], persistent=False)
        self.register_buffer("action_token_ids", torch.arange(vocab - cfg.n_bins, vocab), persistent=False)
        hidden = language_model.cfg.hidden_size
        self.state_proj = nn.Linear(cfg.state_dim, hidden)
        self.expert = ActionExpert(cfg, hidden) if cfg.head == "flow" else None
        if cfg.head == "tokens":  # the action tokens' own input and output rows, trained (OpenVLA trains them all)
            ids = self.action_token_ids
            self.action_embed = nn.Parameter(language_model.embed_tokens.weight.detach()[ids].clone())
            self.action_out = nn.Parameter(language_model.lm_head.weight.detach()[ids].clone())
        self.gradient_checkpointing = False  # set by the Trainer; handed to the language model

    @property
    def language_model(self) -> Transformer:
        return self.vlm.language_model

    @property
    def prefix_length(self) -> int:
        return self.prompt_ids.shape[1] + 1

    # ---- the shared prefix ----

    def prefix_embeddings(self, pixels: torch.Tensor, agent_pos: torch.Tensor,
                          generator: torch.Generator | None = None) -> torch.Tensor:
        """uint8 pixels (B, 1, H, W, 3) and agent_pos (B, 1, state_dim) in env units → the LM's input
        rows (B, prefix_length, D): image tokens, instruction, state token. generator: random crops
        (training); None: the centre crop."""
        if agent_pos.shape[1] != 1:
            raise ValueError(f"the VLA reads one observation, got windows of {agent_pos.shape[1]}")
        x = pixels[:, -1].permute(0, 3, 1, 2).float() / 127.5 - 1
        x = crop(x, self.cfg.crop_size, generator)
        rows = self.vlm.embed(self.prompt_ids.expand(len(x), -1), x)
        state = self.state_proj(self.normalizer.normalize("state", agent_pos[:, -1]))
        return torch.cat([rows, state[:, None].to(rows.dtype)], dim=1)

    def run_lm(self, rows: torch.Tensor) -> torch.Tensor:
        """Input rows (B, T, D) → the truncated LM's final-normed hidden states (B, T, D), causal."""
        lm = self.language_model
        lm.gradient_checkpointing = self.gradient_checkpointing
        return lm.norm(lm.run_layers(rows))

    def encode_obs(self, pixels: torch.Tensor, agent_pos: torch.Tensor,
                   generator: torch.Generator | None = None) -> torch.Tensor:
        """The flow head's context: the LM's hidden states over the prefix, (B, prefix_length, D)."""
        return self.run_lm(self.prefix_embeddings(pixels, agent_pos, generator))

    # ---- flow head ----

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The action expert's velocity for normalised noisy chunks x_t at model time t."""
        if self.expert is None:
            raise ValueError("this VLA has the tokens head; its loss is action_token_logits, not a velocity")
        return self.expert(x_t, t, cond)

    # ---- tokens head ----

    def to_bins(self, action: torch.Tensor) -> torch.Tensor:
        """Actions in env units (..., A) → bin indices (..., A) in [0, n_bins)."""
        unit = (self.normalizer.normalize("action", action) + 1) / 2
        return (unit * self.cfg.n_bins).floor().long().clamp(0, self.cfg.n_bins - 1)

    def from_bins(self, bins: torch.Tensor) -> torch.Tensor:
        """Bin indices (..., A) → their centres in env units (..., A)."""
        return self.normalizer.unnormalize("action", (bins.float() + 0.5) / self.cfg.n_bins * 2 - 1)

    def bin_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., D) → logits (..., n_bins) of the action tokens (their LM-head rows)."""
        return F.linear(hidden, self.action_out.to(hidden.dtype))

    def embed_bins(self, bins: torch.Tensor) -> torch.Tensor:
        """Bin indices (...) → the action tokens' input embeddings (..., D), scaled as the LM scales its own."""
        rows = self.action_embed[bins]
        lm_cfg = self.language_model.cfg
        return rows * lm_cfg.hidden_size ** 0.5 if lm_cfg.scale_embeddings else rows

    def action_token_logits(self, pixels: torch.Tensor, agent_pos: torch.Tensor, action: torch.Tensor,
                            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (B, T_p·A, n_bins), target bins (B, T_p·A)) under teacher forcing: the prefix, then
        each action token's embedding; position p's output predicts action token p."""
        bins = self.to_bins(action).flatten(1)
        prefix = self.prefix_embeddings(pixels, agent_pos, generator)
        tokens = self.embed_bins(bins[:, :-1]).to(prefix.dtype)
        hidden = self.run_lm(torch.cat([prefix, tokens], dim=1))
        return self.bin_logits(hidden[:, prefix.shape[1] - 1:]), bins

    @torch.no_grad()
    def decode_action_tokens(self, pixels: torch.Tensor, agent_pos: torch.Tensor) -> torch.Tensor:
        """Greedy decoding of T_p·A action tokens → bins (B, T_p, A). Each token re-runs the short
        sequence (no KV cache: at ≤ 60 tokens and a few blocks that costs less than it saves)."""
        rows = self.prefix_embeddings(pixels, agent_pos)
        bins = []
        for _ in range(self.cfg.horizon * self.cfg.action_dim):
            b = self.bin_logits(self.run_lm(rows)[:, -1]).argmax(-1)
            bins.append(b)
            rows = torch.cat([rows, self.embed_bins(b)[:, None].to(rows.dtype)], 1)
        return torch.stack(bins, 1).view(len(rows), self.cfg.horizon, self.cfg.action_dim)

    # ---- acting ----

    @torch.no_grad()
    def predict_action_chunk(self, pixels: torch.Tensor, agent_pos: torch.Tensor,
                             generator: torch.Generator | None = None, steps: int | None = None) -> torch.Tensor:
        """(B, horizon, action_dim) actions in env units: flow — Euler-sampled from N(0, I) noise drawn
        with `generator` in `steps` steps (default num_inference_steps); tokens — greedy tokens."""
        if self.cfg.head == "tokens":
            return self.from_bins(self.decode_action_tokens(pixels, agent_pos))
        cond = self.encode_obs(pixels, agent_pos)
        shape = (len(cond), self.cfg.horizon, self.cfg.action_dim)
        chunk = sample(self, FlowMatchEulerScheduler(self.cfg.num_train_timesteps), shape, cond,
                       steps or self.cfg.num_inference_steps, generator=generator, precision="fp32")
        return self.normalizer.unnormalize("action", chunk.clamp(-1, 1))


def truncate_lm(language_model: Transformer, layers: int) -> Transformer:
    """`language_model` keeping only its first `layers` blocks (in place; config updated to match)."""
    total = len(language_model.layers)
    _check(1 <= layers <= total, f"policy.lm_layers={layers} must be in [1, {total}] (the LM's blocks)")
    language_model.layers = language_model.layers[:layers]
    language_model.cfg = replace(language_model.cfg, num_hidden_layers=layers)
    return language_model


def prepare_lm(cfg: VLAConfig, language_model: Transformer, seed: int = 0) -> Transformer:
    """Cut the LM to cfg.lm_layers, freeze it, and add LoRA when cfg.lora_rank > 0."""
    lm = truncate_lm(language_model, cfg.lm_layers)
    lm.requires_grad_(False)
    if cfg.lora_rank:
        add_lora(lm, LoRAConfig(rank=cfg.lora_rank, alpha=2.0 * cfg.lora_rank), seed=seed)
    return lm


def build_vla(cfg: VLAConfig, language_model: Transformer, tokenizer: Tokenizer, seed: int = 0) -> VLA:
    """A fresh VLA around a pretrained LM (cut, frozen, LoRA'd per cfg): the image placeholder is
    `choose_image_token`'s, the instruction is tokenized once; the new parts start from `seed`."""
    token_id = tokenizer.token_to_id(choose_image_token(tokenizer))
    instruction = tokenizer.encode(cfg.instruction)
    _check(len(instruction) > 0, "policy.instruction is empty; give the VLA a language instruction")
    lm = prepare_lm(cfg, language_model, seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return VLA(cfg, lm, token_id, instruction)


def save_vla(model: VLA, path: str | Path, state: dict[str, torch.Tensor] | None = None,
             extra: dict | None = None) -> Path:
    """Write `model` (or `state`, e.g. its EMA weights) as config.json + model.safetensors, atomically.
    A tied LM head is stored once (as the embedding)."""
    state = dict(model.state_dict() if state is None else state)
    lm = model.language_model
    if lm.cfg.tie_word_embeddings:
        state.pop("vlm.language_model.lm_head.weight", None)
    config = {"kind": KIND, "policy": config_dict(model.cfg), "lm_config": lm.cfg.to_hf(),
              "image_token_id": model.vlm.image_token_id, "instruction_ids": model.instruction_ids, **(extra or {})}
    return write_policy_dir(path, config, state)


def load_vla(path: str | Path, device: str | torch.device = "cpu") -> VLA:
    """The VLA saved at `path` (config.json + model.safetensors), in eval mode."""
    path = Path(path)
    config = read_policy_config(path, KIND)
    cfg = build_config(VLAConfig, config["policy"])
    lm = Transformer(ModelConfig.from_hf(config["lm_config"]))
    model = VLA(cfg, prepare_lm(cfg, lm), int(config["image_token_id"]), config["instruction_ids"])
    missing, unexpected = model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    tied = {"vlm.language_model.lm_head.weight"} if lm.cfg.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path}/model.safetensors does not match its config (missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}); re-export the run")
    if tied:
        lm.lm_head.weight = lm.embed_tokens.weight
    return model.to(device).eval()
