"""Sample N, then pick: best-of-N and self-consistency at inference, rejection sampling and RAFT for training.

All four start the same way (`sample_candidates`): every prompt goes to the paged engine once with
`SamplingParams(n=N)`, so its N completions are forked siblings that share the prompt's KV blocks
(the prompt is computed once, not N times) and are seeded seed, seed+1, ..., so they differ yet
reproduce. A scorer then rates each completion (self-consistency instead lets them vote):

* a reward function, `(prompt, completion, **meta) -> float` (the verifiers of `tasks.py`), called
  one sample at a time with the item's fields as `meta`; or
* a learned reward model: any object with `.score(prompts, completions) -> list[float]` (higher is
  better), called once for the whole batch (`rm:PATH` loads one with
  `tokenmind.posttrain.reward.load_reward_model`).

Then:

* best-of-N (`best_of_n`) returns every candidate with its score and picks the highest (the first
  of equals): more compute at inference for a better answer, no training;
* self-consistency (`self_consistency`, Wang et al. 2022) needs no scorer that knows the answer:
  it extracts each candidate's final answer (`tasks.ANSWER_EXTRACTORS`) and returns the most
  frequent one with its share of the votes, on the bet that right reasoning paths agree more
  often than wrong ones;
* rejection sampling (`rejection_sample`) keeps the best completion of each prompt when its score
  reaches a threshold, as chat JSONL that `tokenmind sft` trains on, reports the acceptance rate,
  and turns the same samples into preference pairs (the best against the worst, where the scorer
  separates them) and unpaired KTO records;
* RAFT (`raft`, Dong et al. 2023, "Reward rAnked FineTuning") repeats sample → filter → SFT for K
  rounds, each round sampling from the model the last one trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.llm import LLM
from ..engine.outputs import RequestOutput
from ..engine.sampling import SamplingParams
from ..model.load import Pretrained
from ..jsonl import write_json, write_jsonl
from .pairs import EvalFilter, as_messages, preference_pair, unpaired
from .rewards import item_fields, load_scorer, score
from .sft import load_sft_config, sft
from .tasks import get_answer_extractor

Item = dict[str, Any]  # {"prompt": chat or text, "id"?, **meta}; meta goes to reward functions


@dataclass
class Ranked:
    """One prompt's N candidates (in sampling order), their scores and how each ended."""

    item: Item
    texts: list[str]
    scores: list[float]
    finish_reasons: list[str]

    @property
    def best(self) -> int:
        """Index of the highest score (the earliest of equals)."""
        return max(range(len(self.scores)), key=lambda i: (self.scores[i], -i))

    @property
    def worst(self) -> int:
        """Index of the lowest score (the earliest of equals)."""
        return min(range(len(self.scores)), key=lambda i: (self.scores[i], i))


@dataclass
class Vote:
    """One prompt's N candidates (in sampling order), the answer extracted from each (None where it
    gives none) and the majority."""

    item: Item
    texts: list[str]
    answers: list[str | None]

    @property
    def answer(self) -> str | None:
        """The most frequent answer (of equals, the one given first); None if no candidate gave one."""
        given = [a for a in self.answers if a is not None]
        return max(given, key=lambda a: (given.count(a), -given.index(a)), default=None)

    @property
    def share(self) -> float:
        """The majority's votes over all N candidates (those without an answer count against it)."""
        return self.answers.count(self.answer) / len(self.answers) if self.answer is not None else 0.0


