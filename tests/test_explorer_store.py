"""The explorer's store page: a corpus store's rows paged, searched and sorted by the API
(checked against the store read whole), a row's map exactly the stored one, bad queries
refused by name, an unfinished store refused; and in headless Chromium, the page lists rows,
searches, sorts, draws an image map, colours tokens with markup shown as text, and clicks
through a generation's answer tokens. The browser tests skip, with the reason, where no
Chromium binary or no Playwright package exists (as ``test_explorer_browser.py``)."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("uvicorn")
pytest.importorskip("pyarrow")
from starlette.testclient import TestClient  # noqa: E402

from captum_transformers.corpus import (digit_canvas_source, explain_dataset, explain_generations,  # noqa: E402
                                        read_store, recall_prompt_source, rows_to_maps, table_source)
from captum_transformers.corpus.store import record_path  # noqa: E402
from captum_transformers.errors import InputError  # noqa: E402
from captum_transformers.explorer.app import create_app  # noqa: E402
from captum_transformers.explorer.pages.store.index import StoreIndex  # noqa: E402
from captum_transformers.explorer.server import start  # noqa: E402

TOKEN = "store-page-test-token-0123456789"
HEADERS = {"X-Explorer-Token": TOKEN}
MARKUP = '<img src=x onerror="window.__pwned=1">'


@pytest.fixture(scope="module")
def digit_store(tmp_path_factory):
    from captum_transformers.tasks.digits.model import load_digit_model

    out = tmp_path_factory.mktemp("digits")
    explain_dataset(load_digit_model(), digit_canvas_source(60), "generic-attention", out, batch_size=16,
                    shard_rows=16, progress=False)
    return out


@pytest.fixture(scope="module")
def text_store(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        num_labels=2, attn_implementation="eager")).eval()
    folder = tmp_path_factory.mktemp("text")
    texts = ["a b c", "b c d e", "c a " + MARKUP, "d e", "e f a b c"]
    (folder / "rows.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    vocab = {w: i + 5 for i, w in enumerate("abcdef")}

    def prepare(values):
        tokens = [v.split() if MARKUP not in v else ["c", "a", MARKUP] for v in values]
        width = max(map(len, tokens))
        ids = torch.tensor([[vocab.get(w, 4) for w in t] + [0] * (width - len(t)) for t in tokens])
        mask = (torch.arange(width)[None] < torch.tensor([len(t) for t in tokens])[:, None]).long()
        return (ids,), {"attention_mask": mask}, tokens

    explain_dataset(model, table_source(folder / "rows.jsonl", prepare), "attn-lrp", folder / "store", batch_size=2,
                    shard_rows=2, progress=False)
    return folder / "store"


@pytest.fixture(scope="module")
def generation_store(tmp_path_factory):
    from captum_transformers.tasks.recall.model import load_recall_model

    model, tokenizer = load_recall_model()
    out = tmp_path_factory.mktemp("generation")
    explain_generations(model, tokenizer, recall_prompt_source(6), "attn-lrp", out, max_new_tokens=3, batch_size=3,
                        progress=False)
    return out


def _client(out):
    return TestClient(create_app(StoreIndex(out), TOKEN), base_url="http://127.0.0.1")


def test_queries_page_search_filter_and_sort_as_the_whole_table_says(digit_store):
    client, table = _client(digit_store), read_store(digit_store)
    session = client.get("/api/session", headers=HEADERS).json()
    assert (session["page"], session["kind"], session["rows"], session["state"]) == ("store", "classifier", 60, "ready")
    targets, scores = np.array(table.column("target").to_pylist()), np.array(table.column("score").to_pylist())
    assert session["targets"] == sorted(set(targets.tolist()))
    page = client.get("/api/rows", params={"sort": "score", "order": "desc", "offset": 5, "limit": 10},
                      headers=HEADERS).json()
    expected = np.lexsort((np.arange(60), -scores))[5:15]
    assert [row["row_id"] for row in page["rows"]] == expected.tolist() and page["matched"] == 60
    chosen = int(targets[0])
    page = client.get("/api/rows", params={"target": chosen, "limit": 500}, headers=HEADERS).json()
    assert [row["row_id"] for row in page["rows"]] == np.flatnonzero(targets == chosen).tolist()
    assert all(row["target"] == chosen for row in page["rows"])
    detail = client.get("/api/rows/7", headers=HEADERS).json()
    stored = rows_to_maps(table, [7])[0].double()
    while stored.dim() > 2:
        stored = stored.sum(0)
    assert torch.equal(torch.tensor(detail["map"]["grid"], dtype=torch.float64), stored)
    assert detail["map"]["shape"] == table.column("map_shape")[7].as_py()


def test_bad_queries_are_refused_by_name_and_the_token_is_required(digit_store):
    client = _client(digit_store)
    for params, message in (({"sort": "map"}, "sort='map': expected one of row_id, target, score, length"),
                            ({"order": "up"}, "order='up': expected asc or desc"),
                            ({"limit": 0}, "1 <= limit <= 500"), ({"offset": "x"}, "offset='x': expected an integer")):
        answer = client.get("/api/rows", params=params, headers=HEADERS)
        assert answer.status_code == 400 and message in answer.json()["error"], answer.json()
    assert client.get("/api/rows/60", headers=HEADERS).status_code == 400
    assert client.get("/api/rows").status_code in (401, 403)


def test_text_search_and_the_token_map(text_store):
    client, table = _client(text_store), read_store(text_store)
    page = client.get("/api/rows", params={"q": "B C"}, headers=HEADERS).json()
    assert [row["row_id"] for row in page["rows"]] == [0, 1, 4]
    detail = client.get("/api/rows/2", headers=HEADERS).json()
    assert detail["tokens"] == ["c", "a", MARKUP]
    assert detail["map"]["values"] == rows_to_maps(table, [2])[0].double().tolist()
    length = client.get("/api/rows", params={"sort": "length", "order": "desc", "limit": 2}, headers=HEADERS).json()
    assert [row["row_id"] for row in length["rows"]] == [4, 1]


def test_a_generation_store_lists_prompt_and_answer_and_gives_the_matrices(generation_store):
    client, table = _client(generation_store), read_store(generation_store)
    assert client.get("/api/session", headers=HEADERS).json()["targets"] == []
    first = client.get("/api/rows", headers=HEADERS).json()["rows"][0]
    assert first["text"] == f"{table.column('prompt')[0].as_py()} → {' '.join(table.column('output_tokens')[0].as_py())}"
    detail = client.get("/api/rows/0", headers=HEADERS).json()
    token_attr, target_attr = rows_to_maps(table, [0])[0]
    assert torch.equal(torch.tensor(detail["token_attr"]), token_attr.double())
    assert torch.equal(torch.tensor(detail["target_attr"]), target_attr.double())


def test_the_page_has_no_inline_script_or_style_and_writes_no_markup():
    import re

    from captum_transformers.explorer.http import static_dir

    page = static_dir().joinpath("store.html").read_text()
    assert "<script>" not in page and "<style" not in page and "style=" not in page
    assert not re.search(r"\son[a-z]+\s*=", page, re.IGNORECASE) and not re.search(r'(src|href)="/', page)
    for name in ("explorer-common.js", "store.js"):
        assert f'src="static/{name}"' in page
    script = static_dir().joinpath("store.js").read_text()
    assert "innerHTML" not in script and "outerHTML" not in script and "insertAdjacentHTML" not in script
    assert "eval(" not in script and "document.write" not in script and not re.search(r"""api\(["'`]/""", script)


def test_an_unfinished_store_is_refused_and_explore_takes_no_model_with_it(digit_store, tmp_path, capsys):
    from captum_transformers.cli import main

    shutil.copytree(digit_store, tmp_path / "cut")
    record_path(tmp_path / "cut", 1).unlink()
    with pytest.raises(InputError, match=r"is not finished: 1 of 4 shards"):
        StoreIndex(tmp_path / "cut")
    with pytest.raises(InputError, match="not a corpus store"):
        StoreIndex(tmp_path)
    assert main(["explore", "--store", str(digit_store), "--model", "x", "--port", "0"]) == 2
    assert "--store opens a corpus store, which takes none of --model" in capsys.readouterr().err


sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
CHROMIUM = os.environ.get("CAPTUM_EXPLORER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary found (apt-get install -y chromium, "
                                                             "or set CAPTUM_EXPLORER_CHROMIUM)")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


def _page(browser, out):
    running = start(StoreIndex(out), port=0, blocking=False, quiet=True)
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto(running.url)
    page.wait_for_selector("body[data-ready=yes]", timeout=30_000)
    return running, page, errors


@needs_chromium
def test_the_page_lists_searches_sorts_and_draws_an_image_map(browser, digit_store, tmp_path):
    running, page, errors = _page(browser, digit_store)
    try:
        assert page.locator("#rows tbody tr").count() == 50
        assert "rows 1–50 of 60 matching" in page.locator("#page-info").text_content()
        page.click("#next")
        page.wait_for_function("() => document.querySelectorAll('#rows tbody tr').length === 10")
        scores = read_store(digit_store).column("score").to_pylist()
        best = int(np.argmax(scores))
        page.select_option("#sort", "score")
        page.click("#order")
        page.wait_for_function("(best) => { const row = document.querySelector('#rows tbody tr'); "
                               "return row && row.dataset.row === String(best) && "
                               "document.querySelector('#page-info').textContent.startsWith('rows 1–50'); }", arg=best)
        assert page.locator("#order").text_content() == "descending"
        page.locator("#rows tbody tr").first.click()
        page.wait_for_selector("#map-canvas")
        spread = page.evaluate("""() => { const c = document.getElementById('map-canvas');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let lo = 255, hi = 0;
            for (let i = 0; i < d.length; i += 4) { lo = Math.min(lo, d[i + 1]); hi = Math.max(hi, d[i + 1]); }
            return hi - lo; }""")
        assert spread > 50  # a drawn map, not a blank canvas
        page.screenshot(path=str(os.environ.get("STORE_SCREENSHOTS", tmp_path)) + "/store-digits.png")
        assert errors == []
    finally:
        page.close()
        running.stop()


@needs_chromium
def test_tokens_show_markup_as_text_and_a_generation_answer_is_clicked_through(browser, text_store,
                                                                               generation_store):
    running, page, errors = _page(browser, text_store)
    try:
        page.fill("#search", "onerror")
        page.wait_for_function("() => document.querySelectorAll('#rows tbody tr').length === 1")
        page.locator("#rows tbody tr").first.click()
        page.wait_for_selector(".tokens span")
        assert page.locator(".tokens span").all_text_contents() == ["c", "a", MARKUP]
        assert page.evaluate("window.__pwned === undefined") and page.locator("#detail img").count() == 0
        assert errors == []
    finally:
        page.close()
        running.stop()
    running, page, errors = _page(browser, generation_store)
    try:
        page.locator("#rows tbody tr").nth(1).click()
        page.wait_for_selector(".outputs button")
        table = read_store(generation_store)
        answer = table.column("output_tokens")[1].as_py()
        assert page.locator(".outputs button").all_text_contents() == answer
        before = page.locator(".tokens").first.evaluate("(n) => [...n.children].map((s) => s.style.background)")
        page.locator(".outputs button").nth(1).click()
        page.wait_for_selector(".outputs button.selected[data-step='1']")
        after = page.locator(".tokens").first.evaluate("(n) => [...n.children].map((s) => s.style.background)")
        assert before != after and len(after) == len(table.column("input_tokens")[1].as_py())
        if os.environ.get("STORE_SCREENSHOTS"):
            page.screenshot(path=os.environ["STORE_SCREENSHOTS"] + "/store-generation.png")
        assert errors == []
    finally:
        page.close()
        running.stop()
