"""The chunked output-layer cross-entropy (`train/losses.py`) against F.cross_entropy on full
logits: loss and gradients of the hidden states and of the head, with soft-capping, ignored
targets and chunks that do not divide the rows; and the next-token objective's use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.data.loader import IGNORE_INDEX
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.train.losses import linear_cross_entropy
from tokenmind.train.objectives import fuses_output_layer, token_loss


def _plain(hidden, weight, targets, softcap):
    logits = hidden @ weight.t()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_chunked_loss_and_gradients_equal_full_logits(softcap) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=g)
    weight = torch.randn(50, 16, generator=g)
    targets = torch.randint(50, (3, 7), generator=g)
    targets[0, :4] = IGNORE_INDEX
    targets[2, -1] = IGNORE_INDEX
    grads = []
    for fn in (lambda h, w: _plain(h, w, targets, softcap),
               lambda h, w: linear_cross_entropy(h, w, targets, IGNORE_INDEX, softcap, chunk=4)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w)
        (loss * 3).backward()  # the incoming gradient scales both
        grads.append((loss.detach(), h.grad, w.grad))
    for plain, fused in zip(*grads):
        torch.testing.assert_close(fused, plain)
    assert grads[1][1][0, :4].abs().max() == 0  # ignored positions get no gradient


def test_frozen_head_gets_no_gradient_and_evaluation_skips_them() -> None:
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 8, generator=g, requires_grad=True), torch.randn(20, 8, generator=g)
    targets = torch.randint(20, (9,), generator=g)
    loss = linear_cross_entropy(hidden, weight, targets, IGNORE_INDEX)
    loss.backward()
    assert weight.grad is None and hidden.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, IGNORE_INDEX), loss.detach())
    all_ignored = linear_cross_entropy(hidden, weight, torch.full_like(targets, IGNORE_INDEX), IGNORE_INDEX)
    assert float(all_ignored.detach()) == 0.0


def test_token_loss_fuses_a_plain_transformer_to_the_same_loss_and_gradients() -> None:
    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, final_logit_softcapping=8.0)
    model = Transformer(cfg)
    model.init_weights(0.05, torch.Generator().manual_seed(0))
    assert fuses_output_layer(model)
    g = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(40, (2, 10), generator=g), torch.randint(40, (2, 10), generator=g)
    targets[1, :3] = IGNORE_INDEX
    docs, positions = torch.zeros_like(ids), torch.arange(10).repeat(2, 1)

    fused, _ = token_loss(model, ids, targets, docs, positions, "fp32")
    fused.backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain = _plain(model.hidden_states(ids, positions), model.lm_head.weight, targets, cfg.final_logit_softcapping)
    plain.backward()
    torch.testing.assert_close(fused, plain)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused_grads[name], p.grad, msg=name)
