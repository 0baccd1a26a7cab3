"""The built-in digit captioner: tokenizer, reading order, ViT transfer, shipped weights and their record."""
from __future__ import annotations

import math

import pytest
import torch
from benchmark_scripts import load_benchmark_script

pytest.importorskip("transformers")

from captum_transformers.errors import InputError
from captum_transformers.tasks.captioner import model as dc
from captum_transformers.tasks.digits.canvas import DigitCanvasSet, digit_canvases, normalize


@pytest.fixture(scope="module")
def shipped():
    return dc.load_digit_captioner()


def test_prompt_holds_one_image_token_per_patch_after_bos():
    tokenizer = dc.captioner_tokenizer()
    inputs = dc.caption_inputs(tokenizer, torch.zeros(2, 3, 32, 32))
    ids = inputs["input_ids"]
    assert ids.shape == (2, 1 + dc.IMAGE_TOKENS + 1)
    assert ids[0, 0].item() == dc.VOCABULARY[dc.BOS] and ids[0, -1].item() == dc.VOCABULARY[dc.CUE]
    assert (ids == dc.VOCABULARY[dc.IMAGE]).sum(-1).tolist() == [64, 64]
    assert tokenizer.decode(dc.answer_ids(torch.tensor([[3, 7]]))[0], skip_special_tokens=True) == "3 7"


def _boxes(first_box, second_box):
    """Two-digit set with one canvas whose masks fill the given (rows, cols) slices."""
    masks = torch.zeros(1, 2, 32, 32, dtype=torch.bool)
    masks[0, 0][first_box] = True
    masks[0, 1][second_box] = True
    return DigitCanvasSet(torch.zeros(1, 3, 32, 32), masks, torch.tensor([[4, 9]]), torch.tensor([[0, 1]]))


@pytest.mark.parametrize("first_box, second_box, order", [
    ((slice(8, 20), slice(18, 30)), (slice(6, 22), slice(2, 14)), [1, 0]),  # side by side, second mask left
    ((slice(8, 20), slice(2, 14)), (slice(6, 22), slice(18, 30)), [0, 1]),
    ((slice(17, 30), slice(5, 19)), (slice(1, 15), slice(3, 17)), [1, 0]),  # stacked, second mask on top
])
def test_reading_order_is_left_to_right_then_top_to_bottom(first_box, second_box, order):
    data = _boxes(first_box, second_box)
    assert dc.reading_order_labels(data)[0].tolist() == order
    labels, masks = dc.caption_targets(data)
    assert labels[0].tolist() == [[4, 9][i] for i in order]
    assert torch.equal(masks[0, 0], data.masks[0, order[0]])


def test_reading_order_of_generated_canvases_puts_the_first_mask_left_or_on_top():
    data = digit_canvases("test", "two", n=64, seed=2)
    _, masks = dc.caption_targets(data)
    cols = torch.arange(32).float()
    centre = [(m.float().sum(-2) * cols).sum(-1) / m.float().sum((-1, -2)) for m in (masks[:, 0], masks[:, 1])]
    rows = [(m.float().sum(-1) * cols).sum(-1) / m.float().sum((-1, -2)) for m in (masks[:, 0], masks[:, 1])]
    side = (centre[1] - centre[0]).abs() > (rows[1] - rows[0]).abs()
    assert bool((centre[0] < centre[1])[side].all()) and bool((rows[0] < rows[1])[~side].all())
    assert 0 < int(side.sum()) < 64  # both layouts occur


def test_reading_order_refuses_one_digit_canvases():
    with pytest.raises(InputError, match="two-digit canvases"):
        dc.reading_order_labels(digit_canvases("test", "one", n=2))


