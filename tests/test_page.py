"""The web page in headless Chromium (Debian's chromium + chromium-driver, driven by
selenium) against a real `moefit serve` on a tiny model and a simulated card."""

import json
import re
import shutil
import time

import httpx
import pytest

from moefit.memory.simcard import write_card

import tiny
from serving import Served

pytestmark = pytest.mark.skipif(not shutil.which("chromedriver"), reason="chromium-driver is not installed")
CARD = ("RTX 4070 (simulated)", 120.0)
DESKTOP = [(2101, "gnome-shell", 10.0)]


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """A tiny model with no end-of-text token, so an answer runs until it is stopped."""
    from moefit.pack.convert import convert
    root = tmp_path_factory.mktemp("page-model")
    hf = tiny.build_checkpoint("qwen3_moe", root / "hf", eos_token_id=None)
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    cfg["eos_token"] = None
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    convert(hf, root / "pack", "int8", progress=False)
    return root / "pack"


def start(pack, root, *extra):
    card = root / "card.json"
    write_card(card, *CARD, DESKTOP)
    s = Served(pack, card, root / "state", "--ctx", "4096", *extra)
    s.card = card
    return s


@pytest.fixture(scope="module")
def server(pack, tmp_path_factory):
    s = start(pack, tmp_path_factory.mktemp("page-server"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,1000"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    yield driver
    driver.quit()


def wait_for(fn, timeout=20.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception:  # noqa: BLE001 - the page may be mid-refresh
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def segments(browser):
    return browser.execute_script(
        "return [...document.querySelectorAll('#ledger-bar div')].map(d => [d.dataset.name, Number(d.dataset.bytes)])")


def test_the_ledger_bar_adds_up_to_the_card_and_matches_the_status(server, browser):
    browser.get(server.url + "/")
    segs = wait_for(lambda: segments(browser), what="the ledger bar")
    status = httpx.get(server.url + "/v1/status").json()
    assert sum(b for _, b in segs) == status["device"]["total_bytes"]
    by_name = dict(segs)
    for line in status["ledger"]:
        if line["name"] == "reserve":
            assert sum(by_name["reserve: " + p["name"]] for p in line["parts"]) == line["bytes"]
        else:
            assert by_name[line["name"]] == max(0, line["bytes"])
    assert "gnome-shell" not in browser.find_element("id", "culprits").text


def test_the_hit_rate_chart_updates_after_requests(server, browser):
    browser.get(server.url + "/")
    wait_for(lambda: segments(browser), what="the page")
    before = browser.execute_script("return Number(document.getElementById('hit-chart').dataset.points || 0)")
    for _ in range(3):
        httpx.post(server.url + "/v1/completions", json={"prompt": "the lantern", "max_tokens": 8}, timeout=30)
    hits = lambda: int(re.search(r"\((\d+) hits", browser.find_element("id", "cache-summary").text)[1])  # noqa: E731
    wait_for(lambda: hits() > 0, what="hits in the summary")
    points = lambda: browser.execute_script("return Number(document.getElementById('hit-chart').dataset.points)")  # noqa: E731
    wait_for(lambda: points() > before, what="new points on the chart")
    bars = browser.execute_script("return document.querySelectorAll('#layer-bars div').length")
    assert bars == 3
    look = r"look-ahead \(router\): next-layer recall \d+ %, (\d+) prefetched \(\d+ used in time\)"
    wait_for(lambda: re.search(look, browser.find_element("id", "cache-summary").text), what="the look-ahead figures")


def test_a_guard_warning_shows_a_mark_and_the_shrunken_cache(server, browser):
    browser.get(server.url + "/")
    wait_for(lambda: segments(browser), what="the page")
    slots = httpx.get(server.url + "/v1/status").json()["expert_cache"]["slots"]
    free = httpx.get(server.url + "/v1/status").json()["device_now"]["free_bytes"] / 2**20
    write_card(server.card, *CARD, DESKTOP + [(5000, "blender", free - 300 / 1024)])
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    chart = lambda: browser.execute_script("return document.getElementById('hit-chart').dataset")  # noqa: E731
    wait_for(lambda: int(chart()["warnings"]) >= 1 and int(chart()["marks"]) >= 2, what="the guard marks")
    summary = browser.find_element("id", "cache-summary").text
    assert int(summary.split(" of ")[0]) < slots and "guard warnings 1" in summary
    write_card(server.card, *CARD, DESKTOP)


def test_the_chat_streams_and_the_stop_button_stops_it(server, browser):
    browser.get(server.url + "/")
    browser.find_element("id", "tab-chat").click()
    box = browser.find_element("id", "prompt")
    box.send_keys("Define: lantern")
    browser.find_element("id", "maxtokens").clear()
    browser.find_element("id", "maxtokens").send_keys("3000")
    browser.find_element("id", "send").click()
    answer = lambda: browser.find_elements("css selector", ".msg.assistant")[-1]  # noqa: E731
    first = wait_for(lambda: len(answer().text) > 5 and answer().text, what="streamed text")
    wait_for(lambda: len(answer().text) > len(first), what="more streamed text")
    browser.find_element("id", "stop").click()
    wait_for(lambda: answer().get_attribute("data-done") == "stopped", what="the stop")
    recent = wait_for(lambda: httpx.get(server.url + "/v1/status").json()["recent_requests"], what="status")
    assert recent[-1]["generated"] < 3000


def test_dark_scheme_follows_the_system(server, browser):
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    browser.get(server.url + "/")
    dark = browser.execute_script("return getComputedStyle(document.body).backgroundColor")
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "light"}]})
    browser.get(server.url + "/")
    light = browser.execute_script("return getComputedStyle(document.body).backgroundColor")
    assert dark != light


