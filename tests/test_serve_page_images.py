"""Images on the web chat page, in headless Chromium against a served tiny VLM and a text-only model:
attach (keyboard, paste, drop), downscale, remove, send as OpenAI `image_url` parts, keep them in the
history, and show the server's 400s. Skipped, as tests/test_serve_page.py is, without playwright or Chromium.
"""

import base64
import io

import numpy as np
import test_serve_page
import test_serve_vision
from PIL import Image
from test_serve_fixtures import LiveServer, tiny_pretrained

# The fixtures of those modules, registered here under these names: Chromium, and a tiny random VLM on disk.
chromium = test_serve_page.browser
vlm_dir = test_serve_vision.vlm_path

QUESTION = "What is in this picture?"


def picture(width: int, height: int) -> bytes:
    """A colour-gradient PNG (small as a file at any size)."""
    x = np.linspace(0, 255, width, dtype=np.uint8)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.uint8)[:, None, None]
    pixels = np.concatenate(np.broadcast_arrays(x, y, (x // 2 + y // 2)), axis=2)
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def upload(name: str, data: bytes, mime: str = "image/png") -> dict:
    return {"name": name, "mimeType": mime, "buffer": data}


def decode(url: str) -> Image.Image:
    """The image of a data URL, checked to be the file its media type says."""
    head, _, payload = url.partition(",")
    image = Image.open(io.BytesIO(base64.b64decode(payload)))
    assert head == f"data:image/{image.format.lower()};base64"
    return image


# Hands the page an image file the way a paste or a drop does (a DataTransfer holding a File).
GIVE_FILE = """async ([how, name, type]) => {
  const canvas = document.createElement("canvas");
  canvas.width = 40; canvas.height = 30;
  canvas.getContext("2d").fillRect(0, 0, 40, 30);
  const blob = type === "image/png" ? await new Promise((r) => canvas.toBlob(r, type)) : new Blob(["not an image"]);
  const data = new DataTransfer();
  data.items.add(new File([blob], name, { type }));
  const init = { bubbles: true, cancelable: true };
  if (how === "paste") document.getElementById("input").dispatchEvent(new ClipboardEvent("paste", { ...init, clipboardData: data }));
  else document.getElementById("conversation").dispatchEvent(new DragEvent("drop", { ...init, dataTransfer: data }));
}"""


def open_page(browser, url: str, model: str):
    """The chat page, its file choosers recorded in `page.choosers`. (Registered before the page loads, the
    listener makes playwright intercept choosers from the start; `expect_file_chooser` alone, called on a
    loaded page, missed about half of them here.)"""
    page = browser.new_page()
    page.set_default_timeout(20_000)
    page.choosers = []
    page.on("filechooser", lambda chooser: page.choosers.append(chooser))
    page.goto(url + "/")
    page.wait_for_function(f"document.getElementById('model').textContent === '{model}'")
    return page


def finished(page, index: int) -> str:
    page.wait_for_function(f"document.querySelectorAll('.message.assistant')[{index}]?.dataset.finish")
    return page.locator(".message.assistant").nth(index).get_attribute("data-finish")


def test_a_vlm_chat_sends_downscaled_images_keeps_them_in_the_history_and_shows_400s(chromium, vlm_dir):
    with LiveServer(None, model=str(vlm_dir), max_images_per_request=2) as server:
        page = open_page(chromium, server.url, "tiny-vlm")
        page.click("#settings summary")
        page.fill("#max-tokens", "6")
        page.eval_on_selector("#temperature", "el => { el.value = '0'; el.dispatchEvent(new Event('input')); }")
        attach = page.get_by_role("button", name="Attach image")
        assert attach.get_attribute("aria-disabled") == "false" and "at most 512 px" in attach.get_attribute("title")

        attach.focus()  # keyboard only: Enter on the button opens the file chooser
        with page.expect_file_chooser() as chooser:
            page.keyboard.press("Enter")
        chooser.value.set_files([upload("wide.png", picture(1200, 800)), upload("small.png", picture(20, 30))])
        thumbs = page.locator("#attachments img")
        page.wait_for_function("document.querySelectorAll('#attachments img').length === 2")
        sizes = thumbs.evaluate_all("els => els.map(e => [e.alt, e.naturalWidth, e.naturalHeight])")
        assert sizes == [["wide.png", 512, 341], ["small.png", 20, 30]]  # downscaled to 512 px, never upscaled
        assert page.inner_text("#status") == "2 images attached"  # role=status: read out
        page.get_by_role("button", name="Remove image small.png").focus()
        page.keyboard.press("Enter")
        assert thumbs.count() == 1 and page.evaluate("document.activeElement.getAttribute('aria-label')") == \
            "Remove image wide.png"  # focus stays in the list

        with page.expect_request("**/v1/chat/completions") as request:
            page.fill("#input", QUESTION)
            page.press("#input", "Enter")
        first = request.value.post_data_json
        [message] = first["messages"]
        image_part, text_part = message["content"]
        assert message["role"] == "user" and text_part == {"type": "text", "text": QUESTION}
        assert image_part["type"] == "image_url" and list(image_part["image_url"]) == ["url"]
        sent = decode(image_part["image_url"]["url"])
        assert sent.format == "JPEG" and sent.size == (512, 341)  # a photo-like gradient: JPEG is the smaller
        assert finished(page, 0) in ("stop", "length") and page.is_hidden("#attachments")
        user = page.locator(".message.user")
        assert user.locator("img").get_attribute("src") == image_part["image_url"]["url"]
        assert user.inner_text() == QUESTION
        # The same JSON, sent without the page, gets the same (greedy) answer the page kept.
        direct = server.openai().chat.completions.create(model=first["model"], messages=first["messages"],
                                                         max_tokens=6, temperature=0)
        answer = direct.choices[0].message.content

        # Paste and drop attach too; a file that is no image is refused in the page, not sent.
        page.evaluate(GIVE_FILE, ["paste", "pasted.png", "image/png"])
        page.evaluate(GIVE_FILE, ["drop", "dropped.png", "image/png"])
        page.evaluate(GIVE_FILE, ["drop", "notes.txt", "text/plain"])
        page.wait_for_function("document.getElementById('status').textContent.includes('notes.txt')")
        assert "notes.txt is not an image" in page.inner_text("#status")
        assert page.locator("#attachments img").evaluate_all("els => els.map(e => e.alt)") == \
            ["pasted.png", "dropped.png"]
        with page.expect_request("**/v1/chat/completions") as request:
            page.press("#input", "Enter")  # images alone, no text: the composer allows it
        second = request.value.post_data_json
        assert second["messages"][:2] == [message, {"role": "assistant", "content": answer}]  # history kept
        pasted, dropped = second["messages"][2]["content"]
        for part in (pasted, dropped):  # a flat 40x30 drawing: PNG is the smaller, and nothing is upscaled
            assert part["type"] == "image_url" and decode(part["image_url"]["url"]).size == (40, 30)
            assert part["image_url"]["url"].startswith("data:image/png;")
        # three images in the request against the server's limit of two: its 400 is shown, not swallowed
        assert finished(page, 1) == "error"
        assert "holds 3 images; this server takes at most 2" in page.inner_text(".message.assistant >> nth=1")
        assert page.inner_text("#status") == "error"

        with page.expect_request("**/v1/chat/completions") as request:  # the failed turn left the history
            page.fill("#input", "And now?")
            page.press("#input", "Enter")
        third = request.value.post_data_json
        assert third["messages"] == second["messages"][:2] + [{"role": "user", "content": "And now?"}]
        assert finished(page, 2) in ("stop", "length")
        page.close()


def test_a_text_only_model_disables_attaching_and_its_400_is_shown(chromium):
    with LiveServer(tiny_pretrained()) as server:
        page = open_page(chromium, server.url, "tiny")
        attach = page.get_by_role("button", name="Attach image")
        assert attach.get_attribute("aria-disabled") == "true"
        assert attach.get_attribute("title").startswith("tiny reads text only; serve a vision-language model")
        attach.focus()  # focusable, says why in its tooltip and, pressed, in the status line
        page.keyboard.press("Enter")
        page.evaluate(GIVE_FILE, ["paste", "pasted.png", "image/png"])
        page.evaluate(GIVE_FILE, ["drop", "dropped.png", "image/png"])
        assert page.choosers == [] and page.is_hidden("#attachments")
        assert page.inner_text("#status").startswith("tiny reads text only")

        # A card that claims images (a stale page, a misconfigured proxy): the server's own 400 reaches the user.
        card = server.openai().models.retrieve("tiny").model_dump() | {"input_modalities": ["text", "image"]}
        page.route("**/v1/models", lambda route: route.fulfill(json={"object": "list", "data": [card]}))
        page.reload()
        page.wait_for_function("document.getElementById('attach').getAttribute('aria-disabled') === 'false'")
        page.set_input_files("#image-file", [upload("photo.png", picture(64, 48))])
        page.locator("#attachments img").wait_for()
        page.fill("#input", QUESTION)
        page.press("#input", "Enter")
        assert finished(page, 0) == "error"
        assert "messages[0].content[0] is an image, but 'tiny' is a text-only model" in \
            page.inner_text(".message.assistant .note")
        page.close()
