"""The induction probe: the loss drop on the second copy of a random token run."""

import math

import pytest
import torch

from tokenmind.eval.induction import evaluate_induction
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer

VOCAB = 512


class Copier(torch.nn.Module):
    """Predicts, from the second copy on, the token that followed this one's first occurrence; a
    uniform guess before that: what an ideal induction head does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, length = x.shape
        logits = torch.zeros(rows, length, VOCAB)
        half = length // 2
        for t in range(half, length - 1):
            logits[torch.arange(rows), t, x[:, t - half + 1]] = 50.0
        return logits


def test_an_ideal_copier_gains_the_whole_first_copy_loss():
    result = evaluate_induction(Copier(), VOCAB, runs=6, length=10, batch_size=4)
    assert result["first_copy_loss"] == pytest.approx(math.log(VOCAB), rel=1e-5)  # a uniform guess
    assert result["second_copy_loss"] < 1e-3  # the first token of the second copy is not counted
    assert result["induction_gain"] == pytest.approx(math.log(VOCAB), rel=1e-3)


def test_an_untrained_model_does_not_copy():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)).eval()
    result = evaluate_induction(model, VOCAB, runs=8, length=20)
    assert abs(result["induction_gain"]) < 0.1
    assert result == evaluate_induction(model, VOCAB, runs=8, length=20)  # seeded
    with pytest.raises(ValueError, match="vocabulary above"):
        evaluate_induction(model, 50)
