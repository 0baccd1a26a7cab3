"""Which adapter knows which model: an MRO lookup over registered classes.

Keys are classes or dotted strings (``"transformers.modeling_utils.PreTrainedModel"``),
so registering an adapter never imports an optional dependency. A model whose own class
is unknown is searched for a registered submodule, so user wrappers around a HF or timm
model work unchanged. Families no built-in adapter fits (Swin and other windowed or
hierarchical models, :mod:`.unsupported`) are refused unless a user adapter is given.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Union

from torch import nn

from ..errors import UnsupportedModelError
from .graph.refusal import graph_model_reason
from .unsupported import is_user_adapter, refuse_attention_free, refuse_unsupported

if TYPE_CHECKING:  # pragma: no cover
    from .base import Adapter

_BY_KEY: Dict[str, "Adapter"] = {}
_BY_NAME: Dict[str, "Adapter"] = {}


def _class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_adapter(key: Union[type, str], adapter: "Adapter") -> None:
    """Make ``adapter`` handle models whose class (or a base class) is ``key``.

    Example::

        register_adapter("mypkg.models.MyTransformer", MyAdapter())
    """
    _BY_KEY[key if isinstance(key, str) else _class_key(key)] = adapter
    _BY_NAME[adapter.name] = adapter


def registered_adapters() -> List["Adapter"]:
    """Every registered adapter, once each, in registration order."""
    return list(_BY_NAME.values())


def _lookup_class(cls: type) -> Optional["Adapter"]:
    for base in cls.__mro__:
        adapter = _BY_KEY.get(_class_key(base))
        if adapter is not None:
            return adapter
    return None


def _refuse_graph_models(model: nn.Module, adapter_name: Optional[str] = None) -> None:
    reason = graph_model_reason(model, adapter_name)
    if reason is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__} contains the graph attention layer {reason}. Explain it with a graph method "
            "(e.g. torch_geometric.explain), or pass adapter=YourGraphAdapter() (a captum_transformers.adapters."
            "Adapter subclass of your own)."
        )


def registered_adapter(model: nn.Module) -> Optional["Adapter"]:
    """The adapter registered for ``model``'s class (or the first of its submodules'), without
    :func:`get_adapter`'s refusals of families no method explains: for facts an adapter knows
    about a model it would not capture (:meth:`Adapter.next_token_rows`). None if none is."""
    from . import base  # noqa: F401  (registers the built-in adapters on first use)

    for sub in (model, *model.modules()):
        found = _lookup_class(type(sub))
        if found is not None:
            return found
    return None


def get_adapter(model: nn.Module, adapter: Union["Adapter", str, None] = None) -> "Adapter":
    """The adapter for ``model``: ``adapter`` if given, else an MRO lookup.

    ``adapter`` may be an adapter instance or the name of a registered one.
    """
    from . import base  # registers the built-in adapters on first use

    if isinstance(model, nn.Module) and adapter is not None and not is_user_adapter(adapter):
        _refuse_graph_models(model, adapter if isinstance(adapter, str) else getattr(adapter, "name", None))
    if isinstance(adapter, base.Adapter):
        refuse_unsupported(model, adapter)
        return adapter
    if isinstance(adapter, str):
        if adapter not in _BY_NAME:
            raise UnsupportedModelError(
                f"Unknown adapter name {adapter!r}; registered adapters are {sorted(_BY_NAME)}. "
                "Pass one of these names or an Adapter instance."
            )
        refuse_unsupported(model, _BY_NAME[adapter])
        return _BY_NAME[adapter]
    if adapter is not None:
        raise UnsupportedModelError(
            f"adapter= must be an Adapter instance or a registered name, got {type(adapter).__name__}."
        )
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"Expected a torch.nn.Module, got {type(model).__name__}. Pass the model itself, not a function."
        )
    found = _lookup_class(type(model))
    if found is None:
        for sub in model.modules():
            found = _lookup_class(type(sub))
            if found is not None:
                break
    if not is_user_adapter(found):  # a user's registered adapter may take graph models
        _refuse_graph_models(model, getattr(found, "name", None) or "none")
    refuse_unsupported(model, found)  # windowed, hierarchical models: say so, not "no adapter"
    refuse_attention_free(model, found)  # CNNs: one line naming Captum's methods
    if found is None:
        families = "; ".join(f"{a.name}: {a.families}" for a in registered_adapters())
        raise UnsupportedModelError(
            f"No adapter knows {type(model).__module__}.{type(model).__qualname__} or any of its submodules. "
            f"Supported families are {families}. To add one, subclass captum_transformers.adapters.Adapter "
            "(implement blocks() and capture()), then call "
            "captum_transformers.register_adapter('your.module.ModelClass', YourAdapter()), "
            "or pass adapter=YourAdapter() to the method."
        )
    return found