def test_a_phone_width_window_keeps_everything_reachable(server, browser):
    browser.set_window_size(390, 844)
    try:
        browser.get(server.url + "/")
        wait_for(lambda: segments(browser), what="the page")
        width = browser.execute_script("return document.documentElement.scrollWidth")
        assert width <= 400
        browser.find_element("id", "tab-chat").click()
        assert browser.find_element("id", "prompt").is_displayed()
    finally:
        browser.set_window_size(1280, 1000)


def test_with_an_api_key_the_page_asks_once_then_works(pack, tmp_path, browser):
    s = start(pack, tmp_path, "--api-key", "s3cret")
    try:
        browser.get(s.url + "/")
        form = wait_for(lambda: browser.find_element("id", "keyform").is_displayed()
                        and browser.find_element("id", "keyform"), what="the key form")
        assert "s3cret" not in browser.page_source
        browser.find_element("id", "apikey").send_keys("s3cret")
        form.submit()
        wait_for(lambda: segments(browser), what="the ledger after the key")
        assert browser.execute_script("return sessionStorage.getItem('moefit-key')") == "s3cret"
        browser.refresh()
        wait_for(lambda: segments(browser), what="the ledger after a reload")
        assert not browser.find_element("id", "keyform").is_displayed()
    finally:
        browser.execute_script("sessionStorage.clear()")
        s.stop()


def test_the_chart_is_filled_when_the_page_opens_and_everything_is_labelled(server, browser):
    for _ in range(2):
        httpx.post(server.url + "/v1/completions", json={"prompt": "the lantern", "max_tokens": 4}, timeout=30)
    wait_for(lambda: len(httpx.get(server.url + "/v1/status").json()["cache_samples"]) >= 2, what="server samples")
    kept = len(httpx.get(server.url + "/v1/status").json()["cache_samples"])
    browser.get(server.url + "/")
    wait_for(lambda: browser.execute_script("return document.body.dataset.refreshed") == "1", what="the first refresh")
    chart = browser.execute_script("return document.getElementById('hit-chart').dataset")
    assert int(chart["points"]) > kept and chart["axes"] == "hit rate,slots,time"
    labels = browser.execute_script("return [...document.querySelectorAll('#layer-bars div span')].map(s => s.textContent)")
    assert [x.split()[0] for x in labels] == ["L0", "L1", "L2"] and all(x.endswith("%") for x in labels)


def test_the_history_reads_in_mib_and_no_word_is_said_twice(server, browser):
    browser.get(server.url + "/")
    wait_for(lambda: browser.find_elements("css selector", "#history tbody tr"), what="the history")
    cache_cell = browser.find_element("css selector", "#history tbody tr td:nth-child(4)").text
    assert re.fullmatch(r"\d+ / [\d.,]+ MiB", cache_cell), cache_cell
    zero, spec = browser.find_element("id", "zero-check").text, browser.find_element("id", "speculative").text
    verdict = zero.split()[0]
    assert zero.count(verdict) == 1 and not re.search(r"\b(\w+)\)?: \1:", spec), (zero, spec)


def test_the_page_has_a_favicon(server, browser):
    r = httpx.get(server.url + "/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml") and b"<svg" in r.content
    browser.get(server.url + "/")
    assert browser.execute_script("return document.querySelector('link[rel=icon]').href").endswith("/favicon.ico")


def test_the_sessions_card_shows_what_each_session_holds(pack, tmp_path, browser):
    """--sessions 2: the card lists both, the tokens each holds and which served the last request."""
    s = start(pack, tmp_path, "--sessions", "2")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Define: lantern", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        held = next(x["tokens"] for x in httpx.get(s.url + "/v1/status").json()["sessions"] if x["current"])
        browser.get(s.url + "/")
        text = wait_for(lambda: browser.find_element("id", "sessions").text, what="the sessions card")
        assert text.count("tokens") == 2 and f"{held} tokens (the last request's)" in text, text
    finally:
        s.stop()
