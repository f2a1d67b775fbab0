"""The web chat page in headless Chromium: a reply streams in, Stop aborts it on the server, the chat goes on;
replies render as sanitised markdown (code blocks, tool calls, hostile HTML) from canned streams.

Needs the `playwright` package and Debian's Chromium (`apt-get install -y chromium`); playwright's
own browser download is not used. Without them the test is skipped, saying which is missing.
"""

import json
import shutil

import pytest
from test_serve_fixtures import LiveServer, tiny_pretrained

playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the Python package)")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y chromium")
    with playwright.sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        except Exception as e:  # noqa: BLE001 -- any launch failure means: no browser here
            pytest.skip(f"Chromium at {CHROMIUM} does not start: {e}")
        yield browser
        browser.close()


def test_chat_page_streams_stops_and_keeps_the_conversation(browser):
    with LiveServer(tiny_pretrained(step_delay=0.03, context=1024)) as server:  # 256 tokens: ~8 s
        page = browser.new_page()
        page.set_default_timeout(10_000)
        page.goto(server.url + "/")
        page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
        page.fill("#input", "Tell me a long story")
        page.press("#input", "Enter")

        reply = page.locator(".message.assistant").last
        seen = []
        for _ in range(200):  # watch the reply change while it streams (as markdown, so not always longer)
            seen.append(reply.inner_text())
            if len(seen[-1]) >= 15:
                break
            page.wait_for_timeout(20)
        assert len(set(seen)) >= 3  # it arrived piece by piece
        assert "streaming" in reply.get_attribute("class")
        page.click("#stop")
        page.wait_for_function("document.querySelector('.message.assistant').dataset.finish === 'stopped'")
        stopped_text = reply.inner_text()
        assert "[stopped]" in stopped_text and len(stopped_text) < 200
        m = server.wait_idle()  # the server saw the disconnect: nothing runs, no KV blocks held
        assert m["tokenmind_generation_tokens_total"] < 200

        page.click("#settings summary")  # open the settings panel
        page.fill("#max-tokens", "8")
        page.eval_on_selector("#temperature", "el => { el.value = '0'; el.dispatchEvent(new Event('input')); }")
        assert page.inner_text("#temperature-value") == "0"
        with page.expect_request("**/v1/chat/completions") as request:
            page.fill("#input", "Now a short one")
            page.click("#send")
        sent = request.value.post_data_json
        assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]  # the history goes along
        assert sent["max_tokens"] == 8 and sent["temperature"] == 0 and sent["stream"] is True
        page.wait_for_function("document.querySelectorAll('.message.assistant')[1].dataset.finish === 'length'")
        assert page.locator(".message").count() == 4
        assert "8 tokens" in page.inner_text("#status")  # max_tokens held: 8 tokens arrived
        # (the tiny model's 8 random characters render as markdown, which may eat a `*` or a space)
        assert 1 <= len(page.locator(".message.assistant").nth(1).inner_text()) <= 8
        page.close()


# --- Rendering: markdown, code blocks, hostile HTML and tool calls, from canned streams ---------------------

@pytest.fixture(scope="module")
def server():
    with LiveServer(tiny_pretrained()) as live:  # serves the page and /v1/models; completions are canned
        yield live


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
            "choices": choices, **extra}
    return "data: " + json.dumps(body) + "\n\n"


HOSTILE = ('<img src=x onerror="window.__xss=\'img\'">\n\n<script>window.__xss="script"</script>\n\n'
           "[click me](javascript:window.__xss='link') and <a href=\"javascript:window.__xss='a'\">raw</a> "
           "<svg onload=\"window.__xss='svg'\"></svg> <iframe src=\"javascript:parent.__xss='iframe'\"></iframe>\n\n"
           "![pixel](http://127.0.0.1:9/pixel.png)\n\n")
CODE = 'def hi():\n    return "<b>not bold</b>"\n'


def call(index: int, arguments: str, name: str | None = None) -> dict:
    head = {"id": f"call_{index}", "type": "function"} if name else {}
    return {"index": index, **head, "function": ({"name": name} if name else {}) | {"arguments": arguments}}


CANNED = "".join([
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "# Weather report\n\nHere is **bold**, *emphasis*, `inline code` and a "}),
    chunk({"content": "[link](https://example.com/docs).\n\n- one\n- two\n\n"}),
    chunk({"content": "| city | temp |\n|---|---|\n| Oslo | 3 |\n\n"}),
    chunk({"content": "```pyth"}), chunk({"content": "on\n" + CODE[:12]}), chunk({"content": CODE[12:] + "```\n\n"}),
    chunk({"content": HOSTILE}),
    # two calls, their argument fragments interleaved the way a server may send them
    chunk({"tool_calls": [call(0, "", name="get_weather")]}),
    chunk({"tool_calls": [call(0, '{"city": "Os')]}),
    chunk({"tool_calls": [call(1, '{"q": ', name="search")]}),
    chunk({"tool_calls": [call(0, 'lo", "unit"')]}),
    chunk({"tool_calls": [call(1, '"<img src=x onerror=alert(1)>"}')]}),
    chunk({"tool_calls": [call(0, ': "celsius"}')]}),
    chunk({}, finish="tool_calls"),
    chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 42, "total_tokens": 47}),
    "data: [DONE]\n\n",
])


