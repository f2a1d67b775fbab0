"""Cross-entropy through the output layer without the (tokens × vocab) logits.

A language model's loss reads logits = hidden · Wᵀ for every trained token: with SmolLM2's 49,152
words and 1,024 tokens that is 200 MB in fp32, and the plain path keeps three of them (logits,
log-softmax, its gradient). `linear_cross_entropy` walks the tokens in chunks instead: per chunk
it computes the logits, their log-sum-exp and target logit, and right away the gradient of the
summed loss with respect to the logits (softmax − one-hot), which it multiplies into the
gradients of the hidden states (and of W when W trains). Only a chunk's logits ever exist; the
backward pass just scales the stored gradients by the incoming one (the loss is a scalar). The
matmuls are the plain path's (logits, dlogits · W, dlogitsᵀ · hidden); the elementwise passes
over the vocabulary run on a cache-sized chunk.

Under autocast the two matmuls run in the autocast dtype, as `nn.Linear` would, and the softmax
in fp32, as the plain path's upcast does.
"""

from __future__ import annotations

import torch

from tokenmind.model.lora import autocast_dtype

# Rows per chunk: 128 × 49,152 fp32 logits is 25 MB, about a last-level cache, and keeps the
# matmuls wide enough to run at full speed.
CHUNK_ROWS = 128


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None,
                chunk: int, grads: bool) -> torch.Tensor:
        dtype = autocast_dtype(hidden)
        h, w = hidden.to(dtype), weight.to(dtype)
        grad_h = torch.empty_like(hidden) if grads and ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if grads and ctx.needs_input_grad[1] else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, h.shape[0], chunk):
            rows, t = h[start:start + chunk], targets[start:start + chunk]
            logits = (rows @ w.t()).float()
            if softcap is not None:
                logits = torch.tanh(logits.div_(softcap))
                slope = 1 - logits.square()  # d(cap·tanh(z/cap))/dz
                logits.mul_(softcap)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, t[:, None])[:, 0]
            loss += (lse - picked).sum()
            if grad_h is None and grad_w is None:
                continue
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            grad.scatter_add_(1, t[:, None], torch.full_like(picked[:, None], -1.0))
            if softcap is not None:
                grad.mul_(slope)
            grad = grad.to(dtype)
            if grad_h is not None:
                grad_h[start:start + chunk] = grad @ w
            if grad_w is not None:
                grad_w.addmm_(grad.t().float(), rows.float())
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss.to(grad_h.dtype) if grad_h is not None else None
        return (grad_h * scale if grad_h is not None else None,
                (grad_w * grad_loss).to(ctx.weight_dtype) if grad_w is not None else None, None, None, None, None)


@torch.compiler.disable  # a Python loop over chunks: compiled graphs call it as it is
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                         softcap: float | None = None, chunk: int = CHUNK_ROWS) -> torch.Tensor:
    """Σ over targets ≠ ignore_index of −log softmax(s(hidden · weightᵀ))[target], where s is
    cap·tanh(·/cap) with `softcap`, else the identity; hidden (..., H), weight (V, H), targets
    hidden's leading shape. Equal to `F.cross_entropy(logits, targets, reduction="sum")` on the
    full logits, gradients included, without holding them (see the module docstring)."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    keep = targets != ignore_index
    if not bool(keep.all()):  # prompt tokens, padding: no logits at all there
        rows = keep.nonzero()[:, 0]
        hidden, targets = hidden.index_select(0, rows), targets.index_select(0, rows)
    if targets.numel() == 0:
        return hidden.sum() * 0.0  # keeps the graph (and zero gradients) for backward
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)  # not in evaluation
    return _LinearCrossEntropy.apply(hidden, weight, targets, softcap, chunk, grads)
