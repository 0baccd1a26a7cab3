"""Several methods' curves of one metric on one axis, written to an image file.

matplotlib is imported only when a plot is drawn, and through its Agg canvas directly, so
the global backend of a notebook or GUI session is left alone.
"""
from __future__ import annotations

from typing import Mapping, Optional

from ..errors import InputError
from .results import CurveResult

_LINE_STYLES = ("-", "--", ":", "-.")


def plot_curves(curves: Mapping[str, CurveResult], path, title: Optional[str] = None, dpi: int = 120) -> None:
    """Draw ``{method_name: CurveResult}`` as lines on one axis (legend: name and AUC) and save to ``path``.

    Every method gets its own (colour, line style) pair, up to 40 methods.

    The axis labels come from the first curve; the file format from ``path``'s suffix.

    >>> plot_curves({"rollout": rollout_curve, "lrp": lrp_curve}, "auac.png", title="AUAC")  # doctest: +SKIP
    """
    if not curves or not all(isinstance(c, CurveResult) for c in curves.values()):
        received = ({k: type(v).__name__ for k, v in curves.items()} if isinstance(curves, Mapping)
                    else type(curves).__name__)
        raise InputError(f"plot_curves needs a non-empty {{method_name: CurveResult}} dict, got {received}.")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4.5))
    FigureCanvasAgg(figure)
    axis = figure.add_subplot(1, 1, 1)
    for index, (method, curve) in enumerate(curves.items()):
        # matplotlib's 10 colours repeat from the 11th method on; the line style tells those apart.
        axis.plot(curve.x, curve.y, marker="o", markersize=3, color=f"C{index % 10}",
                  linestyle=_LINE_STYLES[index // 10 % len(_LINE_STYLES)], label=f"{method} (AUC {curve.auc:.3g})")
    first = next(iter(curves.values()))
    axis.set_xlabel(first.x_label)
    axis.set_ylabel(first.y_label)
    axis.set_title(title if title is not None else first.name)
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
