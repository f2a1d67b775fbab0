"""FP8 training, simulated faithfully on CPU: per-tensor scaled casts with delayed scaling.

An FP8 GEMM (H100 tensor cores) multiplies two 8-bit tensors and accumulates in fp32. Training
with it (the Transformer Engine recipe, Micikevicius et al. 2022, "FP8 Formats for Deep
Learning") casts the inputs of every projection's three matmuls:

* forward  y = x·Wᵀ:        x and W in float8_e4m3fn (3 mantissa bits, max 448: precision);
* backward dx = dy·W, dW = dyᵀ·x: the gradient dy in float8_e5m2 (2 mantissa bits, max 57344:
  range, since gradients span more orders of magnitude than weights and activations).

Eight bits cover a narrow range, so each tensor is multiplied by a per-tensor `scale` before the
cast (`quantize`: scale, clamp to ±fp8_max — the saturating cast — round to fp8) and the GEMM's
fp32 result is divided by both scales. Delayed scaling picks the scale from the tensor's
*previous* amaxes (largest |value|) instead of its own: each `Fp8Linear` keeps an amax history
of the last `amax_history_len` calls for x, W and dy, and scale = fp8_max / (max(history) · 2^margin).
That avoids a reduction over the tensor before the cast (on a GPU, a second pass over memory)
at the risk of clamping a value that outgrew the history; the call's own amax joins the history
afterwards. The very first call, with an empty history, uses its own amax.

The matmul is `torch._scaled_mm` (it runs on CPU in torch 2.13: the fp8 operands are upcast
exactly and multiplied with fp32 accumulation), so every value the simulated GEMM sees is the
value an FP8 GEMM would see; only the speed is not an FP8 tensor core's. The rest of the model
(attention scores, norms, the LM head, embeddings) runs in bf16 autocast, as in Transformer
Engine; the master weights and optimizer state stay fp32. Histories advance only in training
mode; they are per-rank state (not in `state_dict`, so exports and model checkpoints are
unchanged) that the trainer saves with each rank's checkpoint part (`fp8_state`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_INPUT, _WEIGHT, _GRAD = 0, 1, 2  # rows of an Fp8Linear's amax_history


@dataclass(frozen=True)
class Fp8Recipe:
    """Delayed scaling. amax_history_len: calls remembered per tensor (1 = the previous call only).
    margin: scale down by 2^margin more, headroom for amaxes that grow between calls."""

    amax_history_len: int = 16
    margin: int = 0

    def __post_init__(self) -> None:
        if self.amax_history_len < 1:
            raise ValueError(f"fp8 amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"fp8 margin must be >= 0, got {self.margin}")


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x · scale cast to the fp8 `dtype`, saturating at ±fp8_max (the GPU recipes' cast; a plain
    `.to()` would turn out-of-range values into NaN for e5m2)."""
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """fp8_max / (amax · 2^margin): the largest magnitude lands at the top of the fp8 range; 1 for amax 0."""
    scale = torch.finfo(dtype).max / (amax.float() * 2.0**margin)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _delayed_scale(history: torch.Tensor, current: torch.Tensor, dtype: torch.dtype, margin: int,
                   record: bool) -> torch.Tensor:
    """The scale from one amax history row (its own amax `current` while the history is empty), then
    `current` recorded as the newest entry when `record`."""
    past = history.max()
    scale = scale_from_amax(torch.where(past > 0, past, current), dtype, margin)
    if record:
        history.copy_(history.roll(1))
        history[0] = current
    return scale


def _scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """(a / scale_a) @ (b / scale_b) for fp8 a (M, K) and b (K, N), fp32 accumulation. The FP8
    GEMM wants a row-major and b column-major (as cuBLASLt's fp8 kernels do); copies make them so."""
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=scale_a.reciprocal(),
                            scale_b=scale_b.reciprocal(), out_dtype=out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """x (N, in) @ weightᵀ with fp8 inputs; the backward's two GEMMs take dy in e5m2 and the saved
    fp8 x and W (saved in 8 bits, as the GPU recipe keeps them)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor, margin: int,
                out_dtype: torch.dtype, record: bool) -> torch.Tensor:
        x_scale = _delayed_scale(history[_INPUT], x.abs().amax(), E4M3, margin, record)
        w_scale = _delayed_scale(history[_WEIGHT], weight.abs().amax(), E4M3, margin, record)
        xq, wq = quantize(x, x_scale, E4M3), quantize(weight, w_scale, E4M3)
        ctx.save_for_backward(xq, wq, x_scale, w_scale)
        ctx.history = history  # updated in place by the backward too: not a saved (version-checked) tensor
        ctx.margin, ctx.record, ctx.x_dtype, ctx.w_dtype = margin, record, x.dtype, weight.dtype
        return _scaled_matmul(xq, wq.t(), x_scale, w_scale, out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xq, wq, x_scale, w_scale = ctx.saved_tensors
        g_scale = _delayed_scale(ctx.history[_GRAD], grad.abs().amax(), E5M2, ctx.margin, ctx.record)
        gq = quantize(grad, g_scale, E5M2)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _scaled_matmul(gq, wq, g_scale, w_scale, ctx.x_dtype)  # (N, out) @ (out, in)
        if ctx.needs_input_grad[1]:  # not for a frozen (LoRA) base
            grad_w = _scaled_matmul(gq.t(), xq, g_scale, x_scale, ctx.w_dtype)  # (out, N) @ (N, in)
        return grad_x, grad_w, None, None, None, None


class Fp8Linear(nn.Linear):
    """An `nn.Linear` whose matmul runs through FP8 casts with delayed scaling. It shares the
    original layer's parameters (same names in `state_dict`); the bias is added in the output's
    precision. amax_history: (3, amax_history_len) for input, weight and output gradient."""

    def __init__(self, linear: nn.Linear, recipe: Fp8Recipe) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.recipe = linear.in_features, linear.out_features, recipe
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("amax_history", torch.zeros(3, recipe.amax_history_len, device=linear.weight.device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        y = _Fp8Matmul.apply(x.reshape(-1, self.in_features), self.weight, self.amax_history, self.recipe.margin,
                             out_dtype, self.training)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.recipe}"


def enable_fp8(model: nn.Module, recipe: Fp8Recipe | None = None) -> list[str]:
    """Swap every plain `nn.Linear` of `model` in place for an `Fp8Linear` (same parameters);
    returns their names. The LM head stays in higher precision, as in the FP8 recipes: its
    logits feed the softmax over the vocabulary, where 3 mantissa bits cost the most, and a
    tied head is the embedding table. Subclasses of `nn.Linear` (MoE routers) are left alone."""
    recipe = recipe or Fp8Recipe()
    head = getattr(model, "lm_head", None)
    swapped = []
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and module is not head:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Fp8Linear(module, recipe))
            swapped.append(name)
    return swapped


def fp8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every `Fp8Linear`'s amax history by module name (what an exact resume needs)."""
    return {name: m.amax_history.clone() for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def load_fp8_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore `fp8_state`; the model's FP8 layers must be the ones saved."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    if layers.keys() != state.keys():
        raise ValueError(f"the checkpoint's FP8 layers ({len(state)}) are not this model's ({len(layers)}); "
                         "resume with the train.precision and model config the run was saved with")
    for name, history in state.items():
        layers[name].amax_history.copy_(history)
