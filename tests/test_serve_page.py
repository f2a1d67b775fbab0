"""The web chat page in headless Chromium: a reply streams in, Stop aborts it on the server, the chat goes on.

Needs the `playwright` package and Debian's Chromium (`apt-get install -y chromium`); playwright's
own browser download is not used. Without them the test is skipped, saying which is missing.
"""

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
        lengths = []
        for _ in range(200):  # watch the reply grow while it streams
            lengths.append(len(reply.inner_text()))
            if lengths[-1] >= 15:
                break
            page.wait_for_timeout(20)
        assert len(set(lengths)) >= 3 and lengths == sorted(lengths)  # it arrived piece by piece
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
        assert len(page.locator(".message.assistant").nth(1).inner_text()) == 8
        assert "8 tokens" in page.inner_text("#status")
        page.close()
