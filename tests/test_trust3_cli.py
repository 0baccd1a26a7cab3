"""The command line's and the explorer's trust boundaries (issue trust-3): an ``--out`` folder is
claimed by exactly one run (items 1), a checkpoint is never unpickled as code unless asked
(11), the explorer's Host check takes exactly one allowed host[:port] (12), a lone surrogate in
a prompt is a 400 (14), torchao's import noise stays off the CLI's output (17), and the page's
polls while the model loads get a 200 saying so (20)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from captum_transformers.cli import main
from captum_transformers.cli import output_folder
from captum_transformers.cli.output_folder import claimed_output_folder
from captum_transformers.errors import InputError
from captum_transformers.model_loading import load_model

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


# -- 1. --out is claimed atomically ---------------------------------------------------------

def _racing_claims(monkeypatch, folder: Path):
    """Two threads claim ``folder`` at once, each held at its first ``mkdir`` of ``folder``
    until both got there (both have checked for an earlier run by then), and each keeps its
    claim until both have one."""
    at_mkdir, both_claimed = threading.Barrier(2, timeout=10), threading.Barrier(2, timeout=10)
    original, waited = Path.mkdir, set()

    def mkdir(self, *args, **kwargs):
        if self == folder and threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            at_mkdir.wait()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    got, errors = [], []

    def claim():
        try:
            with claimed_output_folder(str(folder), "explanations.png", "explain") as out:
                got.append(out)
                both_claimed.wait()
                (out / "explanations.png").write_bytes(b"png")
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=claim) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not errors, errors
    return got


@pytest.mark.parametrize("made_by_user", [False, True])
def test_two_runs_racing_for_one_out_get_two_folders(tmp_path, monkeypatch, capsys, made_by_user):
    folder = tmp_path / "out"
    if made_by_user:  # an empty folder made on purpose: exactly one run gets it
        folder.mkdir()
    got = _racing_claims(monkeypatch, folder)
    assert sorted(got) == [folder, tmp_path / "out-2"]
    assert (folder / "explanations.png").exists() and (tmp_path / "out-2" / "explanations.png").exists()
    assert "writing to" in capsys.readouterr().err


def test_concurrent_processes_each_get_their_own_folder(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from captum_transformers.cli.output_folder import claimed_output_folder
        go = Path({str(tmp_path / "go")!r})
        Path({str(tmp_path)!r}, "ready-" + sys.argv[1]).touch()
        while not go.exists():
            time.sleep(0.005)
        with claimed_output_folder({str(tmp_path / "out")!r}, "explanations.png", "explain") as out:
            (out / ("run-" + sys.argv[1])).touch()
            time.sleep(0.3)
            (out / "explanations.png").touch()
    """)
    runs = [subprocess.Popen([PYTHON, "-c", script, str(index)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for index in range(3)]
    deadline = time.time() + 120
    while len(list(tmp_path.glob("ready-*"))) < 3 and time.time() < deadline:
        time.sleep(0.02)
    (tmp_path / "go").touch()
    for run in runs:
        assert run.wait(120) == 0, run.stderr.read()
    folders = sorted(path.parent.name for path in tmp_path.glob("out*/run-*"))
    assert folders == ["out", "out-2", "out-3"]
    assert not list(tmp_path.glob(f"out*/{output_folder.CLAIM_FILE}"))  # released at the end


def test_a_folder_claimed_by_another_run_is_not_shared_and_the_claim_is_released(tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / output_folder.CLAIM_FILE).write_text("12345 explain\n")  # a run still writing there
    with claimed_output_folder(str(folder), "explanations.png", "explain") as out:
        assert out == tmp_path / "out-2"
        assert (out / output_folder.CLAIM_FILE).exists()
    err = capsys.readouterr().err
    assert "in use by another run" in err and output_folder.CLAIM_FILE in err and len(err.splitlines()) == 1
    assert list(out.iterdir()) == []  # the claim is gone with the run


def test_a_failed_run_leaves_no_folder_and_no_claim(tmp_path):
    with pytest.raises(RuntimeError):
        with claimed_output_folder(str(tmp_path / "a" / "out"), "explanations.png", "explain"):
            raise RuntimeError("the model could not be loaded")
    assert list(tmp_path.iterdir()) == []


# -- 11. checkpoints are read with weights_only ---------------------------------------------

class _RunsCode:
    """Unpickling this runs ``exec``: it writes the flag file."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        return exec, (f"open({str(self.flag)!r}, 'w').write('ran')",)


def test_a_crafted_pickle_does_not_run_by_default(tmp_path, capsys):
    flag, path = tmp_path / "flag", tmp_path / "model.pt"
    torch.save(_RunsCode(flag), path)
    with pytest.raises(InputError, match="--trust-pickle") as refused:
        load_model(str(path))
    assert not flag.exists()
    message = str(refused.value)
    assert "object exec," in message and "state_dict" in message and "run code" in message
    assert main(["explain", "--model", str(path), "--image", "x.png", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert not flag.exists() and "--trust-pickle" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()
    # asked for, on purpose: the file's code runs (what the flag's help warns of)
    with pytest.raises(InputError, match="holds a NoneType"):
        load_model(str(path), trust_pickle=True)
    assert flag.read_text() == "ran"


def test_a_whole_module_checkpoint_needs_the_flag(tmp_path):
    from torch import nn

    path = tmp_path / "module.pt"
    torch.save(nn.Sequential(nn.Flatten(), nn.Linear(3 * 224 * 224, 2)), path)
    with pytest.raises(InputError, match="torch.nn.modules.container.Sequential.*--trust-pickle"):
        load_model(str(path))
    assert isinstance(load_model(str(path), trust_pickle=True).model, nn.Sequential)
    state = tmp_path / "state.pt"
    torch.save({"weight": torch.zeros(2)}, state)
    with pytest.raises(InputError, match="--arch"):  # a state dict needs no flag
        load_model(str(state))


def test_the_flag_is_offered_and_its_help_says_the_file_is_code(capsys):
    for command in ("explain", "explore"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--trust-pickle" in text and "runs as code" in text


# -- 12. the Host header --------------------------------------------------------------------

def _host_answer(host_headers, allowed=("127.0.0.1", "localhost", "[::1]", "::1")) -> int:
    from captum_transformers.explorer.security import SecurityMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware = SecurityMiddleware(app, "a-long-random-session-token", allowed)
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "headers": [(b"host", h.encode("latin-1"))
                                                                       for h in host_headers]}
    asyncio.run(middleware(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8765", "localhost:1", "LOCALHOST:65535", "[::1]:8765",
                                  "[::1]"])
def test_one_allowed_host_with_or_without_a_port_is_answered(host):
    assert _host_answer([host]) == 200


@pytest.mark.parametrize("host", ["127.0.0.1:8765, evil.com", "127.0.0.1,evil.com", "127.0.0.1 evil.com",
                                  " 127.0.0.1", "127.0.0.1 ", "127.0.0.1\t", "127.0.0.1 :8765", "127.0.0.1: 8765",
                                  "user@127.0.0.1", "127.0.0.1@evil.com", "evil.com#@127.0.0.1",
                                  "127.0.0.1:abc", "127.0.0.1:", "127.0.0.1:99999", "127.0.0.1:+80",
                                  "127.0.0.1:8765:8765", "127.0.0.1/evil", "127.0.0.1.", "localhost.", "::1",
                                  "[::1]evil", "[::1]:", "[::1", "", "evil.com", "127.0.0.1\x00"])
def test_a_host_header_that_is_not_exactly_one_allowed_host_is_refused(host):
    assert _host_answer([host]) == 400


def test_two_host_headers_are_refused():
    assert _host_answer(["127.0.0.1", "127.0.0.1"]) == 400
    assert _host_answer(["evil.com", "127.0.0.1"]) == 400
    assert _host_answer([]) == 400


# -- 14 and 20: the generation page's prompt, and both pages while the model loads ----------

TOKEN = "trust3-test-token-0123456789"
HEADERS = {"X-Explorer-Token": TOKEN}


def _generation_workspace():
    from captum_transformers.explorer.pages.generation.workspace import GenerationWorkspace
    from captum_transformers.tasks.recall.model import build_recall_model, recall_tokenizer

    torch.manual_seed(0)
    return GenerationWorkspace(build_recall_model().eval(), recall_tokenizer(), name="recall Llama",
                               default_new_tokens=2)


@pytest.mark.parametrize("field", ["prompt", "contrast"])
def test_a_lone_surrogate_in_the_prompt_is_a_400_naming_it(field):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from captum_transformers.explorer.app import create_app

    client = TestClient(create_app(_generation_workspace(), TOKEN), base_url="http://127.0.0.1",
                        raise_server_exceptions=False)
    body = {"prompt": "a red fox ; b tan cat ? b", "max_new_tokens": 2, "methods": [{"name": "attn-lrp"}],
            "score": "contrast", "contrast": "cat"}
    raw = json.dumps(body).replace(json.dumps(body[field]), json.dumps(body[field])[:-1] + ' \\ud800"')
    answer = client.post("/api/generate", content=raw.encode(), headers={**HEADERS, "content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert "surrogate" in error and f'"{field}"' in error and "\\ud800" in error
    for path in ("/api/generate/export",):
        assert client.post(path, content=raw.encode(),
                           headers={**HEADERS, "content-type": "application/json"}).status_code == 400
    # a pair written as two escapes is one character, and fine
    paired = json.dumps(body).replace('"cat"', '"\\ud83d\\ude00"')
    assert client.post("/api/generate", content=paired.encode(),
                       headers={**HEADERS, "content-type": "application/json"}).status_code != 500


def test_check_request_refuses_a_lone_surrogate_from_python_too():
    workspace = _generation_workspace()
    with pytest.raises(InputError, match="surrogate"):
        workspace.check_request({"prompt": "a \ud800 b"})


def _loading_client(page: str):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from captum_transformers.explorer.app import create_app
    from captum_transformers.explorer.loading import LoadingWorkspace
    from captum_transformers.explorer.pages.generation.sources import LoadingGenerationWorkspace

    gate = threading.Event()
    if page == "classifier":
        from explorer_workspaces import image_workspace

        loading = LoadingWorkspace(lambda: gate.wait(20) and image_workspace())
    else:
        loading = LoadingGenerationWorkspace(lambda: gate.wait(20) and _generation_workspace())
    client = TestClient(create_app(loading, TOKEN, allowed_hosts=("testserver",), warm=False))
    return client, gate, loading


@pytest.mark.parametrize("page", ["classifier", "generation"])
def test_the_session_poll_while_the_model_loads_is_a_200_saying_so(page):
    client, gate, loading = _loading_client(page)
    try:
        waiting = client.get("/api/session", headers=HEADERS)
        assert waiting.status_code == 200, waiting.text
        payload = waiting.json()
        assert payload["state"] == "loading" and payload["seconds"] >= 0 and "loading" in payload["message"]
        # the routes the page calls only once the session is there still say it is not ready
        assert client.get("/api/jobs/job-1", headers=HEADERS).status_code == 503
    finally:
        gate.set()
    assert loading.wait(20)
    ready = client.get("/api/session", headers=HEADERS)
    assert ready.status_code == 200 and ready.json()["state"] == "ready" and ready.json()["model"]


def test_the_pages_show_the_loading_state_and_keep_polling():
    from captum_transformers.explorer.http import static_dir

    for script in ("explorer.js", "generation.js"):
        text = static_dir().joinpath(script).read_text()
        assert 'payload.state !== "loading"' in text and "503" not in text


# -- 17. the CLI prints its error only ------------------------------------------------------

def test_a_cli_error_is_all_that_stderr_holds(tmp_path):
    """``explain`` on a model folder without weights imports transformers' model classes, and
    with them torchao (where installed): its import warnings must not reach the user."""
    transformers = pytest.importorskip("transformers")
    transformers.ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                           image_size=8, patch_size=4, num_labels=2).save_pretrained(tmp_path / "config_only")
    ran = subprocess.run([PYTHON, "-m", "captum_transformers", "explain", "--model", str(tmp_path / "config_only"),
                          "--image", "x.png", "--out", str(tmp_path / "out")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert ran.returncode == 2
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("captum-transformers explain: error: "), ran.stderr


def test_the_filter_drops_only_torchaos_enum_registration_warning():
    import enum
    import logging

    from captum_transformers.cli import torchao_import_noise_held

    theirs, ours = enum.Enum("KernelPreference", "AUTO"), enum.Enum("Ours", "A")
    theirs.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    template = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
                "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future "
                "release.")
    logger = logging.getLogger("torch.utils._pytree")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage().split(" is an")[0])

    handler = Keep()
    logger.addHandler(handler)
    try:
        with torchao_import_noise_held():
            logger.warning(template, theirs)
            logger.warning(template, ours)
            logger.warning("something else")
        logger.warning(template, theirs)
    finally:
        logger.removeHandler(handler)
    assert seen == [str(ours), "something else", str(theirs)]


def test_an_allowed_host_that_is_not_one_name_is_refused_before_anything_binds():
    pytest.importorskip("uvicorn")
    from captum_transformers.explorer.server import start

    for extra in ("proxy.example, evil.com", "user@proxy.example", "proxy example"):
        with pytest.raises(InputError, match="--allowed-host"):
            start(None, port=0, blocking=False, quiet=True, extra_hosts=[extra])
