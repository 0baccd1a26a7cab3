"""The arguments of each catalog method, read from its constructor, as form fields.

Nothing here is written per method: every factory of ``methods.catalog.METHOD_FACTORIES``
is inspected (``inspect.signature`` and its type hints) and each keyword argument the
explorer can offer becomes a field:

* ``Literal[...]`` -> a choice among the literal values (``head_fusion``, ``variant``);
* ``RuleSet`` -> a choice among the presets defined on ``RuleSet`` (``CHEFER``, ``LRP``, ...);
* ``int`` or a union whose only number is ``int`` -> an integer (``start_layer``, ``n_steps``);
* ``float`` or a union holding ``float`` -> a number (``discard_ratio``);
* ``bool`` -> a check box.

``model`` and ``adapter`` are never offered; an argument of any other type is left at its
default and listed under ``fixed`` so that the page can say it is not settable here.

Example::

    >>> fields = method_fields("rollout")
    >>> [(field["name"], field["kind"]) for field in fields]
    [('head_fusion', 'choice'), ('discard_ratio', 'number'), ('start_layer', 'integer')]
"""
from __future__ import annotations

import functools
import inspect
import json
import typing
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from ..errors import InputError
from ..methods.catalog import METHOD_FACTORIES, METHOD_NAMES, SIGNED_METHODS
from ..propagation.rules.rule_set import RuleSet

_NOT_OFFERED = frozenset({"self", "model", "adapter"})
#: Numbers from the page are bounded (a request may not ask for, say, 10**9 integration steps);
#: each method still checks its own range (``start_layer`` against the depth, ...).
NUMBER_BOUND = 10_000


#: The most work one request may ask for, in model inputs run forward and back: examples times
#: integration steps (``n_steps``; 1 for a method without steps), summed over its methods.
#: 4096 is the built-in ViT's 48 test canvases under Integrated Gradients' default 50 steps
#: (2400) with room to spare, and about 20-40 s of one CPU core; the 10000-step request that
#: ran for minutes is refused with this figure in its message.
WORK_BUDGET = 4096

#: The most jobs of one model that may be unfinished (queued or running) at once; one more is
#: refused (429) until one is cancelled or ends. With ``WORK_BUDGET`` per request this bounds
#: the work queued on a model at 8 x 4096 model passes (a few minutes of one CPU core). The
#: page keeps one job at a time (it cancels the one it replaces) and the warm-up adds one, so
#: 8 leaves room for several tabs, while a script submitting in a loop is stopped early.
MAX_UNFINISHED_JOBS = 8

#: Ranges of arguments whose constructors accept any number but whose methods fail later on
#: one outside them (inside the job, after the request was accepted): checked with the request.
#: ``(low, high, high_included)`` by argument name, whichever method takes it.
ARGUMENT_RANGES = {
    "discard_ratio": (0.0, 1.0, False),    # a fraction of attention values dropped: [0, 1)
    "n_steps": (1, WORK_BUDGET, True),
    # rows per forward pass: a cancelled job stops at the next pass, so a pass stays short
    "internal_batch_size": (1, 512, True),
}


def rule_presets() -> Dict[str, RuleSet]:
    """The ``RuleSet`` presets by attribute name (``GRADIENT``, ``AH``, ``CHEFER``, ...)."""
    return {name: value for name, value in vars(RuleSet).items() if isinstance(value, RuleSet)}


def _constructor(factory) -> Tuple[Any, Dict[str, Any]]:
    """The class behind a factory (a class or a ``functools.partial`` of one) and its hints."""
    target = factory.func if isinstance(factory, functools.partial) else factory
    try:
        hints = typing.get_type_hints(target.__init__)
    except Exception:  # an annotation that cannot be resolved: offer nothing we cannot type
        hints = {}
    return target, hints


def _field(name: str, hint: Any, default: Any) -> Dict[str, Any] | None:
    origin, members = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"name": name, "kind": "choice", "choices": [str(m) for m in members], "default": str(default)}
    if hint is RuleSet:
        presets = rule_presets()
        chosen = next((key for key, value in presets.items() if value == default), None)
        return {"name": name, "kind": "choice", "choices": list(presets), "default": chosen}
    if hint is bool:
        return {"name": name, "kind": "boolean", "default": bool(default)}
    numbers = set(members) if origin is typing.Union else {hint}
    optional = type(None) in numbers
    if float in numbers:
        return {"name": name, "kind": "number", "default": default, "optional": optional}
    if int in numbers:
        return {"name": name, "kind": "integer", "default": default, "optional": optional}
    return None


