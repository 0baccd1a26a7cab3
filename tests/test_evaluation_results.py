"""Result records: JSON / CSV round trips and the curve plot."""
import json

import pytest

from captum_transformers.errors import InputError
from captum_transformers.evaluation import (CurveResult, RationaleF1Result, SegmentationResult, SpecificityResult,
                                            read_csv, read_json, write_csv, write_json)
from captum_transformers.visualization import plot_curves

CURVE = CurveResult("auac", (0.0, 0.5, 1.0), (0.25, 0.5, 0.75), 0.5, 10, y_label="p(true class)")
ROWS = [
    ("rollout", CURVE),
    ("lrp", CurveResult("auac", (0.0, 0.5, 1.0), (0.5, 0.75, 1.0), 0.75, 10)),
    ("lrp", SegmentationResult("segmentation", 0.9, 0.8, 0.7, 0.75, 0.85, 4)),
    ("lrp", RationaleF1Result("rationale_f1_topgold", 0.5, 0.6, 0.7, 0.5, 3)),
    ("lrp", SpecificityResult("class_specificity", 0.5, 8, 0)),
]


def test_to_dict_and_json_round_trip(tmp_path):
    assert CURVE.to_dict()["x"] == [0.0, 0.5, 1.0] and CURVE.to_dict()["kind"] == "CurveResult"
    CURVE.to_json(tmp_path / "curve.json")
    assert CurveResult.from_dict(json.loads((tmp_path / "curve.json").read_text())) == CURVE
    write_json(ROWS, tmp_path / "all.json")
    assert read_json(tmp_path / "all.json") == ROWS


def test_csv_has_one_row_per_method_and_metric(tmp_path):
    write_csv(ROWS, tmp_path / "all.csv")
    rows = read_csv(tmp_path / "all.csv")
    assert [(r["method"], r["name"]) for r in rows] == [(m, r.name) for m, r in ROWS]
    assert rows[0]["auc"] == 0.5 and rows[0]["count"] == 10 and "x" not in rows[0]
    assert rows[2]["miou"] == 0.75 and "auc" not in rows[2]
    assert rows[1]["higher_is_better"] is True


def test_writers_reject_rows_that_are_not_method_result_pairs(tmp_path):
    with pytest.raises(InputError, match="method_name"):
        write_csv([CURVE], tmp_path / "bad.csv")


def test_plot_file_is_written(tmp_path):
    path = tmp_path / "curves.png"
    plot_curves({method: result for method, result in ROWS[:2]}, path, title="AUAC")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(InputError):
        plot_curves({}, path)


def test_plot_gives_every_method_its_own_colour_and_line_style(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), save(self, *a, **k))[1])
    curve = CurveResult("auac", (0.0, 1.0), (0.2, 0.8), 0.5, 3)
    plot_curves({f"method-{i}": curve for i in range(13)}, tmp_path / "many.png")
    (axis,) = drawn[0].axes
    styles = {(line.get_color(), line.get_linestyle()) for line in axis.get_lines()}
    assert len(styles) == 13  # matplotlib's colour cycle alone repeats after 10
