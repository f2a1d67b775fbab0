"""`tokenmind serve --model VLM_DIR` through the official `openai` client: chat messages with
`image_url` data URLs answer as the offline engine and the dense VLM do, concurrent requests keep
their own images, the prefix cache is keyed on the image, and bad images get a 400 naming the
problem while the server keeps serving."""

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from test_serve_fixtures import LiveServer, tiny_pretrained
from test_vlm import IMAGE_TOKEN, chat_texts, tiny_vit

from tokenmind.engine.llm import LLM
from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.config import ModelConfig
from tokenmind.model.load import Pretrained
from tokenmind.model.transformer import Transformer
from tokenmind.tokenizer.train import DEFAULT_SPECIAL_TOKENS, train_bpe
from tokenmind.vision.images import decode_image, to_pixel_values
from tokenmind.vision.vlm import (
    IMAGE_PLACEHOLDER,
    build_vlm,
    load_vlm,
    render_vlm_chat,
    save_vlm,
)
from tokenmind.vision.vlm_eval import greedy_answers

QUESTION = "What is in this picture?"
MAX_TOKENS = 12
LIMITS = {"max_image_bytes": 8000, "max_image_pixels": 100 * 100, "max_images_per_request": 2}


def png(seed: int, size: int = 28, mode: str = "L", fmt: str = "PNG", noise: bool = True) -> bytes:
    """A random-noise (or, noise False, one-colour: a few hundred bytes at any size) image file."""
    rng = np.random.default_rng(seed)
    shape = (size, size) if mode == "L" else (size, size, 3)
    pixels = rng.integers(0, 256, shape, dtype=np.uint8) if noise else np.full(shape, seed, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(url: str, question: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                                         {"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    """A tiny random VLM saved as `tokenmind serve` finds one; its LM has large weights, so different
    images lead to different answers."""
    tokenizer = train_bpe(chat_texts(), vocab_size=400, special_tokens=[*DEFAULT_SPECIAL_TOKENS, IMAGE_TOKEN])
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    lm = Transformer(cfg)
    lm.init_weights(0.3, torch.Generator().manual_seed(0))
    vlm = build_vlm(tiny_vit(), lm, tokenizer, pool_grid=2, seed=1)
    with torch.no_grad():
        vlm.projector.linear_2.weight.mul_(20.0)  # image rows as large as the token embeddings
    return save_vlm(vlm, tokenizer, tmp_path_factory.mktemp("vlm") / "tiny-vlm")


@pytest.fixture(scope="module")
def offline(vlm_path):
    """The answer to QUESTION about an image (PNG bytes), by the offline engine and by the dense VLM."""
    vlm, tokenizer = load_vlm(vlm_path)
    llm = LLM(Pretrained(vlm.language_model, tokenizer, vlm_path), block_size=4)

    def answer(*images: bytes) -> tuple[str, str | None]:
        """(the engine's answer, the dense model's for a single image) to QUESTION after the images."""
        messages = [{"role": "user", "content": f"{IMAGE_PLACEHOLDER}\n" * len(images) + QUESTION}]
        ids, _, _ = render_vlm_chat(tokenizer, messages, vlm, add_generation_prompt=True)
        n = vlm.tokens_per_image
        starts = [p for p, t in enumerate(ids) if t == vlm.image_token_id][::n]
        pixels = to_pixel_values([decode_image(data, 1 << 20, 1 << 20) for data in images], vlm.image_size,
                                 vlm.image_channels)
        with torch.no_grad():
            rows = vlm.image_embeddings(pixels)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        engine = llm.generate(ids, params, prompt_embeds=[list(zip(starts, rows))])[0]
        dense = greedy_answers(vlm, tokenizer, QUESTION, pixels, max_new_tokens=MAX_TOKENS)[0] if len(images) == 1 \
            else None
        return engine.outputs[0].text, dense

    return answer


@pytest.fixture(scope="module")
def server(vlm_path):
    with LiveServer(None, model=str(vlm_path), kv_cache_bytes=4 << 20, **LIMITS) as live:
        yield live


def ask(server, url: str, **options):
    return server.openai().chat.completions.create(model="tiny-vlm", messages=image_message(url),
                                                   max_tokens=MAX_TOKENS, temperature=0, **options)


def test_the_answer_is_the_offline_engines_and_the_dense_models(server, offline):
    data = png(0)
    engine, dense = offline(data)
    reply = ask(server, data_url(data))
    assert reply.choices[0].message.content == engine
    assert engine.strip() == dense
    chunks = server.openai().chat.completions.create(model="tiny-vlm", messages=image_message(data_url(data)),
                                                     max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == engine


def test_concurrent_requests_keep_their_own_images(server, offline):
    images = [png(1), png(2, mode="RGB", size=40), png(3)]  # RGB and another size: converted and resized
    with ThreadPoolExecutor(len(images)) as pool:
        replies = list(pool.map(lambda data: ask(server, data_url(data)), images))
    answers = [r.choices[0].message.content for r in replies]
    assert answers == [offline(data)[0] for data in images]
    assert len(set(answers)) > 1  # the images matter: a mix-up would show


def test_two_images_in_one_message_are_read_in_order(server, offline):
    first, second = png(10), png(11)
    content = [{"type": "image_url", "image_url": {"url": data_url(data)}} for data in (first, second)]
    reply = server.openai().chat.completions.create(
        model="tiny-vlm", max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}])
    assert reply.choices[0].message.content == offline(first, second)[0] != offline(second, first)[0]


def test_the_prefix_cache_is_keyed_on_the_image(server, offline):
    """The same image and text again reuse the cached blocks; another image behind the same
    placeholder tokens shares none of the image's blocks and gets its own answer."""
    first, second = png(4), png(5)
    cold = ask(server, data_url(first))
    hits_before = server.metrics()["tokenmind_prefix_cache_hit_rate"]
    warm = ask(server, data_url(first))
    other = ask(server, data_url(second))
    prompt = cold.usage.prompt_tokens
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // 16 * 16 > 0  # 16: the block size
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # the image starts in the first block
    assert warm.choices[0].message.content == cold.choices[0].message.content == offline(first)[0]
    assert other.choices[0].message.content == offline(second)[0]
    assert server.metrics()["tokenmind_prefix_cache_hit_rate"] > hits_before


BAD_IMAGES = [
    ("https://example.com/cat.png", "fetches no URLs, so it cannot read a https: URL"),
    ("data:image/png," + "x" * 10, "not base64-encoded"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "media type is 'text/plain', not an image"),
    (data_url(b"hello, not an image"), "not an image"),
    (data_url(png(6, fmt="BMP"), "image/bmp"), "unsupported image format BMP"),
    (data_url(png(7, size=120)), "over the limit of 8,000 bytes"),
    (data_url(png(8, size=101, noise=False)), "is 101x101 = 10,201 pixels, over the limit of 10,000"),
    (data_url(png(9)[:-30]), "truncated or corrupt"),
]


@pytest.mark.parametrize("url, message", BAD_IMAGES, ids=[m.split(",")[0][:24] for _, m in BAD_IMAGES])
def test_a_bad_image_is_a_400_naming_it_and_the_server_goes_on(server, url, message):
    with pytest.raises(openai.BadRequestError) as e:
        ask(server, url)
    error = e.value.body
    assert message in error["message"] and error["message"].startswith("messages[0].content[0]: ")
    assert error["param"] == "messages[0].content[0].image_url" and error["code"] == "invalid_image"
    assert ask(server, data_url(png(0))).choices[0].finish_reason in ("stop", "length")


def test_request_level_image_errors(server):
    client = server.openai()
    three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(i))}}
                                          for i in range(3)]}]
    with pytest.raises(openai.BadRequestError, match="at most 2 per request"):
        client.chat.completions.create(model="tiny-vlm", messages=three, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="contains the reserved image token"):
        client.chat.completions.create(model="tiny-vlm", messages=[{"role": "user", "content": IMAGE_TOKEN}],
                                       max_tokens=2)
    server.wait_idle()


def test_the_model_card_says_it_reads_images(server):
    card = server.openai().models.retrieve("tiny-vlm")
    assert card.input_modalities == ["text", "image"] and card.tokens_per_image == 5


def test_a_text_only_model_refuses_images_by_name():
    with LiveServer(tiny_pretrained(), max_image_bytes=8000) as live:
        with pytest.raises(openai.BadRequestError) as e:
            live.openai().chat.completions.create(model="tiny", messages=image_message(data_url(png(0))), max_tokens=2)
        assert "messages[0].content[0] is an image, but 'tiny' is a text-only model" in e.value.body["message"]
        assert e.value.body["param"] == "messages[0].content[0]"
        text = live.openai().chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
        assert text.choices[0].message.content
