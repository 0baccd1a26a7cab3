"""Image overlays and the methods x examples grid: colours checked pixel by pixel, scales,
refusals, escaping of user strings, and files written and read back."""
from __future__ import annotations

import io
import re

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.visualization import ColorScale, ExplanationGrid, image_overlay, report
from captum_transformers.visualization.colors import BLUE, RED

pytest.importorskip("matplotlib")
PIL = pytest.importorskip("PIL.Image")

XSS = "<img src=x onerror=alert(1)>"
GREY = torch.full((3, 8, 8), 0.5)


def is_red(pixel) -> bool:
    r, g, b = (int(v) for v in pixel)
    return r > g + 60 and r > b + 60


def is_blue(pixel) -> bool:
    r, g, b = (int(v) for v in pixel)
    return b > r + 60 and b > g + 30


def test_signed_scale_is_symmetric_white_at_zero_red_positive_blue_negative():
    scale = ColorScale.fit([torch.tensor([-1.0, 0.5, 3.0])])
    assert scale.signed and scale.limit == 3.0 and scale.low == -3.0
    white, red, blue = scale.rgb(torch.tensor([0.0, 3.0, -3.0])).tolist()
    assert white == [255, 255, 255]
    assert red == [round(v) for v in RED] and blue == [round(v) for v in BLUE]
    # Beyond the limit is drawn at full colour, not wrapped around.
    assert scale.rgb(torch.tensor([30.0])).tolist() == [red]


def test_a_non_negative_map_gets_a_sequential_scale_unless_asked_and_a_negative_one_cannot_be_sequential():
    assert not ColorScale.fit([torch.tensor([0.0, 2.0])]).signed
    assert ColorScale.fit([torch.tensor([0.0, 2.0])], signed=True).signed
    with pytest.raises(InputError, match="negative values"):
        ColorScale.fit([torch.tensor([-1.0, 2.0])], signed=False)


def test_percentile_limits_ignore_a_few_extreme_values():
    values = torch.cat([torch.ones(99), torch.tensor([100.0])])
    assert ColorScale.fit([values]).limit == 100.0
    assert ColorScale.fit([values], percentile=98).limit == pytest.approx(1.0)
    many = torch.arange(1, 2 ** 24 + 101, dtype=torch.float32)  # more than torch.quantile accepts
    assert ColorScale.fit([many], percentile=50).limit == pytest.approx(2 ** 23 + 50, rel=1e-6)


def test_overlay_is_the_image_where_the_map_is_zero_red_where_positive_blue_where_negative():
    heat = torch.zeros(8, 8)
    heat[0, 0], heat[7, 7] = 2.0, -2.0
    overlay = image_overlay(GREY, heat, opacity=1.0)
    zoom = overlay.rgb.shape[0] // 8
    assert overlay.rgb.shape == (8 * zoom, 8 * zoom, 3) and zoom > 1  # small images are enlarged
    assert overlay.rgb[4 * zoom, 4 * zoom].tolist() == [128, 128, 128]  # zero relevance shows the image
    assert is_red(overlay.rgb[0, 0]) and is_blue(overlay.rgb[-1, -1])
    assert overlay.scale.signed and overlay.scale.limit == 2.0


def test_opacity_fades_the_colour_and_zero_opacity_shows_the_image_only():
    heat = torch.ones(8, 8)
    faint, strong = image_overlay(GREY, heat, opacity=0.3), image_overlay(GREY, heat, opacity=0.9)
    assert int(faint.rgb[0, 0, 1]) > int(strong.rgb[0, 0, 1])  # less green removed
    assert (image_overlay(GREY, heat, opacity=0.0).rgb == 128).all()


def test_channels_are_summed_a_patch_grid_is_enlarged_and_wrong_shapes_are_refused():
    three_channels = torch.zeros(3, 8, 8)
    three_channels[:, 0, 0] = torch.tensor([1.0, 1.0, -0.5])  # sum 1.5 > 0: red
    assert is_red(image_overlay(GREY, three_channels).rgb[0, 0])
    patches = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # 2 x 2 grid of 4 x 4 patches
    overlay = image_overlay(GREY, patches, patch_grid=(2, 2), opacity=1.0)
    zoom = overlay.rgb.shape[0] // 8
    assert is_red(overlay.rgb[zoom, zoom]) and is_red(overlay.rgb[3 * zoom, 3 * zoom])
    assert overlay.rgb[5 * zoom + 1, 5 * zoom + 1].tolist() == [128, 128, 128]
    assert overlay.rgb[4 * zoom, 1].tolist() == [128, 128, 128]  # the grid line between the patches
    with pytest.raises(InputError, match=r"3 x 3 map for a 8 x 8 image"):
        image_overlay(GREY, torch.ones(3, 3))
    with pytest.raises(InputError, match=r"reshaped to the patch grid"):
        image_overlay(GREY, torch.ones(17))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_with_where_they_are(bad):
    heat = torch.zeros(8, 8)
    heat[2, 3] = bad
    with pytest.raises(InputError, match=r"NaN or infinite.*\[\[2, 3\]\]"):
        image_overlay(GREY, heat)