def sample_candidates(llm: LLM, items: Sequence[Item], n: int, params: SamplingParams | None = None,
                      seed: int | None = 0, progress: bool | None = None) -> list[RequestOutput]:
    """Sample `n` completions of each item's prompt: one request of n siblings per prompt, in item order.

    params: how to sample (its `n` and `seed` are set here); sampling must be random, or the n
        candidates are all the same. seed: prompt i's candidates use seeds seed·1,000,003 + i·n + j,
        so a run reproduces and no two of its (up to a million) candidates share a seed; None: fresh
        randomness.
    A chat prompt (a list of messages) is rendered with the tokenizer's chat template; a string is
    continued as plain text."""
    params = params or SamplingParams(temperature=0.8, top_p=0.95)
    if n < 1:
        raise ValueError(f"sampling N candidates needs n >= 1, got {n}")
    if n > 1 and params.greedy:
        raise ValueError("temperature 0 samples the same completion N times; sample with a "
                         "temperature > 0 (e.g. 0.8; on the command line --temperature 0.8)")
    if n > llm.engine.scheduler.max_num_seqs:
        raise ValueError(f"n={n} candidates must run together but the engine runs at most max_num_seqs="
                         f"{llm.engine.scheduler.max_num_seqs}; make the LLM with max_num_seqs >= {n}")
    ids = [llm.tokenizer.apply_chat_template(it["prompt"], add_generation_prompt=True)
           if isinstance(it["prompt"], list) else llm.tokenizer.encode_prompt(it["prompt"]) for it in items]
    per_prompt = [dataclasses.replace(params, n=n, seed=None if seed is None else seed * 1_000_003 + i * n)
                  for i in range(len(items))]
    return llm.generate(ids, per_prompt, progress=progress)


def best_of_n(llm: LLM, items: Sequence[Item], scorer: Any, n: int, params: SamplingParams | None = None,
              seed: int | None = 0, progress: bool | None = None) -> list[Ranked]:
    """Sample `n` completions of each item's prompt (`sample_candidates`) and score them; the
    result's `.best` is the pick."""
    outputs = sample_candidates(llm, items, n, params, seed, progress)
    prompts, texts, metas = [], [], []
    for item, out in zip(items, outputs):
        for c in out.outputs:
            prompts.append(item["prompt"])
            texts.append(c.text.strip())
            metas.append(item_fields(item))
    scores = score(scorer, prompts, texts, metas)
    return [Ranked(item, texts[i * n:(i + 1) * n], scores[i * n:(i + 1) * n],
                   [c.finish_reason for c in out.outputs]) for i, (item, out) in enumerate(zip(items, outputs))]


def self_consistency(llm: LLM, items: Sequence[Item], n: int, extract: str | Callable[[str], str | None] = "numeric",
                     params: SamplingParams | None = None, seed: int | None = 0,
                     progress: bool | None = None) -> list[Vote]:
    """Sample `n` completions of each item's prompt (`sample_candidates`) and vote: `extract` names
    an answer extractor of `tasks.py` ("numeric", "choice") or is one (text → answer or None); the
    result's `.answer` is the majority, `.share` its share of the n votes."""
    extract = get_answer_extractor(extract) if isinstance(extract, str) else extract
    outputs = sample_candidates(llm, items, n, params, seed, progress)
    votes = []
    for item, out in zip(items, outputs):
        texts = [c.text.strip() for c in out.outputs]
        votes.append(Vote(item, texts, [extract(t) for t in texts]))
    return votes


def _one_prompt(model: Pretrained, prompt: str, n: int, chat: bool, meta: dict[str, Any] | None) -> tuple[LLM, Item]:
    """An engine for n candidates of one prompt, and the prompt as an item: a user turn with the
    chat template when `chat`, else plain text to continue; `meta` its other fields."""
    llm = LLM(model, max_num_seqs=n, max_num_batched_tokens=max(2048, n))
    return llm, {"prompt": as_messages(prompt) if chat else prompt, **(meta or {})}


def best_of_prompt(model: Pretrained, prompt: str, n: int, scorer: str | Any, params: SamplingParams,
                   chat: bool = False, meta: dict[str, Any] | None = None) -> Ranked:
    """Best-of-`n` for one prompt (what `tokenmind generate --best-of N` runs): `scorer` a spec for
    `load_scorer` or a scorer; `meta` the fields the scorer reads (the gold `answer`, ...); the seed
    is `params.seed`."""
    scorer = load_scorer(scorer) if isinstance(scorer, str) else scorer
    llm, item = _one_prompt(model, prompt, n, chat, meta)
    return best_of_n(llm, [item], scorer, n, params, params.seed, progress=False)[0]


