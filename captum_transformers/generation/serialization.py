"""Generation explanations as JSON: one :class:`GenerationResult` as a dict, and ``scores.json``.

One result (``result_to_dict`` / ``result_from_dict``), schema
``"captum_transformers.generation/1"``::

    {
      "schema": "captum_transformers.generation/1",
      "method": "AttnLRP", "score_kind": "logit", "signed": true,
      "encoder_decoder": false,                     # a source and a decoder sequence (BART, T5)
      "input_tokens": ["<s>", "k", ...],            # n prompt tokens (or template features)
      "output_tokens": ["3", "</s>"],               # T explained rows (a span: one, "a+b")
      "target_attr_tokens": ["3", "</s>"],          # the columns of target_attr
      "input_ids": [1, 9, ...], "output_ids": [7, 2],
      "contrast_tokens": ["4", "4"] | null,         # the foils of a contrastive explanation
      "token_attr":        {"dtype": "float64", "shape": [T, n], "values": [[...], ...]},
      "target_attr":       {"dtype": "float64", "shape": [T, m], "values": [[...], ...]},
      "output_probs":      {"dtype": "float64", "shape": [T], "values": [...]},
      "scores":            {"dtype": "float64", "shape": [T], "values": [...]},
      "first_token_share": {"dtype": "float64", "shape": [T], "values": [...]},
      "sink_share":        {"dtype": "float64", "shape": [T], "values": [...]} | null,
      "images": [{"image_attr": {... [T, H, W]}, "image_token_attr": {... [T, V]}, "grid": [rows, cols]}]
    }

``"images"`` is written only for a vision-language model's result (one entry per image; one
entry reads back as tensors, several as lists, as ``attribute`` returns them). ``"sink_share"``
(:data:`OPTIONAL_ARRAY_FIELDS`) is null for a model without an attention-sink slot; a file
written before it existed (no such key) reads back with ``sink_share=None``.

Every array keeps its dtype and shape, so reading it back gives equal tensors bit for bit
(Python writes the shortest decimal that reads back to the same double, and a float32 value is
a double exactly). Values that are not finite are written as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"`` (plain JSON has no such numbers). Captum's ``inp`` (the
``TextTokenInput`` / ``TextTemplateInput`` of the call) is not written; a read result has
``inp=None`` and ``seq_attr = token_attr.sum(0)`` as when it was made.

``scores.json`` (``save_scores_json`` / ``load_scores_json``; what ``explain`` writes for a
generation), schema ``"captum_transformers.generation.scores/1"``: one prompt explained by
several methods::

    {
      "schema": "captum_transformers.generation.scores/1",
      "prompt": "k = 3 ; q ?", "model": "recall-llama", ...   # the caller's **meta, as given
      "score_kind": "logit",                # shared by every method (null if they differ)
      "input_tokens": [...], "output_tokens": [...],
      "output_probs": [...],                # each output token's probability (the first method's)
      "methods": {"AttnLRP": {<one result, as above>}, "RawAttention": {...}}
    }

Example::

    >>> result = GenerationAttribution(AttnLRP(llm), tokenizer).attribute("k = 3 ; q ?", target="3")
    >>> save_scores_json({"attn-lrp": result}, "out/scores.json", prompt="k = 3 ; q ?", model="llama")
    >>> load_scores_json("out/scores.json")["attn-lrp"].token_attr.equal(result.token_attr)
    True
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Union

import torch

from ..errors import InputError
from .result import GenerationResult

SCHEMA = "captum_transformers.generation/1"
SCORES_SCHEMA = "captum_transformers.generation.scores/1"
ARRAY_FIELDS = ("token_attr", "target_attr", "output_probs", "scores", "first_token_share")
#: Arrays a result may lack (None, written as null; absent in older files): (T,) each.
OPTIONAL_ARRAY_FIELDS = ("sink_share",)
TOKEN_FIELDS = ("input_tokens", "output_tokens", "target_attr_tokens")
ID_FIELDS = ("input_ids", "output_ids")
SCORES_RESERVED = ("schema", "score_kind", "input_tokens", "output_tokens", "output_probs", "methods")
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
           "bfloat16": torch.bfloat16}


def _finite_or_name(value: float) -> Union[float, str]:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def _encode_values(values: Any) -> Any:
    if isinstance(values, list):
        return [_encode_values(v) for v in values]
    return _finite_or_name(float(values))


def _decode_values(values: Any, field: str) -> Any:
    if isinstance(values, list):
        return [_decode_values(v, field) for v in values]
    if isinstance(values, str):
        if values not in _NON_FINITE:
            raise InputError(f"{field!r} holds the string {values!r}; expected numbers or one of "
                             f"{sorted(_NON_FINITE)}. The file was not written by result_to_dict.")
        return _NON_FINITE[values]
    if isinstance(values, bool) or not isinstance(values, (int, float)):
        raise InputError(f"{field!r} holds {values!r} ({type(values).__name__}); expected numbers.")
    return float(values)


def array_to_dict(tensor: torch.Tensor) -> Dict[str, Any]:
    """``{"dtype", "shape", "values"}`` of a floating tensor (values as nested lists)."""
    tensor = torch.as_tensor(tensor).detach().cpu()
    dtype = str(tensor.dtype).replace("torch.", "")
    if dtype not in _DTYPES:
        raise InputError(f"Expected a floating tensor (one of {sorted(_DTYPES)}), got {tensor.dtype}.")
    # bfloat16/float16 values are doubles exactly; tolist() of a float64 copy loses nothing.
    return {"dtype": dtype, "shape": list(tensor.shape), "values": _encode_values(tensor.double().tolist())}


def array_from_dict(entry: Any, field: str) -> torch.Tensor:
    """The tensor ``array_to_dict`` wrote, with its dtype and shape."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "values"} <= set(entry):
        raise InputError(f"{field!r} must be an object with 'dtype', 'shape' and 'values'; got {str(entry)[:80]}.")
    if entry["dtype"] not in _DTYPES:
        raise InputError(f"{field!r} has dtype {entry['dtype']!r}; expected one of {sorted(_DTYPES)}.")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise InputError(f"{field!r} has shape {shape!r}; expected a list of sizes.")
    values = torch.tensor(_decode_values(entry["values"], field), dtype=torch.float64)
    if values.numel() == 0 and math.prod(shape) == 0:
        values = values.reshape(shape)
    if list(values.shape) != shape:
        raise InputError(f"{field!r} holds values of shape {list(values.shape)} but says shape {shape}.")
    return values.to(_DTYPES[entry["dtype"]])


