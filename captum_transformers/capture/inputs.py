"""Mapping inputs (a tokenizer's ``BatchEncoding``, an image processor's output, any dict).

Captum's ``attribute`` takes a tensor or a tuple of tensors, passed positionally. A mapping
is split into the one tensor to explain, the first of :data:`EXPLAINED_KEYS` present, and
keyword arguments for the rest; the explained tensor is passed to the model by its name
too, so ``forward(**batch)`` wrappers and ``inputs_embeds`` work. The attribution is the
one of that tensor.

Example::

    >>> batch = tokenizer(texts, return_tensors="pt", padding=True)
    >>> scores = GenericAttention(model).attribute(batch, target=labels)   # shaped like batch["input_ids"]
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any, Callable, Dict, Iterator, Mapping, NamedTuple, Optional

import torch
from torch import nn

from ..errors import InputError
from ..model_state import patching

#: The keys a mapping input may hold the explained tensor under, in the order looked for.
EXPLAINED_KEYS = ("input_ids", "pixel_values", "inputs_embeds", "input_nodes")  # input_nodes: Graphormer


class NamedInput(NamedTuple):
    """A mapping input split: the tensor to explain, its keyword, and every other entry."""

    tensor: torch.Tensor
    name: str
    forward_kwargs: Dict[str, Any]


def split_mapping(inputs: Mapping, additional_forward_args: Any, forward_kwargs: Optional[dict]) -> NamedInput:
    """Split a mapping input into the explained tensor and keyword arguments (see module doc)."""
    keys = list(inputs.keys())
    present = [key for key in EXPLAINED_KEYS if key in inputs]
    if not present:
        raise InputError(
            f"inputs is a {type(inputs).__name__} with keys {keys}, none of {list(EXPLAINED_KEYS)}; it is not clear "
            "which tensor to explain. Pass that tensor as inputs and the other entries as forward_kwargs, e.g. "
            f"attribute(batch[{keys[0] if keys else 'name'!r}], forward_kwargs={{...}})."
        )
    if len(present) > 1:
        raise InputError(
            f"inputs is a {type(inputs).__name__} holding {present}: several tensors to explain. A mapping input "
            f"explains one; pass a tuple in the model's argument order instead, e.g. "
            f"attribute(({', '.join(f'batch[{key!r}]' for key in present)}), forward_kwargs={{...rest}})."
        )
    if additional_forward_args is not None:
        raise InputError(
            f"inputs is a {type(inputs).__name__}, whose entries are passed to the model by name, and "
            "additional_forward_args would be passed by position after them. Put those arguments into the "
            "mapping (or forward_kwargs) by name."
        )
    name = present[0]
    tensor = inputs[name]
    if not isinstance(tensor, torch.Tensor):
        raise InputError(
            f"inputs[{name!r}] is a {type(tensor).__name__}, not a tensor. Tokenize with return_tensors='pt' "
            "(or convert the entries with torch.as_tensor)."
        )
    rest = {key: value for key, value in inputs.items() if key != name}
    clashes = sorted((set(rest) | {name}) & set(forward_kwargs or {}))
    if clashes:
        raise InputError(
            f"{clashes} are given both in the mapping inputs and in forward_kwargs; give each argument once."
        )
    return NamedInput(tensor, name, {**rest, **(forward_kwargs or {})})


@contextlib.contextmanager
def passed_by_name(model: nn.Module, name: Optional[str]) -> Iterator[None]:
    """While active, ``model(x, **kwargs)`` runs as ``model(**{name: x}, **kwargs)``.

    The adapters call the model with the explained tensor first, positionally; a mapping's
    tensor must reach the model under its own name (``forward(**batch)`` wrappers, and
    ``inputs_embeds``, which is not a HF model's first parameter). ``name=None``: no change,
    but a ``forward(**batch)`` that takes no positional argument is refused with the fix.
    """
    if name is None:
        _refuse_keyword_only(model)
        yield
        return

    def by_name(module, args, kwargs):
        if len(args) != 1 or name in kwargs:
            return None
        return (), {name: args[0], **kwargs}

    with patching.forward_hook(model, by_name, pre=True, with_kwargs=True):
        yield


def _takes_positional(forward: Callable) -> bool:
    """Whether ``forward`` (a bound method or function) takes an argument by position;
    remembered per function, since reading a signature costs as much as a small layer."""
    bound = hasattr(forward, "__func__")  # a bound method's signature drops its first parameter
    function, answers = (forward.__func__, _POSITIONAL_BOUND) if bound else (forward, _POSITIONAL)
    try:
        return answers[function]
    except (KeyError, TypeError):  # not seen, or not weakly referenceable
        pass
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # builtins, C extensions: nothing to check
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                  inspect.Parameter.VAR_POSITIONAL)
    answer = any(parameter.kind in positional for parameter in parameters)
    try:
        answers[function] = answer
    except TypeError:
        pass
    return answer


# function -> whether it takes a positional argument, called as is or bound (as a method);
# weak, so that per-instance forwards (closures) do not outlive their modules.
_POSITIONAL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_POSITIONAL_BOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _refuse_keyword_only(model: nn.Module) -> None:
    if not _takes_positional(model.forward):
        raise InputError(
            f"{type(model).__name__}.forward takes keyword arguments only, but a tensor input is passed by position "
            "(Captum's contract). Pass the inputs as a mapping, e.g. attribute({'input_ids': ids, 'attention_mask': "
            "mask}) or a tokenizer's BatchEncoding: its input_ids, pixel_values or inputs_embeds is explained and "
            "every entry passed by name."
        )