def self_consistency_prompt(model: Pretrained, prompt: str, n: int, extract: str, params: SamplingParams,
                            chat: bool = False) -> Vote:
    """Self-consistency over `n` samples of one prompt (what `tokenmind generate --self-consistency N`
    runs); the seed is `params.seed`."""
    llm, item = _one_prompt(model, prompt, n, chat, None)
    return self_consistency(llm, [item], n, extract, params, params.seed, progress=False)[0]


def accepted(r: Ranked, threshold: float, accept_truncated: bool = False) -> bool:
    """Whether a prompt's best candidate is kept: its score reaches `threshold` and (unless
    `accept_truncated`) it ended on its own, not cut off by max_tokens, since SFT would teach the
    model to end there."""
    return r.scores[r.best] >= threshold and (accept_truncated or r.finish_reasons[r.best] == "stop")


def ranked_to_records(ranked: Sequence[Ranked], threshold: float, accept_truncated: bool = False,
                      source: str = "on-policy") -> tuple[list[dict], list[dict], list[dict]]:
    """(SFT chats, preference pairs, unpaired records) from ranked samples.

    SFT: the accepted best completion after the prompt, `{"id", "messages", "score"}`. Pairs: the
    accepted best against the worst, where the worst scores strictly lower (a scorer that cannot tell
    them apart says nothing about which is preferred). Unpaired (KTO): every candidate, labelled by
    whether it reaches the threshold (a passing one only if it ended on its own)."""
    chats, pairs, singles = [], [], []
    for k, r in enumerate(ranked):
        item_id = str(r.item.get("id", k))
        messages = as_messages(r.item["prompt"])
        if accepted(r, threshold, accept_truncated):
            best, worst = r.best, r.worst
            chats.append({"id": item_id, "messages": [*messages, {"role": "assistant", "content": r.texts[best]}],
                          "score": r.scores[best]})
            if r.scores[worst] < r.scores[best]:
                pairs.append(preference_pair(messages, r.texts[best], r.texts[worst], id=item_id, source=source,
                                             scores=[r.scores[best], r.scores[worst]]))
        for j, (text, s) in enumerate(zip(r.texts, r.scores)):
            if s < threshold or accept_truncated or r.finish_reasons[j] == "stop":
                singles.append(unpaired(messages, text, s >= threshold, id=f"{item_id}/{j}", source=source))
    return chats, pairs, singles


def rejection_sample(llm: LLM, items: Sequence[Item], scorer: Any, out_dir: str | Path, n: int = 8,
                     threshold: float = 1.0, params: SamplingParams | None = None, seed: int = 0,
                     accept_truncated: bool = False, eval_filter: EvalFilter | None = None,
                     progress: bool | None = None) -> dict[str, Any]:
    """Best-of-`n` over `items`, written to `out_dir`: `sft.jsonl` (accepted chats), `pairs.jsonl`,
    `unpaired.jsonl` and `report.json` (acceptance rate, mean scores); returns the report.

    eval_filter: drops items whose prompt is an evaluation item before sampling (default: an
    `EvalFilter` over the held-out chat prompts alone)."""
    eval_filter = eval_filter or EvalFilter()
    kept = [it for it in items if eval_filter.allows(as_messages(it["prompt"]))]
    ranked = best_of_n(llm, kept, scorer, n, params, seed, progress)
    chats, pairs, singles = ranked_to_records(ranked, threshold, accept_truncated)
    out = Path(out_dir)
    all_scores = [s for r in ranked for s in r.scores]
    report = {
        "prompts": len(items), "dropped_as_eval_items": len(items) - len(kept), "n": n, "threshold": threshold,
        "accepted": len(chats), "acceptance_rate": len(chats) / max(len(kept), 1),
        "candidates_passing": sum(s >= threshold for s in all_scores) / max(len(all_scores), 1),
        "mean_score": sum(all_scores) / max(len(all_scores), 1),
        "mean_best_score": sum(r.scores[r.best] for r in ranked) / max(len(ranked), 1),
        "mean_first_score": sum(r.scores[0] for r in ranked) / max(len(ranked), 1),  # what N=1 would get
        "pairs": write_jsonl(out / "pairs.jsonl", pairs), "unpaired": write_jsonl(out / "unpaired.jsonl", singles),
    }
    write_jsonl(out / "sft.jsonl", chats)
    write_json(out / "report.json", report)
    return report


