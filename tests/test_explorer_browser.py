"""The explorer page in headless Chromium (Debian's ``chromium``, driven by Playwright with
``executable_path``): it loads and draws the built-in model's gallery, re-renders when a
method or an argument changes, shows injected HTML as text without running it, and the
server refuses a foreign Host and requests without the token.

Skipped, with the reason, only where no Chromium binary or no Playwright package exists
(``.ci/run`` installs both)."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest

pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
CHROMIUM = os.environ.get("CAPTUM_EXPLORER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium binary found (apt-get install -y chromium, or set CAPTUM_EXPLORER_CHROMIUM); the browser "
                "tests need one", allow_module_level=True)

from captum_transformers.explorer.server import start  # noqa: E402
from captum_transformers.explorer.pages.classifier.sources import builtin_workspace  # noqa: E402
from explorer_workspaces import PAYLOAD, CountingBuilder, text_workspace  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def digits_server():
    running = start(builtin_workspace(samples=8), port=0, blocking=False, quiet=True)
    yield running
    running.stop()


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("dialog", lambda dialog: (errors.append("dialog: " + dialog.message), dialog.dismiss()))
    page.goto(url)
    page.wait_for_selector("body[data-ready=yes]", timeout=30_000)
    return page, errors


PIXEL_SPREAD = """(selector) => {
  const canvas = document.querySelector(selector);
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  let low = 255, high = 0;
  for (let i = 0; i < data.length; i += 4) { low = Math.min(low, data[i]); high = Math.max(high, data[i]); }
  return high - low;
}"""

FIRST_MAP = "#grid tr[data-row=rollout] td[data-ready=yes] canvas"


def test_page_loads_and_draws_the_gallery_and_grid(browser, digits_server):
    page, errors = open_page(browser, digits_server.url)
    assert page.locator("#gallery .thumb canvas").count() == 8
    assert page.evaluate(PIXEL_SPREAD, "#gallery .thumb canvas") > 30  # a real canvas image, not a blank
    assert page.locator("#grid td[data-ready=yes] canvas").count() == 2 * 6  # rollout, generic-attention x 6
    assert page.evaluate(PIXEL_SPREAD, FIRST_MAP) > 30
    # Both default methods are unsigned: each row says so, not "red = for the class".
    notes = page.locator("#grid td.method-name .sign-note").all_text_contents()
    assert notes == ["unsigned: darker = more relevant, no direction"] * 2
    assert "token" not in page.url  # taken out of the address bar once read
    assert page.locator("#status").text_content().startswith("ready")
    assert errors == []
    page.close()


def test_changing_an_argument_or_a_method_rerenders(browser, digits_server):
    page, errors = open_page(browser, digits_server.url)
    before_key = page.locator("#grid tr[data-row=rollout] td[data-key]").first.get_attribute("data-key")
    before = page.evaluate("() => document.querySelector('" + FIRST_MAP + "').toDataURL()")
    page.select_option("[data-method-box=rollout] select[data-field=head_fusion]", "max")
    page.wait_for_selector("#grid tr[data-row=rollout] td[data-key*='\"head_fusion\":\"max\"'][data-ready=yes]")
    after_key = page.locator("#grid tr[data-row=rollout] td[data-key]").first.get_attribute("data-key")
    after = page.evaluate("() => document.querySelector('" + FIRST_MAP + "').toDataURL()")
    assert before_key != after_key and before != after
    page.check("input[data-method=grad-cam]")
    page.wait_for_selector("#grid tr[data-row=grad-cam] td[data-ready=yes] canvas")
    page.uncheck("input[data-method=generic-attention]")
    page.wait_for_function("() => !document.querySelector('#grid tr[data-row=generic-attention]')")
    # explaining another class for one example re-renders that column only
    page.select_option("select[data-target-for='0']", "7")
    page.wait_for_selector("#grid tr[data-row=grad-cam] td[data-key$='|0|7'][data-ready=yes] canvas")
    # filters narrow the gallery
    page.select_option("#filter-correct", "no")
    wrong = page.locator("#gallery .thumb").count()
    page.select_option("#filter-correct", "all")
    assert page.locator("#gallery .thumb").count() == 8 >= wrong
    assert errors == []
    page.close()


def test_curves_and_the_three_exports(browser, digits_server, tmp_path):
    page, errors = open_page(browser, digits_server.url)
    page.click(FIRST_MAP)
    page.wait_for_selector("#curve svg polyline")
    assert page.locator("#curve svg polyline").count() == 2  # deletion and insertion
    saved = {}
    for button in ("png", "json", "html"):
        with page.expect_download() as download:
            page.click(f"#export-{button}")
        path = tmp_path / download.value.suggested_filename
        download.value.save_as(path)
        saved[button] = path
    assert saved["png"].read_bytes().startswith(b"\x89PNG")
    view = json.loads(saved["json"].read_text())
    assert [m["name"] for m in view["methods"]] == ["rollout", "generic-attention"] and len(view["examples"]) == 6
    assert len(view["methods"][0]["maps"]["0"]["values"]) == 32 * 32
    document = saved["html"].read_text()
    assert document.count("data:image/png;base64,") == 6 * 3 and "<script" not in document
    assert errors == []
    page.close()


def test_injected_html_is_shown_as_text_and_runs_nothing(browser):
    running = start(text_workspace(), port=0, blocking=False, quiet=True)
    try:
        page, errors = open_page(browser, running.url)
        page.wait_for_selector("#grid td[data-ready=yes] .tokens")
        assert page.evaluate("() => window.__pwned") is None
        assert page.locator("img").count() == 0 and page.locator("b").count() == 0
        tokens = page.locator("#gallery .tokens span").all_text_contents()
        assert PAYLOAD in tokens and "<b>bold</b>" in tokens
        assert PAYLOAD in page.locator("#filter-label option").all_text_contents()  # a class name
        assert PAYLOAD in page.locator("#grid .tokens span").all_text_contents()
        assert errors == []
        page.close()
    finally:
        running.stop()


class SlowBuilder(CountingBuilder):
    """Each attribute call takes at least a second: long enough to see the progress."""

    def __call__(self, name, model, arguments):
        explainer = super().__call__(name, model, arguments)
        counted = explainer.attribute

        def attribute(*args, **kwargs):
            time.sleep(1.0)
            return counted(*args, **kwargs)

        explainer.attribute = attribute
        return explainer


def test_progress_is_shown_while_it_computes(browser):
    builder = SlowBuilder()
    running = start(text_workspace(builder), port=0, blocking=False, quiet=True, warm=False)
    try:
        page = browser.new_page()
        page.goto(running.url)
        page.wait_for_selector("#status:has-text('computing')", timeout=10_000)
        assert page.locator("#progress").is_visible()
        page.wait_for_selector("body[data-ready=yes]", timeout=30_000)
        assert page.locator("#status").text_content().startswith("ready") and not page.locator("#progress").is_visible()
        assert [call[2] for call in builder.calls] == [2, 2]  # two methods, each one call over both examples
        page.close()
    finally:
        running.stop()


class HeldBuilder(CountingBuilder):
    """Each attribute call waits (at most 30 s) until the test lets it go: the job is running
    for as long as the test needs, without any sleep."""

    def __init__(self):
        super().__init__()
        self.entered, self.proceed = threading.Event(), threading.Event()

    def __call__(self, name, model, arguments):
        explainer = super().__call__(name, model, arguments)
        counted = explainer.attribute

        def attribute(*args, **kwargs):
            self.entered.set()
            self.proceed.wait(30)
            return counted(*args, **kwargs)

        explainer.attribute = attribute
        return explainer


def test_a_running_job_is_cancelled_from_the_page(browser):
    builder = HeldBuilder()
    workspace = text_workspace(builder)
    running = start(workspace, port=0, blocking=False, quiet=True, warm=False)
    try:
        page = browser.new_page()
        page.goto(running.url)
        assert builder.entered.wait(30)
        cancel = page.locator("#cancel-job")
        cancel.wait_for(state="visible", timeout=10_000)
        cancel.click()
        page.wait_for_selector("#status:has-text('cancelling')", timeout=10_000)
        assert cancel.is_hidden()
        builder.proceed.set()  # the held method goes on, and stops at its first torch operation
        page.wait_for_selector("#status:has-text('cancelled after 0/2 methods')", timeout=30_000)
        assert cancel.is_hidden() and page.locator("#error").is_hidden()
        assert workspace.cached("rollout", {}, {0: 0}) == {}  # nothing of the stopped method is kept
        page.close()
    finally:
        builder.proceed.set()
        running.stop()


def test_page_says_the_model_is_loading_then_draws(browser):
    import threading

    from captum_transformers.explorer.loading import LoadingWorkspace

    gate = threading.Event()
    running = start(LoadingWorkspace(lambda: gate.wait(20) and text_workspace()), port=0, blocking=False, quiet=True)
    try:
        page = browser.new_page()
        page.goto(running.url)
        page.wait_for_selector("#status:has-text('loading the model')", timeout=10_000)
        assert page.locator("#gallery .thumb").count() == 0
        gate.set()
        page.wait_for_selector("body[data-ready=yes]", timeout=30_000)
        assert page.locator("#gallery .thumb").count() == 2
        page.close()
    finally:
        running.stop()


def test_a_second_model_is_chosen_in_the_header(browser):
    first, second = text_workspace(), text_workspace()
    second.name = "second encoder"
    running = start([first, second], port=0, blocking=False, quiet=True, warm=False)
    try:
        page, errors = open_page(browser, running.url)
        assert page.locator("#model-select option").all_text_contents() == ["tiny encoder", "second encoder"]
        page.select_option("#model-select", "1")  # reloads the page for that model
        # The page reloads: until the new document has its header, the element is absent (not an error).
        page.wait_for_function("() => (document.getElementById('model-name')?.textContent ?? '').startsWith('second')")
        page.wait_for_selector("body[data-ready=yes] #grid td[data-ready=yes]")
        assert page.locator("#model-select").input_value() == "1" and errors == []
        page.close()
    finally:
        running.stop()


def test_foreign_host_and_missing_token_are_refused(browser, digits_server):
    base = f"http://127.0.0.1:{digits_server.port}"
    context = browser.new_context()
    assert context.request.get(f"{base}/api/session").status == 403
    assert context.request.get(f"{base}/api/session", headers={"X-Explorer-Token": digits_server.token}).status == 200
    foreign = context.request.get(f"{base}/api/session", headers={"X-Explorer-Token": digits_server.token,
                                                                   "Host": "attacker.example"})
    assert foreign.status == 400
    page = context.new_page()
    page.goto(f"{base}/")  # no token in the URL: the page loads but its API calls are refused
    page.wait_for_selector("#error:not([hidden])")
    assert "token" in page.locator("#error").text_content()
    context.close()
