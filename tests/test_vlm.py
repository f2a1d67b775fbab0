"""The LLaVA-style VLM on tiny random parts: placeholder splicing, save/load, chat rendering, the
instruction data and its loader, both training stages on the one Trainer with exact resume, and
evaluation; one slow test on the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_train_helpers import Preempted, one_thread  # noqa: F401 (one_thread: autouse fixture)

from tokenmind.data.loader import IGNORE_INDEX, LoaderConfig
from tokenmind.model.checkpoint import save_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.load import load_model
from tokenmind.model.lora import lora_layers
from tokenmind.model.transformer import Transformer
from tokenmind.tokenizer import Tokenizer
from tokenmind.tokenizer.train import DEFAULT_SPECIAL_TOKENS, train_bpe
from tokenmind.train.checkpoint import latest_checkpoint
from tokenmind.train.distributed import init_distributed
from tokenmind.vision.images import to_pixel_values
from tokenmind.vision.vit import ViT, ViTConfig, load_vit, save_vit
from tokenmind.vision.vlm import (
    IMAGE_PLACEHOLDER,
    VisionLanguageModel,
    build_vlm,
    choose_image_token,
    expand_image_placeholders,
    is_vlm_dir,
    load_vlm,
    render_vlm_chat,
    save_vlm,
)
from tokenmind.posttrain.data import to_example
from tokenmind.vision.vlm_data import (
    VLMBatch,
    VLMLoader,
    conversation,
    exact_match,
    identify_answer,
    mentioned_class,
    vlm_examples,
    yes_no,
)
from tokenmind.vision.vlm_eval import engine_answers, eval_vlm, greedy_answers
from tokenmind.vision.vlm_train import VLMObjective, VLMTrainConfig, build_vlm_trainer, load_vlm_train_config, train_vlm

IMAGE_TOKEN = "<image_pad>"


def chat_texts() -> list[str]:
    rng = np.random.default_rng(0)
    chats = [conversation(label % 10, rng) for label in range(200)]
    return ["".join(f"{m['role']}\n{m['content']}\n" for m in chat) for chat in chats]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """Byte-level BPE with a ChatML template and one spare special token for image placeholders."""
    return train_bpe(chat_texts(), vocab_size=400, special_tokens=[*DEFAULT_SPECIAL_TOKENS, IMAGE_TOKEN])


def tiny_lm(tokenizer: Tokenizer, seed: int = 0) -> Transformer:
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Transformer(cfg)
    model.init_weights(0.02, torch.Generator().manual_seed(seed))
    return model


def tiny_vit(seed: int = 0, num_classes: int = 0) -> ViT:
    torch.manual_seed(seed)
    return ViT(ViTConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, num_classes=num_classes))


def tiny_vlm(tokenizer: Tokenizer, pool_grid: int = 2) -> VisionLanguageModel:
    return build_vlm(tiny_vit(), tiny_lm(tokenizer), tokenizer, pool_grid=pool_grid).eval()


def pixels(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def prompt_ids(model: VisionLanguageModel, images: int = 1) -> torch.Tensor:
    ids = [5, 6, 7] + ([model.image_token_id] * model.tokens_per_image + [8, 9]) * images + [10]
    return torch.tensor([ids])


def test_the_image_token_is_a_spare_special_token(tokenizer: Tokenizer) -> None:
    assert choose_image_token(tokenizer) == IMAGE_TOKEN
    plain = train_bpe(chat_texts()[:20], vocab_size=300)  # every special token is bos/eos/template
    with pytest.raises(ValueError, match="no spare special token"):
        choose_image_token(plain)


@pytest.mark.parametrize("pool_grid, tokens", [(0, 50), (2, 5), (7, 50), (1, 2)])
def test_tokens_per_image_follow_the_pooled_grid(tokenizer: Tokenizer, pool_grid: int, tokens: int) -> None:
    model = tiny_vlm(tokenizer, pool_grid)
    assert model.tokens_per_image == tokens
    embeds = model.image_embeddings(pixels(3))
    assert embeds.shape == (3, tokens, 64) and embeds.dtype == torch.float32
    with pytest.raises(ValueError, match="larger than the ViT's 7x7"):
        tiny_vlm(tokenizer, 8)


def test_without_images_the_vlm_is_its_language_model(tokenizer: Tokenizer) -> None:
    model = tiny_vlm(tokenizer)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(model(ids), model.language_model(ids))


def test_image_rows_are_spliced_in_order(tokenizer: Tokenizer) -> None:
    model = tiny_vlm(tokenizer)
    ids, images = prompt_ids(model, images=2), pixels(2)
    embeds = model.image_embeddings(images)
    manual = model.language_model.embed(ids)
    slots = (ids[0] == model.image_token_id).nonzero().squeeze(1)
    manual[0, slots] = embeds.reshape(-1, 64)  # image 0's rows first, then image 1's
    lm = model.language_model
    torch.testing.assert_close(model(ids, images), lm.logits(lm.norm(lm.run_layers(manual))))
    swapped = model(ids, images.flip(0))  # the images change places: the logits after the first one change
    first = int(slots[0])
    torch.testing.assert_close(swapped[:, :first], model(ids, images)[:, :first])  # causal: before it, no change
    assert not torch.allclose(swapped[:, first:], model(ids, images)[:, first:])


def test_a_placeholder_count_that_does_not_match_the_images_is_refused(tokenizer: Tokenizer) -> None:
    model = tiny_vlm(tokenizer)
    with pytest.raises(ValueError, match="10 image placeholder tokens but 1 image"):
        model(prompt_ids(model, images=2), pixels(1))
    with pytest.raises(ValueError, match="5 image placeholder tokens but 0 image"):
        model(prompt_ids(model, images=1))


def test_placeholders_expand_through_the_chat_template(tokenizer: Tokenizer) -> None:
    model = tiny_vlm(tokenizer)
    text, images = expand_image_placeholders(f"{IMAGE_PLACEHOLDER}\nWhat is this?", IMAGE_TOKEN, 5)
    assert images == 1 and text == IMAGE_TOKEN * 5 + "\nWhat is this?"
    with pytest.raises(ValueError, match="reserved image token"):
        expand_image_placeholders(f"{IMAGE_TOKEN} sneaky", IMAGE_TOKEN, 5)
    messages = [{"role": "user", "content": f"{IMAGE_PLACEHOLDER}\nWhat is this?"},
                {"role": "assistant", "content": "A bag."}]
    ids, mask, n = render_vlm_chat(tokenizer, messages, model)
    assert n == 1 and ids.count(model.image_token_id) == 5
    assert not any(mask[i] for i, t in enumerate(ids) if t == model.image_token_id)  # image rows are never targets
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "A bag.<|im_end|>"


def test_save_and_load_round_trip(tokenizer: Tokenizer, tmp_path) -> None:
    model = tiny_vlm(tokenizer)
    ids, images = prompt_ids(model), pixels(1)
    path = save_vlm(model, tokenizer, tmp_path / "vlm")
    assert is_vlm_dir(path) and is_vlm_dir(tmp_path) is False
    loaded, loaded_tokenizer = load_vlm(path)
    assert loaded.tokens_per_image == 5 and loaded.image_token_id == model.image_token_id
    assert loaded_tokenizer.id_to_token(loaded.image_token_id) == IMAGE_TOKEN
    torch.testing.assert_close(loaded(ids, images), model(ids, images))
    plain = load_model(path)  # the language model alone, as any tool reads the directory
    torch.testing.assert_close(plain.model(torch.tensor([[5, 6, 7]])), model.language_model(torch.tensor([[5, 6, 7]])))
    with pytest.raises(FileNotFoundError, match="holds no VLM"):
        load_vlm(tmp_path / "nothing")


# ---- instruction data, training stages, evaluation -------------------------------------------------------


def test_answers_follow_the_labels() -> None:
    rng = np.random.default_rng(1)
    for label in range(10):
        chat = conversation(label, rng, max_turns=3)
        assert chat[0]["content"].startswith(f"{IMAGE_PLACEHOLDER}\n")
        assert sum(IMAGE_PLACEHOLDER in m["content"] for m in chat) == 1
        for question, reply in zip(chat[::2], chat[1::2]):
            if question["content"].endswith("Is it footwear?"):
                assert reply["content"] == ("Yes." if label in (5, 7, 9) else "No.")
            if question["content"].endswith("What is in this picture?"):
                assert reply["content"] == identify_answer(label)
    assert identify_answer(9) == "An ankle boot." and identify_answer(0) == "A t-shirt."
    assert mentioned_class("This is a t-shirt, not a shirt.") == 0 and mentioned_class("A shirt.") == 6
    assert mentioned_class("Nothing here.") is None
    assert exact_match("a Sneaker", "A sneaker.") and not exact_match("A sneaker, maybe.", "A sneaker.")
    assert yes_no("Yes, it is.") == "yes" and yes_no("No.") == "no" and yes_no("Maybe.") is None


def test_the_loader_hands_each_row_its_images_in_placeholder_order(tokenizer: Tokenizer) -> None:
    model = tiny_vlm(tokenizer)
    images = torch.randint(0, 256, (12, 28, 28), dtype=torch.uint8)
    labels = torch.arange(12) % 10
    examples = vlm_examples(tokenizer, model, labels, 12, seq_len=256, seed=0)
    loader = VLMLoader(examples, images, LoaderConfig(batch_size=2, seq_len=256, seed=0), 28, 1)
    batch = next(loader)
    placeholders = int((batch.input_ids == model.image_token_id).sum())
    assert placeholders == batch.pixel_values.shape[0] * model.tokens_per_image
    order = [examples[i].image for row in loader.rows_for_epoch(0)[:2] for i in loader.rows[row]]
    torch.testing.assert_close(batch.pixel_values, to_pixel_values(images[order], 28, 1))
    assert (batch.targets[batch.input_ids == model.image_token_id] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="does not fit data.seq_len=20"):
        vlm_examples(tokenizer, model, labels, 2, seq_len=20, seed=0)


@pytest.fixture(scope="module")
def parts(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random LM (with the tokenizer), a tiny ViT classifier and a stage-1 VLM of the two, on disk."""
    root = tmp_path_factory.mktemp("vlm")
    lm = save_hf_dir(tiny_lm(tokenizer), root / "lm", tokenizer=tokenizer)
    vit = save_vit(tiny_vit(num_classes=10), root / "vit")
    vlm = save_vlm(build_vlm(load_vit(vit), tiny_lm(tokenizer), tokenizer), tokenizer, root / "stage1")
    return {"lm": lm, "vit": vit, "stage1": vlm}


