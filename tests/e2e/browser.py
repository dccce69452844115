"""Headless Chromium for the dashboard's browser tests: Debian's `chromium` (.ci/run installs it) driven by Playwright
(pyproject's [test] extra; never `playwright install`, which downloads a browser of its own). Skips, with the reason,
only where Chromium is missing or cannot start here."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def sync_playwright_or_skip():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (it is in pyproject's [test] extra)")
    if not os.path.exists(CHROMIUM):
        reason = "Debian's chromium is not installed (.ci/run installs it as root: apt-get install chromium)"
        if os.geteuid() != 0:
            reason += "; this is not root, so it could not be installed"
        pytest.skip(reason)
    return sync_playwright


@contextlib.contextmanager
def chromium() -> Iterator:
    """A launched browser (closed at the end)."""
    sync_playwright = sync_playwright_or_skip()
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, timeout=60_000)
        except Exception as e:  # noqa: BLE001 - a Chromium that cannot start here is a skip, with its reason
            pytest.skip(f"Chromium cannot be launched here: {str(e).splitlines()[0]}")
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def dashboard_page(url: str, api_key: Optional[str] = None) -> Iterator:
    """The live /dashboard page of the server at url (the key sent as a Bearer header with every request the page
    makes, its event stream's included), once it has drawn its first event. On leaving, no console error may have
    happened."""
    problems: list[str] = []
    with chromium() as browser:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, extra_http_headers=headers)
        page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.goto(url + "/dashboard")
        page.wait_for_selector("#kv-grid[data-cells]", timeout=120_000)
        yield page
    assert not problems, problems
