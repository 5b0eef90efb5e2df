"""The browser chat page at ``/``, driven in a real headless Chromium by Selenium.

``sluice serve`` runs as a user runs it (a subprocess on a free loopback port, with an API
key); the page asks for the key, streams replies from ``/v1/chat/completions``, shows each
reply's stats, trims the oldest turn when the context is full, and its Stop button cancels
the generation on the server (counted in ``/metrics``). Model text is rendered without ever
becoming markup. Skips, saying why, when Selenium, Chromium or its driver is missing
(``apt-get install chromium chromium-driver``; ``pip install selenium``).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess

import httpx
import pytest
from serve_process import spawn_serve
from serve_process import wait_for as _wait_for

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium: pip install selenium")

KEY = "page-test-key"
CTX = 2048
HOSTILE = '<img src=x onerror="window.__pwned=1"> <script>window.__pwned=2</script> **not bold here**'


def wait_for(pred, timeout: float = 20.0, what: str = "condition"):
    """``serve_process.wait_for`` at a pace that suits a browser driver."""
    return _wait_for(pred, timeout, what, interval=0.02)


def _browser() -> tuple[str, str]:
    """Paths of Chromium and its driver, or skip with the reason."""
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("needs Chromium and chromedriver: apt-get install chromium chromium-driver")

    def major(cmd: str) -> str:
        out = subprocess.run([cmd, "--version"], capture_output=True, text=True, timeout=30).stdout
        m = re.search(r"(\d+)\.\d+\.\d+", out)
        return m.group(1) if m else "?"

    if major(browser) != major(driver):
        pytest.skip(f"Chromium {major(browser)} and chromedriver {major(driver)} do not match")
    return browser, driver




@pytest.fixture(scope="module")
def endless_model(chat_model, tmp_path_factory):
    """``chat_model`` whose end-of-sequence id is outside the vocabulary: every reply runs until the
    context is full, so a generation is long enough to stop and a second turn must trim the first."""
    path = tmp_path_factory.mktemp("webchat") / "endless-chat"
    shutil.copytree(chat_model, path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    for name, extra in (("config.json", {"max_position_embeddings": CTX}), ("generation_config.json", {})):
        cfg = json.loads((path / name).read_text())
        cfg.update(extra, eos_token_id=vocab)
        (path / name).write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def server(endless_model):
    proc, url = spawn_serve(endless_model, "--memory", "2GiB", "--threads", "1", "--max-context", str(CTX),
                            "--no-progress", "--model-name", "endless", "--api-key", KEY, "--log-level", "warning",
                            stdout=subprocess.DEVNULL)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _browser()
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage",
                 "--window-size=1100,800", f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    try:
        yield drv
    finally:
        drv.quit()


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text


def counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    return float(m.group(1)) if m else 0.0


CANCELLED = 'sluice_generations_total{outcome="cancelled"}'
CLOSED = 'sluice_requests_total{endpoint="chat_completions",status="499"}'


def test_page_needs_no_key_and_is_locked_down(server):
    r = httpx.get(server + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>Sluice chat</title>" in r.text
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "'unsafe-inline'" not in csp
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", r.text), "the page must load nothing from elsewhere"
    assert httpx.get(server + "/v1/models").status_code == 401  # the API itself still needs the key
    assert "<script>" not in r.text and "script-src 'self'" in csp  # no inline script: only the files below
    for name in ("markdown.js", "chat.js"):
        assert f'<script src="{name}"></script>' in r.text
        js = httpx.get(f"{server}/{name}")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript"), name
        assert js.headers["x-content-type-options"] == "nosniff" and js.text.startswith('"use strict";')


def test_chat_in_the_browser(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    d = browser
    find = d.find_element
    d.get(server + "/")

    # the key prompt: the API answered 401; the key entered is kept in local storage
    wait_for(lambda: find(By.ID, "overlay").is_displayed(), what="the API key prompt")
    find(By.ID, "key-input").send_keys("wrong", Keys.ENTER)
    wait_for(lambda: "refused" in find(By.ID, "key-why").text, what="the prompt to say the key was refused")
    assert find(By.ID, "overlay").is_displayed()
    find(By.ID, "key-input").send_keys(KEY, Keys.ENTER)
    wait_for(lambda: find(By.ID, "model").text.startswith("endless"), what="the model id")
    assert f"context {CTX} tokens" in find(By.ID, "model").text
    d.refresh()
    wait_for(lambda: find(By.ID, "model").text.startswith("endless"), what="the model id after a reload")
    assert not find(By.ID, "overlay").is_displayed()
    assert d.execute_script("return localStorage.getItem('sluice.apiKey')") == KEY

    # a reply streams in (text while Stop is still showing), then gets its stats line
    find(By.ID, "input").send_keys("Hello there", Keys.ENTER)
    reply = wait_for(lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"), what="a reply")[0]
    wait_for(lambda: find(By.ID, "stop").is_displayed() and reply.find_element(By.CLASS_NAME, "body").text,
             what="streamed text while the generation runs")
    stats = wait_for(lambda: reply.find_elements(By.CLASS_NAME, "stats"), timeout=60, what="the stats line")[0].text
    m = re.search(r"^(\d+) tokens · [\d.]+ tok/s · hit rate [\d.]+% · read [\d.]+ [kMG]?B · prompt (\d+) tokens",
                  stats)
    assert m and int(m[1]) + int(m[2]) == CTX, stats  # the reply filled the context
    assert "cut by the token limit" in stats  # this model never ends a reply by itself
    assert find(By.ID, "send").is_displayed() and not find(By.ID, "stop").is_displayed()

    # the context is full: the next turn drops the first one, with a notice; Stop cancels on the server
    m0 = metrics(server)
    before, closed = counter(m0, CANCELLED), counter(m0, CLOSED)
    find(By.ID, "input").send_keys(HOSTILE, Keys.ENTER)
    wait_for(lambda: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2
             and d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[1].text.count("\n") >= 1,
             what="the second reply to stream")
    find(By.ID, "stop").click()
    second = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[1]
    assert wait_for(lambda: second.find_elements(By.CLASS_NAME, "stats"), what="the stopped reply's line")[0] \
        .text.endswith("stopped")
    wait_for(lambda: counter(metrics(server), CANCELLED) > before, what="the server to count a cancellation")
    wait_for(lambda: counter(metrics(server), CLOSED) == closed + 1, what="the request counted as 499 (client gone)")
    notice = find(By.CLASS_NAME, "notice").text
    assert notice.startswith("Context full: the oldest turn is no longer sent"), notice
    assert len(d.find_elements(By.CSS_SELECTOR, ".msg.dropped")) == 2  # the first question and its reply

    # the hostile user message is shown as text: no element made from it, no script run
    user = d.find_elements(By.CSS_SELECTOR, ".msg.user .body")[1]
    assert user.text == HOSTILE
    assert not d.find_elements(By.CSS_SELECTOR, ".msg.user .body *, #messages img, #messages script")

    # model text goes through the same renderer: markdown subset, everything else literal
    counts = d.execute_script("""
        const box = document.createElement('div');
        window.sluiceChat.renderMarkdown(arguments[0], box);
        document.getElementById('messages').appendChild(box);
        const n = (s) => box.querySelectorAll(s).length;
        return {img: n('img'), script: n('script'), pre: n('pre > code'), code: n('p > code'), strong: n('strong'),
                em: n('em'), p: n('p'), text: box.textContent, code_text: box.querySelector('pre code').textContent,
                pwned: window.__pwned === undefined ? null : window.__pwned};
    """, "Some **bold** and *it* with `<b>x</b>`.\n\n" + HOSTILE.replace("**not bold here**", "") +
        "\n\n```html\n<script>window.__pwned=3</script>\n<img src=x onerror=\"window.__pwned=4\">\n```\nafter")
    assert counts["img"] == counts["script"] == 0 and counts["pwned"] is None, counts
    assert (counts["pre"], counts["code"], counts["strong"], counts["em"], counts["p"]) == (1, 1, 1, 1, 3), counts
    assert counts["code_text"] == '<script>window.__pwned=3</script>\n<img src=x onerror="window.__pwned=4">'
    assert "<b>x</b>" in counts["text"] and '<img src=x onerror="window.__pwned=1">' in counts["text"]

    # Clear empties the conversation
    find(By.ID, "clear").click()
    assert not d.find_elements(By.CSS_SELECTOR, ".msg")
    # no script error, no CSP violation (the 401 that asked for the key is the one failed load)
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"
              and not (e["source"] == "network" and "status of 401" in e["message"])]
    assert not errors, errors


def open_page(d, server):
    """Load the page with the key already stored, and wait for the model."""
    from selenium.webdriver.common.by import By

    d.get(server + "/")
    d.execute_script("localStorage.setItem('sluice.apiKey', arguments[0])", KEY)
    d.refresh()
    wait_for(lambda: d.find_element(By.ID, "model").text.startswith("endless"), what="the model id")
    d.find_element(By.ID, "clear").click()


# Replies built to stall a backtracking renderer (the old one took minutes of main thread on
# 8,002 backticks), each over 10,000 characters, with what the renderer must make of them.
HOSTILE_REPLIES = {
    "a line of backticks": ("`" * 10_002, dict(pre=1, code_text="")),  # an unclosed fence: empty code block
    "backticks after text": ("x " + "`" * 10_002, dict(pre=0, code=0, literal=True)),
    "backtick runs of every length": ("".join("`" * k + "x" for k in range(1, 141)), dict(code=0, literal=True)),
    "backtick pairs": ("`` ` " * 2_500, dict(pre=0, literal=False)),
    "code spans": ("`a` " * 2_600, dict(code=2_600)),
    "unclosed fence": ("```python\n" + "<script>window.__pwned=1</script> **x** `y`\n" * 250, dict(pre=1, p=0)),
    "a flood of fences": ("```\n" * 2_600, dict(pre=1_300, p=0)),
    "emphasis never closed": ("*a **b _c __d " * 800, dict(strong=0, em=0, literal=True)),
    "deep emphasis": ("**" * 2_500 + "x" + "**" * 2_500, dict(literal=False)),
    "underscores": ("_" * 5_001 + " a_b" * 1_300, dict(strong=0, em=0, literal=True)),
    "interleaved emphasis": ("*_" * 2_500 + "x" + "_*" * 2_500, dict(literal=False)),
    "script in code": ("`<script>window.__pwned=2</script>`\n```html\n<img src=x onerror=window.__pwned=3>\n```\n"
                       * 130, dict(code=130, pre=130, script=0, img=0)),
}
RENDER_BUDGET_MS = 250  # each reply, rendered and laid out; about 1-20 ms here


def test_renderer_is_linear_on_hostile_replies(server, browser):
    d = browser
    open_page(d, server)
    d.set_script_timeout(30)
    got = d.execute_script("""
        const out = {};
        const nesting = (box) => {  // the deepest nesting of strong and em
          let most = 0;
          for (const e of box.querySelectorAll('strong, em')) {
            let k = 0;
            for (let a = e; a !== box; a = a.parentElement) k += a.matches('strong, em');
            most = Math.max(most, k);
          }
          return most;
        };
        for (const [name, text] of Object.entries(arguments[0])) {
          const box = document.createElement('div');
          box.className = 'msg assistant';
          document.getElementById('messages').appendChild(box);
          const t0 = performance.now();
          window.sluiceChat.renderMarkdown(text, box);
          void box.offsetHeight;  // and the layout it causes, all on the main thread
          const ms = performance.now() - t0;
          const n = (s) => box.querySelectorAll(s).length;
          out[name] = {ms, pre: n('pre > code'), code: n('p > code'), strong: n('strong'), em: n('em'), p: n('p'),
                       script: n('script'), img: n('img'), depth: nesting(box),
                       text: box.textContent, code_text: (box.querySelector('pre code') || {}).textContent};
          box.remove();
        }
        out.pwned = window.__pwned === undefined ? null : window.__pwned;
        return out;
    """, {name: text for name, (text, _) in HOSTILE_REPLIES.items()})
    assert got.pop("pwned") is None
    slow = {name: round(r["ms"], 1) for name, r in got.items() if r["ms"] > RENDER_BUDGET_MS}
    assert not slow, f"rendering took over {RENDER_BUDGET_MS} ms: {slow}"
    for name, (text, want) in HOSTILE_REPLIES.items():
        r = got[name]
        assert len(text) >= 10_000 and r["script"] == r["img"] == 0, name
        want = dict(want)
        literal = want.pop("literal", None)
        if literal is not None:  # every character shown, none taken as markup
            assert (r["text"] == text) is literal, (name, r["text"][:80])
        for key, value in want.items():
            assert r[key] == value, (name, key, r[key], value)
        assert r["depth"] <= 32, name  # nesting is bounded
    assert got["deep emphasis"]["strong"] == got["deep emphasis"]["depth"] == 32
    assert got["unclosed fence"]["code_text"] == HOSTILE_REPLIES["unclosed fence"][0].split("\n", 1)[1]


def test_code_blocks(server, browser):
    d = browser
    open_page(d, server)
    text = ("Run `pip install x` then:\n\n```python\nif a < b and c > d:\n    print(\"<b>hi</b>\")\n```\n\n"
            "and ``a`b`` plus **bold `code` inside** and *it*.\n~~~\n```\nnot a fence\n```\n~~~\n"
            "```\n<script>window.__pwned=1</script>")
    html = d.execute_script("""
        const box = document.createElement('div');
        document.getElementById('messages').appendChild(box);
        window.sluiceChat.renderMarkdown(arguments[0], box);
        return [box.innerHTML, window.__pwned === undefined ? null : window.__pwned];
    """, text)
    assert html == [
        '<p>Run <code>pip install x</code> then:</p>'
        '<pre><code data-lang="python">if a &lt; b and c &gt; d:\n    print("&lt;b&gt;hi&lt;/b&gt;")</code></pre>'
        '<p>and <code>a`b</code> plus <strong>bold <code>code</code> inside</strong> and <em>it</em>.</p>'
        '<pre><code>```\nnot a fence\n```</code></pre>'
        '<pre><code>&lt;script&gt;window.__pwned=1&lt;/script&gt;</code></pre>', None]


OK_CHATS = 'sluice_requests_total{endpoint="chat_completions",status="200"}'


def test_temperature_is_sent(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    d = browser
    find = d.find_element
    open_page(d, server)
    field = find(By.ID, "temperature")
    assert field.get_attribute("value") == "0"  # greedy by default, as `sluice chat`
    d.execute_script("""
        window.__sent = [];
        const fetch0 = window.fetch;
        window.fetch = (url, init) => {
          if (init && init.body) window.__sent.push(JSON.parse(init.body));
          return fetch0(url, init);
        };
    """)
    question = "Tell me a story"
    greedy = httpx.post(server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                        json={"model": "endless", "messages": [{"role": "user", "content": question}],
                              "temperature": 0, "max_tokens": 40}).json()["choices"][0]["message"]["content"]
    assert len(greedy) > 20

    def reply(temperature: str) -> str:
        find(By.ID, "clear").click()
        field.clear()
        field.send_keys(temperature)
        find(By.ID, "input").send_keys(question, Keys.ENTER)
        wait_for(lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"), timeout=60, what="a full reply")
        return d.execute_script("return window.sluiceChat.transcript()")[-1]["content"]

    # 0: the server decoded greedily (its default, with no temperature sent, is 1)
    assert reply("0").startswith(greedy)
    # 1.5: sampled, so not the greedy reply
    assert not reply("1.5").startswith(greedy[:20])
    assert [b["temperature"] for b in d.execute_script("return window.__sent")] == [0, 1.5]

    # values the server would refuse are not sent: the message stays, the field says why
    before = counter(metrics(server), OK_CHATS)
    find(By.ID, "clear").click()
    for bad in ("abc", "3", "2.5", "0.0001", "-1", "1e-3", ""):
        field.clear()
        field.send_keys(bad)
        find(By.ID, "input").send_keys("again", Keys.ENTER)
        error = find(By.ID, "temp-error")
        assert error.is_displayed() and f'"{bad}" is not a valid temperature' in error.text, (bad, error.text)
        assert field.get_attribute("aria-invalid") == "true" and find(By.ID, "input").get_attribute("value") == "again"
        find(By.ID, "input").clear()
    assert not d.find_elements(By.CSS_SELECTOR, ".msg") and len(d.execute_script("return window.__sent")) == 2
    assert counter(metrics(server), OK_CHATS) == before
    field.clear()
    field.send_keys("0.7")  # fixing the value clears the error
    assert not find(By.ID, "temp-error").is_displayed() and field.get_attribute("aria-invalid") == "false"
