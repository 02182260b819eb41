"""`txl serve` in a real browser (issue 20): headless Chromium (Debian's `chromium` and
`chromium-driver`, which `.ci/run` installs) driven by Selenium loads the page, generates 50 tokens,
sees them arrive in several steps, opens the attention view of one token, re-scores the text for two
memory lengths and takes a screenshot.

Skipped only where no Chromium is installed. TXL_SERVE_SCREENSHOT=PATH also writes the screenshot
there (docs/guide/serve.png was made so); TXL_SERVE_RUN=DIR serves that run instead of a freshly trained
tiny one (a better-trained model makes a more readable picture).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from serve_helpers import running, train_run, word_checkpoint
from txl.serve.app import Limits, create_app
from txl.serve.engine import open_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.slow,  # a browser and a server: end to end
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                       reason="no Chromium installed: apt-get install chromium chromium-driver (Debian) runs this test"),
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return Path(os.environ.get("TXL_SERVE_RUN") or train_run(tmp_path_factory.mktemp("browser"), steps=60))


@pytest.fixture(scope="module")
def url(run_dir):
    with running(create_app([open_run(run_dir)], Limits(max_new_tokens=200))) as base:
        yield base


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1640", "--force-device-scale-factor=1", "--no-first-run"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait_for(driver, script: str, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: d.execute_script(script))


def test_page_streams_50_tokens_and_shows_attention_over_memory(browser, url, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(url + "/")
    wait_for(browser, "return document.body.dataset.ready === '1'")
    assert "txl playground" in browser.title
    cards = browser.find_element(By.ID, "cards").text
    assert "parameters" in cards and "mem_len" in cards

    # every batch of DOM changes in the output records how many generated tokens were on the page then
    browser.execute_script("""
        window.seen = [];
        new MutationObserver(() => window.seen.push(document.querySelectorAll('#text-0 .tok.gen').length))
            .observe(document.getElementById('text-0'), {childList: true});""")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("the memory of the segment and the attention of the")
    for field, value in (("max-new-tokens", "50"), ("seed", "5")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "generate").click()
    wait_for(browser, "return document.getElementById('text-0').dataset.done !== undefined")

    generated = browser.find_elements(By.CSS_SELECTOR, "#text-0 .tok.gen")
    assert len(generated) == 50
    seen = [n for n in browser.execute_script("return window.seen") if n > 0]
    assert len(set(seen)) >= 3 and min(seen) < 50 and seen == sorted(seen), seen  # arrived in steps, in order
    assert all(span.value_of_css_property("background-color") not in ("", "rgba(0, 0, 0, 0)") for span in generated)
    assert "50 tokens (max_new_tokens)" in browser.find_element(By.ID, "info-0").text

    # the attention of the query that predicted a late generated token (a visible one), layer 1, head 0
    browser.find_element(By.CSS_SELECTOR, "#layer option[value='1']").click()
    next(span for span in generated[35:] if span.text.strip()).click()
    wait_for(browser, "return document.getElementById('attention').dataset.state === 'ready'")
    info = browser.find_element(By.ID, "attn-info").text
    assert "memory keys" in info and "predicting token" in info
    assert browser.find_elements(By.CSS_SELECTOR, "#attn-strip .key.mem")  # keys from memory …
    assert len(browser.find_elements(By.CSS_SELECTOR, "#attn-strip .boundary")) == 1  # … | the segment
    assert browser.find_elements(By.CSS_SELECTOR, "#attn-strip .key.query")
    painted = browser.execute_script("""
        const c = document.getElementById('attn-matrix'), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && d[i] < 200) n++; return n;""")
    assert painted > 1000

    browser.find_element(By.ID, "rescore").click()
    wait_for(browser, "return document.getElementById('memory').dataset.state === 'ready'")
    assert "predictions" in browser.find_element(By.ID, "score-info").text

    browser.execute_script("window.scrollTo(0, 0)")
    shot = tmp_path / "serve.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("TXL_SERVE_SCREENSHOT"):
        shutil.copyfile(shot, Path(os.environ["TXL_SERVE_SCREENSHOT"]))


def test_two_runs_stream_side_by_side_from_one_prompt(browser, run_dir):
    from selenium.webdriver.common.by import By

    runs = [open_run(run_dir / "best"), open_run(run_dir / "last")]
    with running(create_app(runs)) as base:
        browser.get(base + "/")
        wait_for(browser, "return document.body.dataset.ready === '1'")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#outputs .output")) == 2
        assert len(browser.find_elements(By.CSS_SELECTOR, "#cards .panel")) == 2
        browser.find_element(By.ID, "prompt").send_keys("the attention")
        box = browser.find_element(By.ID, "max-new-tokens")
        box.clear()
        box.send_keys("20")
        browser.find_element(By.ID, "generate").click()
        for index in (0, 1):
            wait_for(browser, f"return document.getElementById('text-{index}').dataset.done !== undefined")
            prompt = "".join(s.text for s in browser.find_elements(By.CSS_SELECTOR, f"#text-{index} .tok.prompt"))
            assert prompt == "the attention"
            assert len(browser.find_elements(By.CSS_SELECTOR, f"#text-{index} .tok.gen")) == 20


def generate_in_page(browser, prompt: str, tokens: int, *, button: str = "generate", index: int = 0):
    """Type `prompt` (unless None), ask for `tokens` tokens with seed 5, press `button`, wait for the end."""
    from selenium.webdriver.common.by import By

    if prompt is not None:
        box = browser.find_element(By.ID, "prompt")
        box.clear()
        box.send_keys(prompt)
    for field, value in (("max-new-tokens", str(tokens)), ("seed", "5")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.execute_script(f"delete document.getElementById('text-{index}').dataset.done")
    browser.find_element(By.ID, button).click()
    wait_for(browser, f"return document.getElementById('text-{index}').dataset.done !== undefined")


def test_continue_goes_on_from_the_generated_text_not_the_prompt_again(browser, url):
    """Issue 45: after Generate, Continue fed the prompt box into the text a second time."""
    from selenium.webdriver.common.by import By

    browser.get(url + "/")
    wait_for(browser, "return document.body.dataset.ready === '1'")
    generate_in_page(browser, "the memory of", 20)
    first = browser.find_element(By.ID, "text-0").text
    generate_in_page(browser, None, 15, button="continue")  # the prompt box still says "the memory of"
    prompt = "".join(s.text for s in browser.find_elements(By.CSS_SELECTOR, "#text-0 .tok.prompt"))
    assert prompt == "the memory of"  # once: Continue fed nothing new
    assert len(browser.find_elements(By.CSS_SELECTOR, "#text-0 .tok.gen")) == 35
    text = browser.find_element(By.ID, "text-0").text
    assert text.startswith(first) and text.count("the memory of") == first.count("the memory of")
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "the memory of"  # kept for Generate
    assert "15 tokens (max_new_tokens)" in browser.find_element(By.ID, "info-0").text
    generate_in_page(browser, "the memory of", 35)  # the same seed's stream drawn on: one generation of 35
    assert browser.find_element(By.ID, "text-0").text == text


def test_a_text_of_one_segment_says_memory_cannot_help(browser, url):
    """Issue 45: a text shorter than one segment drew two identical curves with no word why."""
    from selenium.webdriver.common.by import By

    browser.get(url + "/")
    wait_for(browser, "return document.body.dataset.ready === '1'")
    generate_in_page(browser, "the", 5)  # 8 tokens: one segment of 16
    browser.find_element(By.ID, "rescore").click()
    wait_for(browser, "return document.getElementById('memory').dataset.state === 'ready'")
    info = browser.find_element(By.ID, "score-info").text
    assert "one segment" in info and "memory cannot" in info, info
    assert browser.find_element(By.ID, "loss-plot").get_attribute("data-curves") == "1"
    generate_in_page(browser, "the memory of", 40)  # 3 segments: both curves, no such sentence
    browser.find_element(By.ID, "rescore").click()
    wait_for(browser, "return document.getElementById('score-info').textContent.includes('predictions')")
    assert "one segment" not in browser.find_element(By.ID, "score-info").text
    assert browser.find_element(By.ID, "loss-plot").get_attribute("data-curves") == "2"


@pytest.fixture(scope="module")
def lstm_dir(tmp_path_factory) -> Path:
    return train_run(tmp_path_factory.mktemp("browser-lstm"), steps=20, arch="lstm")


def test_a_recurrent_run_hides_the_attention_panel_and_transformer_rows(browser, lstm_dir, run_dir):
    """Issue 45: an LSTM run showed the attention panel (clicking a token printed the API's refusal) and
    model-card rows of 'undefined'."""
    from selenium.webdriver.common.by import By

    with running(create_app([open_run(lstm_dir)])) as base:
        browser.get(base + "/")
        wait_for(browser, "return document.body.dataset.ready === '1'")
        assert not browser.find_element(By.ID, "attention").is_displayed()
        assert browser.find_element(By.ID, "memory").is_displayed()
        card = browser.find_element(By.ID, "cards").text
        assert "undefined" not in card and "heads" not in card and "lstm" in card
        generate_in_page(browser, "the memory of", 10)
        browser.find_elements(By.CSS_SELECTOR, "#text-0 .tok.gen")[5].click()
        assert not browser.find_element(By.ID, "attention").is_displayed()
    # side by side with a Transformer: the panel is there, and a token of the LSTM gets one plain sentence
    with running(create_app([open_run(run_dir), open_run(lstm_dir)])) as base:
        browser.get(base + "/")
        wait_for(browser, "return document.body.dataset.ready === '1'")
        assert browser.find_element(By.ID, "attention").is_displayed()
        generate_in_page(browser, "the memory of", 10)
        wait_for(browser, "return document.getElementById('text-1').dataset.done !== undefined")
        browser.find_elements(By.CSS_SELECTOR, "#text-1 .tok.gen")[5].click()
        info = browser.find_element(By.ID, "attn-info").text
        assert "recurrent" in info and "no attention" in info and "'attention'" not in info and "arch=" not in info
        assert browser.find_element(By.ID, "attention").get_attribute("data-state") == "unavailable"


def test_prompt_words_read_as_unk_are_named_beside_the_text(browser, tmp_path):
    """Issue 45: a words vocabulary read unknown prompt words as <unk> with no word on the page."""
    from selenium.webdriver.common.by import By

    with running(create_app([open_run(word_checkpoint(tmp_path / "words"))])) as base:
        browser.get(base + "/")
        wait_for(browser, "return document.body.dataset.ready === '1'")
        assert not browser.find_element(By.ID, "notice-0").is_displayed()
        generate_in_page(browser, "The Company said that Bob's", 3)
        notice = browser.find_element(By.ID, "notice-0")
        assert notice.is_displayed() and "<unk>" in notice.text and "'the' for 'The'" in notice.text
        generate_in_page(browser, "the company said", 3)
        assert not browser.find_element(By.ID, "notice-0").is_displayed()

