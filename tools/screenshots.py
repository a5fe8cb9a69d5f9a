"""Screenshots of the page (monitor and chat, light and dark) for the README, taken in
headless Chromium against the demo served on its simulated card.

    .venv/bin/python tools/screenshots.py        # writes docs/page-*.png
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PORT = 8765


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                 "--disable-background-networking", "--disable-component-update", "--window-size=1280,1500"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def main() -> None:
    server = subprocess.Popen([sys.executable, "-m", "moefit.demo", "--port", str(PORT)], cwd=ROOT,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PORT}"
    try:
        while not _ready(url):
            time.sleep(0.5)
        for word in ("lantern", "river", "harbor", "candle", "forest", "music"):
            httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": f"Define: {word}"}], "max_tokens": 60})
        driver = browser()
        for scheme in ("light", "dark"):
            driver.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                   {"features": [{"name": "prefers-color-scheme", "value": scheme}]})
            driver.get(url + "/")
            time.sleep(4)
            driver.save_screenshot(str(ROOT / "docs" / f"page-monitor-{scheme}.png"))
            driver.find_element("id", "tab-chat").click()
            driver.find_element("id", "prompt").send_keys("Define: lantern")
            driver.find_element("id", "send").click()
            time.sleep(5)
            driver.save_screenshot(str(ROOT / "docs" / f"page-chat-{scheme}.png"))
        driver.quit()
    finally:
        server.terminate()
        server.wait(timeout=30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    main()