def result_to_dict(result: GenerationResult) -> Dict[str, Any]:
    """A JSON-safe dict of ``result`` (schema in the module docstring)."""
    if not isinstance(result, GenerationResult):
        raise InputError(f"Expected a GenerationResult (what GenerationAttribution.attribute returns), got "
                         f"{type(result).__name__}.")
    out: Dict[str, Any] = {"schema": SCHEMA, "method": str(result.method), "score_kind": str(result.score_kind),
                           "signed": bool(result.signed), "encoder_decoder": bool(result.encoder_decoder)}
    for field in TOKEN_FIELDS:
        out[field] = [str(t) for t in getattr(result, field)]
    for field in ID_FIELDS:
        out[field] = [int(i) for i in getattr(result, field)]
    contrast = result.contrast_tokens
    out["contrast_tokens"] = None if contrast is None else [str(t) for t in contrast]
    for field in ARRAY_FIELDS:
        out[field] = array_to_dict(getattr(result, field))
    for field in OPTIONAL_ARRAY_FIELDS:
        value = getattr(result, field, None)
        out[field] = None if value is None else array_to_dict(value)
    if getattr(result, "image_attr", None) is not None:
        several = isinstance(result.image_attr, list)
        listed = [(result.image_attr, result.image_token_attr, result.image_grid)] if not several else \
            list(zip(result.image_attr, result.image_token_attr, result.image_grid))
        out["images"] = [{"image_attr": array_to_dict(pixels), "image_token_attr": array_to_dict(tokens),
                          "grid": [int(g) for g in grid]} for pixels, tokens, grid in listed]
    return out


