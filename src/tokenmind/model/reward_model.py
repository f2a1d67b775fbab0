"""The Transformer with a scalar head: a reward model, as `transformers`' *ForSequenceClassification.

A reward model reads a whole conversation and says how good it is: the same blocks as the
language model, then one linear map from each position's final hidden state to a number, where
the LM maps it to vocabulary logits. An outcome reward model's score is the one at a sequence's
last token; a process reward model reads the score at the end of every reasoning step.

Checkpoints are `transformers`' sequence-classification layout with one label (`score.weight`
beside `model.*`, architectures `LlamaForSequenceClassification` and kin), so a reward model
trained here loads there with the same scores, and one trained there loads here. There is no LM
head: a reward model does not generate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .attention import AttentionMetadata
from .config import ModelConfig
from .transformer import Transformer


class RewardModel(Transformer):
    """`forward` gives a score per position, (B, T), instead of logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.lm_head = None
        self.score = nn.Linear(cfg.hidden_size, 1, bias=False)

    @classmethod
    def from_language_model(cls, lm: Transformer, generator: torch.Generator | None = None) -> RewardModel:
        """A reward model on `lm`'s blocks (a copy of its weights), the head drawn from N(0, 1/hidden)
        so first scores are of order one whatever the hidden size."""
        model = cls(lm.cfg)
        missing, _ = model.load_state_dict({k: v for k, v in lm.state_dict().items() if not k.startswith("lm_head.")},
                                           strict=False)
        assert missing == ["score.weight"], missing
        with torch.no_grad():
            model.score.weight.normal_(0.0, lm.cfg.hidden_size ** -0.5, generator=generator)
        return model.to(lm.embed_tokens.weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn: AttentionMetadata | None = None, kv_cache: Any = None) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, positions, attn, kv_cache)
        return self.score(hidden.to(self.score.weight.dtype)).squeeze(-1)

    def hf_config(self) -> dict:
        hf = self.cfg.to_hf()
        hf["architectures"] = [hf["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
        hf["id2label"], hf["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
        if hf.get("pad_token_id") is None:  # transformers needs one to find each row's last token
            eos = hf.get("eos_token_id")
            hf["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
        return hf


def check_reward_config(hf: dict, where: Any) -> None:
    """Refuse sequence-classification checkpoints that are not one-score reward models."""
    labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 1)
    if labels != 1:
        raise ValueError(f"{where}: a classifier with {labels} labels; tokenmind reads reward models, which have "
                         "one (num_labels=1)")
