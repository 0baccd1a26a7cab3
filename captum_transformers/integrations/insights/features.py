"""Captum Insights' feature classes, with Captum 0.8's constructor arguments.

A feature says how one model input is turned into what the model takes
(``input_transforms``, applied in order to the batch tensor), into an Integrated Gradients
baseline (``baseline_transforms``, applied to the transformed input) and into what is shown
(``visualization_transform``, applied to the raw input). Existing Insights code keeps its
feature lists; only the import changes::

    from captum_transformers.integrations.insights.features import ImageFeature   # was captum.insights.attr_vis.features

The explorer draws ``ImageFeature`` (an (N, C, H, W) tensor, C = 1 or 3) and ``TextFeature``
(token indices, shown through ``visualization_transform``). ``GeneralFeature`` is accepted
with Captum's arguments, but the explorer has no view for tabular inputs and refuses it when
the visualizer is built.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Union

Transforms = Optional[Union[Callable, List[Callable]]]


def _as_list(transforms: Transforms) -> List[Callable]:
    if transforms is None:
        return []
    return list(transforms) if isinstance(transforms, (list, tuple)) else [transforms]


class BaseFeature:
    """What every feature holds: a name and its three kinds of transforms (see the module)."""

    def __init__(self, name: str, baseline_transforms: Transforms, input_transforms: Transforms,
                 visualization_transform: Optional[Callable]) -> None:
        self.name = name
        self.baseline_transforms = _as_list(baseline_transforms)
        self.input_transforms = _as_list(input_transforms)
        self.visualization_transform = visualization_transform

    @staticmethod
    def visualization_type() -> str:
        raise NotImplementedError

    def transform_input(self, data):
        """``data`` through ``input_transforms`` in order (what the model takes)."""
        for transform in self.input_transforms:
            data = transform(data)
        return data


class ImageFeature(BaseFeature):
    """An image input (N, C, H, W), C = 1 (grey) or 3 (RGB); shown as the raw tensor (or
    ``visualization_transform`` of it), scaled to [0, 1] per image when outside that range."""

    def __init__(self, name: str, baseline_transforms: Transforms, input_transforms: Transforms,
                 visualization_transform: Optional[Callable] = None) -> None:
        super().__init__(name, baseline_transforms, input_transforms, visualization_transform)

    @staticmethod
    def visualization_type() -> str:
        return "image"


class TextFeature(BaseFeature):
    """A text input of token indices; ``visualization_transform`` turns one example's indices
    (shape (1, L)) into its tokens (a list of strings, or one string split on spaces)."""

    def __init__(self, name: str, baseline_transforms: Transforms, input_transforms: Transforms,
                 visualization_transform: Optional[Callable]) -> None:
        super().__init__(name, baseline_transforms, input_transforms, visualization_transform)

    @staticmethod
    def visualization_type() -> str:
        return "text"


class GeneralFeature(BaseFeature):
    """A tabular input (N, C) with one category name per column (Captum's arguments)."""

    def __init__(self, name: str, categories: List[str]) -> None:
        super().__init__(name, baseline_transforms=None, input_transforms=None, visualization_transform=None)
        self.categories = categories

    @staticmethod
    def visualization_type() -> str:
        return "general"


class EmptyFeature(BaseFeature):
    """A placeholder input (Captum's ``EmptyFeature``): passed to the model, never shown."""

    def __init__(self, name: str = "empty", baseline_transforms: Transforms = None, input_transforms: Transforms = None,
                 visualization_transform: Optional[Callable] = None) -> None:
        super().__init__(name, baseline_transforms, input_transforms, visualization_transform)

    @staticmethod
    def visualization_type() -> str:
        return "empty"
