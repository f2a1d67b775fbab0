"""Held-out evaluation of the VLM: questions about test-split images, answered by greedy decoding.

Each of the first num_images test images is asked three questions (`vlm_data.EVAL_QUESTIONS`):

* "What is in this picture?" → exact match against "A {class}." and class accuracy (the class the
  answer names, `mentioned_class`, is the image's): the number comparable to a classifier's;
* "Is it footwear?" → yes/no accuracy (the reply starts with the right word);
* "Describe the image." → keyword score: the caption names the image's class.

The VLM's own ViT, when it was trained as a classifier (it keeps its head), is scored on the same
images and on the whole test split: the VLM reads the same features through a projector and a
135M-parameter LM, so the classifier's accuracy is what it should approach.

Decoding is plain greedy over the model's forward (no KV cache: the answers are a few tokens,
and every prompt of a batch asks the same question about a different image, so the rows have
equal lengths and need no padding); the engine path is the server's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tokenmind.diffusion.data import load_split
from tokenmind.jsonl import atomic_open, write_json
from tokenmind.tokenizer import Tokenizer

from .images import to_pixel_values
from .vlm import IMAGE_PLACEHOLDER, VisionLanguageModel, load_vlm, render_vlm_chat, vlm_dir
from .vlm_data import CATEGORIES, EVAL_QUESTIONS, KEYWORDS, exact_match, identify_answer, mentioned_class, yes_no

IDENTIFY, FOOTWEAR, CAPTION = EVAL_QUESTIONS


@torch.no_grad()
def greedy_answers(model: VisionLanguageModel, tokenizer: Tokenizer, question: str, pixel_values: torch.Tensor,
                   max_new_tokens: int = 24) -> list[str]:
    """The model's greedy reply to `question` about each image of pixel_values (n, C, H, W), up
    to its first stop token (or max_new_tokens)."""
    messages = [{"role": "user", "content": f"{IMAGE_PLACEHOLDER}\n{question}"}]
    prompt, _, _ = render_vlm_chat(tokenizer, messages, model, add_generation_prompt=True)
    n, stops = pixel_values.shape[0], sorted(tokenizer.eos_token_ids)
    ids = torch.tensor(prompt).repeat(n, 1)
    image_embeds = model.image_embeddings(pixel_values)
    lm, done = model.language_model, torch.zeros(n, dtype=torch.bool)
    replies = torch.zeros(n, 0, dtype=torch.long)
    for _ in range(max_new_tokens):
        hidden = lm.norm(lm.run_layers(model.embed(ids, image_embeds=image_embeds)))
        token = lm.logits(hidden[:, -1]).argmax(-1)
        replies = torch.cat([replies, token[:, None]], dim=1)
        done |= torch.isin(token, torch.tensor(stops))
        if done.all():
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
    answers = []
    for row in replies.tolist():
        end = next((i for i, t in enumerate(row) if t in stops), len(row))
        answers.append(tokenizer.decode(row[:end], skip_special_tokens=True).strip())
    return answers


@torch.no_grad()
def classifier_accuracy(model: VisionLanguageModel, pixel_values: torch.Tensor, labels: torch.Tensor,
                        batch_size: int = 500) -> float | None:
    """Accuracy of the VLM's ViT as the classifier it was trained as (None when it has no head)."""
    if not model.vision.cfg.num_classes:
        return None
    correct = 0
    for i in range(0, len(labels), batch_size):
        logits = model.vision(pixel_values[i:i + batch_size].to(model.vision.patch_embed.weight.dtype))
        correct += int((logits.argmax(-1) == labels[i:i + batch_size]).sum())
    return correct / len(labels)