def raft(model: str | Path, items: Sequence[Item] | Callable[[int], Sequence[Item]], scorer: Any,
         out_dir: str | Path, rounds: int = 1, n: int = 8, threshold: float = 1.0,
         params: SamplingParams | None = None, sft_overrides: Sequence[str] = (), seed: int = 0,
         accept_truncated: bool = False, engine_options: dict[str, Any] | None = None,
         eval_filter: EvalFilter | None = None, progress: bool | None = None) -> list[dict[str, Any]]:
    """RAFT: `rounds` × (sample `n` per prompt from the current model → keep the best above
    `threshold` → SFT on them, starting from the current model); returns each round's report, with
    the model it trained (`model`) and its final train loss.

    items: the prompts, the same every round, or a function of the round number giving fresh ones
        (RAFT draws a new batch each round). sft_overrides: `--section.key=value` for the SFT runs
        (steps, lr, batch size, ...); data files, init_from and out_dir are set here.
    Round k writes `out_dir/round_k/` (the samples, then `sft/` with the trained model in `final/`)."""
    out, current, reports = Path(out_dir), str(model), []
    eval_filter = eval_filter or EvalFilter()
    for k in range(rounds):
        round_dir = out / f"round_{k}"
        llm = LLM(current, **{"max_num_seqs": max(n, 16), **(engine_options or {})})
        round_items = items(k) if callable(items) else items
        report = rejection_sample(llm, round_items, scorer, round_dir, n, threshold, params, seed + k,
                                  accept_truncated, eval_filter, progress)
        del llm  # free the engine's KV pool before training
        if not report["accepted"]:
            raise ValueError(f"RAFT round {k}: no sample reached the threshold {threshold} (best mean score "
                             f"{report['mean_best_score']:.3f}); lower the threshold, raise n, or start from a "
                             "stronger model")
        cfg = load_sft_config(None, [*sft_overrides, f"--sft.init_from={current}",
                                     f"--data.files={round_dir / 'sft.jsonl'}", f"--train.out_dir={round_dir / 'sft'}"])
        result = sft(cfg)
        current = str(result.final_model_path)
        reports.append({**report, "round": k, "model": current, "final_loss": result.final_loss})
    return reports


def reference_pairs(llm: LLM, items: Sequence[Item], params: SamplingParams | None = None, seed: int = 0,
                    source: str = "reference", progress: bool | None = None) -> list[dict[str, Any]]:
    """A pair per item with a `reference` answer (MT-bench's, via `pairs.mtbench_items`): the
    reference chosen, the model's own sample rejected. This is the SPIN recipe's first round (Chen et
    al. 2024): a model is pushed from its own answers toward the reference ones. Items whose sample
    repeats the reference give no pair."""
    params = params or SamplingParams(temperature=0.8, top_p=0.95, max_tokens=512)
    ids = [llm.tokenizer.apply_chat_template(as_messages(it["prompt"]), add_generation_prompt=True) for it in items]
    outputs = llm.generate(ids, [dataclasses.replace(params, seed=seed * 1_000_003 + i) for i in range(len(items))],
                           progress=progress)
    return [preference_pair(it["prompt"], it["reference"], out.text.strip(), id=str(it.get("id", i)), source=source)
            for i, (it, out) in enumerate(zip(items, outputs)) if out.text.strip() != it["reference"].strip()]