def _images_from_dict(d: Mapping[str, Any], rows: int) -> tuple:
    """(image_attr, image_token_attr, image_grid) from the optional ``"images"`` entry."""
    entries = d.get("images")
    if entries is None:
        return None, None, None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, Mapping) for e in entries):
        raise InputError(f"'images' must be a non-empty list of dicts (one per image); got {str(entries)[:80]}.")
    pixels, tokens, grids = [], [], []
    for i, entry in enumerate(entries):
        pixels.append(array_from_dict(entry.get("image_attr"), f"images[{i}].image_attr"))
        tokens.append(array_from_dict(entry.get("image_token_attr"), f"images[{i}].image_token_attr"))
        grids.append(tuple(int(g) for g in entry.get("grid", ())))
        if pixels[-1].dim() != 3 or tokens[-1].dim() != 2 or pixels[-1].shape[0] != rows or \
                tokens[-1].shape[0] != rows or len(grids[-1]) != 2:
            raise InputError(f"images[{i}] must hold image_attr (T, H, W), image_token_attr (T, V) with T = {rows} "
                             f"and a grid [rows, cols]; got {list(pixels[-1].shape)}, {list(tokens[-1].shape)}, "
                             f"{list(grids[-1])}.")
    return (pixels[0], tokens[0], grids[0]) if len(entries) == 1 else (pixels, tokens, grids)


def _string_list(d: Mapping[str, Any], field: str) -> List[str]:
    value = d[field]
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise InputError(f"{field!r} must be a list of strings; got {str(value)[:80]}.")
    return value


def _check_shapes(arrays: Dict[str, torch.Tensor], d: Mapping[str, Any]) -> None:
    rows, columns, read = len(d["output_tokens"]), len(d["input_tokens"]), len(d["target_attr_tokens"])
    expected = {"token_attr": (rows, columns), "target_attr": (rows, read), "output_probs": (rows,),
                "scores": (rows,), "first_token_share": (rows,)}
    for field, shape in expected.items():
        if tuple(arrays[field].shape) != shape:
            raise InputError(f"{field!r} has shape {tuple(arrays[field].shape)}; expected {shape} from "
                             f"{rows} output tokens, {columns} input tokens and {read} target_attr_tokens.")


def result_from_dict(d: Mapping[str, Any]) -> GenerationResult:
    """The :class:`GenerationResult` that ``result_to_dict`` wrote (``inp`` is None)."""
    if not isinstance(d, Mapping):
        raise InputError(f"Expected a dict written by result_to_dict, got {type(d).__name__}.")
    if d.get("schema") != SCHEMA:
        raise InputError(f"Expected schema {SCHEMA!r}, got {d.get('schema')!r}; this is not a generation result "
                         "written by result_to_dict (a scores.json file is read with load_scores_json).")
    required = ("method", "score_kind", "signed", "contrast_tokens") + TOKEN_FIELDS + ID_FIELDS + ARRAY_FIELDS
    missing = [field for field in required if field not in d]
    if missing:
        raise InputError(f"The generation result lacks the field(s) {missing}; every field of schema {SCHEMA!r} "
                         "is required (see captum_transformers.generation.serialization).")
    for field in ID_FIELDS:
        if not isinstance(d[field], list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in d[field]):
            raise InputError(f"{field!r} must be a list of token ids (ints); got {str(d[field])[:80]}.")
    contrast = d["contrast_tokens"]
    if contrast is not None:
        contrast = _string_list(d, "contrast_tokens")
    tokens = {field: _string_list(d, field) for field in TOKEN_FIELDS}
    arrays = {field: array_from_dict(d[field], field) for field in ARRAY_FIELDS}
    _check_shapes(arrays, d)
    optional = {field: None if d.get(field) is None else array_from_dict(d[field], field)
                for field in OPTIONAL_ARRAY_FIELDS}
    for field, value in optional.items():
        if value is not None and tuple(value.shape) != (len(d["output_tokens"]),):
            raise InputError(f"{field!r} has shape {tuple(value.shape)}; expected ({len(d['output_tokens'])},), one "
                             "value per output token.")
    image_attr, image_token_attr, image_grid = _images_from_dict(d, len(d["output_tokens"]))
    return GenerationResult(
        **tokens, token_attr=arrays["token_attr"], target_attr=arrays["target_attr"],
        output_probs=arrays["output_probs"], scores=arrays["scores"], score_kind=str(d["score_kind"]),
        method=str(d["method"]), first_token_share=arrays["first_token_share"], input_ids=list(d["input_ids"]),
        output_ids=list(d["output_ids"]), contrast_tokens=contrast, signed=bool(d["signed"]),
        encoder_decoder=bool(d.get("encoder_decoder", False)), image_attr=image_attr,
        image_token_attr=image_token_attr, image_grid=image_grid, sink_share=optional["sink_share"])


