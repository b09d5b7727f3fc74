"""The chat page of `h2o-local serve`, driven in a real browser (headless Chromium through Selenium): a
conversation streams, and the cache view beside it shows the kept tokens shaded and the evicted ones struck
through, with the policy and budget the conversation chose."""
import os
import shutil
import time

import httpx
import pytest

from h2o_local.server.routes import STATIC_DIR
from test_server import CHATML, serving
from tiny_model import write_tiny_llama

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
except ImportError:
    selenium = None

needs_browser = pytest.mark.skipif(
    BROWSER is None or DRIVER is None or selenium is None,
    reason="optional: no browser here (Debian's chromium and chromium-driver, and selenium; CI installs them)")


def test_the_page_is_installed_as_plain_files_that_need_nothing_from_outside(server):
    for name in ("index.html", "chat.js", "chat.css"):
        text = open(os.path.join(STATIC_DIR, name), encoding="utf-8").read()
        assert "http://" not in text and "https://" not in text, f"{name} must work offline"
    port, _ = server
    for path, kind in (("/", "text/html"), ("/static/chat.js", "javascript"), ("/static/chat.css", "text/css")):
        r = httpx.get(f"http://127.0.0.1:{port}{path}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert httpx.get(f"http://127.0.0.1:{port}/static/%2e%2e/routes.py").status_code == 404  # no way out of static/


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = str(write_tiny_llama(tmp_path_factory.mktemp("web") / "chat.gguf", chat_template=CHATML, n_ctx_train=4096))
    with serving(model, slots=2, budget=64) as s:
        yield s


def wait(driver, predicate, timeout_s=60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s).until(lambda d: predicate(d))


def ask(driver, text):
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()
    n = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-finish]")) == n)
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def cache_view(driver):
    """The cache view's token classes, read in one script (the page may redraw between two WebDriver calls)."""
    from selenium.webdriver.common.by import By

    classes = driver.execute_script(
        "return Array.from(document.querySelectorAll('#cache-tokens span'), (s) => s.className)")
    return classes, driver.find_element(By.ID, "cache-stats")


@needs_browser
def test_a_conversation_in_the_browser_shows_what_its_cache_keeps(browser, server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    port, _ = server
    browser.get(f"http://127.0.0.1:{port}/")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "idle")
    assert "tiny" in browser.find_element(By.ID, "model").text
    Select(browser.find_element(By.ID, "policy")).select_by_value("sink")
    browser.find_element(By.ID, "budget").send_keys("24")
    answer = ask(browser, "Tell me about the cache. " * 6)
    assert answer.get_attribute("data-finish") in ("stop", "length") and answer.text.strip()
    classes, stats = cache_view(browser)
    kept = [c for c in classes if "kept" in c]
    assert len(kept) == int(stats.get_attribute("data-kept")) <= 24
    assert sum("evicted" in c for c in classes) > 0 and stats.get_attribute("data-policy") == "sink-24"
    # a policy that ranks by attention: the kept tokens are shaded by their scores' rank
    assert browser.find_element(By.ID, "policy").get_attribute("disabled")  # chosen once per conversation
    browser.save_screenshot(str(tmp_path / "sink.png"))

    # the second turn continues the conversation: the view holds both turns
    n_first = len(classes)
    ask(browser, "And then?")
    classes, _ = cache_view(browser)
    assert len(classes) > n_first

    browser.find_element(By.ID, "new").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
    assert not browser.find_element(By.ID, "policy").get_attribute("disabled")
    Select(browser.find_element(By.ID, "policy")).select_by_value("h2o")
    budget = browser.find_element(By.ID, "budget")
    budget.clear()
    budget.send_keys("32")
    ask(browser, "Which tokens are heavy hitters? " * 4)
    classes, stats = cache_view(browser)
    assert stats.get_attribute("data-policy") == "h2o-32" and int(stats.get_attribute("data-kept")) <= 32
    shades = {s.value_of_css_property("background-color")
              for s in browser.find_elements(By.CSS_SELECTOR, "#cache-tokens span.kept")}
    assert len(shades) > 3  # shaded by score, not one colour
    browser.save_screenshot(str(tmp_path / "h2o.png"))
    shutil.copy(tmp_path / "h2o.png", os.environ.get("H2O_LOCAL_SCREENSHOT", tmp_path / "copy.png"))


