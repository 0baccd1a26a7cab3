"""A generation explanation as the JSON that inseq writes, so ``inseq`` reads it back.

``save_inseq_json(result, "out.json")`` writes what inseq 0.7's ``FeatureAttributionOutput.save``
writes (without importing inseq), so ``inseq.FeatureAttributionOutput.load("out.json")`` gives
an output with inseq's tools (``show``, ``aggregate``, merging). inseq's layout, per generated
token ``t`` (a column):

* decoder-only models: ``source`` is the prompt, ``target`` the prompt then the output tokens,
  ``source_attributions`` is None and ``target_attributions`` (P + T, T) holds
  ``token_attr[t]`` over the prompt rows then ``target_attr[t]`` over the output rows;
  ``attr_pos_start = P`` (the first generated position);
* encoder-decoders: ``source_attributions`` (n, T) is ``token_attr`` transposed, ``target``
  the decoder's tokens (the start token, then the outputs), ``target_attributions`` (T + 1, T)
  ``target_attr`` transposed with a last row for the last output token; ``attr_pos_start = 1``.

A token a step did not read (``y_j`` for ``j >= t``) is NaN, as inseq marks it (the result
holds a structural 0 there; a nonzero value there is refused rather than dropped). Step scores:
``"probability"`` (``output_probs``) and the explained score under its kind (``"logit"``,
``"log_prob"``, ``"prob"``; with foils ``"contrast_<kind>_diff"``). ``info`` names the method
(``attribution_method``), the score, and whatever the caller adds (``model_name``...).

Tensors are base64 safetensors (one tensor named ``"attribution"``) in the result's dtype;
inseq's ``load`` casts them to float32, so what it reads equals ``tensor.float()``. Each
sequence is a ``CoarseFeatureAttributionSequenceOutput`` (one score per token, as inseq's
occlusion methods give). A span result (one row for several tokens) has no column per token
in inseq's layout and is refused. Token ids unknown to the result (template features, an
encoder-decoder's start token) are -1.

Example::

    >>> result = GenerationAttribution(AttnLRP(llm), tokenizer).attribute("k = 3 ; q ?", target="3")
    >>> save_inseq_json(result, "out.json", model_name="my-llama")
    >>> inseq.FeatureAttributionOutput.load("out.json").show()       # in a venv with inseq
"""
from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...errors import InputError
from ...generation.result import GenerationResult

INSEQ_OUTPUT_TYPE = ("inseq.data.attribution", "FeatureAttributionOutput")
INSEQ_SEQUENCE_TYPE = ("inseq.data.attribution", "CoarseFeatureAttributionSequenceOutput")
INSEQ_TOKEN_TYPE = ("inseq.utils.typing", "TokenWithId")
SEQUENCE_FIELDS = ("attr_pos_end", "attr_pos_start", "sequence_scores", "source", "source_attributions",
                   "step_scores", "target", "target_attributions")
SAFETENSOR_NAME = "attribution"
_SAFETENSOR_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSOR_DTYPES.items()}