@functools.lru_cache(maxsize=None)
def _fields_and_fixed(method: str) -> Tuple[Tuple[Dict[str, Any], ...], Tuple[str, ...]]:
    if method not in METHOD_FACTORIES:
        raise InputError(f"unknown method {method!r}; expected one of {', '.join(METHOD_NAMES)}.")
    factory = METHOD_FACTORIES[method]
    _, hints = _constructor(factory)
    fields, fixed = [], []
    for parameter in inspect.signature(factory).parameters.values():
        if parameter.name in _NOT_OFFERED or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        default = None if parameter.default is inspect.Parameter.empty else parameter.default
        field = _field(parameter.name, hints.get(parameter.name), default)
        if field is None:
            fixed.append(parameter.name)
        else:
            fields.append(field)
    return tuple(fields), tuple(fixed)


def method_fields(method: str) -> List[Dict[str, Any]]:
    """The form fields of ``method`` (copies: callers may change them)."""
    return [dict(field) for field in _fields_and_fixed(method)[0]]


def method_catalog(names=METHOD_NAMES) -> List[Dict[str, Any]]:
    """Every method with its fields, the arguments left at their defaults, and whether its maps are
    signed (so the page can say what its colours mean), for the page."""
    return [{"name": name, "fields": method_fields(name), "fixed": list(_fields_and_fixed(name)[1]),
             "signed": name in SIGNED_METHODS} for name in names]


def checked_arguments(method: str, arguments: Mapping[str, Any] | None) -> Dict[str, Any]:
    """``arguments`` (JSON values from the page) checked against the fields of ``method``.

    Returns a complete, canonical dict (every field, defaults filled in) so that equal
    settings give equal cache keys. Unknown names, wrong types and choices outside the
    list raise ``InputError`` naming what was expected.
    """
    arguments = dict(arguments or {})
    fields = {field["name"]: field for field in method_fields(method)}
    unknown = sorted(set(arguments) - set(fields))
    if unknown:
        raise InputError(f"{method} takes no argument {', '.join(map(repr, unknown))}; its arguments are "
                         f"{', '.join(fields) or 'none'}.")
    checked = {}
    for name, field in fields.items():
        value = arguments.get(name, field["default"])
        checked[name] = _checked_value(method, field, value)
    return checked


def _checked_value(method: str, field: Dict[str, Any], value: Any) -> Any:
    kind, name = field["kind"], field["name"]
    if value is None and field.get("optional"):
        return None
    if kind == "choice":
        if value not in field["choices"]:
            raise InputError(f"{method}: {name}={value!r} is not one of {field['choices']}.")
        return value
    if kind == "boolean":
        if not isinstance(value, bool):
            raise InputError(f"{method}: {name} must be true or false, received {value!r}.")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{method}: {name} must be a number, received {value!r}.")
    if value != value or abs(value) > NUMBER_BOUND:
        raise InputError(f"{method}: {name}={value!r} is outside [-{NUMBER_BOUND}, {NUMBER_BOUND}].")
    if kind == "integer":
        if float(value) != int(value):
            raise InputError(f"{method}: {name} must be a whole number, received {value!r}.")
        value = int(value)
    else:
        value = float(value)
    if name in ARGUMENT_RANGES:
        low, high, high_included = ARGUMENT_RANGES[name]
        if not (low <= value and (value <= high if high_included else value < high)):
            interval = f"[{low}, {high}{']' if high_included else ')'}"
            raise InputError(f"{method}: {name}={value!r} is outside {interval}; give a value in {interval}.")
    return value


def request_work(requests: Sequence[Tuple[str, Mapping[str, Any]]], examples: int) -> int:
    """The work of explaining ``examples`` examples with each checked ``(method, arguments)``:
    examples times ``n_steps`` (1 for a method without steps), summed over the methods."""
    return sum(examples * int(arguments.get("n_steps") or 1) for _, arguments in requests)


def check_work(requests: Sequence[Tuple[str, Mapping[str, Any]]], examples: int) -> None:
    """Refuse a request whose ``request_work`` exceeds ``WORK_BUDGET``, saying how to fit it."""
    work = request_work(requests, examples)
    if work > WORK_BUDGET:
        stepped = [f"{method} n_steps={arguments['n_steps']}" for method, arguments in requests
                   if arguments.get("n_steps")]
        raise InputError(f"this request asks for {work} model passes ({examples} example(s) x "
                         f"{', '.join(stepped) or '1 pass'}, summed over {len(requests)} method(s)); the explorer's "
                         f"budget is {WORK_BUDGET} per request. Lower n_steps or explain fewer examples at once.")


def constructor_arguments(method: str, checked: Mapping[str, Any]) -> Dict[str, Any]:
    """Checked arguments as the method's constructor takes them (preset names -> ``RuleSet``)."""
    presets = rule_presets()
    _, hints = _constructor(METHOD_FACTORIES[method])
    return {name: presets[value] if hints.get(name) is RuleSet else value for name, value in checked.items()}


def arguments_key(checked: Mapping[str, Any]) -> str:
    """A canonical string of checked arguments (sorted keys), for cache keys."""
    return json.dumps(dict(checked), sort_keys=True, separators=(",", ":"))