def evaluate_vlm(model: VisionLanguageModel, tokenizer: Tokenizer, dataset: str = "fashion-mnist",
                 num_images: int = 100, batch_size: int = 50, samples: int = 8) -> dict[str, Any]:
    """{"metrics": {...}, "samples": [...]} over the first num_images test images; see the module docstring."""
    images, labels = load_split(dataset, "test")
    if not 0 < num_images <= len(labels):
        raise ValueError(f"num_images must be in 1..{len(labels)}, got {num_images}")
    pixels = to_pixel_values(images[:num_images], model.image_size, model.image_channels)
    labels = labels[:num_images]
    was_training = model.training
    model.eval()
    try:
        answers = {q: sum((greedy_answers(model, tokenizer, q, pixels[i:i + batch_size])
                           for i in range(0, num_images, batch_size)), []) for q in EVAL_QUESTIONS}
    finally:
        model.train(was_training)
    truth = labels.tolist()
    footwear = ["yes" if label in CATEGORIES["footwear"] else "no" for label in truth]
    n = len(truth)
    metrics = {
        "identify_exact_match": sum(exact_match(a, identify_answer(y)) for a, y in zip(answers[IDENTIFY], truth)) / n,
        "identify_class_accuracy": sum(mentioned_class(a) == y for a, y in zip(answers[IDENTIFY], truth)) / n,
        "footwear_yes_no_accuracy": sum(yes_no(a) == f for a, f in zip(answers[FOOTWEAR], footwear)) / n,
        "caption_keyword_score": sum(mentioned_class(a) == y for a, y in zip(answers[CAPTION], truth)) / n,
    }
    vit = classifier_accuracy(model, pixels, labels)
    if vit is not None:
        metrics["vit_classifier_accuracy"] = vit
    shown = [{"image": i, "class": KEYWORDS[truth[i]], **{q: answers[q][i] for q in EVAL_QUESTIONS}}
             for i in range(min(samples, n))]
    return {"metrics": metrics, "samples": shown}


def eval_vlm(path: str | Path, num_images: int = 200, dataset: str = "fashion-mnist", batch_size: int = 50,
             out_dir: str | Path | None = None) -> dict[str, Any]:
    """Evaluate the VLM at `path` (a run folder or its final/) and write `vlm_eval.json` and
    `vlm_eval.md` to out_dir (default: the run folder); behind `tokenmind vision eval-vlm`."""
    folder = vlm_dir(path)
    if folder is None:
        raise FileNotFoundError(f"{path} holds no VLM; pass a `tokenmind vision train-vlm` run folder or its final/")
    model, tokenizer = load_vlm(folder)
    report = {"model": str(folder), "dataset": dataset, "split": "test", "num_images": num_images,
              **evaluate_vlm(model, tokenizer, dataset, num_images, batch_size)}
    images, labels = load_split(dataset, "test")
    full = classifier_accuracy(model, to_pixel_values(images, model.image_size, model.image_channels), labels)
    if full is not None:
        report["vit_classifier_accuracy_full_test"] = full
    out = Path(out_dir) if out_dir else (folder.parent if folder.name == "final" else folder)
    write_json(out / "vlm_eval.json", report)
    with atomic_open(out / "vlm_eval.md") as fh:
        fh.write(report_markdown(report))
    return report


def report_markdown(report: dict[str, Any]) -> str:
    """The report as a short markdown page: metrics table, then sample answers."""
    lines = [f"# VLM evaluation: {report['model']}", "",
             f"{report['num_images']} held-out {report['dataset']} {report['split']} images.", "",
             "| metric | value |", "| --- | ---: |"]
    lines += [f"| {name} | {value:.3f} |" for name, value in report["metrics"].items()]
    if "vit_classifier_accuracy_full_test" in report:
        lines.append(f"| vit_classifier_accuracy (whole test split) | {report['vit_classifier_accuracy_full_test']:.3f} |")
    lines += ["", "| image | class | " + " | ".join(EVAL_QUESTIONS) + " |", "| --- " * (2 + len(EVAL_QUESTIONS)) + "|"]
    lines += [f"| {s['image']} | {s['class']} | " + " | ".join(s[q].replace("|", "/") for q in EVAL_QUESTIONS) + " |"
              for s in report["samples"]]
    return "\n".join(lines) + "\n"