def test_normalised_model_inputs_are_refused_as_images_and_uint8_images_are_read():
    with pytest.raises(InputError, match="before normalisation"):
        image_overlay(torch.linspace(-2, 2, 192).reshape(3, 8, 8), torch.ones(8, 8))
    as_bytes = torch.full((8, 8, 3), 128, dtype=torch.uint8)  # channel-last uint8
    assert image_overlay(as_bytes, torch.zeros(8, 8)).rgb[0, 0].tolist() == [128, 128, 128]
    pil_image = PIL.fromarray(as_bytes.numpy())
    assert image_overlay(pil_image, torch.zeros(8, 8)).rgb[0, 0].tolist() == [128, 128, 128]


def test_a_notebook_fragment_styles_only_its_own_elements():
    fragment = image_overlay(GREY, torch.ones(8, 8))._repr_html_()
    style = re.search(r"<style>(.*?)</style>", fragment).group(1)
    assert all(rule.strip().startswith(".ctv") for rule in style.split("}") if rule.strip())


def _two_maps():
    strong = torch.zeros(2, 8, 8)
    strong[:, 0, 0] = 10.0
    weak = torch.zeros(2, 8, 8)
    weak[:, 0, 0] = 1.0
    return {"strong": strong, "weak": weak}


def test_shared_scale_pales_the_weaker_method_per_method_scale_does_not():
    images = GREY.expand(2, -1, -1, -1)
    shared = ExplanationGrid(images, _two_maps(), scale="shared", opacity=1.0)
    per_method = ExplanationGrid(images, _two_maps(), scale="per-method", opacity=1.0)
    assert shared.scales["weak"][0].limit == 10.0 and per_method.scales["weak"][0].limit == 1.0
    assert per_method.cells["weak"][0][0, 0].tolist() == per_method.cells["strong"][0][0, 0].tolist()
    strong_red, weak_pale = shared.cells["strong"][0][0, 0], shared.cells["weak"][0][0, 0]
    assert is_red(strong_red) and not is_red(weak_pale) and int(weak_pale[1]) > int(strong_red[1])
    fixed = ExplanationGrid(images, _two_maps(), scale=5.0)
    assert fixed.scales["strong"][1].limit == 5.0


def test_per_map_scale_gives_each_example_its_own_limit():
    maps = {"m": torch.stack([torch.ones(8, 8), 3 * torch.ones(8, 8)])}
    grid = ExplanationGrid(GREY.expand(2, -1, -1, -1), maps, scale="per-map")
    assert [s.limit for s in grid.scales["m"]] == [1.0, 3.0]
    with pytest.raises(InputError, match="scale="):
        ExplanationGrid(GREY.expand(2, -1, -1, -1), maps, scale="global")


def test_grid_refuses_maps_of_the_wrong_batch_or_titles_of_the_wrong_count():
    with pytest.raises(InputError, match=r"has shape \(3, 8, 8\); expected \(2, H, W\)"):
        ExplanationGrid(GREY.expand(2, -1, -1, -1), {"m": torch.ones(3, 8, 8)})
    with pytest.raises(InputError, match="3 titles for 2 images"):
        ExplanationGrid(GREY.expand(2, -1, -1, -1), {"m": torch.ones(2, 8, 8)}, titles=["a", "b", "c"])