def save_scores_json(results: Mapping[str, GenerationResult], path: Union[str, Path], **meta: Any) -> Path:
    """Write ``scores.json``: one prompt's results by method name, with ``meta`` (prompt, model...)
    at the top level (schema in the module docstring). Returns the path."""
    if not isinstance(results, Mapping) or not results:
        raise InputError(f"results must be a non-empty mapping of method name -> GenerationResult; got "
                         f"{type(results).__name__} {str(results)[:60]}.")
    reserved = [key for key in meta if key in SCORES_RESERVED]
    if reserved:
        raise InputError(f"The meta key(s) {reserved} are written by save_scores_json itself; rename them.")
    for key, value in meta.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InputError(f"meta {key!r} = {str(value)[:60]} is not JSON-safe ({error}); give a string, number, "
                             "list or dict.") from None
    methods = {str(name): result_to_dict(result) for name, result in results.items()}
    first_name, first = next(iter(methods.items()))
    for name, entry in methods.items():
        if entry["output_tokens"] != first["output_tokens"] or entry["input_tokens"] != first["input_tokens"]:
            raise InputError(f"scores.json holds one prompt's explanation, but {name!r} explains "
                             f"{entry['input_tokens'][:6]} -> {entry['output_tokens'][:6]} and {first_name!r} "
                             f"{first['input_tokens'][:6]} -> {first['output_tokens'][:6]}; write one file per "
                             "prompt.")
    kinds = {entry["score_kind"] for entry in methods.values()}
    payload = {"schema": SCORES_SCHEMA, **meta, "score_kind": kinds.pop() if len(kinds) == 1 else None,
               "input_tokens": first["input_tokens"], "output_tokens": first["output_tokens"],
               "output_probs": first["output_probs"]["values"], "methods": methods}
    path = Path(path)
    path.write_text(json.dumps(payload, allow_nan=False), encoding="utf-8")
    return path


def load_scores_json(path: Union[str, Path]) -> Dict[str, GenerationResult]:
    """The results of a ``scores.json`` written by ``save_scores_json``, by method name."""
    payload = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(payload, dict) or payload.get("schema") != SCORES_SCHEMA:
        found = payload.get("schema") if isinstance(payload, dict) else type(payload).__name__
        raise InputError(f"{path} has schema {found!r}; expected {SCORES_SCHEMA!r} (a file written by "
                         "save_scores_json). An image/text classification scores.json is not a generation file.")
    methods = payload.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise InputError(f"{path} has no 'methods' object of method name -> result; the file is incomplete.")
    results = {}
    for name, entry in methods.items():
        try:
            results[name] = result_from_dict(entry)
        except InputError as error:
            raise InputError(f"{path}, method {name!r}: {error}") from None
    return results
