"""Does a chat model answer simple questions on topic, in fluent English? Three measurable figures.

The prompts (`data/chat_prompts.jsonl`, written for this purpose and never trained on) are
greetings, "who are you", short factual questions, definitions of common words and simple
instructions; each carries a check and a reference answer written by hand.

* **on-topic rate**: the share of answers that pass their prompt's check: a keyword from a list
  (`any`), one of each group (`all`: "one, two, three, four, five"), or at least `min` distinct
  words from a list (`count`: "list three colours"). Words match whole, case-insensitively.
* **fluency ratio**: the mean per-token negative log-likelihood of the model's answers under a
  judge model (SmolLM2-135M-Instruct), divided by the same for the reference answers. 1 means as
  fluent as a careful human answer to the judge; 1.5 is this project's bar.
* **judged preference**: the judge reads a question and two answers and is asked which is better;
  the log-likelihoods of "A" and "B" decide, in both orders. A pair is decided only when both
  orders prefer the same answer; the figure is the share of decided pairs won by the first set.
  A position-corrected figure (both orders' log-odds together) is reported beside it, because a
  small judge tends to name one letter whatever it reads.

Also reported: how many answers start with a multiple-choice letter ("B. ...") although no prompt
here is multiple choice.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engine.config import EngineConfig
from ..engine.llm import Engine
from ..engine.sampling import SamplingParams
from .loglik import loglikelihoods

PROMPTS_PATH = Path(__file__).parent / "data" / "chat_prompts.jsonl"
MC_LETTER = re.compile(r"^\s*\(?[A-E][.):]\s")
JUDGE_QUESTION = ("Here is a question and two answers to it.\n\nQuestion: {question}\n\nAnswer A: {a}\n\n"
                  "Answer B: {b}\n\nWhich answer is better: more correct, more on topic and more fluent? "
                  "Reply with one letter, A or B.")


def load_baseline(name_or_path: str | Path) -> dict[str, Any]:
    """A saved set of answers to compare against: a packaged name (`cpu_v1`: the first speedrun
    recipe's model) or a JSON file of `save_baseline`'s shape."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROMPTS_PATH.parent / f"chat_answers_{name_or_path}.json"
    if not path.is_file():
        names = ", ".join(p.stem.removeprefix("chat_answers_") for p in PROMPTS_PATH.parent.glob("chat_answers_*"))
        raise FileNotFoundError(f"no chat baseline {name_or_path!r}: give a JSON file written by save_baseline "
                                f"or a packaged name ({names or 'none yet'})")
    return json.loads(path.read_text(encoding="utf-8"))


def save_baseline(result: dict[str, Any], name: str, path: str | Path) -> Path:
    """Keep a chat evaluation's answers and figures, to compare later runs with (`load_baseline`)."""
    figures = {k: v for k, v in result.items() if k not in ("predictions", "common_openings")}
    data = {"name": name, "figures": figures, "answers": [p["answer"] for p in result["predictions"]],
            "prompt_ids": [p["id"] for p in result["predictions"]]}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def load_chat_prompts(path: str | Path = PROMPTS_PATH) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+(?:'[a-z]+)?", text.lower())


def _has(text: str, phrase: str) -> bool:
    """Whole-word, case-insensitive: "hi" is not found in "this", "good morning" is a phrase."""
    return re.search(r"(?<![a-z0-9])" + re.escape(phrase.lower()) + r"(?![a-z0-9])", text.lower()) is not None


def passes(answer: str, check: dict[str, Any]) -> bool:
    """Whether `answer` satisfies a prompt's check (`any`, `all` groups, or `count` + `min`)."""
    if "any" in check:
        return any(_has(answer, k) for k in check["any"])
    if "all" in check:
        return all(any(_has(answer, k) for k in group) for group in check["all"])
    if "count" in check:
        words = set(_words(answer))
        return len(words & {w.lower() for w in check["count"]}) >= check["min"]
    raise ValueError(f"unknown check {check!r}: use any, all, or count with min")


def chat_answers(model, tokenizer, prompts: Sequence[str], max_tokens: int = 64, batch_size: int = 64) -> list[str]:
    """Greedy answers to single-turn chats, generated together by the engine."""
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
           for p in prompts]
    longest = max(map(len, ids)) + max_tokens
    config = EngineConfig(max_num_seqs=batch_size, max_model_len=min(longest, model.cfg.max_position_embeddings),
                          max_num_batched_tokens=max(2048, batch_size))
    engine = Engine(model, tokenizer, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rids = [engine.add_request(p, params) for p in ids]
    done: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.text.strip()
    return [done[r] for r in rids]


def _answer_request(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(context, continuation) ids: the chat up to the assistant's turn, then the answer and its end."""
    messages = [{"role": "user", "content": question}]
    context = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}])
    if full[:len(context)] != context:  # templates that rewrite earlier turns: fall back to plain text
        context, full = context, context + tokenizer.encode(answer)
    return context, full[len(context):]


def mean_nll(judge, tokenizer, questions: Sequence[str], answers: Sequence[str], batch_size: int = 16) -> float:
    """Mean negative log-likelihood per answer token under `judge`, over all answers together."""
    requests = [_answer_request(tokenizer, q, a) for q, a in zip(questions, answers)]
    total = loglikelihoods(judge, requests, batch_size)
    return -sum(total) / sum(len(cont) for _, cont in requests)