def test_chat_page_renders_markdown_code_tool_calls_and_neutralises_html(browser, server):
    context = browser.new_context(permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.set_default_timeout(10_000)
    dialogs, sent, fetched = [], [], []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("request", lambda r: fetched.append(r.url))

    def completions(route):
        sent.append(route.request.post_data_json)
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=CANNED)

    page.route("**/v1/chat/completions", completions)
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
    question = "**not bold** <i>not italic</i> <img src=x onerror=\"window.__xss='user'\">"
    page.fill("#input", question)
    page.press("#input", "Enter")
    page.wait_for_function("document.querySelector('.message.assistant').dataset.finish === 'tool_calls'")

    user = page.locator(".message.user")  # the user's text is shown as typed, never parsed
    assert user.inner_text() == question and user.locator("*").count() == 0
    reply = page.locator(".message.assistant .content")
    assert reply.locator("h1").inner_text() == "Weather report"
    assert reply.locator("strong").inner_text() == "bold" and reply.locator("em").inner_text() == "emphasis"
    assert reply.locator("p > code").inner_text() == "inline code"
    link = reply.locator("a", has_text="link")
    assert link.get_attribute("href") == "https://example.com/docs"
    assert link.get_attribute("target") == "_blank" and link.get_attribute("rel") == "noopener noreferrer"
    assert reply.locator("li").all_inner_texts() == ["one", "two"]
    assert reply.locator("td").all_inner_texts() == ["Oslo", "3"]

    code = reply.locator(".code-block pre > code.language-python")  # the fence was split over three chunks
    assert code.inner_text() == CODE and code.locator("b").count() == 0
    assert reply.locator(".code-block .language").inner_text() == "python"
    reply.locator(".code-block button.copy").click()
    page.wait_for_function("document.querySelector('button.copy').textContent === 'Copied'")
    assert page.evaluate("navigator.clipboard.readText()") == CODE

    # Hostile HTML: shown as text, never interpreted; a javascript: link loses its href; no remote image.
    text = reply.inner_text()
    assert '<img src=x onerror="window.__xss=\'img\'">' in text and '<script>window.__xss="script"</script>' in text
    for tag in ("img", "script", "svg", "iframe", "[onerror]", "[onload]", "a[href^='javascript']"):
        assert page.locator(f".message {tag}").count() == 0, tag
    reply.locator("a", has_text="click me").click()
    pixel = reply.locator("a", has_text="pixel")
    assert pixel.get_attribute("href") == "http://127.0.0.1:9/pixel.png"  # an image becomes a link ...
    assert all(url.startswith((server.url, "data:")) for url in fetched)  # ... not fetched; nor is any CDN
    assert page.evaluate("window.__xss") is None and dialogs == []

    calls = page.locator(".message.assistant .tool-call")
    assert calls.count() == 2
    assert calls.locator(".tool-name").all_inner_texts() == ["get_weather", "search"]
    args = calls.locator(".tool-args")
    assert args.nth(0).inner_text() == '{\n  "city": "Oslo",\n  "unit": "celsius"\n}'  # pretty-printed
    assert json.loads(args.nth(1).inner_text()) == {"q": "<img src=x onerror=alert(1)>"}
    assert args.locator("*").count() == 0  # arguments are text, not markup
    assert "finish_reason: tool_calls" in page.inner_text(".message.assistant .note")
    assert "42 tokens" in page.inner_text("#status") and "finish: tool_calls" in page.inner_text("#status")

    page.click("#new-chat")  # a new chat forgets the old one, on screen and in what is sent
    assert page.locator(".message").count() == 0 and page.is_visible("#empty")
    page.fill("#input", "again")
    page.click("#send")
    page.wait_for_function("document.querySelector('.message.assistant')?.dataset.finish === 'tool_calls'")
    assert [m["role"] for m in sent[0]["messages"]] == ["user"]
    assert sent[1]["messages"] == [{"role": "user", "content": "again"}]
    assert page.evaluate("window.__xss") is None and dialogs == []
    context.close()


# A stand-in for fetch("/v1/chat/completions") whose stream the test writes piece by piece, to look at
# the page between pieces (page.route can only fulfil a whole body at once). It honours AbortSignal.
STREAM_STUB = """
window.__requests = [];
const realFetch = window.fetch;
window.fetch = (url, options) => {
  if (!String(url).endsWith("/v1/chat/completions")) return realFetch(url, options);
  window.__requests.push(JSON.parse(options.body));
  const encoder = new TextEncoder();
  const body = new ReadableStream({ start(controller) {
    window.__push = (text) => controller.enqueue(encoder.encode(text));
    window.__close = () => controller.close();
    options.signal.addEventListener("abort", () => controller.error(new DOMException("aborted", "AbortError")));
  } });
  return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
};
"""