def test_vision_tower_copy_is_the_digit_vit_but_for_the_pre_norm():
    """With CLIP's pre-norm bypassed, the copied tower computes the timm ViT's features exactly."""
    from captum_transformers.tasks.digits.model import load_digit_model
    vit = load_digit_model()
    model = dc.build_digit_captioner().eval()
    dc.vision_tower_from_digit_vit(model, vit)
    tower = model.model.vision_tower
    tower.pre_layrnorm = torch.nn.Identity()
    x = normalize(digit_canvases("val", "two", n=4).images)
    with torch.no_grad():
        expected = vit.forward_features(x)
        got = tower.post_layernorm(tower(x, output_hidden_states=True).hidden_states[-1])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_shipped_captioner_writes_both_digits_in_reading_order(shipped):
    model, tokenizer = shipped
    assert type(model).__name__ == "LlavaForConditionalGeneration" and not model.training
    data = digit_canvases("test", "two", n=64, seed=5)
    scores = dc.caption_accuracy(model, tokenizer, data)
    assert scores["canvases"] == 64 and scores["digit_accuracy"] >= 0.85
    inputs = dc.caption_inputs(tokenizer, data.images[:2])
    out = model.generate(**inputs)
    text = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert all(len(caption.split()) == 2 for caption in text)


def test_the_record_matches_a_re_evaluation_on_a_slice(shipped):
    model, tokenizer = shipped
    record = dc.digit_captioner_record()
    assert record["test_canvases"] >= 1000 and record["test_digit_accuracy"] >= 0.9
    assert record["model_config"] == {"vision": dc.VISION_CONFIG, "text": dc.TEXT_CONFIG, "llava": dc.LLAVA_CONFIG}
    assert record["command"].startswith(dc.RETRAIN_COMMAND)
    # The same canvases as the record's first 128 (generation depends on n, so slice the full set).
    data = digit_canvases("test", "two", n=record["test_canvases"], seed=record["test_canvas_seed"])[:128]
    scores = dc.caption_accuracy(model, tokenizer, data)
    # Greedy generation from the shipped weights is deterministic: the slice's exact figures
    # (computed once from the shipped weights: 249 of 256 digits, 121 of 128 captions).
    assert scores == {"digit_accuracy": 249 / 256, "exact_caption": 121 / 128, "canvases": 128}
    # And they sit within sampling noise of the full record's.
    p, n = record["test_digit_accuracy"], 2 * len(data)
    assert abs(scores["digit_accuracy"] - p) <= 4 * math.sqrt(p * (1 - p) / n) + 2 / n


def test_shipped_file_is_small_and_float16():
    path = dc.weights_path()
    assert path.is_file() and len(path.read_bytes()) < 3 * 2 ** 20
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert {t.dtype for t in state.values() if t.is_floating_point()} == {torch.float16}


def test_training_is_seeded():
    from captum_transformers.tasks.captioner.train import train
    first, second = (train(steps=2, evaluate_n=16) for _ in range(2))
    assert first["losses"] == second["losses"]
    assert all(torch.equal(a, b) for a, b in zip(first["model"].state_dict().values(),
                                                 second["model"].state_dict().values()))
    assert sorted(first["test"]) == ["canvases", "digit_accuracy", "exact_caption"]


def _benchmark():
    return load_benchmark_script("caption_mask_share.py", "caption_mask_share_benchmark")


def test_mask_share_counts_positive_mass_on_the_written_digit_against_both():
    bench = _benchmark()
    masks = torch.zeros(1, 2, 4, 4, dtype=torch.bool)
    masks[0, 0, :, :2] = True
    masks[0, 1, :, 2:] = True
    maps = torch.zeros(1, 2, 4, 4)
    maps[0, 0, :, :2] = 3.0   # step 1: all positive mass on its own digit, negative mass elsewhere ignored
    maps[0, 0, :, 2:] = -5.0
    maps[0, 1, :, :2] = 1.0   # step 2: one part on the other digit, three on its own
    maps[0, 1, :, 2:] = 3.0
    shares = bench.mask_shares(maps, masks)
    torch.testing.assert_close(shares, torch.tensor([[1.0, 0.75]], dtype=torch.float64))
    assert torch.isnan(bench.mask_shares(-maps.abs(), masks)).all()  # no positive mass: no share


