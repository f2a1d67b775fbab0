"""The LLaVA-style VLM on tiny random parts: placeholder splicing, save/load, chat rendering, the
instruction data and its loader, both training stages on the one Trainer with exact resume, and
evaluation; one slow test on the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.model.config import ModelConfig
from tokenmind.model.load import load_model
from tokenmind.model.transformer import Transformer
from tokenmind.tokenizer import Tokenizer
from tokenmind.tokenizer.train import DEFAULT_SPECIAL_TOKENS, train_bpe
from tokenmind.vision.vit import ViT, ViTConfig
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
from tokenmind.vision.vlm_data import conversation

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
