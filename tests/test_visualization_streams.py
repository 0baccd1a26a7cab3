"""Multi-stream views (CLIP, LXMERT, DETR) and perturbation curves from results.json."""
from __future__ import annotations

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation import CurveResult, write_json
from captum_transformers.evaluation.results import SegmentationResult
from captum_transformers.methods.detection import Detections
from captum_transformers.visualization import (CurvePlot, curve_plots, detection_view, text_image_view,
                                               text_regions_view)

pytest.importorskip("matplotlib")
PIL = pytest.importorskip("PIL.Image")
XSS = "<img src=x onerror=alert(1)>"


def test_clip_view_puts_each_examples_tokens_beside_its_image_with_separate_scales(tmp_path):
    tokens = [["<s>", "a", XSS, "</s>"], ["<s>", "dog", "</s>", "<pad>"]]
    text = torch.tensor([[0.0, 1.0, -3.0, 0.1], [0.0, 2.0, 0.1, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    images, maps = torch.rand(2, 3, 16, 16), torch.rand(2, 3, 16, 16) * 100
    view = text_image_view(tokens, text, images, maps, attention_mask=mask, special_tokens={"<s>", "</s>"},
                           patch_grid=(4, 4), titles=[XSS, "two"])
    (words, overlay), _ = view.rows
    assert words.lines[0].tokens == tokens[0] and view.rows[1][0].lines[0].tokens == ["<s>", "dog", "</s>"]
    assert words.scales["text"][0].limit == 3.0 and overlay.scale.limit > 100  # one scale per stream
    page = view.to_html(standalone=True)
    assert XSS not in page and page.count("<table") >= 3
    with PIL.open(view.save(tmp_path / "clip.png")) as drawn:
        assert drawn.width > 300
    assert "<svg" in view.save(tmp_path / "clip.svg").read_text()


def test_lxmert_view_draws_regions_as_a_strip_and_as_boxes_in_their_colour():
    tokens = [["[CLS]", "what", "[SEP]"]]
    regions = torch.tensor([[0.0, 2.0, -2.0]])
    boxes = torch.tensor([[[0.0, 0.0, 0.5, 0.5], [0.5, 0.5, 1.0, 1.0], [0.0, 0.5, 0.5, 1.0]]])
    view = text_regions_view(tokens, torch.tensor([[0.0, 1.0, 0.0]]), regions, images=torch.full((1, 3, 20, 20), 0.5),
                             boxes=boxes, special_tokens={"[CLS]", "[SEP]"})
    text, strip, drawn = view.rows[0]
    assert strip.lines[0].tokens == ["region 0", "region 1", "region 2"]
    r, g, b = (int(v) for v in drawn.rgb[-1, -1])   # region 1's corner: positive, red
    assert r > g + 60
    r, g, b = (int(v) for v in drawn.rgb[-1, 0])            # region 2's corner: negative, blue
    assert b > r + 60
    with pytest.raises(InputError, match="both images and boxes"):
        text_regions_view(tokens, torch.zeros(1, 3), regions, boxes=boxes)
    with pytest.raises(InputError, match="has 2 rows; expected 1"):
        text_regions_view(tokens, torch.zeros(2, 3), regions)


def test_detr_view_groups_detections_by_image_with_their_boxes_and_class_names():
    found = Detections(maps=torch.rand(3, 3, 16, 12), image_index=torch.tensor([0, 0, 1]),
                       query_index=torch.tensor([2, 5, 1]), label=torch.tensor([1, 0, 1]),
                       score=torch.tensor([0.9, 0.8, 0.95]))
    pred_boxes = torch.tensor([[0.5, 0.5, 0.5, 0.5]]).expand(2, 6, 4)
    view = detection_view(torch.rand(2, 3, 16, 12), found, pred_boxes=pred_boxes, class_names=["cat", XSS])
    assert [len(row) for row in view.rows] == [2, 1] and view.titles == ["image 0", "image 1"]
    first = view.rows[0][0]
    assert first.title == f"query 2: {XSS} 0.90"
    zoom = first.rgb.shape[0] // 16
    assert first.rgb[4 * zoom, 6 * zoom].tolist() == [255, 200, 0]  # the box's top edge at y = 4 pixels
    assert XSS not in view.to_html()
    empty = Detections(torch.zeros(0, 3, 16, 12), *(torch.zeros(0, dtype=torch.long),) * 3, torch.zeros(0))
    with pytest.raises(InputError, match="no detection to draw"):
        detection_view(torch.rand(2, 3, 16, 12), empty)


def test_curves_from_a_results_json_one_plot_per_curve_metric(tmp_path):
    rows = [("rollout", CurveResult("perturbation_positive", (0.0, 0.5, 1.0), (1.0, 0.4, 0.1), 42.5, 8,
                                    higher_is_better=False)),
            (XSS, CurveResult("perturbation_positive", (0.0, 0.5, 1.0), (1.0, 0.2, 0.0), 35.0, 8,
                              higher_is_better=False)),
            ("rollout", CurveResult("auac", (0.0, 1.0), (0.5, 0.9), 0.7, 8)),
            ("rollout", SegmentationResult("segmentation", 0.9, 0.8, 0.7, 0.75, 0.6, 8))]
    write_json(rows, tmp_path / "results.json")
    plots = curve_plots(tmp_path / "results.json")
    assert set(plots) == {"perturbation_positive", "auac"}
    assert list(plots["perturbation_positive"].curves) == ["rollout", XSS]
    page = plots["perturbation_positive"].to_html(standalone=True)
    assert XSS not in page and "lower" in page and "42.5" in page
    assert plots["auac"].save(tmp_path / "auac.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in plots["auac"].save(tmp_path / "auac.svg").read_text()
    with pytest.raises(InputError, match="no curves named"):
        curve_plots(rows, metrics=["aopc"])
    with pytest.raises(InputError, match="CurveResult"):
        CurvePlot({"rollout": rows[-1][1]})


def test_stream_views_label_every_part_by_the_methods_signedness_not_by_its_values():
    """An AttnLRP image map with no negative pixel stays signed beside its signed text part."""
    tokens = [["<s>", "a", "dog", "</s>"]]
    text, maps = torch.tensor([[0.0, 1.0, -0.5, 0.0]]), torch.rand(1, 3, 16, 16)
    words, overlay = text_image_view(tokens, text, torch.rand(1, 3, 16, 16), maps, signed=True).rows[0]
    assert words.scales["text"][0].signed and overlay.scale.signed and "sum of relevance" in overlay.caption
    guessed = text_image_view(tokens, text, torch.rand(1, 3, 16, 16), maps).rows[0][1]
    assert not guessed.scale.signed                                   # signed=None: a guess from the data
    regions = torch.tensor([[0.5, 2.0, 1.0]])
    boxes = torch.tensor([[[0.0, 0.0, 0.5, 0.5], [0.5, 0.5, 1.0, 1.0], [0.0, 0.5, 0.5, 1.0]]])
    _, strip, drawn = text_regions_view([["a", "b", "c"]], regions, regions, images=torch.full((1, 3, 20, 20), 0.5),
                                        boxes=boxes, signed=True).rows[0]
    assert strip.scales["regions"][0].signed and drawn.scale.signed
    found = Detections(maps=torch.rand(1, 3, 16, 12), image_index=torch.tensor([0]), query_index=torch.tensor([2]),
                       label=torch.tensor([1]), score=torch.tensor([0.9]))
    assert detection_view(torch.rand(1, 3, 16, 12), found, signed=True).rows[0][0].scale.signed
    with pytest.raises(InputError, match="negative"):
        text_image_view(tokens, text, torch.rand(1, 3, 16, 16), maps, signed=False)


def test_stream_views_take_the_mask_as_the_tokenizers_output_like_token_heatmap():
    """``text_image_view`` passes each row's mask to TokenHeatmap, which accepts a BatchEncoding or a
    ``{"attention_mask": ...}`` dict: the view must accept them too, not fail slicing the dict."""
    tokens = [["<s>", "a", "cat", "</s>"], ["<s>", "dog", "</s>", "<pad>"]]
    text = torch.tensor([[0.0, 1.0, 0.5, 0.1], [0.0, 2.0, 0.1, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    images, maps = torch.rand(2, 3, 16, 16), torch.rand(2, 3, 16, 16)
    as_tensor = text_image_view(tokens, text, images, maps, attention_mask=mask, special_tokens={"<s>", "</s>"})
    as_dict = text_image_view(tokens, text, images, maps, attention_mask={"attention_mask": mask},
                              special_tokens={"<s>", "</s>"})
    assert [row[0].lines[0].tokens for row in as_dict.rows] == [row[0].lines[0].tokens for row in as_tensor.rows]
