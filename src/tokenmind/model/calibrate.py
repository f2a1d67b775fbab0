"""Calibration for post-training quantization: token batches from text, and the block-by-block pass
that GPTQ (`model/gptq.py`) and AWQ (`model/awq.py`) quantize in.

Both methods choose a layer's int4 weights from the inputs X (tokens × in_features) it sees on
calibration text, and both only need two statistics of X: the second-moment matrix XᵀX (a linear's
output error ‖XΔWᵀ‖² for a weight change ΔW is tr(ΔW XᵀX ΔWᵀ), and GPTQ's Hessian is 2XᵀX) and
the mean |x| per input channel (AWQ's activation magnitude). `LinearStats` accumulates them from
forward hooks, so no activation matrix is kept.

`sequential_calibration` runs the model one decoder block at a time, as the GPTQ paper does: the
inputs of block i are produced by blocks 0..i-1 *after* they were quantized, so each block's
weights compensate for the error that reaches it. Per block it collects the stats of every
linear inside it on one pass, hands them to the method's `step`, then runs the (now quantized)
block again to make the next block's inputs. The LM head comes last, on the final norm's output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .transformer import Transformer


@dataclass
class LinearStats:
    """What a linear layer's calibration inputs tell the quantizers: XᵀX (in × in, float32 sum: its
    relative rounding over 10⁴ tokens stays ~1e-6, far below any quantization step), the sum of |x| per
    input channel, and the number of rows (tokens) seen."""

    xtx: torch.Tensor
    abs_sum: torch.Tensor
    rows: int = 0

    @classmethod
    def empty(cls, in_features: int) -> LinearStats:
        return cls(torch.zeros(in_features, in_features), torch.zeros(in_features))

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.xtx.addmm_(x.t(), x)
        self.abs_sum += x.abs().sum(dim=0)
        self.rows += x.shape[0]

    @property
    def mean_xtx(self) -> torch.Tensor:
        """XᵀX / rows (float32): the output error per token of ΔW is tr(ΔW · this · ΔWᵀ)."""
        return self.xtx / max(self.rows, 1)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.rows, 1)


class _Captured(Exception):
    """Raised by the hook on the first block once it has its inputs: the rest of the forward is not needed."""


# step(scope, stats): quantize the linears of `scope` (a decoder block, or the model for its LM head)
# named in `stats` (names relative to scope) in place.
Step = Callable[[nn.Module, dict[str, LinearStats]], None]


def _linears(scope: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, nn.Linear]:
    return {name: m for name, m in scope.named_modules() if isinstance(m, nn.Linear)
            and name.rsplit(".", 1)[-1] not in skip}


@torch.no_grad()
def _collect(scope: nn.Module, linears: dict[str, nn.Linear], run: Callable[[], None]) -> dict[str, LinearStats]:
    stats = {name: LinearStats.empty(m.in_features) for name, m in linears.items()}
    hooks = [m.register_forward_pre_hook(lambda _m, args, s=stats[name]: s.add(args[0]))
             for name, m in linears.items()]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return stats


@torch.no_grad()
def sequential_calibration(model: Transformer, calibration_ids: torch.Tensor, step: Step, *,
                           batch_size: int = 8, quantize_lm_head: bool = True,
                           skip: tuple[str, ...] = ("gate", "shared_expert_gate")) -> Transformer:
    """Quantize `model` block by block with `step` (see the module docstring); returns `model`.

    calibration_ids: (N, T) token ids. skip: linear names left in float (a mixture of experts'
    routers, as `quant.quantize_model` keeps them). quantize_lm_head=False leaves the head alone.
    """
    if calibration_ids.ndim != 2 or calibration_ids.numel() == 0:
        raise ValueError(f"calibration_ids must be a non-empty (sequences, tokens) tensor, got shape "
                         f"{tuple(calibration_ids.shape)}")
    if model.cfg.num_nextn_predict_layers:
        raise ValueError("calibrated quantization does not cover multi-token prediction depths; load the "
                         "model without them or use round-to-nearest (quantize='int4')")
    first = model.layers[0]
    batches: list[list] = []  # per calibration batch: the positional arguments of a block call

    def capture(_module, args):
        batches.append(list(args))
        raise _Captured

    hook = first.register_forward_pre_hook(capture)
    try:
        for ids in calibration_ids.split(batch_size):
            try:
                model.hidden_states(ids)
            except _Captured:
                pass
    finally:
        hook.remove()
    for layer in model.layers:
        linears = _linears(layer, skip)

        def run_all(layer=layer):
            for b in batches:
                layer(*b)

        step(layer, _collect(layer, linears, run_all))
        for b in batches:  # the next block's inputs come from this block as quantized
            b[0] = layer(*b)
    if quantize_lm_head:
        stats = LinearStats.empty(model.cfg.hidden_size)
        for b in batches:
            stats.add(model.norm(b[0]))
        step(model, {"lm_head": stats})
    return model


def calibration_ids(texts: Iterable[str], tokenizer, num_sequences: int = 32, seq_len: int = 256) -> torch.Tensor:
    """(num_sequences, seq_len) token ids cut from `texts` joined by EOS: the first
    num_sequences · seq_len tokens, so the same texts always give the same batch."""
    need = num_sequences * seq_len
    sep = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text, add_special_tokens=False) + sep
        if len(ids) >= need:
            return torch.tensor(ids[:need]).view(num_sequences, seq_len)
    raise ValueError(f"the calibration text holds {len(ids):,} tokens, fewer than the {need:,} asked for "
                     f"({num_sequences} sequences × {seq_len}); give more text or fewer/shorter sequences")


def read_calibration_texts(path: str | Path, text_field: str = "text") -> Iterable[str]:
    """The texts of a .txt/.jsonl/.parquet file or a folder of them (`data.readers`), in a fixed order."""
    from ..data.readers import ReaderConfig, read_documents

    return (doc.text for doc in read_documents(path, ReaderConfig(text_field=text_field)))
