"""Images in chat requests for a vision-language model: OpenAI `image_url` parts → prompt embeddings.

`tokenmind serve --model VLM_DIR` (a `save_vlm` directory) serves the VLM's language model on the
usual paged engine and keeps the VLM for its images. An image part must carry a data URL
(`data:image/png;base64,...`; PNG, JPEG or WebP): the server fetches nothing. On the request's
worker thread each image is decoded with limits on its bytes and pixels (`decode_image`) and
written into the prompt as LLaVA's `<image>\\n`, expanded to `tokens_per_image` placeholder tokens;
anything wrong is a 400 naming the content part. Its embeddings (ViT → projector) are computed on
the engine thread between two steps, as the sentence encoder's are (one OpenMP team; see
`app.load_off_main_thread`), and enter the engine as `PromptEmbeds` at the placeholder positions:
image tokens are prefill like any other — batched with other requests, split by chunked prefill,
recomputed after a preemption. Their prefix-cache key is a digest of the image's bytes, so the same
image with the same text reuses its k/v, and another image behind the same placeholders never does.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

import torch
from PIL import Image

from ..engine.sequence import PromptEmbeds
from ..tokenizer import Tokenizer
from ..vision.images import decode_image, to_pixel_values
from ..vision.vlm import VisionLanguageModel
from .errors import APIError
from .protocol import ChatMessage


@dataclass
class RequestImage:
    """One decoded image of a request, with its file bytes (the prefix-cache key is their digest)."""

    data: bytes
    image: Image.Image


def read_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 data URL; ValueError naming what is wrong otherwise."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] + ":" if ":" in url[:16] else "this"
        raise ValueError(f"this server fetches no URLs, so it cannot read a {scheme} URL; send the image inline as a "
                         "data URL: data:image/png;base64,<the file's bytes in base64>")
    header, comma, payload = url[len("data:"):].partition(",")
    mime, *params = header.split(";")
    if not comma or "base64" not in params:
        raise ValueError("the data URL is not base64-encoded; send data:image/png;base64,<the file's bytes in base64>")
    if mime and not mime.startswith("image/"):
        raise ValueError(f"the data URL's media type is {mime!r}, not an image; send image/png, image/jpeg or "
                         "image/webp")
    if len(payload) > 4 * (max_bytes // 3 + 1):  # decoded, it would be over the limit: do not decode it
        raise ValueError(f"the image is about {len(payload) * 3 // 4:,} bytes, over the limit of {max_bytes:,} bytes; "
                         "send a smaller image")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise ValueError(f"the data URL's data is not valid base64 ({e})") from e


class ImageInputs:
    """What the server does with a VLM's images: read them from a request, find their placeholders
    in the rendered prompt, and embed them (on the engine thread)."""

    def __init__(self, model: VisionLanguageModel, tokenizer: Tokenizer, max_images: int, max_bytes: int,
                 max_pixels: int):
        self.model, self.max_images, self.max_bytes, self.max_pixels = model, max_images, max_bytes, max_pixels
        self.token = tokenizer.id_to_token(model.image_token_id)
        self.image_text = self.token * model.tokens_per_image + "\n"  # LLaVA's "<image>\n", expanded

    def read(self, messages: list[ChatMessage]) -> list[RequestImage]:
        """Every image of the messages, in order, decoded; a 400 naming the part that is wrong."""
        parts = [(i, j, image) for i, m in enumerate(messages) for j, image in m.images()]
        if len(parts) > self.max_images:
            raise APIError(400, f"the request holds {len(parts)} images; this server takes at most {self.max_images} "
                                "per request (--max-images-per-request)", param="messages", code="too_many_images")
        images = []
        for i, j, part in parts:
            try:
                data = read_data_url(part.url, self.max_bytes)
                images.append(RequestImage(data, decode_image(data, self.max_bytes, self.max_pixels)))
            except ValueError as e:
                raise APIError(400, f"messages[{i}].content[{j}]: {e}", param=f"messages[{i}].content[{j}].image_url",
                               code="invalid_image") from e
        return images

    def starts(self, prompt: list[int], num_images: int) -> list[int]:
        """The first placeholder position of each image in the rendered prompt; a 400 if the text
        itself holds the placeholder token (it would be read as an image)."""
        n, token_id = self.model.tokens_per_image, self.model.image_token_id
        slots = [p for p, t in enumerate(prompt) if t == token_id]
        starts = slots[::n]
        if len(slots) != num_images * n or any(slots[k] != starts[k // n] + k % n for k in range(len(slots))):
            raise APIError(400, f"the messages' text contains the reserved image token {self.token!r}; send images "
                                "as image_url content parts and leave that token out of the text", param="messages")
        return starts

    @torch.inference_mode()
    def embeds(self, images: list[RequestImage], starts: list[int]) -> list[PromptEmbeds]:
        """The images' rows for the engine (one `PromptEmbeds` each), keyed by their bytes. Tensor
        work: call it on the engine thread (`AsyncEngine.run_between_steps`)."""
        m = self.model
        pixels = to_pixel_values([im.image for im in images], m.image_size, m.image_channels)
        rows = m.image_embeddings(pixels.to(m.projector.linear_1.weight.device))
        return [PromptEmbeds(start, r, b"image:" + hashlib.blake2b(im.data, digest_size=16).digest())
                for start, r, im in zip(starts, rows, images)]