def tiny_train_config(parts: dict[str, Path], out_dir: Path, *overrides: str) -> VLMTrainConfig:
    """Digits stand in for Fashion-MNIST (same 10 labels, 8×8 resized to 28×28): 4 rows × 256 tokens, fp32."""
    base = [f"--vlm.language_model={parts['lm']}", f"--vlm.vision={parts['vit']}", f"--vlm.init_from={parts['stage1']}",
            "--data.dataset=digits", "--data.train_images=48", "--data.val_images=16", "--data.batch_size=4",
            "--optim.lr=3e-3", "--schedule.warmup_steps=2", "--train.steps=8", "--train.precision=fp32",
            "--train.eval_batches=2", f"--train.out_dir={out_dir}"]
    return load_vlm_train_config(None, base + list(overrides))


def test_stage_1_trains_the_projector_alone(parts: dict[str, Path], tmp_path: Path) -> None:
    cfg = tiny_train_config(parts, tmp_path, "--train.steps=16", "--schedule.name=constant")
    result = train_vlm(cfg)
    assert np.mean(result.losses[-5:]) < result.losses[0] - 0.02  # a frozen random LM: the projector only nudges it
    saved = load_file(str(latest_checkpoint(tmp_path / "checkpoints") / "model.safetensors"))
    assert saved and all(k.startswith("projector.") for k in saved)  # the frozen ViT and LM are not checkpointed
    trained, _ = load_vlm(result.final_model_path)
    start = load_vit(parts["vit"])
    lm = load_model(parts["lm"]).model
    for a, b in zip(trained.vision.state_dict().values(), start.state_dict().values()):
        torch.testing.assert_close(a, b)
    for a, b in zip(trained.language_model.state_dict().values(), lm.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert json.loads((tmp_path / "vlm_data.json").read_text())["tokens_per_image"] == 5


def test_stage_2_resume_retraces_the_uninterrupted_run(parts: dict[str, Path], tmp_path: Path) -> None:
    args = ["--vlm.stage=2", "--train.checkpoint_every=4", "--train.keep_last=0", "--train.grad_accum=2",
            "--data.batch_size=2"]
    straight = train_vlm(tiny_train_config(parts, tmp_path / "straight", *args))
    cfg = tiny_train_config(parts, tmp_path / "crashed", *args)
    trainer = build_vlm_trainer(cfg, init_distributed(cfg.train.distributed, cfg.train.device))

    def die(module, inputs, output):
        if trainer.step == 5:
            raise Preempted

    trainer.model.language_model.norm.register_forward_hook(die)
    with pytest.raises(Preempted):
        trainer.train()
    resumed = train_vlm(cfg)
    assert len(resumed.losses) == 4 and resumed.losses == pytest.approx(straight.losses[4:], abs=1e-6)
    saved = load_file(str(latest_checkpoint(tmp_path / "crashed" / "checkpoints") / "model.safetensors"))
    assert any(".adapters." in k for k in saved) and any(k.startswith("projector.") for k in saved)
    assert not any(k.startswith("vision.") for k in saved)
    merged, _ = load_vlm(resumed.final_model_path)  # LoRA merged into the saved LM: a plain Transformer again
    assert not lora_layers(merged.language_model)
    with pytest.raises(ValueError, match="stage 2 starts from a stage-1 VLM"):
        load_vlm_train_config(None, ["--vlm.stage=2"])


def test_engine_answers_equal_greedy_decoding_over_the_forward(parts: dict[str, Path]) -> None:
    model, tokenizer = load_vlm(parts["stage1"])
    images = pixels(4)
    with torch.no_grad():
        model.projector.linear_2.weight.mul_(50)  # images that matter: the random answers differ by image
    dense = greedy_answers(model, tokenizer, "What is in this picture?", images, max_new_tokens=6)
    assert len(set(dense)) > 1
    assert engine_answers(model, tokenizer, "What is in this picture?", images, max_new_tokens=6) == dense
    alone = [greedy_answers(model, tokenizer, "What is in this picture?", images[i:i + 1], max_new_tokens=6)[0]
             for i in range(4)]
    assert alone == dense


def test_eval_writes_a_report_with_the_classifier_beside(parts: dict[str, Path], tmp_path: Path) -> None:
    report = eval_vlm(parts["stage1"], num_images=6, dataset="digits", out_dir=tmp_path)
    metrics = report["metrics"]
    assert set(metrics) == {"identify_exact_match", "identify_class_accuracy", "footwear_yes_no_accuracy",
                            "caption_keyword_score", "vit_classifier_accuracy"}
    assert all(0 <= v <= 1 for v in metrics.values()) and 0 <= report["vit_classifier_accuracy_full_test"] <= 1
    assert json.loads((tmp_path / "vlm_eval.json").read_text())["metrics"] == metrics
    assert "identify_exact_match" in (tmp_path / "vlm_eval.md").read_text()
    assert len(report["samples"]) == 6


@pytest.mark.slow
def test_smollm2_vlm_splices_images_and_trains_only_the_projector() -> None:
    start = load_model("smollm2", dtype=torch.float32)
    model = build_vlm(tiny_vit(), start.model, start.tokenizer)
    tokenizer = start.tokenizer
    assert tokenizer.id_to_token(model.image_token_id) == "<empty_output>"  # a spare special token, no new row
    assert model.language_model.cfg.vocab_size == tokenizer.vocab_size
    messages = [{"role": "user", "content": f"{IMAGE_PLACEHOLDER}\nWhat is in this picture?"},
                {"role": "assistant", "content": "A sneaker."}]
    ids, mask, images = render_vlm_chat(tokenizer, messages, model)
    text = tokenizer.decode(ids)
    assert images == 1 and "<|im_start|>user\n" + "<empty_output>" * 5 + "\nWhat is in this picture?" in text
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "A sneaker.<|im_end|>"
    plain = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        torch.testing.assert_close(model(plain), model.language_model(plain))
    for p in [*model.vision.parameters(), *model.language_model.parameters()]:
        p.requires_grad_(False)
    example = to_example(ids, mask, len(ids))
    batch = VLMBatch(*(torch.from_numpy(a)[None] for a in (example.inputs, example.targets)),
                     torch.zeros(1, len(ids), dtype=torch.long), torch.arange(len(ids))[None], pixels(1))
    terms = VLMObjective()(model, batch, "fp32")
    terms.loss.backward()
    assert int(terms.count) == len(tokenizer.encode("A sneaker.")) + 1  # the answer and <|im_end|>
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.projector.parameters())


def test_cli_trains_a_stage_and_evaluates_it(parts: dict[str, Path], tmp_path: Path, capsys) -> None:
    from tokenmind.cli import main

    args = [f"--vlm.language_model={parts['lm']}", f"--vlm.vision={parts['vit']}", "--data.dataset=digits",
            "--data.train_images=16", "--data.val_images=0", "--data.batch_size=2", "--train.steps=2",
            "--schedule.warmup_steps=1", "--train.precision=fp32", f"--train.out_dir={tmp_path / 'run'}"]
    assert main(["vision", "train-vlm", "--stage", "1", *args]) == 0
    assert "done: 2 steps" in capsys.readouterr().out
    assert main(["vision", "eval-vlm", "--model", str(tmp_path / "run"), "--images", "3", "--dataset", "digits"]) == 0
    assert "identify_exact_match:" in capsys.readouterr().out and (tmp_path / "run" / "vlm_eval.md").is_file()
