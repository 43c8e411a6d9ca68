"""The chat page (`jaxllm serve`'s `/` and `/ui`) in headless Chromium, driven by Selenium, against the shared
in-process server (the `server` fixture): the page loads, a message streams in, Stop aborts the request on the
server, a reload finds the conversation, model output is rendered as text (never as HTML), and the page asks
for the API key when the server has one.

Needs Debian's `chromium` and `chromium-driver` (.ci/install_browser.sh). Without them the tests skip on a
developer's machine; with $JAXLLM_REQUIRE_BROWSER set (.ci/run sets it) they fail instead.
"""

import asyncio
import json
import os
import re
import shutil
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from jaxllm.entrypoints.openai.api_server import build_app
from tests.inprocess_server import MODEL

CHROMIUM = os.environ.get("JAXLLM_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("JAXLLM_CHROMEDRIVER", "/usr/bin/chromedriver")
API_KEY = "sk-chat-page-test"
ABORTED = 'jaxllm:request_success_total{engine="0",finished_reason="abort",model_name="smol"}'


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.isfile(path) and os.access(path, os.X_OK)) and not shutil.which(path):
            return f"{path} is missing (Debian: apt-get install chromium chromium-driver; .ci/install_browser.sh)"
    return None


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module."""
    if (why := missing_browser()) is not None:
        if os.environ.get("JAXLLM_REQUIRE_BROWSER"):
            pytest.fail(f"$JAXLLM_REQUIRE_BROWSER is set but {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def wait_for(predicate, timeout=30.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def metric(name: str, url: str) -> float:
    page = httpx.get(url + "/metrics").text
    return sum(float(m[1]) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", page, re.M))


def last_answer(driver) -> str:
    return driver.execute_script(
        "const a = document.querySelectorAll('#messages .msg.assistant .content');"
        "return a.length ? a[a.length - 1].textContent : '';"
    )


def last_meta(driver) -> str:
    return driver.execute_script("return document.querySelector('#messages .msg.assistant:last-child .meta').innerText")


def busy(driver) -> bool:
    return driver.execute_script("return !document.getElementById('stop').hidden")


def open_page(driver, url: str, clear: bool = True) -> None:
    driver.get(url)
    if clear:
        driver.execute_script("localStorage.clear()")
        driver.get(url)
    wait_for(lambda: driver.find_element("id", "model").text == MODEL, what="the model name from /v1/models")


def type_and_send(driver, text: str, max_tokens: int) -> None:
    driver.execute_script(
        "document.getElementById('max-tokens').value = arguments[0];"
        "document.getElementById('temperature').value = '0';",
        str(max_tokens),
    )
    driver.find_element("id", "prompt").send_keys(text)
    driver.find_element("id", "send").click()


def enter_key(driver, key: str) -> None:
    driver.find_element("id", "api-key").send_keys(key)
    driver.find_element("css selector", "#key-form button").click()


def test_the_page_is_open_without_a_key_and_disable_ui_removes_it(server):
    """/ and /ui serve the page (and its assets) with the API key set; --disable-ui: a 404."""
    with TestClient(build_app(server.engine, served_model_names=[MODEL], api_key=API_KEY)) as http:
        for path in ("/", "/ui"):
            page = http.get(path)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "/ui/chat.js" in page.text and "default-src 'self'" in page.headers["content-security-policy"]
        assert http.get("/ui/chat.js").headers["content-type"].startswith("text/javascript")
        assert http.get("/ui/chat.css").status_code == 200
        assert http.get("/v1/models").status_code == 401
    with TestClient(build_app(server.engine, served_model_names=[MODEL], disable_ui=True)) as http:
        assert http.get("/").status_code == 404 and http.get("/ui").status_code == 404
        assert http.get("/ui/chat.js").status_code == 404
        assert http.get("/v1/models").status_code == 200


def test_send_stream_stop_reload(browser, server, tmp_path):
    """Streamed text grows in the page; Stop aborts the request on the server (its running count returns to
    0 and the abort is counted); a reload finds the conversation. A screenshot lands in tmp_path."""
    open_page(browser, server.url + "/")
    # every length the answer's text takes, as the page paints it
    browser.execute_script(
        "window.lengths = [];"
        "new MutationObserver(() => {"
        "  const a = document.querySelectorAll('#messages .msg.assistant .content');"
        "  if (a.length) window.lengths.push(a[a.length - 1].textContent.length);"
        "}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});"
    )
    type_and_send(browser, "Write a short story about a dragon who learns to bake bread.", max_tokens=48)
    wait_for(lambda: busy(browser), what="the Stop button")
    wait_for(lambda: not busy(browser), what="the answer to finish")
    answer = last_answer(browser)
    lengths = [n for n in browser.execute_script("return window.lengths") if n]
    assert answer.strip(), "no answer text"
    assert len(set(lengths)) >= 3 and lengths == sorted(lengths), f"the text did not grow as it streamed: {lengths}"
    meta = last_meta(browser)
    assert "tokens" in meta, meta  # the usage chunk (stream_options.include_usage) arrived
    timing = browser.execute_script("return window.jaxllmTimings[0]")
    assert timing["sent"] < timing["firstText"] <= timing["done"]

    # a long answer, stopped once some text is shown
    wait_for(lambda: len(server.core.scheduler.running) == 0, timeout=10, what="an idle server")
    aborted = metric(ABORTED, server.url)
    type_and_send(browser, "Tell me everything you know about the history of Rome, in great detail.", max_tokens=300)
    wait_for(lambda: len(last_answer(browser)) > 20 or not busy(browser), what="the long answer's first words")
    assert busy(browser), f"the long answer ended before it could be stopped: {last_meta(browser)!r}"
    assert len(server.core.scheduler.running) >= 1
    browser.find_element("id", "stop").click()
    wait_for(lambda: not busy(browser), timeout=5, what="the page to end the request")
    wait_for(lambda: len(server.core.scheduler.running) == 0, timeout=5, what="the server's running count to be 0")
    wait_for(lambda: metric(ABORTED, server.url) >= aborted + 1, timeout=5, what="the abort to be counted")
    stopped = last_answer(browser)
    assert last_meta(browser) == "stopped"
    browser.save_screenshot(str(tmp_path / "chat_page.png"))
    print(f"screenshot: {tmp_path / 'chat_page.png'}")

    # a reload finds the conversation, in the sidebar and in full
    browser.refresh()
    wait_for(lambda: browser.find_element("id", "model").text == MODEL, what="the page after a reload")
    titles = [e.text for e in browser.find_elements("css selector", "#conversations .open")]
    assert titles == ["Write a short story about a dragon who learns to bake bread."[:48]]  # its first 48 characters
    texts = browser.execute_script(
        "return [...document.querySelectorAll('#messages .msg .content')].map(e => e.textContent)"
    )
    assert texts == [
        "Write a short story about a dragon who learns to bake bread.",
        answer,
        "Tell me everything you know about the history of Rome, in great detail.",
        stopped,
    ]
    assert (tmp_path / "chat_page.png").stat().st_size > 0


# a stored conversation whose answer tries to run code: the page must show it as text. The model cannot be made
# to write this on demand, so it is seeded in localStorage; stored answers go through the same renderer as
# streamed ones (updateMessageElement → renderMarkdown).
HOSTILE = (
    "Here:\n<script>window.pwned = 'script'</script>\n"
    "<img src=x onerror=\"window.pwned = 'img'\">\n"
    "**bold** and `<b>code</b>` and [js](javascript:window.pwned='link') and [ok](https://example.com/?a=1&b=\"2\")\n"
    "```html\n<script>window.pwned = 'fence'</script>\n```\n"
    "- one\n- two"
)


def test_model_output_renders_as_text(browser, server):
    """`<script>`, an `<img onerror>` and a javascript: link in an answer are shown as text, never run."""
    open_page(browser, server.url + "/ui")
    conversation = {
        "id": "seeded",
        "title": "<img src=x onerror=\"window.pwned='title'\">",
        "messages": [{"role": "user", "content": "<i>hi</i>"}, {"role": "assistant", "content": HOSTILE}],
    }
    browser.execute_script(
        "localStorage.setItem('jaxllm.conversations', JSON.stringify([arguments[0]]));"
        "localStorage.setItem('jaxllm.current', 'seeded');",
        conversation,
    )
    browser.refresh()
    wait_for(lambda: browser.find_element("id", "model").text == MODEL, what="the page after a reload")
    messages = browser.find_element("id", "messages")
    assert browser.execute_script("return window.pwned === undefined"), "model output ran code"
    assert not messages.find_elements("css selector", "script, img, i, b, iframe")
    assert not browser.find_elements("css selector", "#conversations img")
    answer = browser.find_elements("css selector", "#messages .msg.assistant .content")[0]
    assert "<script>window.pwned = 'script'</script>" in answer.text
    assert "<img src=x onerror=\"window.pwned = 'img'\">" in answer.text
    # the markdown around it is rendered: emphasis, code, the fenced block (its text intact), the list, one link
    assert answer.find_element("css selector", "strong").text == "bold"
    assert answer.find_element("css selector", "code").text == "<b>code</b>"
    assert answer.find_element("css selector", "pre code").text == "<script>window.pwned = 'fence'</script>"
    assert [li.text for li in answer.find_elements("css selector", "ul li")] == ["one", "two"]
    (link,) = answer.find_elements("css selector", "a")
    assert link.get_attribute("href") == "https://example.com/?a=1&b=%222%22"
    assert link.get_attribute("rel") == "noopener noreferrer"
    assert "[js](javascript:window.pwned='link')" in answer.text
    assert browser.find_element("css selector", "#messages .msg.user .content").text == "<i>hi</i>"


# a stream the server does not send yet: reasoning (`reasoning_content`, vLLM's older `reasoning`) before the answer,
# and markup in the answer; one event is split across two reads, as the network may split it
STUB_FETCH = """
const [reads, status] = arguments;
const real = window.fetch;
window.fetch = (url, init) => {
  if (!String(url).includes('/v1/chat/completions')) return real(url, init);
  window.sentBody = JSON.parse(init.body);
  const encoder = new TextEncoder();
  const body = new ReadableStream({start(c) { for (const r of reads) c.enqueue(encoder.encode(r)); c.close(); }});
  return Promise.resolve(new Response(body, {status, headers: {'Content-Type': 'text/event-stream'}}));
};
"""


def sse(delta: dict | None = None, **fields) -> str:
    chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]} if delta is not None else {}
    return f"data: {json.dumps({**chunk, **fields})}\n\n"


def test_streamed_reasoning_is_folded_and_streamed_markup_is_text(browser, server):
    """The page's request carries the settings; streamed reasoning goes in a folded <details> above the answer;
    markup streamed in the answer is text; an error response is shown as one. (fetch is stubbed in the page.)"""
    open_page(browser, server.url + "/")
    tail = sse({"content": " **done**"})
    reads = [
        sse({"role": "assistant", "content": ""}),
        sse({"reasoning_content": "Let me <b>think</b>"}),
        sse({"reasoning": " more."}),
        sse({"content": "<script>window.pwned = 'stream'</script>"}),
        tail[:20],
        tail[20:],
        sse(choices=[], usage={"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}),
        "data: [DONE]\n\n",
    ]
    browser.execute_script(STUB_FETCH, reads, 200)
    browser.execute_script("document.getElementById('system').value = 'Be brief.'")
    type_and_send(browser, "Think first.", max_tokens=7)
    wait_for(lambda: not busy(browser) and last_meta(browser), what="the stubbed answer")
    sent = browser.execute_script("return window.sentBody")
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"], sent["model"]) == (0, 1, 7, MODEL)
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Think first."}]
    reasoning = browser.find_element("css selector", "#messages .msg.assistant details.reasoning")
    assert reasoning.get_attribute("open") is None, "reasoning is shown folded"
    assert browser.execute_script("return arguments[0].querySelector('.text').textContent", reasoning) == (
        "Let me <b>think</b> more."
    )
    assert not reasoning.find_elements("css selector", "b")
    answer = browser.find_element("css selector", "#messages .msg.assistant .content")
    assert answer.text == "<script>window.pwned = 'stream'</script> done"
    assert answer.find_element("css selector", "strong").text == "done"
    assert browser.execute_script("return window.pwned === undefined")
    assert last_meta(browser).startswith("5 tokens · ")  # usage, from the last chunk

    error = json.dumps({"error": {"message": "max_tokens is too large", "type": "BadRequestError", "code": 400}})
    browser.execute_script(STUB_FETCH, [error], 400)
    type_and_send(browser, "Again.", max_tokens=7)
    wait_for(lambda: not busy(browser) and last_meta(browser), what="the error")
    assert last_meta(browser) == "error: max_tokens is too large"
    assert browser.find_elements("css selector", "#messages .msg.assistant.error")


def test_the_page_asks_for_the_api_key(browser, server):
    """With --api-key, the page's first API call gets a 401: it asks for the key, keeps it, and carries on."""
    import uvicorn

    # the same engine behind a second app with a key, served on the shared server's event loop (AsyncLLM serves
    # one loop; the tests above have bound it)
    app = build_app(server.engine, served_model_names=[MODEL], api_key=API_KEY)
    keyed = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    if server.engine._loop is None:  # this test alone: one request binds it
        httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    serving = asyncio.run_coroutine_threadsafe(keyed.serve(), server.engine._loop)
    try:
        wait_for(lambda: keyed.started and keyed.servers, what="the keyed server")
        port = keyed.servers[0].sockets[0].getsockname()[1]
        browser.get(f"http://127.0.0.1:{port}/")
        browser.execute_script("localStorage.clear()")
        browser.refresh()
        wait_for(lambda: browser.find_element("id", "key-form").is_displayed(), what="the API key form")
        prompt = browser.find_element("id", "prompt")
        type_and_send(browser, "Say hi.", max_tokens=4)  # before the key: the message waits in the box
        wait_for(lambda: prompt.get_attribute("value") == "Say hi.", what="the message back in the box")
        enter_key(browser, API_KEY)
        wait_for(lambda: browser.find_element("id", "model").text == MODEL, what="the model name with the key")
        assert not browser.find_element("id", "key-form").is_displayed()
        assert browser.execute_script("return localStorage.getItem('jaxllm.apiKey')") == API_KEY
        browser.find_element("id", "send").click()
        wait_for(lambda: last_answer(browser) and not busy(browser), what="an answer with the key")
        assert not browser.find_elements("css selector", "#messages .msg.error")

        # a key that stops working (rotated): the chat request's 401 asks again and keeps the message
        browser.execute_script("localStorage.setItem('jaxllm.apiKey', 'sk-old')")
        prompt.send_keys("Say bye.")
        browser.find_element("id", "send").click()
        wait_for(lambda: browser.find_element("id", "key-form").is_displayed(), what="the API key form again")
        assert prompt.get_attribute("value") == "Say bye."
        assert len(browser.find_elements("css selector", "#messages .msg")) == 2  # the first exchange only
        enter_key(browser, API_KEY)
        wait_for(lambda: browser.find_element("id", "model").text == MODEL, what="the model name with the key")
        browser.find_element("id", "send").click()
        wait_for(
            lambda: len(browser.find_elements("css selector", "#messages .msg")) == 4 and not busy(browser),
            what="the second answer",
        )
        assert not browser.find_elements("css selector", "#messages .msg.error")
    finally:
        keyed.should_exit = True
        serving.result(timeout=10)
