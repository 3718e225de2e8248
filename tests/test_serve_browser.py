"""The web chat page in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`, which .ci/run
installs) driven by selenium loads the page from a test server, uploads the demo image, asks, sees the answer
stream in, asks a follow-up (answered through prefix reuse), and saves a screenshot under the test's tmp_path.
Without the browser this fails rather than skips: CI installs it, so its absence is a broken set-up.
"""

import shutil

import pytest

from test_serve import DEMO_IMAGE, Server, answer_in_process  # the same server harness

INSTALL = "apt-get install -y chromium chromium-driver (Debian; .ci/run does it)"


@pytest.fixture(scope="module")
def vlm():
    import tinyvila

    return tinyvila.load("demo")


@pytest.fixture()
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, f"headless Chromium is needed for the web page test: {INSTALL}"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1100,900"):
        options.add_argument(flag)
    b = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    yield b
    b.quit()


def ask(browser, question: str) -> str:
    """Type a question, send it, wait for the answer to finish; -> the last answer's text."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.execute_script("window.tinyvila.done = false; window.tinyvila.chunks = 0;")
    browser.find_element(By.ID, "question").send_keys(question)
    browser.find_element(By.ID, "ask").click()
    WebDriverWait(browser, 60).until(lambda b: b.execute_script("return window.tinyvila.done"))
    return browser.execute_script("return Array.from(document.querySelectorAll('.assistant')).pop().textContent")


def test_web_page_image_question_streams_the_answer(browser, vlm, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    questions = ["What is in the image?", "And what else?"]
    want, _ = answer_in_process(vlm, questions[:1], 24, [("image", DEMO_IMAGE)])
    server = Server(vlm)
    try:
        browser.get(server.url + "/")
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "model").text == "demo")
        limit = browser.find_element(By.ID, "max_tokens")
        limit.clear()
        limit.send_keys("24")
        browser.find_element(By.ID, "file").send_keys(str(DEMO_IMAGE))
        WebDriverWait(browser, 20).until(lambda b: b.find_elements(By.CSS_SELECTOR, "#preview img"))
        first = ask(browser, questions[0])
        chunks = browser.execute_script("return window.tinyvila.chunks")
        stats = browser.find_element(By.ID, "stats").text
        assert first == want[0]
        assert chunks > 1, "the answer arrived in one piece, not streamed"
        assert "decode" in stats and "usage:" in stats, stats
        assert browser.find_elements(By.CSS_SELECTOR, "#log .user img"), "the uploaded image is not shown"
        second = ask(browser, questions[1])
        assert second and "prefix reused" in browser.find_element(By.ID, "stats").text
        assert server.metric("prefix_cache_hits_total") == 1
        shot = tmp_path / "web_page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 1000
    finally:
        server.close()