def test_chat_page_rerenders_a_growing_reply_with_an_open_code_fence(browser, server):
    page = browser.new_page()
    page.set_default_timeout(10_000)
    page.add_init_script(STREAM_STUB)
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model').textContent === 'tiny'")
    page.fill("#input", "Some code please")
    page.press("#input", "Enter")
    page.wait_for_function("typeof window.__push === 'function'")

    def push(text):
        page.evaluate("t => window.__push(t)", chunk({"content": text}))

    reply = page.locator(".message.assistant")
    push("Here it is:\n\n```js\nconst a = 1;\n<img src=x onerror=\"window.__xss='fence'\">")
    code = reply.locator(".code-block pre > code.language-js")
    code.wait_for()  # the fence is still open: what came so far is code, and only code
    assert code.inner_text() == "const a = 1;\n<img src=x onerror=\"window.__xss='fence'\">\n"
    assert reply.locator(".content > p").all_inner_texts() == ["Here it is:"]
    assert "streaming" in reply.get_attribute("class") and page.is_enabled("#stop")

    push("\n```\n\nAnd **done**.")
    reply.locator(".content > p strong").wait_for()  # the fence closed, the text after it is markdown again
    assert code.inner_text() == "const a = 1;\n<img src=x onerror=\"window.__xss='fence'\">\n"
    assert reply.locator(".content > p").all_inner_texts() == ["Here it is:", "And done."]

    page.click("#new-chat")  # mid-stream: aborts, and the half reply does not leak into the new chat
    page.wait_for_function("document.getElementById('stop').disabled")
    assert page.locator(".message").count() == 0
    page.fill("#input", "Fresh start")
    page.press("#input", "Enter")
    page.wait_for_function("window.__requests.length === 2")
    assert page.evaluate("window.__requests[1].messages") == [{"role": "user", "content": "Fresh start"}]
    page.evaluate("t => { window.__push(t); window.__close(); }", chunk({"content": "ok"}, finish="stop"))
    page.wait_for_function("document.querySelector('.message.assistant').dataset.finish === 'stop'")
    assert reply.inner_text() == "ok" and page.evaluate("window.__xss") is None
    page.close()


def test_image_page_generates_the_picked_class_and_shows_hostile_data_as_text(browser, tmp_path):
    from test_serve_images import save_tiny_dit

    with LiveServer(None, model=str(save_tiny_dit(tmp_path / "dit-fashion"))) as live:
        page = browser.new_page()
        page.set_default_timeout(20_000)
        page.goto(live.url + "/")
        page.wait_for_function("document.querySelectorAll('#class option').length === 10")
        assert page.inner_text("#model") == "dit-fashion (28x28)"
        page.select_option("#class", "sneaker")
        page.fill("#n", "2")
        page.fill("#steps", "2")
        with page.expect_request("**/v1/images/generations") as request:
            page.click("#generate")
        assert request.value.post_data_json["prompt"] == "sneaker" and request.value.post_data_json["n"] == 2
        page.wait_for_function("document.querySelectorAll('.image-row img').length === 2")
        sizes = page.eval_on_selector_all(".image-row img", "els => els.map(e => [e.naturalWidth, e.naturalHeight])")
        assert sizes == [[28, 28], [28, 28]]
        assert "2 images" in page.inner_text("#status")

        page.eval_on_selector("#n", "el => el.removeAttribute('max')")  # past the form's own check
        page.fill("#n", "99")  # the server's 400 is shown, and the page stays usable
        page.click("#generate")
        page.wait_for_function("document.getElementById('status').textContent.startsWith('error')")
        assert "at most 16 images" in page.inner_text("#status")

        # a hostile server: markup in class names and image data is shown as text or dropped, never run
        hostile = '<img src=x onerror="window.__xss=1">'
        card = {"id": hostile, "size": "28x28", "classes": [hostile], "max_images": 4}
        page.route("**/v1/models", lambda route: route.fulfill(json={"data": [card]}))
        page.route("**/v1/images/generations", lambda route: route.fulfill(
            json={"created": 0, "data": [{"b64_json": '" onerror="window.__xss=2'}]}))
        page.reload()
        page.wait_for_function("document.querySelectorAll('#class option').length === 1")
        page.click("#generate")
        page.wait_for_function("document.getElementById('status').textContent.startsWith('0 images')")
        assert page.inner_text("#model").startswith(hostile)
        assert page.evaluate("window.__xss") is None and page.locator("img[src=x]").count() == 0
        page.close()