def test_user_strings_are_escaped_in_html_and_the_page_is_self_contained(tmp_path):
    grid = ExplanationGrid(GREY.expand(2, -1, -1, -1), {XSS: torch.ones(2, 8, 8)}, titles=[XSS, "ok"], title=XSS)
    page = grid.to_html(standalone=True)
    assert XSS not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "<script" not in page.lower() and "http://" not in page and "https://" not in page
    assert "onerror" not in re.sub(r"&lt;img src=x onerror=alert\(1\)&gt;", "", page)
    images = re.findall(r"<img src='([^']+)'", page)
    assert len(images) == 4 and all(src.startswith("data:image/png;base64,") for src in images)
    assert grid._repr_html_().count("<img") == 4
    formatters = pytest.importorskip("IPython.core.formatters")
    shown, _ = formatters.DisplayFormatter().format(grid)   # what a notebook does with `grid`
    assert shown["text/html"] == grid._repr_html_()
    path = grid.save(tmp_path / "grid.html")
    assert path.read_text(encoding="utf-8") == page


def test_save_round_trip_png_svg_and_refusal_of_other_suffixes(tmp_path):
    maps = {"signed": torch.linspace(-1, 1, 128).reshape(2, 8, 8), "positive": torch.rand(2, 8, 8)}
    grid = ExplanationGrid(GREY.expand(2, -1, -1, -1), maps, titles=["$x$ one", "two"])
    png = grid.save(tmp_path / "grid.png")
    with PIL.open(png) as image:
        assert image.format == "PNG" and image.width > 200
    assert grid.to_png()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = grid.save(tmp_path / "grid.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    overlay = image_overlay(GREY, torch.ones(8, 8), title=XSS)
    assert XSS not in overlay.to_html()
    with PIL.open(io.BytesIO(overlay.image_png())) as drawn:
        assert torch.equal(torch.as_tensor(list(drawn.getdata()), dtype=torch.uint8).reshape(overlay.rgb.shape),
                           overlay.rgb)
    with pytest.raises(InputError, match=r"\.html, \.png or \.svg"):
        overlay.save(tmp_path / "overlay.jpg")


def test_report_runs_each_method_once_on_the_batch_and_draws_the_grid():
    pytest.importorskip("timm")
    from captum_transformers.tasks.digits.canvas import digit_canvases, normalize
    from captum_transformers.tasks.digits.model import load_digit_model

    canvases = digit_canvases("test", n=2, seed=0)
    model = load_digit_model()
    grid = report(model, normalize(canvases.images), images=canvases.images,
                  methods=["rollout", "attn-lrp"], outlines=canvases.masks, patch_grid=(8, 8))
    assert grid.methods == ["rollout", "attn-lrp"] and len(grid.cells["attn-lrp"]) == 2
    assert grid.scales["attn-lrp"][0].signed and not grid.scales["rollout"][0].signed
    with pytest.raises(InputError, match="before normalisation"):
        report(model, normalize(canvases.images), methods=["rollout"])
    with pytest.raises(InputError, match="TokenHeatmap"):
        report(model, torch.ones(2, 5, dtype=torch.long), methods=["rollout"])
    with pytest.raises(InputError, match="unknown method"):
        report(model, canvases.images, methods=["nope"])


def test_the_documented_drawing_example_runs_as_printed_and_writes_one_offline_page(tmp_path, monkeypatch):
    """The drawing example of docs/explorer.md (it left the README with the docs site)."""
    pytest.importorskip("timm")
    import os

    page_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "explorer.md")
    text = open(page_path, encoding="utf-8").read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if 'grid.save("explanations.html")' in b)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    exec(compile(block, "docs/explorer.md drawing example", "exec"), namespace)
    page = (tmp_path / "explanations.html").read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 3 * 4 and "<script" not in page.lower()
    assert "http://" not in page and "https://" not in page  # nothing fetched
    assert namespace["grid"].scales["attn-lrp"][0].signed


def test_a_saved_page_renders_offline_in_headless_chromium(tmp_path):
    """The file alone, opened by a browser with no network: its data: images are drawn (the page's
    Content-Security-Policy allows nothing else)."""
    import shutil
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (Debian package chromium)")
    red = torch.ones(1, 8, 8)
    page = ExplanationGrid(torch.full((1, 3, 8, 8), 0.5), {"all positive": red}, opacity=1.0).save(tmp_path / "g.html")
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=600,500",
                    page.as_uri()], capture_output=True, timeout=120)
    if not shot.exists():
        pytest.skip("chromium could not take a screenshot here")
    with PIL.open(shot) as image:
        pixels = torch.as_tensor(list(image.convert("RGB").getdata()), dtype=torch.int32)
    full_red = ((pixels[:, 0] > 150) & (pixels[:, 1] < 60) & (pixels[:, 2] < 80)).sum()
    assert full_red > 100 * 100  # the overlay cell (about 160 x 160 pixels of the scale's red) is drawn
