"""The DigitCanvas Swin: shipped weights, their record, training command and benchmark tasks."""
from __future__ import annotations

import pytest

pytest.importorskip("timm")

from captum_transformers import GenericAttention, get_adapter  # noqa: E402
from captum_transformers.tasks.digits import swin as digit_swin
from captum_transformers.tasks.digits.canvas import digit_canvases, normalize  # noqa: E402
from captum_transformers.tasks.shipped_weights import asset  # noqa: E402
from captum_transformers.tasks.runner import run_benchmark  # noqa: E402
from captum_transformers.tasks.digits.train import top1_accuracy, train  # noqa: E402


def test_shipped_weights_are_small_recorded_and_accurate():
    import json

    weights = asset(digit_swin.WEIGHTS_FILE)
    assert weights.is_file() and len(weights.read_bytes()) < 1_000_000
    record = json.loads(asset(digit_swin.RECORD_FILE).read_text())
    assert "--model swin" in record["command"]
    model = digit_swin.load_digit_swin()
    assert get_adapter(model).name == "timm_swin"
    # The record's test accuracy, on the first 100 of its canvases (same seed): within sampling noise.
    accuracy = top1_accuracy(model, digit_canvases("test", "one", n=100, seed=record["test_canvas_seed"]))
    assert accuracy >= record["test_top1_one_digit"] - 0.1, (accuracy, record["test_top1_one_digit"])


def test_explanations_of_the_trained_swin_sit_on_the_digit():
    model = digit_swin.load_digit_swin()
    data = digit_canvases("test", "one", n=16, seed=0)
    maps = GenericAttention(model).attribute(normalize(data.images), target=data.labels).sum(1)
    mask = data.masks.float()
    on = (maps * mask).sum((1, 2)) / mask.sum((1, 2))
    off = (maps * (1 - mask)).sum((1, 2)) / (1 - mask).sum((1, 2))
    assert (on > off).float().mean() >= 0.9


@pytest.mark.parametrize("task", ["digits-swin", "digits-two-swin"])
def test_benchmark_tasks_run_on_the_swin(task):
    report = run_benchmark(task, methods=["rollout", "generic-attention"], limit=4, batch_size=4)
    assert report.task == task and report.examples == 4 and len(report.rows) >= 2


def test_training_command_builds_the_swin():
    result = train(epochs=1, canvases_per_epoch=64, max_steps=1, evaluate_n=16, architecture="swin")
    assert type(result["model"]).__name__ == "SwinTransformer" and len(result["losses"]) == 1