def test_on_digit_mass_counts_mass_off_both_digits_against_the_map():
    bench = _benchmark()
    masks = torch.zeros(1, 2, 4, 4, dtype=torch.bool)
    masks[0, 0, :2, :2] = True
    masks[0, 1, :2, 2:] = True
    maps = torch.zeros(1, 2, 4, 4)
    maps[0, 0, :2, :2] = 1.0   # step 1: 4 on its own digit, 12 on the background (bottom half)
    maps[0, 0, 2:] = 1.5
    maps[0, 1, :2, 2:] = 2.0   # step 2: all on its own digit; negative mass ignored
    maps[0, 1, 2:] = -4.0
    torch.testing.assert_close(bench.on_digit_mass(maps, masks), torch.tensor([[0.25, 1.0]], dtype=torch.float64))
    # The share ignores the background: step 1 scores 1 there.
    torch.testing.assert_close(bench.mask_shares(maps, masks), torch.tensor([[1.0, 1.0]], dtype=torch.float64))
    assert torch.isnan(bench.on_digit_mass(-maps.abs(), masks)).all()


def test_a_map_identical_at_both_steps_has_mean_share_exactly_one_half():
    bench = _benchmark()
    generator = torch.Generator().manual_seed(0)
    masks = torch.zeros(5, 2, 6, 6, dtype=torch.bool)
    masks[:, 0, :, :3] = True
    masks[:, 1, :, 3:] = True
    same = torch.rand(5, 1, 6, 6, generator=generator).expand(5, 2, 6, 6)
    torch.testing.assert_close(bench.per_canvas(bench.mask_shares(same, masks)),
                               torch.full((5,), 0.5, dtype=torch.float64))


def test_no_mass_digits_count_zero_in_share_zero_and_canvases_are_the_unit():
    bench = _benchmark()
    shares = torch.tensor([[1.0, float("nan")], [0.6, 0.4]])
    torch.testing.assert_close(bench.per_canvas(shares), torch.tensor([1.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(bench.per_canvas(shares, missing_as_zero=True),
                               torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert torch.isnan(bench.per_canvas(torch.full((1, 2), float("nan")))).all()


def test_rows_with_many_no_mass_digits_are_marked_and_ranked_last():
    bench = _benchmark()
    from captum_transformers.tasks.bootstrap import bootstrap_interval

    def row(on_digit, no_mass):
        interval = bootstrap_interval([on_digit])
        return {"interval": interval, "share_zero": interval, "on_digit": interval, "digits": 20 - no_mass,
                "no_mass": no_mass, "comparable": no_mass <= bench.NOT_COMPARABLE * 20, "seconds": 0.0}

    rows = {"sparse": row(0.9, 3), "dense": row(0.5, 2), "refusing": {"refused": "no"}}
    lines = bench.format_rows(rows).splitlines()
    assert [line.split()[0] for line in lines] == ["dense", "sparse", "refusing"]
    assert lines[1].startswith("sparse *") and not lines[0].startswith("dense *")
    assert bench.best_method(rows) == "dense"


def test_benchmark_prints_a_row_per_method_and_captum_ig(capsys):
    bench = _benchmark()
    threads = torch.get_num_threads()
    assert bench.main(["--n", "8", "--methods", "attn-lrp", "raw-attention"]) == 0
    assert torch.get_num_threads() == threads
    printed = capsys.readouterr().out
    for name in ("attn-lrp", "raw-attention", bench.CAPTUM_IG):
        line = next(row for row in printed.splitlines() if row.startswith(name))
        assert line.count("[") == 3 and "refused" not in line
    assert "python benchmarks/caption_mask_share.py --n 8" in printed
