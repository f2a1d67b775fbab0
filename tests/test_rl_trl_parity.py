"""tokenmind's GRPO-family loss against TRL's `GRPOTrainer` on one fixed rollout batch.

The same tiny random model (saved as a Hugging Face directory that both `transformers` and
`load_model` read), the same prompts, completions, advantages, sampling-policy ("old") and
reference log-probs: `RLObjective` on tokenmind's packed batch (each prompt once, its G
completions as documents attending to it) must give TRL's `compute_loss` on its padded one
(prompts left-padded, completions right-padded), and the same gradients, for each of TRL's
aggregations: grpo (per-completion token mean, then the mean over completions), dr_grpo (token
sums / (completions × max_completion_length)), dapo and bnpo (mean over all tokens). The cases
cover β > 0 with a reference, ε_high ≠ ε_low, old log-probs away from the current ones (so the
clip is active on some tokens), and a temperature other than 1.

TRL ≥ 1.x multiplies the KL term by the importance ratio by default (`use_bias_correction_kl`,
DeepSeek-V3.2's unbiased reverse-KL gradient; it changes the gradient even on-policy, where the
ratio's value is 1). tokenmind's loss is the GRPO paper's plain β·k3, so TRL runs with that
correction off here.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_sft_helpers import question, tiny_model_dir, tiny_tokenizer
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.model.load import load_model
from tokenmind.posttrain.data import pack as pack_rows
from tokenmind.posttrain.preference_data import Scored, Unit, unit_batch
from tokenmind.posttrain.rl import (
    ALGORITHMS,
    RLObjective,
    RolloutBatch,
    policy_outputs,
    scored_positions,
    sequence_advantages,
)

pytest.importorskip("trl")

GROUP = 3
MAX_NEW = 8
CHATS = ([{"role": "user", "content": question("lime")}],
         [{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": question("plum")}])
LENGTHS = ((4, 8, 2), (6, 3, 5))  # completion tokens of each prompt's G completions (8 = truncated at MAX_NEW)
# parameters compared by gradient: tokenmind name (the HF name is "model." + it, lm_head as is)
GRAD_PARAMS = ("embed_tokens.weight", "layers.0.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight",
               "norm.weight", "lm_head.weight")


@dataclass(frozen=True)
class Case:
    trl_loss: str  # TRL's loss_type
    algo: str  # tokenmind's algorithm whose aggregation and advantage it is
    aggregation: str
    beta: float
    clip_low: float
    clip_high: float
    off_policy: bool  # old log-probs ≠ the current ones (else TRL gets none, tokenmind NaN: ratio 1)
    temperature: float = 1.0


CASES = [
    Case("grpo", "grpo", "sequence", 0.04, 0.2, 0.2, off_policy=False),
    Case("grpo", "grpo", "sequence", 0.04, 0.2, 0.28, off_policy=True, temperature=0.7),
    Case("dr_grpo", "dr_grpo", "constant", 0.0, 0.2, 0.2, off_policy=True),
    Case("dapo", "dapo", "token", 0.0, 0.2, 0.28, off_policy=True),
    Case("bnpo", "dapo", "token", 0.04, 0.2, 0.28, off_policy=True, temperature=1.3),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> SimpleNamespace:
    """The tiny model directory and one rollout: 2 chat prompts of different lengths × 3 completions
    of random tokens (lengths `LENGTHS`), random rewards."""
    root = tmp_path_factory.mktemp("rl_parity")
    tokenizer = tiny_tokenizer()
    model_dir = tiny_model_dir(root / "model", tokenizer, seed=5)
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in CHATS]
    assert len(prompts[0]) != len(prompts[1])  # so TRL left-pads one of them
    rng = np.random.default_rng(0)
    completions = [[rng.integers(3, tokenizer.vocab_size, size=n).tolist() for n in lengths] for lengths in LENGTHS]
    rewards = torch.tensor(rng.uniform(0, 1, size=(len(CHATS), GROUP)), dtype=torch.float32)
    return SimpleNamespace(model_dir=model_dir, prompts=prompts, completions=completions, rewards=rewards)


class Layout:
    """tokenmind's packed batch of the rollout, and the map between its scored positions (flat, in
    sequence order) and TRL's (completions × longest completion) grid, row p·G + j for prompt p's
    j-th completion."""

    def __init__(self, prompts: list[list[int]], completions: list[list[list[int]]]) -> None:
        units = [Unit([Scored(np.asarray(p + c, dtype=np.int64), len(p)) for c in comps])
                 for p, comps in zip(prompts, completions)]
        seq_len = -(-sum(u.length for u in units) // 8) * 8  # both units in one row: they must not see each other
        self.seq = unit_batch(pack_rows([u.length for u in units], seq_len), units, seq_len)
        # each packed sequence's (prompt, completion) index, in sequence order
        order = [(int(u), j) for u, members in zip(self.seq.units, self.seq.members) for j in range(members.numel())]
        owner = self.seq.sequence.flatten()[scored_positions(self.seq)]
        self.rows = torch.tensor([order[s][0] * GROUP + order[s][1] for s in owner.tolist()])
        first = torch.zeros_like(owner)
        for s in owner.unique():
            at = (owner == s).nonzero().squeeze(1)
            first[at] = at[0]
        self.cols = torch.arange(len(owner)) - first
        self.shape = (len(prompts) * GROUP, max(len(c) for comps in completions for c in comps))

    def to_grid(self, flat: torch.Tensor) -> torch.Tensor:
        grid = torch.zeros(self.shape, dtype=flat.dtype)
        grid[self.rows, self.cols] = flat
        return grid

    def to_packed(self, grid: torch.Tensor) -> torch.Tensor:
        """Grid values at the scored positions → tokenmind's (B, T) per-token field (NaN elsewhere)."""
        out = torch.full((self.seq.targets.numel(),), float("nan"))
        out[scored_positions(self.seq)] = grid[self.rows, self.cols].float()
        return out.view(self.seq.targets.shape)


