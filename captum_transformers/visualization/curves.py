"""Perturbation curves of several methods on one axis, from metric results or a results.json.

``CurvePlot({method: CurveResult})`` draws each method's curve (legend: name and AUC) and
shows itself in notebooks (the picture and a table of areas, with which way is better);
``curve_plots("results.json")`` gives one ``CurvePlot`` per curve metric of a benchmark run
(``captum-transformers benchmark`` writes that file). ``plot_curves`` writes one figure to
a file.

>>> plots = curve_plots("captum_transformers_benchmark/results.json")     # doctest: +SKIP
>>> plots["perturbation_positive"].save("positive.svg")                     # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

from ..errors import InputError
from ..evaluation.results import CurveResult, ResultRecord, read_json
from .output import Picture, agg_figure, data_uri, escape, figure_bytes, plain_text

_LINE_STYLES = ("-", "--", ":", "-.")


def _checked(curves) -> Dict[str, CurveResult]:
    if not isinstance(curves, Mapping) or not curves or not all(isinstance(c, CurveResult) for c in curves.values()):
        received = ({k: type(v).__name__ for k, v in curves.items()} if isinstance(curves, Mapping)
                    else type(curves).__name__)
        raise InputError(f"curves need a non-empty {{method_name: CurveResult}} dict, got {received}.")
    return dict(curves)


class CurvePlot(Picture):
    """Several methods' curves of one metric on one axis."""

    def __init__(self, curves: Mapping[str, CurveResult], title: Optional[str] = None):
        self.curves = _checked(curves)
        first = next(iter(self.curves.values()))
        self.title = str(title if title is not None else first.name)

    def _figure(self, dpi_scale: float = 1.0):
        figure = agg_figure(6, 4.5)
        axis = figure.add_subplot(1, 1, 1)
        for index, (method, curve) in enumerate(self.curves.items()):
            # matplotlib's 10 colours repeat from the 11th method on; the line style tells those apart.
            axis.plot(curve.x, curve.y, marker="o", markersize=3, color=f"C{index % 10}",
                      linestyle=_LINE_STYLES[index // 10 % len(_LINE_STYLES)],
                      label=plain_text(f"{method} (AUC {curve.auc:.3g})"))
        first = next(iter(self.curves.values()))
        axis.set_xlabel(plain_text(first.x_label))
        axis.set_ylabel(plain_text(first.y_label))
        axis.set_title(plain_text(self.title))
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
        figure.tight_layout()
        return figure

    def _body_html(self) -> str:
        rows = "".join(f"<tr><td class='name'>{escape(method)}</td><td>{curve.auc:.4g}</td><td>{curve.count}</td>"
                       f"<td>{'higher' if curve.higher_is_better else 'lower'}</td></tr>"
                       for method, curve in self.curves.items())
        return (f"<h3>{escape(self.title)}</h3><img src='{data_uri(self.to_png())}' width='600' "
                f"alt='{escape(self.title)}'><table><tr><th>method</th><th>AUC</th><th>examples</th>"
                f"<th>better</th></tr>{rows}</table>")


def curve_plots(results: Union[str, Path, Iterable[Tuple[str, ResultRecord]]],
                metrics: Optional[Sequence[str]] = None) -> Dict[str, CurvePlot]:
    """One ``CurvePlot`` per curve metric in ``results``: a results.json path (as written by
    ``write_json`` / the benchmark) or ``(method, result)`` rows. ``metrics`` picks names."""
    rows = read_json(results) if isinstance(results, (str, Path)) else list(results)
    by_metric: Dict[str, Dict[str, CurveResult]] = {}
    for method, result in rows:
        if isinstance(result, CurveResult):
            by_metric.setdefault(result.name, {})[method] = result
    if metrics is not None:
        missing = [name for name in metrics if name not in by_metric]
        if missing:
            raise InputError(f"no curves named {missing} in the results; they hold {sorted(by_metric)}.")
        by_metric = {name: by_metric[name] for name in metrics}
    if not by_metric:
        raise InputError("the results hold no curve (CurveResult rows); expected e.g. perturbation_positive or auac.")
    return {name: CurvePlot(curves, title=name) for name, curves in by_metric.items()}


def plot_curves(curves: Mapping[str, CurveResult], path, title: Optional[str] = None, dpi: int = 120) -> None:
    """Draw ``{method_name: CurveResult}`` as lines on one axis (legend: name and AUC) and save to ``path``.

    Every method gets its own (colour, line style) pair, up to 40 methods. The axis labels come
    from the first curve; the file format from ``path``'s suffix (anything matplotlib writes).

    >>> plot_curves({"rollout": rollout_curve, "lrp": lrp_curve}, "auac.png", title="AUAC")  # doctest: +SKIP
    """
    figure = CurvePlot(curves, title)._figure()
    suffix = Path(path).suffix.lstrip(".").lower() or "png"
    Path(path).write_bytes(figure_bytes(figure, suffix, dpi=dpi))
