"""Rollouts for online RL: groups of completions from the paged engine on the live policy, scored and packed.

One rollout is `batch_size × grad_accum` task prompts × `group_size` completions. The engine runs
on the very `Transformer` the trainer updates — same process, same parameters, no copy and no
second server — so the only sync after an optimizer step is dropping the prefix cache (its k/v
came from the old weights). Each prompt is one request with `n = group_size`: its completions
are forked siblings sharing the prompt's KV blocks, seeded from (run seed, rollout, prompt), so a
resumed run draws exactly the same samples.

Then, per completion: the rewards (`RewardMix`), whether the task's verifier calls it right (the
accuracy that is logged), DAPO's overlong penalty if asked; groups whose completions all scored
the same teach nothing under group baselines, so dynamic sampling drops them and samples more
prompts (at most `max_sampling_rounds` rounds). The kept groups are packed as `Unit`s (the prompt
once, the G completions as documents that also attend to it; `preference_data.unit_batch`) into
one micro-batch per grad_accum slice, and no-grad forwards add what the loss needs: the
reference's log-probs (KL), the policy's own (when the rollout is reused for several updates, or
the KL goes into the reward) and, for PPO, values and GAE advantages. The loader then serves the
micro-batches `epochs` times (μ updates per rollout, GRPO's iterations) before sampling again.

Generation can also run on Ray actors (`ray_rollout.RolloutActors`, `rl.rollout_workers`): each holds
a copy of the policy, the trainer pushes the weights after every optimizer step (`policy_updated`),
and the same requests (same seeds) go to them, so a synchronous run draws the same samples as here.
Every group records the policy version (optimizer steps) it was sampled with; with
`async_rollouts` the next rollout is requested as the learner starts the last step that uses the
current one, so sampling overlaps that step and the samples are one version stale.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenmind.engine.llm import LLM
from tokenmind.engine.outputs import RequestOutput
from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.load import Pretrained
from tokenmind.model.lora import adapter_names, routing_of
from tokenmind.model.paged_attention import PagedKVCache

from .data import pack as pack_rows
from .preference_data import Scored, SequenceBatch, Unit, unit_batch
from .rewards import RewardMix, item_fields, overlong_penalty
from .rl import RolloutBatch, gae, policy_outputs, scored_positions, sequence_advantages
from .tasks import Reward

Item = dict[str, Any]


@dataclass
class RolloutSettings:
    """How to sample and what to compute per rollout (`RLSection` fills it; see its docstring)."""

    group_size: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    advantage: str = "group"
    kl_coef: float = 0.0
    kl_place: str = "loss"
    gamma: float = 1.0
    lam: float = 0.95
    epochs: int = 1
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    overlong_cache: int = 0  # > 0: DAPO's soft overlong penalty over the last this many tokens
    precision: str = "fp32"


@dataclass
class Group:
    """One prompt's completions: token ids (with the end-of-turn token when the sample stopped),
    texts, the sampler's per-token log-probs (NaN for that appended end token, and all NaN when the loader
    does not ask for them: `RolloutLoader.recomputes_logps`), rewards."""

    item: Item
    prompt_ids: list[int]
    completions: list[list[int]]
    texts: list[str]
    sample_logps: list[list[float]]
    truncated: list[bool]
    rewards: list[float] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    version: int = 0  # the policy version (optimizer steps) that sampled it


@dataclass
class Generation:
    """One batch of requests' outputs (prompt order), the policy version each came from, and the
    seconds the engine took. Ray actors hand back a pending one; this one is already done."""

    outputs: list[RequestOutput]
    versions: list[int]
    seconds: float

    def result(self) -> Generation:
        return self


@contextmanager
def adapter_off(model: nn.Module):
    """The model as its frozen base: LoRA adapters bypassed (the reference of a LoRA policy)."""
    routing = routing_of(model)
    active, routing.active = routing.active, None
    try:
        yield model
    finally:
        routing.active = active


def rollout_engine(policy: Pretrained, seqs: int, max_len: int) -> LLM:
    """A paged engine on `policy` with room for `seqs` sequences of `max_len` tokens at once."""
    model = policy.model
    blocks = seqs * (-(-max_len // 16) + 1)  # an upper bound: no prompt sharing counted
    per_block = PagedKVCache.bytes_per_block(model.cfg, 16, model.embed_tokens.weight.dtype)
    return LLM(policy, block_size=16, kv_cache_bytes=blocks * per_block, max_num_seqs=seqs, max_model_len=max_len,
               max_num_batched_tokens=max(2048, seqs))


def generate_eval(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                  adapter: str | None) -> list[RequestOutput]:
    """Outputs of the engine's model in eval mode (no dropout), its prefix cache dropped first (its
    k/v may come from weights that have changed since)."""
    model = llm.pretrained.model
    llm.reset_prefix_cache()
    was_training = model.training
    model.eval()
    try:
        return llm.generate(prompts, params, progress=False, adapter=adapter)
    finally:
        model.train(was_training)


def prompt_ids(tokenizer: Any, prompt: str | list[dict]) -> list[int]:
    """A chat prompt rendered with the generation prompt; a string continued as plain text."""
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    return tokenizer.encode_prompt(prompt)


class RolloutLoader:
    """Endless `RolloutBatch`es for the `Trainer` (see the module docstring); its position (prompt
    order, rollouts done, the micro-batches still to serve) is saved in checkpoints.

    workers: generators elsewhere (`ray_rollout.RolloutActors`: `submit(prompts, params)` → a pending
    `Generation`, `push(model, version)`, `close()`); None samples here, on the live policy.
    async_rollouts (needs workers): request the next rollout while the learner trains on this one."""

    def __init__(self, items: Sequence[Item], policy: Pretrained, settings: RolloutSettings, rewards: RewardMix,
                 verifier: Reward, batch_size: int, grad_accum: int, seed: int, end_id: int,
                 reference: nn.Module | None = None, with_values: bool = False, workers: Any = None,
                 async_rollouts: bool = False) -> None:
        if async_rollouts and workers is None:
            raise ValueError("async rollouts overlap sampling with learning on other workers; set rl.rollout_workers "
                             ">= 1 or rl.async_rollouts=false")
        if not items:
            raise ValueError("no task items to train on")
        self.items, self.policy, self.s = list(items), policy, settings
        self.rewards, self.verifier, self.end_id = rewards, verifier, end_id
        self.batch_size, self.grad_accum, self.seed = batch_size, grad_accum, seed
        self.reference, self.with_values = reference, with_values
        self.adapter = routing_of(policy.model).active if adapter_names(policy.model) else None
        self.prompts = [prompt_ids(policy.tokenizer, it["prompt"]) for it in self.items]
        self.max_len = max(map(len, self.prompts)) + settings.max_new_tokens + 1
        self.epoch = self.cursor = self.rollouts = 0
        self.pending: list[RolloutBatch] = []  # micro-batches of the current rollout still to serve
        self.metrics: dict[str, float] = {}
        self.logp_gaps: list[float] = []
        self.served_tokens = 0
        self.llm: LLM | None = None
        self.workers, self.async_rollouts = workers, async_rollouts
        self.version = 0  # the learner's optimizer steps so far
        self.push_s = 0.0  # seconds the last push of the weights to the workers took here
        self.prefetched: tuple[list[int], Any] | None = None  # the next rollout's first round, being sampled
        self.resume_at: tuple[int, int, int] | None = None  # (epoch, cursor, rollouts) before that request

    # ---- the engine ------------------------------------------------------------------------------

    def engine(self) -> LLM:
        """The engine on the live policy (built once, after the trainer placed the model)."""
        if self.llm is None:
            self.llm = rollout_engine(self.policy, self.batch_size * self.grad_accum * self.s.group_size,
                                      self.max_len)
        return self.llm

    def submit(self, prompts: list[list[int]], params: list[SamplingParams]) -> Any:
        """Start generating (on the workers), or generate here on the live policy; `.result()` of
        what it returns is the `Generation`."""
        if self.workers is not None:
            return self.workers.submit(prompts, params)
        tick = time.perf_counter()
        outputs = generate_eval(self.engine(), prompts, params, self.adapter)
        return Generation(outputs, [self.version] * len(outputs), time.perf_counter() - tick)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        """Outputs of the current policy, in prompt order."""
        return self.submit(prompts, params).result().outputs

    def policy_updated(self, version: int) -> None:
        """The learner's weights are now `version` (its optimizer steps): the workers get them. Here
        nothing moves: the engine runs on the live weights and drops its prefix cache per batch."""
        self.version = version
        if self.workers is not None:
            tick = time.perf_counter()
            self.workers.push(self.policy.model, version)
            self.push_s = time.perf_counter() - tick

    def close(self) -> None:
        """Stop the workers (nothing to do without them)."""
        if self.workers is not None:
            self.workers.close()

    def evaluate(self, items: Sequence[Item], max_new_tokens: int | None = None) -> dict[str, float]:
        """Greedy accuracy (the verifier's mean score) and mean completion length on `items`."""
        prompts = [prompt_ids(self.policy.tokenizer, it["prompt"]) for it in items]
        params = SamplingParams(max_tokens=max_new_tokens or self.s.max_new_tokens, temperature=0.0,
                                stop_token_ids=[self.end_id], ignore_eos=True)
        outputs = self.generate(prompts, [params] * len(prompts))
        scores = [self.verifier(it["prompt"], out.text.strip(), **item_fields(it)) for it, out in zip(items, outputs)]
        return {"accuracy": float(np.mean([s >= 1.0 for s in scores])), "score": float(np.mean(scores)),
                "length": float(np.mean([len(out.token_ids) for out in outputs]))}

    # ---- sampling and scoring --------------------------------------------------------------------

    @property
    def recomputes_logps(self) -> bool:
        """Whether `pack` runs the policy for its own log-probs (a rollout reused for several updates,
        the KL in the reward, PPO's values). Only then does the engine return the sampler's
        log-probs, to log how far they are from the learner's (`sampler_logp_gap`): one update per
        rollout takes the learner's detached ones as the old policy, and the engine skips a
        log-softmax and a top-k over the vocabulary per token."""
        s = self.s
        return s.epochs > 1 or (s.kl_coef > 0 and s.kl_place == "reward") or self.with_values

    def next_items(self, count: int) -> list[int]:
        """The next `count` item indices of the seeded per-epoch order."""
        chosen = []
        while len(chosen) < count:
            if self.cursor == len(self.items):
                self.epoch, self.cursor = self.epoch + 1, 0
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.items))
            take = order[self.cursor:self.cursor + count - len(chosen)]
            chosen += take.tolist()
            self.cursor += len(take)
        return chosen

    def sample_groups(self, indices: list[int], round_: int) -> tuple[list[int], Any]:
        """Start sampling the groups of `indices`, sampling round `round_` of rollout `self.rollouts`;
        each prompt's seed comes from (run seed, rollout, round, its place), wherever it runs."""
        s = self.s
        params = [SamplingParams(max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                 n=s.group_size, logprobs=0 if self.recomputes_logps else None,
                                 stop_token_ids=[self.end_id], ignore_eos=True,
                                 seed=int(np.random.default_rng([self.seed, self.rollouts, round_, i]).integers(2**31)))
                  for i in range(len(indices))]
        return indices, self.submit([self.prompts[i] for i in indices], params)

    def groups(self, indices: list[int], generation: Generation) -> list[Group]:
        """The groups of a finished generation, tagged with the policy version that sampled them."""
        groups = []
        for i, out, version in zip(indices, generation.outputs, generation.versions):
            completions, logps, truncated = [], [], []
            for c in out.outputs:
                stopped = c.finish_reason == "stop"
                completions.append(list(c.token_ids) + ([self.end_id] if stopped else []))
                sampled = [lp.logprob for lp in c.logprobs] if c.logprobs is not None else [math.nan] * len(c.token_ids)
                logps.append(sampled + ([math.nan] if stopped else []))
                truncated.append(not stopped)
            groups.append(Group(self.items[i], self.prompts[i], completions, [c.text.strip() for c in out.outputs],
                                logps, truncated, version=version))
        return groups

    def score(self, groups: list[Group]) -> dict[str, list[float]]:
        """Set each group's rewards and correctness; returns every named reward's scores."""
        prompts = [g.item["prompt"] for g in groups for _ in g.texts]
        texts = [t for g in groups for t in g.texts]
        metas = [item_fields(g.item) for g in groups for _ in g.texts]
        totals, parts = self.rewards(prompts, texts, metas)
        correct = [float(self.verifier(p, t, **m) >= 1.0) for p, t, m in zip(prompts, texts, metas)]
        at = 0
        for g in groups:
            n = len(g.texts)
            g.rewards = [r + overlong_penalty(len(c), self.s.max_new_tokens, self.s.overlong_cache)
                         for r, c in zip(totals[at:at + n], g.completions)]
            g.correct = correct[at:at + n]
            at += n
        return parts

    # ---- one rollout -----------------------------------------------------------------------------

    def rollout(self) -> None:
        """Sample, score and pack the next rollout into `pending` (`epochs` passes over its micro-batches)."""
        need = self.batch_size * self.grad_accum
        started = time.perf_counter()
        kept: list[Group] = []
        generated: list[Group] = []
        parts: dict[str, list[float]] = {}
        generate_s = 0.0
        for round_ in range(self.s.max_sampling_rounds if self.s.dynamic_sampling else 1):
            if round_ == 0 and self.prefetched is not None:  # requested while the learner took its last step
                indices, pending = self.prefetched
                self.prefetched = self.resume_at = None
            else:
                indices, pending = self.sample_groups(self.next_items(need - len(kept)), round_)
            generation = pending.result()
            generate_s += generation.seconds
            groups = self.groups(indices, generation)
            for name, values in self.score(groups).items():
                parts.setdefault(name, []).extend(values)
            generated += groups
            kept += [g for g in groups if not self.s.dynamic_sampling or np.ptp(g.rewards) > 0]
            if len(kept) >= need:
                break
        if len(kept) < need:  # dynamic sampling found too few informative groups: fill with the others
            kept += [g for g in generated if g not in kept][:need - len(kept)]
        sample_s = time.perf_counter() - started
        self.logp_gaps: list[float] = []
        batches = [self.pack(kept[k * self.batch_size:(k + 1) * self.batch_size]) for k in range(self.grad_accum)]
        self.pending = batches * self.s.epochs
        self.rollouts += 1
        tokens = sum(len(c) for g in generated for c in g.completions)
        rewards = [r for g in generated for r in g.rewards]
        self.metrics = {
            "reward": float(np.mean(rewards)), "reward_std": float(np.std(rewards)),
            "accuracy": float(np.mean([c for g in generated for c in g.correct])),
            **{f"reward/{name}": float(np.mean(v)) for name, v in parts.items() if len(parts) > 1},
            "completion_length": tokens / sum(len(g.completions) for g in generated),
            "truncated": float(np.mean([t for g in generated for t in g.truncated])),
            "groups_kept": len([g for g in kept if np.ptp(g.rewards) > 0]) / need,
            "rollout_tokens_per_s": tokens / generate_s, "rollout_s": sample_s,
            "prepare_s": time.perf_counter() - started - sample_s,
            "rollout_tokens": float(sum(len(c) for g in kept for c in g.completions)),
            # the oldest weights sampled from, and how many updates behind the learner's they are
            "policy_version": float(min(g.version for g in kept)),
            "staleness": float(self.version - min(g.version for g in kept)),
        }
        if self.workers is not None:  # the learner's share of the last weight push (the actors copy meanwhile)
            self.metrics["weights_push_s"] = self.push_s
        if self.logp_gaps:  # how far the engine's log-probs are from the learner's on the same tokens
            self.metrics["sampler_logp_gap"] = float(np.mean(self.logp_gaps))

    @torch.no_grad()
    def pack(self, groups: list[Group]) -> RolloutBatch:
        """One micro-batch: the groups packed as units, with the per-token fields the loss needs."""
        s, model = self.s, self.policy.model
        units = [Unit([Scored(np.asarray(g.prompt_ids + c, dtype=np.int64), len(g.prompt_ids)) for c in g.completions])
                 for g in groups]
        seq_len = -(-max(u.length for u in units) // 8) * 8
        batch = unit_batch(pack_rows([u.length for u in units], seq_len), units, seq_len)
        # (group, completion) of each of the batch's sequences, in sequence order
        order = [(int(u), j) for u, members in zip(batch.units, batch.members) for j in range(members.numel())]
        scored = scored_positions(batch)
        shape = batch.targets.shape

        def per_token(values: list[list[float]] | torch.Tensor) -> torch.Tensor:
            flat = torch.full((shape[0] * shape[1],), math.nan)
            flat[scored] = values if isinstance(values, torch.Tensor) else torch.tensor(
                [v for seq in values for v in seq], dtype=torch.float32)
            return flat.view(shape)

        device = next(model.parameters()).device
        on_device = batch.to(device)
        need_policy = self.recomputes_logps
        nan = per_token(torch.full((len(scored),), math.nan))
        old_logps, values = nan, None
        if need_policy:
            logps, _, vals = policy_outputs(model, on_device, s.precision, s.temperature, self.with_values)
            old_logps = per_token(logps.cpu())
            values = vals.cpu() if vals is not None else None
        ref_logps = nan
        if s.kl_coef > 0:
            reference = self.reference if self.reference is not None else model
            with adapter_off(reference) if self.reference is None else nullcontext():
                ref_logps = per_token(policy_outputs(reference, on_device, s.precision, s.temperature)[0].cpu())

        rewards = torch.tensor([groups[u].rewards for u in range(len(groups))], dtype=torch.float32)
        owner = batch.sequence.flatten()[scored]
        token_kl = (old_logps - ref_logps).flatten()[scored] if s.kl_place == "reward" and s.kl_coef > 0 else None
        returns, old_values = nan, nan
        if s.advantage == "gae":
            advantages, rets = self._gae(groups, order, owner, rewards, token_kl, values)
            returns, old_values = per_token(rets), per_token(values)
        else:
            if token_kl is not None:  # the whole completion's KL comes off its reward
                seq_kl = torch.zeros(len(order)).index_add(0, owner, token_kl)
                kl = torch.zeros_like(rewards)
                for seq, (u, j) in enumerate(order):
                    kl[u, j] = seq_kl[seq]
                rewards = rewards - s.kl_coef * kl
            adv = sequence_advantages(rewards, s.advantage)
            advantages = torch.tensor([float(adv[u, j]) for u, j in order])[owner]
        if need_policy and s.temperature == 1.0:  # the sampler's log-probs are at temperature 1
            sample = per_token([groups[u].sample_logps[j] for u, j in order])
            self.logp_gaps.append((sample - old_logps).abs().nanmean().item())
        return RolloutBatch(batch, per_token(advantages), old_logps, ref_logps, old_values, returns,
                            sum(u.length for u in units))

    def _gae(self, groups, order, owner, rewards, token_kl, values) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token PPO advantages (whitened over the micro-batch) and returns: each completion's
        reward at its last token, minus β·(logp − ref) at every token."""
        token_rewards = -self.s.kl_coef * token_kl if token_kl is not None else torch.zeros(len(owner))
        advantages, returns = torch.empty(len(owner)), torch.empty(len(owner))
        for s_idx, (u, j) in enumerate(order):
            at = (owner == s_idx).nonzero().squeeze(1)
            r = token_rewards[at].clone()
            r[-1] += rewards[u, j]
            advantages[at], returns[at] = gae(r, values[at], self.s.gamma, self.s.lam)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        return advantages, returns

    # ---- the Loader contract ---------------------------------------------------------------------

    def __iter__(self) -> RolloutLoader:
        return self

    def __next__(self) -> RolloutBatch:
        if not self.pending:
            self.rollout()
        batch = self.pending.pop(0)
        if self.async_rollouts and self.prefetched is None and len(self.pending) < self.grad_accum:
            # the learner starts the last step on this rollout: sample the next one meanwhile
            self.resume_at = (self.epoch, self.cursor, self.rollouts)
            self.prefetched = self.sample_groups(self.next_items(self.batch_size * self.grad_accum), 0)
        self.served_tokens += batch.tokens
        return batch

    def pop_metrics(self) -> dict[str, float]:
        """What the last rollout measured, once (the trainer logs it with the step that used it),
        and the tokens the learner read since the last call (each prompt once, every completion)."""
        metrics, self.metrics = {**self.metrics, "tokens": self.served_tokens}, {}
        self.served_tokens = 0
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The position; a rollout still being sampled is not saved: a resumed run samples it again
        (from its own weights, so an async run's resume is not bit-exact, unlike a synchronous one)."""
        epoch, cursor, rollouts = self.resume_at or (self.epoch, self.cursor, self.rollouts)
        return {"epoch": epoch, "cursor": cursor, "rollouts": rollouts, "items": len(self.items),
                "pending": [_batch_state(b) for b in self.pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["items"] != len(self.items):
            raise ValueError(f"the checkpoint's run trained on {state['items']} task items, this one has "
                             f"{len(self.items)}; resume with the same data section")
        self.epoch, self.cursor, self.rollouts = state["epoch"], state["cursor"], state["rollouts"]
        self.pending = [_batch_from_state(b) for b in state["pending"]]
        self.prefetched = self.resume_at = None


def _batch_state(batch: RolloutBatch) -> dict[str, Any]:
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name != "seq"}
    return {**fields, "seq": {f.name: getattr(batch.seq, f.name) for f in dataclasses.fields(batch.seq)}}


def _batch_from_state(state: dict[str, Any]) -> RolloutBatch:
    return RolloutBatch(SequenceBatch(**state["seq"]), **{k: v for k, v in state.items() if k != "seq"})
