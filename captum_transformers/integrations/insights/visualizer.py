"""``AttributionVisualizer`` and ``Batch`` with Captum Insights 0.8's arguments, served by this
package's explorer.

Existing Insights code works by changing its import::

    from captum_transformers.integrations.insights import AttributionVisualizer, Batch   # was captum.insights
    from captum_transformers.integrations.insights.features import ImageFeature

    visualizer = AttributionVisualizer(models=[model], classes=classes, features=[ImageFeature(
        "Photo", baseline_transforms=[lambda x: x * 0], input_transforms=[normalize])],
        dataset=batches, score_func=lambda o: o.softmax(1))
    visualizer.serve()      # the explorer page (token in the printed URL), or
    visualizer.render()     # a static HTML view, inline in Jupyter

What is explored: the first ``examples`` (default 48) examples of ``dataset``, each input put
through its feature's ``input_transforms`` once; the model's outputs through ``score_func``
(softmax when ``None``). Offered methods: this package's methods when an adapter knows the
model, and Captum's Integrated Gradients and Saliency always (the only methods for a model
with no attention, like Insights' CIFAR CNN).

Several models are served side by side: the page gets a model selector (each model has its
own predictions, offered methods and cache), ``html()`` one view per model.

Refused with an explanation rather than explored wrongly: several features,
a ``GeneralFeature``, ``additional_args``, and ``use_label_for_attr=False`` (the explorer
explains one class per example). Integrated Gradients here starts from zero; a
``baseline_transforms`` that gives anything else is warned about once.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

from ...errors import InputError
from .features import BaseFeature, ImageFeature, TextFeature


class Batch:
    """A batch of raw inputs (a tensor or a tuple, one per feature), labels (N,) and extra
    forward arguments, as in Captum Insights."""

    def __init__(self, inputs: Union[torch.Tensor, Tuple[torch.Tensor, ...]], labels: Optional[torch.Tensor],
                 additional_args=None) -> None:
        self.inputs = inputs
        self.labels = labels
        self.additional_args = additional_args


class AttributionVisualizer:
    """Captum Insights' visualizer on this package's explorer (see the module docstring).

    ``examples`` (not in Captum's signature) bounds how many examples are read from ``dataset``.
    """

    def __init__(self, models: Union[List[nn.Module], nn.Module], classes: List[str],
                 features: Union[List[BaseFeature], BaseFeature], dataset: Iterable[Batch],
                 score_func: Optional[Callable] = None, use_label_for_attr: bool = True, *,
                 examples: int = 48) -> None:
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        features = list(features) if isinstance(features, (list, tuple)) else [features]
        if not models or not all(isinstance(model, nn.Module) for model in models):
            raise InputError(f"models must be an nn.Module or a non-empty list of them, received {models!r}.")
        if len(features) != 1 or not isinstance(features[0], (ImageFeature, TextFeature)):
            kinds = [type(f).__name__ for f in features]
            raise InputError(f"the explorer draws one ImageFeature or TextFeature input; received {kinds}. Models "
                             "with several inputs or tabular (GeneralFeature) inputs are not explored here.")
        if not use_label_for_attr:
            raise InputError("use_label_for_attr=False (a scalar model output) is not supported: the explorer "
                             "explains one class of a (batch, classes) output per example.")
        if examples < 1:
            raise InputError(f"examples={examples}: expected at least 1.")
        self.models, self.classes, self.features = models, list(classes), features
        self.dataset, self.score_func, self.use_label_for_attr = dataset, score_func, use_label_for_attr
        self.examples = examples
        self._workspaces = None
        self._running = None

    # -- the workspace the explorer serves ------------------------------------------------
    def workspaces(self) -> List:
        """One explorer ``Workspace`` per model over the same first ``examples`` examples (built once)."""
        if self._workspaces is None:
            self._workspaces = self._build_workspaces()
        return self._workspaces

    def workspace(self, model: int = 0):
        """The ``Workspace`` of ``models[model]``."""
        return self.workspaces()[model]

    def _read_batches(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        raws, labels, count = [], [], 0
        for batch in self.dataset:
            if not isinstance(batch, Batch):
                raise InputError(f"dataset must yield Batch objects, yielded {type(batch).__name__}.")
            if batch.additional_args is not None:
                raise InputError("Batch.additional_args is not supported by the explorer; fold fixed arguments into "
                                 "the model (a wrapper module).")
            inputs = batch.inputs[0] if isinstance(batch.inputs, (tuple, list)) and len(batch.inputs) == 1 \
                else batch.inputs
            if not isinstance(inputs, torch.Tensor):
                raise InputError(f"Batch.inputs must be one tensor for one feature, received {type(inputs).__name__}.")
            raws.append(inputs)
            labels.append(None if batch.labels is None else torch.as_tensor(batch.labels).reshape(-1))
            count += inputs.shape[0]
            if count >= self.examples:
                break
        if not raws:
            raise InputError("dataset yielded no Batch; give an iterable of Batch objects.")
        raw = torch.cat(raws)[:self.examples]
        label = None if any(l is None for l in labels) else torch.cat(labels)[:self.examples]
        return raw, label

    def _build_workspaces(self) -> List:
        from ...explorer.pages.classifier.workspace import Workspace

        feature = self.features[0]
        raw, labels = self._read_batches()
        inputs = feature.transform_input(raw)
        self._check_baseline(feature, inputs)
        if isinstance(feature, ImageFeature):
            shown = feature.visualization_transform(raw) if feature.visualization_transform else raw
            displays = [_image01(image) for image in torch.as_tensor(shown)]
            modality = "image"
        else:
            displays = [_tokens(feature, raw[i:i + 1]) for i in range(raw.shape[0])]
            _check_token_counts(feature, displays, inputs)
            modality = "text"
        names = [type(model).__name__ for model in self.models]
        for model, name in zip(self.models, names):
            if model.training:  # the explorer never changes a model (only capture/patching.py does, reversibly)
                warnings.warn(f"{name} is in training mode: dropout and batch statistics make its predictions and maps "
                              "vary from call to call; call model.eval() before building the visualizer.",
                              stacklevel=3)
        return [Workspace(model, (inputs,), displays, modality, labels=labels, class_names=self.classes,
                          name=f"{name}{f' #{i}' if names.count(name) > 1 else ''} ({feature.name})",
                          score_func=self.score_func)
                for i, (model, name) in enumerate(zip(self.models, names))]

    @staticmethod
    def _check_baseline(feature: BaseFeature, inputs: torch.Tensor) -> None:
        if not feature.baseline_transforms:
            return
        baseline = feature.baseline_transforms[0](inputs)
        if not isinstance(baseline, torch.Tensor) or bool(baseline.ne(0).any()):
            warnings.warn(f"feature {feature.name!r}: its baseline transform gives a non-zero baseline, but Integrated "
                          "Gradients in the explorer starts from zero (the model input 0); its maps differ from "
                          "Captum Insights' for this baseline.", stacklevel=3)

    def methods(self, model: int = 0) -> List[str]:
        """The catalog names offered for ``models[model]`` (see the module docstring)."""
        from ...explorer.explaining import available_methods

        return available_methods(self.models[model])

    # -- Captum Insights' entry points -----------------------------------------------------
    def serve(self, blocking: bool = False, debug: bool = False, port=None, bind_all: bool = False, *,
              allowed_hosts: Iterable[str] = ()):
        """Start the explorer (on a free port unless ``port`` is given); returns its port.
        ``bind_all`` listens on every address (prints a warning: the session token is then the
        only protection). ``debug`` is accepted and ignored (errors are shown on the page).
        ``allowed_hosts`` (not in Captum's signature): more names the ``Host`` header may carry,
        e.g. a notebook proxy's, which the Host allowlist would otherwise refuse."""
        from ...explorer.server import require_explorer_extra, start

        require_explorer_extra()
        workspaces = self.workspaces()
        running = start(workspaces if len(workspaces) > 1 else workspaces[0],
                        host="0.0.0.0" if bind_all else "127.0.0.1", port=0 if port is None else port,
                        blocking=blocking, allow_remote=bind_all, extra_hosts=tuple(allowed_hosts))
        self._running = running
        return running.port

    def stop(self) -> None:
        """Stop a server started with ``serve(blocking=False)``."""
        if self._running is not None:
            self._running.stop()
            self._running = None

    def html(self, count: int = 8, methods: Optional[List[str]] = None) -> str:
        """A self-contained HTML view of the first ``count`` examples with ``methods`` (default:
        two of the offered ones), each explained for its predicted class; one view per model."""
        from ...explorer.pages.classifier.export import explorer_html

        views = []
        for index, workspace in enumerate(self.workspaces()):
            offered = self.methods(index)
            chosen = methods or [m for m in ("generic-attention", "rollout", "integrated-gradients", "saliency")
                                 if m in offered][:2]
            targets = {p.index: p.predicted for p in workspace.predictions()[:count]}
            maps = {method: workspace.explain(method, {}, targets) for method in chosen}
            views.append(explorer_html(workspace, maps, targets))
        if len(views) == 1:
            return views[0]
        bodies = [view.split("<body>", 1)[1].rsplit("</body>", 1)[0] for view in views]  # one document
        return views[0].split("<body>", 1)[0] + "<body>" + "<hr>".join(bodies) + "</body></html>"

    def render(self, debug: bool = True) -> None:
        """Show ``html()`` inline in a Jupyter notebook (no widget, no server, works offline)."""
        try:
            from IPython.display import HTML, display
        except ImportError:
            raise InputError("render() shows the view in Jupyter and needs IPython; outside a notebook call "
                             "html() and save it, or serve().") from None
        display(HTML(self.html()))


def _image01(image: torch.Tensor) -> torch.Tensor:
    """One image (C, H, W) as float in [0, 1] with 3 channels (min-max scaled if outside)."""
    image = image.detach().float().cpu()
    if image.dim() == 2:
        image = image.unsqueeze(0)
    if image.dim() != 3 or image.shape[0] not in (1, 3):
        raise InputError(f"ImageFeature inputs must be (N, C, H, W) with C = 1 or 3; an example has shape "
                         f"{tuple(image.shape)}.")
    if image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    low, high = image.min(), image.max()
    if low < 0 or high > 1:
        image = (image - low) / (high - low) if high > low else torch.zeros_like(image)
    return image


def _tokens(feature: TextFeature, indices: torch.Tensor) -> List[str]:
    shown: Any = feature.visualization_transform(indices) if feature.visualization_transform else indices
    if isinstance(shown, str):
        return shown.split()
    if isinstance(shown, torch.Tensor):
        return [str(v) for v in shown.reshape(-1).tolist()]
    shown = list(shown)
    if len(shown) == 1 and isinstance(shown[0], (list, tuple)):
        shown = list(shown[0])
    return [str(token) for token in shown]


def _check_token_counts(feature: TextFeature, displays: List[List[str]], inputs: torch.Tensor) -> None:
    """One shown token per input position, or every score would be drawn on the wrong token
    (one token short shifts them all by one) or the map could not be drawn at all."""
    positions = inputs.shape[1] if inputs.dim() >= 2 else 1
    for index, tokens in enumerate(displays):
        if len(tokens) != positions:
            raise InputError(f"TextFeature {feature.name!r}: its visualization_transform gave {len(tokens)} tokens for "
                             f"example {index}, whose input has {positions} positions; it must return one token per "
                             "position (padding included), in order, so that each score is drawn on its own token.")