def trl_inputs(setup, layout: Layout, advantages: torch.Tensor, old: torch.Tensor | None,
               ref: torch.Tensor | None, pad_id: int) -> dict:
    """The `inputs` dict GRPOTrainer's `_generate_and_score_completions` hands its loss."""
    prompts = [p for p in setup.prompts for _ in range(GROUP)]
    completions = [c for comps in setup.completions for c in comps]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    cols = layout.shape[1]
    completion_ids = torch.tensor([c + [pad_id] * (cols - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (cols - len(c)) for c in completions])
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages.flatten(),
              "num_items_in_batch": completion_mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return inputs


def trl_trainer(setup, case: Case, tmp_path: Path):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    def zero_reward(completions, **kwargs):
        return [0.0] * len(completions)

    dataset = datasets.Dataset.from_list([{"prompt": chat} for chat in CHATS])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("trl").setLevel(logging.ERROR)
        args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", bf16=False,
                          per_device_train_batch_size=len(CHATS) * GROUP, num_generations=GROUP,
                          max_completion_length=MAX_NEW, temperature=case.temperature, loss_type=case.trl_loss,
                          beta=case.beta, epsilon=case.clip_low, epsilon_high=case.clip_high, scale_rewards="group",
                          use_bias_correction_kl=False, save_strategy="no", logging_steps=1, seed=0,
                          disable_dropout=True)
        trainer = GRPOTrainer(model=str(setup.model_dir), reward_funcs=zero_reward, args=args, train_dataset=dataset)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop; one micro-batch per step here
    return trainer


def test_group_advantages_are_trls(setup):
    """`sequence_advantages` "group" is TRL's scale_rewards="group" formula, "group_mean" its "none"."""
    from trl.trainer.utils import nanstd

    r = setup.rewards
    mean = r.mean(dim=1, keepdim=True)
    assert torch.allclose(sequence_advantages(r, "group"), (r - mean) / (nanstd(r, dim=1, keepdim=True) + 1e-4))
    assert torch.allclose(sequence_advantages(r, "group_mean"), r - mean)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.trl_loss}-beta{c.beta}-eps{c.clip_low}_{c.clip_high}"
                                                  f"{'-offpolicy' if c.off_policy else ''}-t{c.temperature}")
def test_rl_objective_equals_trl_grpo_loss(setup, tmp_path, case):
    algo = ALGORITHMS[case.algo]
    assert algo.aggregation == case.aggregation
    layout = Layout(setup.prompts, setup.completions)
    policy = load_model(setup.model_dir).model.train()

    # the rollout's per-token fields, drawn around the current policy's log-probs
    with torch.no_grad():
        current = layout.to_grid(policy_outputs(policy, layout.seq, "fp32", case.temperature)[0])
    mask = torch.zeros(layout.shape, dtype=torch.bool)
    mask[layout.rows, layout.cols] = True
    gen = torch.Generator().manual_seed(1)
    old = (current + 0.4 * torch.randn(layout.shape, generator=gen)) * mask if case.off_policy else None
    ref = (current + 0.3 * torch.randn(layout.shape, generator=gen)) * mask if case.beta > 0 else None
    advantages = sequence_advantages(setup.rewards, algo.advantage)  # (P, G)
    if case.off_policy:  # the clip really acts: some tokens' ratios leave [1 - ε_low, 1 + ε_high]
        ratio = torch.exp(current - old)[mask]
        assert (ratio < 1 - case.clip_low).any() and (ratio > 1 + case.clip_high).any()

    # tokenmind
    nan = torch.full(layout.seq.targets.shape, float("nan"))
    batch = RolloutBatch(layout.seq, layout.to_packed(advantages.flatten()[:, None].expand(layout.shape)),
                         layout.to_packed(old) if old is not None else nan,
                         layout.to_packed(ref) if ref is not None else nan, nan, nan)
    objective = RLObjective(case.aggregation, case.clip_low, case.clip_high, case.beta, case.temperature, MAX_NEW)
    terms = objective(policy, batch, "fp32")
    ours = terms.loss / terms.count
    ours.backward()

    # TRL
    trainer = trl_trainer(setup, case, tmp_path)
    inputs = trl_inputs(setup, layout, advantages, old, ref, trainer.processing_class.pad_token_id)
    theirs = trainer.compute_loss(trainer.model, inputs)
    theirs.backward()

    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-7)
    hf_params = dict(trainer.model.named_parameters())
    ours_params = dict(policy.named_parameters())
    for name in GRAD_PARAMS:
        g_ours = ours_params[name].grad
        g_theirs = hf_params[name if name.startswith("lm_head") else f"model.{name}"].grad
        assert g_ours is not None and g_theirs is not None, name
        scale = g_theirs.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-4, atol=1e-5 * scale, msg=name)

    if case.aggregation == "token":  # tokenmind's metrics are token means then, as TRL's are
        metrics = trainer._metrics["train"]
        got = {k: float(v) / terms.count for k, v in terms.metrics.items()}
        assert got["entropy"] == pytest.approx(metrics["entropy"][-1], rel=1e-5)
        assert got["clip_fraction"] == pytest.approx(metrics["clip_ratio/region_mean"][-1], abs=1e-7)
        assert got["clip_fraction"] > 0
        if case.beta > 0:
            assert got["kl"] == pytest.approx(metrics["kl"][-1], rel=1e-5)