@needs_browser
def test_a_request_the_server_refuses_is_shown_and_the_page_stays_usable(browser, server):
    from selenium.webdriver.common.by import By

    port, _ = server
    browser.get(f"http://127.0.0.1:{port}/")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "idle")
    browser.find_element(By.ID, "budget").send_keys("100000")
    browser.find_element(By.ID, "input").send_keys("Hello")
    browser.find_element(By.ID, "send").click()
    error = wait(browser, lambda d: d.find_element(By.ID, "error") if d.find_element(By.ID, "error").is_displayed() else None)
    assert "kv_cache.budget" in error.text and "at most" in error.text
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")
    budget = browser.find_element(By.ID, "budget")
    assert not budget.get_attribute("disabled")
    budget.clear()
    answer = ask(browser, "Hello again")
    assert answer.get_attribute("data-finish") in ("stop", "length")
    assert not browser.find_element(By.ID, "error").is_displayed()


@needs_browser
def test_with_an_api_key_the_page_asks_for_it(tmp_path, browser):
    from selenium.webdriver.common.by import By

    model = str(write_tiny_llama(tmp_path / "chat.gguf", chat_template=CHATML, n_ctx_train=4096))
    with serving(model, slots=1, budget=48, app_kwargs={"api_key": "sesame"}) as (port, _):
        browser.get(f"http://127.0.0.1:{port}/")
        browser.execute_script("localStorage.clear()")
        browser.refresh()
        # the field and the message it comes with (the page shows them one after the other)
        key = wait(browser, lambda d: d.find_element(By.ID, "key") if d.find_element(By.ID, "key").is_displayed()
                   and "API key" in d.find_element(By.ID, "error").text else None)
        key.send_keys("sesame")
        browser.find_element(By.ID, "key-save").click()
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "idle")
        assert ask(browser, "Hi").get_attribute("data-finish") in ("stop", "length")
        browser.execute_script("localStorage.clear()")


@needs_browser
def test_with_recall_the_page_shows_what_waits_in_host_memory(tmp_path, browser):
    from selenium.webdriver.common.by import By

    model = str(write_tiny_llama(tmp_path / "recall.gguf", chat_template=CHATML, n_ctx_train=4096))
    with serving(model, slots=1, budget=48, policy=None, recall=True) as (port, _):  # the default policy
        browser.get(f"http://127.0.0.1:{port}/")
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "idle")
        ask(browser, "Tell me about the lighthouse and its keeper. " * 5)
        ask(browser, "What did the keeper write?")
        classes, stats = cache_view(browser)
        host = sum("host" in c.split() for c in classes)
        assert host > 0 and f"in host memory {host}" in stats.text
        assert len([c for c in classes if "kept" in c.split()]) <= 48
        browser.save_screenshot(str(tmp_path / "recall.png"))


@needs_browser
def test_a_thinking_models_reasoning_is_shown_above_its_answer(tmp_path, browser):
    """The server gives a thinking model's reasoning apart (reasoning_content); the page shows it, dimmed. The
    template opens the think tags itself, so the tiny model's text is all reasoning."""
    from selenium.webdriver.common.by import By
    from test_reasoning import OPENED

    model = str(write_tiny_llama(tmp_path / "think.gguf", chat_template=OPENED, n_ctx_train=4096))
    with serving(model, slots=1, budget=48) as (port, _):
        browser.get(f"http://127.0.0.1:{port}/")
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "idle")
        answer = ask(browser, "Think first.")
        thinking = answer.find_elements(By.CSS_SELECTOR, ".thinking")
        assert thinking and thinking[0].text.strip() and thinking[0].value_of_css_property("font-style") == "italic"
        browser.save_screenshot(str(tmp_path / "thinking.png"))


@needs_browser
def test_the_answer_s_length_and_temperature_are_set_on_the_page(browser, server):
    from selenium.webdriver.common.by import By

    port, _ = server
    browser.get(f"http://127.0.0.1:{port}/")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "idle")
    length = browser.find_element(By.ID, "max-tokens")
    assert length.get_attribute("value") == "512"  # a chat-sized default, not the trained context
    length.clear()
    length.send_keys("3")
    browser.find_element(By.ID, "temperature").send_keys("0")
    answers = []
    for _ in range(2):  # greedy: the same question in a new conversation gives the same answer
        answer = ask(browser, "Say something long.")
        assert answer.get_attribute("data-finish") == "length"
        answers.append(answer.text.split("\n")[0])
        browser.find_element(By.ID, "new").click()
    assert answers[0] == answers[1]
