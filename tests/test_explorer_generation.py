"""The explorer's generation page: its API (generate, bounds refused with a message naming them,
the session token, the work budget, export) and, in headless Chromium, a prompt with markup in
it typed, generated from and an output token clicked: the prompt tokens take that token's
evidence colours, the markup shows as text and runs nothing.

The model is the recall task's tiny Llama with random weights (``build_recall_model``): the
page and the API do not depend on what it answers. The browser tests skip, with the reason,
where no Chromium binary or no Playwright package exists (as ``test_explorer_browser.py``)."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

pytest.importorskip("uvicorn")
from starlette.testclient import TestClient  # noqa: E402

from captum_transformers.explorer.app import create_app  # noqa: E402
from captum_transformers.explorer.pages.generation.workspace import GenerationWorkspace  # noqa: E402
from captum_transformers.explorer.method_arguments import WORK_BUDGET  # noqa: E402
from captum_transformers.explorer.server import start  # noqa: E402
from captum_transformers.tasks.recall.model import build_recall_model, recall_tokenizer  # noqa: E402
from captum_transformers.tasks.recall.task import recall_examples  # noqa: E402

TOKEN = "generation-test-token-0123456789"
HEADERS = {"X-Explorer-Token": TOKEN}
PROMPT, SECOND = (example.prompt for example in recall_examples(2, seed=0, split="test"))
PROMPT_TOKENS = len(recall_tokenizer()(PROMPT)["input_ids"])
MARKUP = '<img src=x onerror="window.__pwned=1">'


def recall_workspace() -> GenerationWorkspace:
    torch.manual_seed(0)
    return GenerationWorkspace(build_recall_model().eval(), recall_tokenizer(), name="recall Llama <b>random</b>",
                               samples=[PROMPT, SECOND], default_new_tokens=3)


@pytest.fixture(scope="module")
def workspace():
    return recall_workspace()


@pytest.fixture(scope="module")
def client(workspace):
    return TestClient(create_app(workspace, TOKEN), base_url="http://127.0.0.1")


def generated(client, body):
    job = client.post("/api/generate", json=body, headers=HEADERS)
    assert job.status_code == 200, job.text
    job = job.json()
    while job["state"] == "running":
        job = client.get(f"/api/jobs/{job['id']}", headers=HEADERS).json()
    return job


def test_session_offers_methods_samples_scores_and_bounds(client, workspace):
    session = client.get("/api/session", headers=HEADERS).json()
    assert session["page"] == "generation" and session["samples"][0] == PROMPT
    assert session["scores"] == ["logit", "log_prob", "contrast"]
    assert session["defaults"]["method"] == "attn-lrp" and "rollout" in [m["name"] for m in session["methods"]]
    assert session["bounds"] == {"max_prompt_tokens": workspace.max_prompt_tokens,
                                 "max_new_tokens": workspace.max_new_tokens, "work_budget": WORK_BUDGET}
    page = client.get("/")
    assert "generation.js" in page.text and "script-src" not in page.headers["content-security-policy"]
    assert page.headers["content-security-policy"].startswith("default-src 'self'")


def test_generate_explains_each_token_with_every_method_on_the_same_answer(client):
    job = generated(client, {"prompt": PROMPT, "max_new_tokens": 3, "score": "log_prob",
                             "methods": [{"name": "attn-lrp"}, {"name": "rollout", "arguments": {"head_fusion": "max"}}]})
    assert job["state"] == "done", job["error"]
    (lrp, rollout) = [entry["result"] for entry in job["results"]]
    assert [entry["method"] for entry in job["results"]] == ["attn-lrp", "rollout"]
    assert lrp["schema"] == "captum_transformers.generation/1" and lrp["signed"] and not rollout["signed"]
    assert lrp["output_tokens"] == rollout["output_tokens"] and len(lrp["output_tokens"]) == 3
    assert lrp["input_tokens"][0] == "<bos>" and len(lrp["input_tokens"]) == PROMPT_TOKENS
    assert lrp["token_attr"]["shape"] == [3, PROMPT_TOKENS] and lrp["target_attr"]["shape"] == [3, 3]
    assert lrp["score_kind"] == "log_prob" and lrp["request"]["prompt"] == PROMPT
    assert rollout["arguments"]["head_fusion"] == "max"
    assert any(value != 0 for row in lrp["token_attr"]["values"] for value in row)
    again = client.post("/api/generate", json={"prompt": PROMPT, "max_new_tokens": 3, "score": "log_prob",
                                               "methods": [{"name": "attn-lrp"}]}, headers=HEADERS).json()
    assert again["state"] == "done" and again["results"][0]["result"] == lrp  # cached: answered at once


def test_contrast_explains_the_difference_with_the_foil(client):
    foil = PROMPT.split()[0]  # a word of the vocabulary
    job = generated(client, {"prompt": PROMPT, "max_new_tokens": 2, "score": "contrast", "contrast": foil,
                             "methods": [{"name": "gradient-x-input"}]})
    assert job["state"] == "done", job["error"]
    result = job["results"][0]["result"]
    assert result["contrast_tokens"] == [foil] * len(result["output_tokens"]) and result["score_kind"] == "logit"
    plain = generated(client, {"prompt": PROMPT, "max_new_tokens": 2, "methods": [{"name": "gradient-x-input"}]})
    assert plain["results"][0]["result"]["scores"] != result["scores"]


@pytest.mark.parametrize("body, words", [
    ({"prompt": " ".join([PROMPT] * 12), "max_new_tokens": 2}, ["prompt has", "prompt tokens", "Shorten"]),
    ({"prompt": PROMPT, "max_new_tokens": 99}, ["max_new_tokens=99", "over the explorer's bound of", "or fewer"]),
    ({"prompt": PROMPT, "max_new_tokens": 0}, ["whole number from 1 to"]),
    ({"prompt": "  ", "max_new_tokens": 2}, ["empty"]),
    ({"prompt": PROMPT, "score": "contrast"}, ["needs a foil"]),
    ({"prompt": PROMPT, "score": "prob"}, ["logit, log_prob, contrast"]),
    ({"prompt": PROMPT, "max_new_tokens": 2, "methods": [{"name": "integrated-gradients",
                                                          "arguments": {"n_steps": WORK_BUDGET}}]},
     [f"{2 * WORK_BUDGET} explained steps", f"budget is {WORK_BUDGET}", "Lower max_new_tokens or n_steps"]),
])
def test_bounds_are_refused_with_a_message_naming_them(client, body, words):
    body = {"methods": [{"name": "attn-lrp"}], **body}
    answer = client.post("/api/generate", json=body, headers=HEADERS)
    assert answer.status_code == 400
    for word in words:
        assert word in answer.json()["error"]


def test_the_session_token_and_the_host_are_required(client):
    body = {"prompt": PROMPT, "methods": [{"name": "attn-lrp"}]}
    assert client.post("/api/generate", json=body).status_code == 403
    assert client.post("/api/generate", json=body, headers={"X-Explorer-Token": "wrong" * 8}).status_code == 403
    assert client.get("/api/session").status_code == 403
    foreign = client.post("/api/generate", json=body, headers={**HEADERS, "Host": "attacker.example"})
    assert foreign.status_code == 400


def test_cli_opens_the_generation_page_for_a_causal_lm_folder_and_refuses_mixes(tmp_path, capsys):
    from captum_transformers.cli import main
    from captum_transformers.explorer.pages.generation.sources import causal_lm_folder, loaded_generation_workspace

    recall_workspace().model.save_pretrained(tmp_path)
    recall_tokenizer().save_pretrained(tmp_path)
    assert causal_lm_folder(str(tmp_path)) and not causal_lm_folder(str(tmp_path / "none"))
    loaded = loaded_generation_workspace(str(tmp_path), [PROMPT])
    assert loaded.samples == [PROMPT] and 1 <= loaded.max_new_tokens <= 16
    assert loaded.check_request({"prompt": PROMPT}).max_new_tokens == loaded.default_new_tokens
    assert main(["explore", "--prompt", PROMPT, "--text", "a film", "--port", "0"]) == 2
    assert "takes none of --text" in capsys.readouterr().err
    assert main(["explore", "--generation", "--model", "/no/such/folder", "--port", "0"]) == 2
    assert "is not a folder whose config.json names a causal LM" in capsys.readouterr().err


def test_export_is_one_escaped_html_file_without_script(client):
    body = {"prompt": PROMPT + " " + MARKUP, "max_new_tokens": 2, "methods": [{"name": "raw-attention"}]}
    answer = client.post("/api/generate/export", json=body, headers=HEADERS)
    assert answer.status_code == 200, answer.text
    document = answer.json()["html"]
    assert "<script" not in document and "<img" not in document and "&lt;img src=x" in document
    assert "<h3>recall Llama &lt;b&gt;random&lt;/b&gt;: why each token" in document
    assert "<h3>raw-attention</h3>" in document and len(re.findall(r"<th class='row[^>]*>", document)) == 2


# -- the page in headless Chromium ---------------------------------------------------------------
CHROMIUM = os.environ.get("CAPTUM_EXPLORER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    if CHROMIUM is None:
        pytest.skip("no Chromium binary found (apt-get install -y chromium, or set CAPTUM_EXPLORER_CHROMIUM)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server():
    running = start(recall_workspace(), port=0, blocking=False, quiet=True)
    yield running
    running.stop()


PROMPT_COLOURS = "() => [...document.querySelectorAll('#prompt-view .token')].map((s) => s.style.backgroundColor)"


def expected_colours(values, earlier):
    """The page's colour of each prompt value of one row, scaled by the row's largest |value| over
    the prompt and the ``earlier`` output."""
    scale = max(abs(v) for v in list(values) + list(earlier)) or 1.0
    out = []
    for v in values:
        p, n = max(v / scale, 0.0), max(-v / scale, 0.0)
        rgb = [round(255 * (1 - 0.8 * n)), round(255 * (1 - 0.8 * (p + n))), round(255 * (1 - 0.8 * p))]
        out.append(f"rgb({rgb[0]}, {rgb[1]}, {rgb[2]})")
    return out


def test_typed_markup_generate_click_recolours_the_prompt(browser, server):
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("dialog", lambda dialog: (errors.append("dialog: " + dialog.message), dialog.dismiss()))
    page.goto(server.url)
    page.wait_for_selector("body[data-ready=yes]", timeout=30_000)
    assert page.locator("#samples button").all_text_contents() == [PROMPT, SECOND]
    assert page.locator("#model-name").text_content() == "recall Llama <b>random</b>"  # shown as text
    typed = f"{PROMPT} {MARKUP}"
    page.fill("#prompt", typed)
    page.select_option("#method", "attn-lrp")
    page.click("#generate")
    page.wait_for_selector("body[data-generated='1'] #output .chip", timeout=60_000)
    assert page.locator("#output .chip").count() == 3
    assert page.locator("#legend").get_attribute("data-signed") == "yes"
    prompt_tokens = page.locator("#prompt-view .token").all_text_contents()
    assert prompt_tokens[0] == "<bos>" and "<unk>" in prompt_tokens  # markup tokens, drawn as text
    before = page.evaluate(PROMPT_COLOURS)
    assert set(before) == {""}  # nothing explained before a click
    result = page.evaluate("() => state.result")
    for step in (1, 0):
        page.click(f"#output .chip[data-step='{step}']")
        page.wait_for_selector(f"body[data-step='{step}']")
        colours = page.evaluate(PROMPT_COLOURS)
        earlier = result["target_attr"]["values"][step][:step]
        assert colours == expected_colours(result["token_attr"]["values"][step], earlier)
        assert colours != before
        before = colours
    assert page.locator("#output-view .token.current").count() == 1
    assert page.locator("#output-view .token.later").count() == 2  # after step 0: tokens 1 and 2 not read yet
    # the typed markup stayed text: no element was made from it and nothing ran
    assert page.locator("#content img").count() == 0 and page.evaluate("() => window.__pwned") is None
    assert page.input_value("#prompt") == typed
    with page.expect_download() as download:
        page.click("#export-json")
    exported = json.loads(open(download.value.path()).read())
    assert exported["request"]["prompt"] == typed and exported["result"]["token_attr"] == result["token_attr"]
    with page.expect_download() as download:
        page.click("#export-html")
    document = open(download.value.path()).read()
    assert "<script" not in document and "&lt;img src=x onerror=" in document
    assert errors == []
    page.close()


def test_a_refused_prompt_shows_the_bound_on_the_page(browser, server):
    page = browser.new_page()
    page.goto(server.url)
    page.wait_for_selector("body[data-ready=yes]", timeout=30_000)
    assert page.locator("#contrast-box").is_hidden()  # the foil is asked for with score "contrast" only
    page.select_option("#score", "contrast")
    assert page.locator("#contrast-box").is_visible()
    page.select_option("#score", "logit")
    page.fill("#max-new-tokens", "99")
    page.click("#generate")
    page.wait_for_selector("#error:not([hidden])")
    assert "over the explorer's bound of" in page.locator("#error").text_content()
    page.close()


def test_page_has_no_inline_script_or_style_and_writes_no_html():
    from captum_transformers.explorer.http import static_dir

    page = static_dir().joinpath("generation.html").read_text()
    assert "<script>" not in page and "<style" not in page and "style=" not in page
    assert not re.search(r"\son[a-z]+\s*=", page, re.IGNORECASE) and not re.search(r'(src|href)="/', page)
    assert 'src="static/generation.js"' in page
    script = static_dir().joinpath("generation.js").read_text()
    assert "innerHTML" not in script and "outerHTML" not in script and "insertAdjacentHTML" not in script
    assert "eval(" not in script and "document.write" not in script
    assert not re.search(r"""api\(["'`]/""", script)


def test_an_encoder_decoder_is_refused_by_the_generation_page():
    import transformers
    from captum_transformers.errors import InputError
    from captum_transformers.explorer.pages.generation.workspace import GenerationWorkspace
    from captum_transformers.tasks.recall.model import recall_tokenizer

    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=70, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64))
    with pytest.raises(InputError, match="not a causal language model"):
        GenerationWorkspace(bart, recall_tokenizer())