def safetensor_b64(tensor: torch.Tensor) -> str:
    """``tensor`` as inseq stores it: the safetensors file of ``{"attribution": tensor}``, base64.

    Safetensors layout: an 8-byte little-endian header length, a JSON header (name -> dtype,
    shape, byte offsets; padded with spaces to 8 bytes), then the little-endian C-order data.
    """
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype not in _SAFETENSOR_DTYPES:
        raise InputError(f"Expected a floating tensor ({sorted(map(str, _SAFETENSOR_DTYPES))}), got {tensor.dtype}.")
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    header = json.dumps({SAFETENSOR_NAME: {"dtype": _SAFETENSOR_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                                           "data_offsets": [0, len(data)]}}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return base64.b64encode(struct.pack("<Q", len(header)) + header + data).decode("ascii")


def tensor_from_safetensor_b64(text: str) -> torch.Tensor:
    """The tensor :func:`safetensor_b64` wrote (its dtype kept; inseq's loader casts to float32).

    Malformed input (bad base64, a header length past the end, a header that is not JSON or
    lacks the entry, an unknown dtype, offsets that are negative, reversed, past the data or of
    a size other than the shape's) raises ``InputError`` naming what was found.
    """
    def refuse(problem: str) -> InputError:
        return InputError(f"Not a safetensors tensor as safetensor_b64 (inseq) writes it: {problem}. Pass the text "
                          "of a 'target_attributions' / 'source_attributions' entry of a saved inseq JSON.")

    if not isinstance(text, (str, bytes)):
        raise refuse(f"expected base64 text, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as error:
        raise refuse(f"the text is not base64 ({error})") from None
    if len(raw) < 8:
        raise refuse(f"{len(raw)} bytes, fewer than the 8-byte header length")
    size = struct.unpack("<Q", raw[:8])[0]
    if size > len(raw) - 8:
        raise refuse(f"the header length {size} runs past the {len(raw) - 8} bytes after it")
    try:
        header = json.loads(raw[8:8 + size])
    except (ValueError, UnicodeDecodeError) as error:
        raise refuse(f"the header is not JSON ({error})") from None
    entry = header.get(SAFETENSOR_NAME) if isinstance(header, dict) else None
    if not isinstance(entry, dict):
        names = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise refuse(f"the header holds no {SAFETENSOR_NAME!r} entry (found {names})")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _TORCH_DTYPES:
        raise refuse(f"dtype {dtype!r} is none of {sorted(_TORCH_DTYPES)}")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise refuse(f"shape {shape!r} is not a list of sizes >= 0")
    data_size = len(raw) - 8 - size
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_size):
        raise refuse(f"data_offsets {offsets!r} are not [start, end] with 0 <= start <= end <= {data_size} "
                     "(the data's size)")
    start, end = offsets
    numel = 1
    for n in shape:
        numel *= n
    width = torch.empty(0, dtype=_TORCH_DTYPES[dtype]).element_size()
    if end - start != numel * width:
        raise refuse(f"{end - start} data bytes for shape {shape} of {dtype} ({numel * width} bytes)")
    data = bytearray(raw[8 + size + start:8 + size + end])
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(_TORCH_DTYPES[dtype]).reshape(shape).clone()


def _instance(kind: Tuple[str, str], attributes: Dict[str, Any]) -> Dict[str, Any]:
    return {"__instance_type__": list(kind), "attributes": attributes}


def _tokens(names: Sequence[str], ids: Optional[Sequence[int]]) -> List[Dict[str, Any]]:
    if ids is None or len(ids) != len(names):  # template features, skipped tokens: no id per name
        ids = [-1] * len(names)
    return [_instance(INSEQ_TOKEN_TYPE, {"id": int(i), "token": str(n)}) for n, i in zip(names, ids)]


def _is_encoder_decoder(result: GenerationResult, encoder_decoder: Optional[bool]) -> bool:
    """Decoder-only results read the output tokens (``target_attr_tokens == output_tokens``),
    encoder-decoders the start token then the outputs but the last."""
    known = encoder_decoder if encoder_decoder is not None else getattr(result, "encoder_decoder", None)
    if known is not None:
        return bool(known)
    read, outputs = list(result.target_attr_tokens), list(result.output_tokens)
    decoder_only = read == outputs
    seq2seq = len(read) == len(outputs) and read[1:] == outputs[:-1]
    if decoder_only and seq2seq:
        raise InputError(f"The output tokens {outputs[:6]} fit both a decoder-only and an encoder-decoder layout; "
                         "pass encoder_decoder=True or False.")
    if not (decoder_only or seq2seq):
        raise InputError(f"target_attr_tokens {read[:6]} are neither the output tokens {outputs[:6]} (decoder-only) "
                         "nor the start token then the outputs (encoder-decoder); pass a result of "
                         "GenerationAttribution.attribute, or encoder_decoder=True/False.")
    return seq2seq


def _unread_as_nan(rows: torch.Tensor, first_unread: int) -> torch.Tensor:
    """``rows`` (T, m) with ``rows[t, j]`` NaN for ``j >= t + first_unread`` (tokens step ``t`` had
    not read); refuses a nonzero there (it would be lost)."""
    steps, width = rows.shape
    unread = torch.arange(width)[None, :] >= torch.arange(steps)[:, None] + first_unread
    if bool((rows[unread] != 0).any()):
        raise InputError("target_attr holds nonzero scores on output tokens a step had not read yet; inseq's layout "
                         "has no place for them (it writes NaN there). This is not a result of "
                         "GenerationAttribution.attribute; report it.")
    return rows.masked_fill(unread, float("nan"))


def _score_name(result: GenerationResult) -> str:
    kind = str(result.score_kind)
    return kind if result.contrast_tokens is None else f"contrast_{kind}_diff"


def to_inseq_dict(result: GenerationResult, encoder_decoder: Optional[bool] = None, **info: Any) -> Dict[str, Any]:
    """The JSON object of inseq's ``FeatureAttributionOutput.save`` for ``result`` (layout in
    the module docstring). ``info`` entries (``model_name``, ``input_texts``...) go into inseq's
    ``info`` dict, over the defaults."""
    if not isinstance(result, GenerationResult):
        raise InputError(f"Expected a GenerationResult (what GenerationAttribution.attribute returns), got "
                         f"{type(result).__name__}.")
    steps = len(result.output_tokens)
    if steps != len(result.output_ids):
        raise InputError(f"This result explains a span ({result.output_tokens[0]!r}: one row for "
                         f"{len(result.output_ids)} output tokens); inseq lays out one column per generated token. "
                         "Export the per-token result (attribute without span=).")
    seq2seq = _is_encoder_decoder(result, encoder_decoder)
    prompt = _tokens(result.input_tokens, result.input_ids)
    outputs = _tokens(result.output_tokens, result.output_ids)
    if seq2seq:
        target = _tokens(result.target_attr_tokens[:1], None) + outputs
        target_rows = torch.cat([_unread_as_nan(result.target_attr, 1),
                                 result.target_attr.new_full((steps, 1), float("nan"))], dim=1)
        source_attributions, start = safetensor_b64(result.token_attr.t()), 1
    else:
        target = prompt + outputs
        target_rows = torch.cat([result.token_attr, _unread_as_nan(result.target_attr, 0)], dim=1)
        source_attributions, start = None, len(prompt)
    step_scores = {"probability": safetensor_b64(result.output_probs),
                   _score_name(result): safetensor_b64(result.scores)}
    sequence = {"attr_pos_end": start + steps, "attr_pos_start": start, "sequence_scores": {}, "source": prompt,
                "source_attributions": source_attributions, "step_scores": step_scores, "target": target,
                "target_attributions": safetensor_b64(target_rows.t())}
    details = {"attribution_method": str(result.method), "attr_pos_start": start, "attr_pos_end": start + steps,
               "attribute_target": True, "attributed_fn": _score_name(result), "step_scores": list(step_scores),
               "signed": bool(result.signed), "contrast_tokens": result.contrast_tokens,
               "input_texts": [" ".join(result.input_tokens)],
               "generated_texts": [" ".join(result.output_tokens)], "exported_by": "captum_transformers"}
    details.update(info)
    try:
        json.dumps(details, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InputError(f"info must be JSON-safe (strings, numbers, lists, dicts): {error}.") from None
    return _instance(INSEQ_OUTPUT_TYPE, {"info": details, "sequence_attributions": [_instance(INSEQ_SEQUENCE_TYPE,
                                                                                                sequence)],
                                         "step_attributions": None})


def save_inseq_json(result: GenerationResult, path: Union[str, Path], encoder_decoder: Optional[bool] = None,
                    **info: Any) -> Path:
    """Write :func:`to_inseq_dict` to ``path`` (read it with ``inseq.FeatureAttributionOutput.load``)."""
    path = Path(path)
    path.write_text(json.dumps(to_inseq_dict(result, encoder_decoder, **info), indent=1, sort_keys=True),
                    encoding="utf-8")
    return path