def judge_preference(judge, tokenizer, questions: Sequence[str], first: Sequence[str], second: Sequence[str],
                     batch_size: int = 16) -> dict[str, Any]:
    """How often `judge` prefers `first`'s answer over `second`'s, asked in both orders.

    Strict (`win_rate`): a pair is decided only when both orders pick the same answer. A small
    judge may pick one position whatever it reads (SmolLM2-135M says "A" almost always), leaving
    nearly every pair tied; `position_bias` reports how often it chose "A". Position-corrected
    (`corrected_win_rate`): the log-odds of "A" over "B" with `first` in place A minus those with
    `first` in place B; a constant lean towards one letter cancels, so every pair with a nonzero
    difference is decided.
    """
    a_ids, b_ids = tokenizer.encode("A"), tokenizer.encode("B")
    requests = []
    for q, x, y in zip(questions, first, second):
        for a, b in ((x, y), (y, x)):
            ctx = tokenizer.apply_chat_template([{"role": "user", "content": JUDGE_QUESTION.format(
                question=q, a=a or "(no answer)", b=b or "(no answer)")}], add_generation_prompt=True)
            requests += [(ctx, a_ids), (ctx, b_ids)]
    scores = loglikelihoods(judge, requests, batch_size)
    wins = losses = ties = chose_a = corrected_wins = corrected_losses = 0
    for i in range(len(questions)):
        s = scores[4 * i:4 * i + 4]  # first as A: P(A), P(B); first as B: P(A), P(B)
        first_as_a, first_as_b = s[0] > s[1], s[3] > s[2]
        chose_a += (s[0] > s[1]) + (s[2] > s[3])
        if first_as_a and first_as_b:
            wins += 1
        elif not first_as_a and not first_as_b:
            losses += 1
        else:
            ties += 1
        margin = (s[0] - s[1]) - (s[2] - s[3])
        corrected_wins += margin > 0
        corrected_losses += margin < 0
    decided, corrected = wins + losses, corrected_wins + corrected_losses
    return {"win_rate": wins / decided if decided else None, "wins": wins, "losses": losses, "ties": ties,
            "position_bias": chose_a / (2 * len(questions)) if questions else None,
            "corrected_win_rate": corrected_wins / corrected if corrected else None,
            "corrected_wins": corrected_wins, "corrected_losses": corrected_losses}


def reference_nll(judge, judge_tokenizer, prompts: Sequence[dict[str, Any]] | None = None) -> float:
    """The judge's mean per-token NLL of the prompts' hand-written reference answers: fluency's
    denominator, the same for every model scored with this judge."""
    items = list(prompts) if prompts is not None else load_chat_prompts()
    return mean_nll(judge, judge_tokenizer, [it["prompt"] for it in items], [it["reference"] for it in items])


def evaluate_chat(model, tokenizer, judge=None, judge_tokenizer=None, baseline: Sequence[str] | None = None,
                  prompts: Sequence[dict[str, Any]] | None = None, max_tokens: int = 64,
                  reference: float | None = None) -> dict[str, Any]:
    """All figures for `model` on the chat prompts; fluency and preference need the `judge`;
    preference also needs `baseline` answers (one per prompt, e.g. an earlier recipe's). reference:
    `reference_nll` of this judge and these prompts when already computed (scoring several models)."""
    items = list(prompts) if prompts is not None else load_chat_prompts()
    questions = [it["prompt"] for it in items]
    answers = chat_answers(model, tokenizer, questions, max_tokens)
    ok = [passes(a, it["check"]) for a, it in zip(answers, items)]
    by_cat: dict[str, list[bool]] = {}
    for it, good in zip(items, ok):
        by_cat.setdefault(it["category"], []).append(good)
    result: dict[str, Any] = {
        "n": len(items), "on_topic": sum(ok) / len(ok),
        "on_topic_by_category": {c: sum(v) / len(v) for c, v in sorted(by_cat.items())},
        "mc_letter_starts": sum(bool(MC_LETTER.match(a)) for a in answers),
        "empty_answers": sum(not a for a in answers),
        "predictions": [{"id": it["id"], "prompt": it["prompt"], "answer": a, "on_topic": good}
                        for it, a, good in zip(items, answers, ok)],
    }
    if judge is not None:
        jt = judge_tokenizer
        ours = mean_nll(judge, jt, questions, [a or "." for a in answers])
        ref = reference if reference is not None else reference_nll(judge, jt, items)
        result.update(nll=ours, reference_nll=ref, fluency_ratio=ours / ref)
        if baseline is not None:
            if len(baseline) != len(items):
                raise ValueError(f"{len(baseline)} baseline answers for {len(items)} prompts; give one per prompt")
            result["preference"] = judge_preference(judge, jt, questions, answers, list(baseline))
    result["common_openings"] = Counter(" ".join(a.split()[:2]) for a in answers).most_common(5)
    return result


def plot_curve(curve: list[dict[str, Any]], path: str | Path) -> Path:
    """On-topic rate and fluency ratio at each evaluated point of a run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [p["point"] for p in curve]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(names, [100 * p["on_topic"] for p in curve], marker="o", label="on-topic (%)")
    ax.set_ylabel("on-topic (%)")
    ax.set_ylim(0, 100)
    ax2 = ax.twinx()
    ax2.plot(names, [p["fluency_ratio"] for p in curve], marker="s", color="tab:orange", label="fluency ratio")
    ax2.axhline(1.5, color="tab:orange", linestyle=":", linewidth=1)
    ax2.set_ylabel("fluency ratio (lower is better)")
    ax.set_title("chat quality along the run")
    fig.legend(loc="center right", bbox_to_anchor=(0.88, 0.5), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path
