"""Turn the ``--model`` argument of the command line into a model and its preprocessing.

``--model`` is read, in this order, as:

1. nothing: the built-in DigitCanvas ViT shipped inside the package (offline);
2. an existing directory: a HuggingFace model saved with ``save_pretrained`` (its
   ``config.json`` says image or text; the processor or tokenizer is read from the same
   directory);
3. an existing file: a checkpoint, a state dict together with ``--arch <timm model name>``,
   read with ``torch.load(weights_only=True)`` (tensors and plain containers only: nothing in
   the file runs); a whole pickled ``nn.Module`` (``torch.save(model)``) only with
   ``trust_pickle=True`` (``--trust-pickle``), since unpickling it runs whatever code the file
   names, so it is refused, before anything in it runs, with the two ways out;
4. a timm model name (``timm.is_model``): pretrained weights from the hub, or random weights
   with ``--random-init``;
5. anything else: a HuggingFace hub id, fetched with ``from_pretrained``.

Every failure is an ``InputError`` that names the fix (a hub that cannot be reached says to
give the model as a local directory). A hub id is looked up fast: when ``HF_HUB_OFFLINE`` is
set or one short connection to the hub's host fails (``HUB_PROBE_SECONDS``), only the local
cache is read, so an unreachable hub is one line at once instead of half a minute of
retries. Weights that cannot be read (an empty or truncated ``model.safetensors``) or that
do not fit ``config.json`` are one line too, never transformers' traceback or report.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlparse

import torch
from torch import nn

from .errors import InputError


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to explain, with what the command line needs around it.

    ``prepare(raws)`` turns a list of raw inputs (PIL images, or strings) into one batch of
    model inputs: ``(model_inputs: tuple, forward_kwargs: dict, displays: list)`` where each
    display is the [0, 1] image (3, H, W) or the example's list of tokens.
    """

    model: nn.Module
    modality: str  # "image" or "text"
    name: str
    prepare: Callable
    class_names: Optional[List[str]] = None
    special_tokens: frozenset = frozenset()  # text: tokens shown but not scored ([CLS], [SEP], <s>, ...)

    def class_name(self, index: int) -> str:
        if self.class_names and 0 <= index < len(self.class_names):
            return self.class_names[index]
        return str(index)


def load_model(spec: Optional[str], arch: Optional[str] = None, random_init: bool = False,
               trust_pickle: bool = False) -> LoadedModel:
    """The model that ``--model spec`` names (see the module docstring for the order).
    ``trust_pickle``: read a checkpoint file as a full pickle (a whole ``nn.Module``), which runs
    any code the file holds; only for a file trusted as code (``--trust-pickle``)."""
    if spec is None:
        return _builtin()
    path = Path(spec).expanduser()
    if path.is_dir():
        return _huggingface(str(path), local=True)
    if path.is_file():
        return _checkpoint(path, arch, trust_pickle)
    if spec.startswith(("./", "../", "/", "~")) or spec.endswith((".pt", ".pth", ".bin", ".safetensors")):
        raise InputError(f"--model {spec!r}: no such file or directory; expected a HuggingFace model directory, "
                         "a checkpoint file, a timm model name or a hub id.")
    if _is_timm_name(spec):
        return _timm(spec, pretrained=not random_init)
    return _huggingface(spec, local=False)


def _image_preparer(size, mean, std) -> Callable:
    """``prepare`` for image models: resize to ``size``, then ``(x - mean) / std`` per channel."""
    mean = torch.as_tensor(mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.as_tensor(std, dtype=torch.float32).view(3, 1, 1)

    def prepare(raws):
        images = torch.stack([_image_tensor(raw, size) for raw in raws])
        return ((images - mean) / std,), {}, list(images)

    return prepare


def _input_size(model: nn.Module, default) -> tuple:
    """The (H, W) the patch embedding was built for (timm), else ``default``."""
    built_for = getattr(getattr(model, "patch_embed", None), "img_size", None)
    return tuple(built_for) if built_for is not None else tuple(default)


def _builtin() -> LoadedModel:
    from .tasks.digits import canvas as digit_canvas
    from .tasks.digits import model as digit_model

    prepare = _image_preparer((32, 32), digit_canvas.DIGIT_MEAN, digit_canvas.DIGIT_STD)
    return LoadedModel(digit_model.load_digit_model(), "image", "built-in DigitCanvas ViT", prepare,
                       [str(digit) for digit in range(10)])


def _is_timm_name(spec: str) -> bool:
    try:
        import timm
    except ImportError:
        return False
    return timm.is_model(spec)


def _timm(name: str, pretrained: bool, state_dict: Optional[Dict[str, torch.Tensor]] = None) -> LoadedModel:
    import timm
    import timm.data

    try:
        model = timm.create_model(name, pretrained=pretrained)
    except Exception as error:  # network, missing weights: many exception types
        raise InputError(f"could not fetch pretrained weights for timm model {name!r} ({type(error).__name__}); "
                         "the hub is unreachable or has no weights for it. Give a local checkpoint instead "
                         "(--model FILE --arch NAME), or --random-init to explain an untrained model.") from None
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise InputError(f"the checkpoint does not fit timm model {name!r}: missing {list(missing)[:5]}, "
                             f"unexpected {list(unexpected)[:5]}; check --arch.")
    model.eval()
    config = timm.data.resolve_data_config({}, model=model)
    prepare = _image_preparer(_input_size(model, config["input_size"][1:]), config["mean"], config["std"])
    return LoadedModel(model, "image", name, prepare, None)


#: What torch's weights-only unpickler names when a file wants a Python object beyond tensors.
_UNSAFE_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _checkpoint(path: Path, arch: Optional[str], trust_pickle: bool) -> LoadedModel:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except Exception as error:
        raise InputError(_unreadable_checkpoint(path, error, trust_pickle)) from None
    if isinstance(loaded, nn.Module):
        return _wrap_module(loaded.eval(), path.name)
    if isinstance(loaded, dict) and all(isinstance(v, torch.Tensor) for v in loaded.values()):
        if arch is None:
            raise InputError(f"{str(path)!r} holds a state dict; say which timm architecture it belongs to with "
                             "--arch NAME (e.g. --arch vit_small_patch16_224).")
        if not _is_timm_name(arch):
            raise InputError(f"--arch {arch!r} is not a timm model name; see timm.list_models().")
        return _timm(arch, pretrained=False, state_dict=loaded)
    raise InputError(f"{str(path)!r} holds a {type(loaded).__name__}; expected a pickled nn.Module or a state dict.")


def _unreadable_checkpoint(path: Path, error: Exception, trust_pickle: bool) -> str:
    """Why ``torch.load`` could not read ``path``, and what to do (one line)."""
    found = None if trust_pickle else _UNSAFE_GLOBAL.search(str(error))
    if found is not None:
        return (f"could not read checkpoint {str(path)!r} safely: it is a pickle that names the Python object "
                f"{found.group(1)}, not only tensors (as a whole nn.Module saved with torch.save(model) does); "
                "unpickling it would run code from the file, so nothing of it was loaded. Save the weights instead, "
                "torch.save(model.state_dict(), path), and give them with --arch NAME; or, only if you trust the "
                "file as you trust a program you run, add --trust-pickle.")
    text = " ".join(str(error).split())
    detail = text.split("WeightsUnpickler error: ")[-1].split(" Check the documentation")[0] or \
        ("it ended early: empty or cut short" if isinstance(error, EOFError) else "no detail")
    detail = detail if len(detail) <= 160 else detail[:157] + "..."
    return (f"could not read checkpoint {str(path)!r} ({type(error).__name__}: {detail}); expected a file written "
            "by torch.save (a state dict of tensors with --arch NAME; a whole pickled module needs --trust-pickle).")


def _wrap_module(model: nn.Module, name: str) -> LoadedModel:
    """A whole pickled module: its timm data config if it has one (else ImageNet statistics),
    at the input size its patch embedding was built for (else 224 x 224)."""
    config = getattr(model, "pretrained_cfg", None) or {}
    size = _input_size(model, config.get("input_size", (3, 224, 224))[1:])
    prepare = _image_preparer(size, config.get("mean", (0.485, 0.456, 0.406)), config.get("std", (0.229, 0.224, 0.225)))
    return LoadedModel(model, "image", name, prepare, None)


#: How long the one connection that tells whether the hub is reachable may take.
HUB_PROBE_SECONDS = 3.0
_TRUE = ("1", "on", "yes", "true")


def hub_unreachable() -> Optional[str]:
    """Why the HuggingFace hub cannot be reached now (``None`` when it may be): the offline
    switch, or one short TCP connection to its host that failed. Behind a proxy (an
    ``HTTPS_PROXY`` / ``ALL_PROXY`` variable) the connection is not tried: the proxy decides."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return f"{name} is set"
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    parsed = urlparse(endpoint)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
    except OSError as error:
        return f"{host}:{port} does not answer ({error.strerror or type(error).__name__})"
    return None


def hub_config(source: str, local: bool, expected: str, not_also: str = "") -> tuple:
    """``(transformers, config, options)`` of a HuggingFace ``source`` (a folder, or a hub id read
    from the local cache when the hub cannot be reached: transformers would retry for half a
    minute), or the one-line :class:`InputError` saying what ``source`` is not; ``expected`` names
    the folder wanted, ``not_also`` the other kinds of ``--model`` the caller tried first."""
    try:
        import transformers
    except ImportError:
        raise InputError("HuggingFace models need transformers: pip install 'captum_transformers[hf]'.") from None
    unreachable = None if local else hub_unreachable()
    options = {"local_files_only": True} if unreachable else {}
    try:
        config = transformers.AutoConfig.from_pretrained(source, **options)
    except (OSError, ValueError) as error:  # transformers 5: a folder with no config.json is a ValueError
        if local:
            found = "has no config.json" if not (Path(source) / "config.json").exists() else \
                f"has a config.json that transformers cannot read ({first_line(error)})"
            raise InputError(f"--model {source!r} is a directory that {found}; expected {expected}.") from None
        where = f"the hub cannot be reached ({unreachable})" if unreachable else \
            "the HuggingFace hub could not provide it (unreachable, or no such model)"
        raise InputError(f"unknown model {source!r}: not a directory{not_also}, not in the local HuggingFace cache, "
                         f"and {where}. Give the model as a local directory saved with save_pretrained "
                         "(--model path/to/dir).") from None
    return transformers, config, options


def _huggingface(source: str, local: bool) -> LoadedModel:
    transformers, config, options = hub_config(
        source, local, "a model folder written by model.save_pretrained(folder) (config.json and the weights)",
        ", not a checkpoint file, not a timm model name")
    names = _class_names(config)
    if getattr(config, "image_size", None) is not None and config.model_type not in _TEXT_TYPES:
        model = _from_pretrained(transformers.AutoModelForImageClassification, source, **options)
        try:
            processor = transformers.AutoImageProcessor.from_pretrained(source, **options)
        except (OSError, ValueError):
            processor = None
        size = _pair(config.image_size)

        def prepare(raws):
            if processor is None:  # ViT-style default: [0, 1] -> [-1, 1]
                images = torch.stack([_image_tensor(raw, size) for raw in raws])
                return (images * 2 - 1,), {}, list(images)
            pixels = processor(images=[raw.convert("RGB") for raw in raws], return_tensors="pt")["pixel_values"]
            return (pixels,), {}, [_image_tensor(raw, tuple(pixels.shape[-2:])) for raw in raws]

        return LoadedModel(model, "image", source, prepare, names)
    model = _from_pretrained(transformers.AutoModelForSequenceClassification, source, **options)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, **options)
    except (OSError, ValueError) as error:
        raise InputError(f"{source!r} has no tokenizer ({type(error).__name__}); save the tokenizer with "
                         "tokenizer.save_pretrained into the same directory.") from None

    def prepare(raws):
        encoded = tokenizer(list(raws), return_tensors="pt", truncation=True, padding=True)
        tokens = [tokenizer.convert_ids_to_tokens(ids[mask.bool()])
                  for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]
        return (encoded["input_ids"],), {"attention_mask": encoded["attention_mask"]}, tokens

    return LoadedModel(model, "text", source, prepare, names, frozenset(tokenizer.all_special_tokens))


_TEXT_TYPES = frozenset({"clip_text_model"})


def _from_pretrained(auto_class, source: str, **options) -> nn.Module:
    """``auto_class.from_pretrained(source)`` in eval mode; missing or unreadable weights,
    weights that do not fit the config, or a config with no classification head of that kind
    are an ``InputError`` (one line: transformers' load report is held back and shown only
    when the load succeeds)."""
    with transformers_log_held() as held:
        try:
            model, loading = auto_class.from_pretrained(source, output_loading_info=True, **options)
        except (OSError, ValueError) as error:
            raise InputError(f"--model {source!r}: {auto_class.__name__} could not load it ({first_line(error)}); "
                             "expected a classification model saved with save_pretrained (config.json and "
                             "model.safetensors).") from None
        except Exception as error:  # safetensors' SafetensorError, torch's RuntimeError on sizes, ...
            raise InputError(weights_problem(source, error, held)) from None
        missing = list(loading.get("missing_keys") or ())
        if missing:
            # A base checkpoint loaded into a classification head: the head is random, and so would
            # be every explanation of its classes.
            raise InputError(f"--model {source!r}: the weights hold no value for {len(missing)} parameter(s) of "
                             f"{auto_class.__name__} (first: {', '.join(sorted(missing)[:3])}), which would be random; "
                             "expected a classification model fine-tuned and saved with save_pretrained. Fine-tune "
                             "the head and save the model, then explain the saved folder.")
        held.passed_on = True
    return model.eval()


class HeldRecords(logging.Handler):
    """Log records kept while a model loads, passed on only if ``passed_on`` is set."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: List[logging.LogRecord] = []
        self.passed_on = False

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def transformers_log_held() -> Iterator[HeldRecords]:
    """transformers' log records held back, and its progress bars off (a failed load then
    prints only our one line). Warnings are recorded whatever the verbosity (the load report
    names the first mismatched weight); on release, only those the verbosity shows are passed on."""
    from transformers.utils import logging as transformers_logging

    logger = logging.getLogger("transformers")
    held, saved, level = HeldRecords(), list(logger.handlers), logger.level
    bars = transformers_logging.is_progress_bar_enabled()
    shown = logger.getEffectiveLevel()
    logger.handlers = [held]
    logger.setLevel(min(shown, logging.WARNING))
    transformers_logging.disable_progress_bar()
    try:
        yield held
    finally:
        logger.handlers = saved
        logger.setLevel(level)
        if bars:
            transformers_logging.enable_progress_bar()
        if held.passed_on:
            for record in held.records:
                if record.levelno >= shown:
                    logger.handle(record)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MISMATCH = re.compile(r"([\w.{}, ]+?)\s*\|\s*MISMATCH\s*\|.*?ckpt:\s*torch\.Size\(\[([^\]]*)\]\)\s*vs\s*"
                       r"model:\s*torch\.Size\(\[([^\]]*)\]\)")


def weights_problem(source: str, error: Exception, held: HeldRecords) -> str:
    """One line saying why the weights of ``source`` could not be loaded, and what to do."""
    text = " ".join(_ANSI.sub("", record.getMessage()) for record in held.records) + " " + str(error)
    found = _MISMATCH.search(text)
    if found or "size mismatch" in text or "mismatched" in text:
        detail = (f" (first: {found.group(1).strip()} is ({found.group(2)}) in the weights, ({found.group(3)}) by "
                  "config.json)") if found else f" ({first_line(error)})"
        return (f"--model {source!r}: the weights do not fit config.json, their sizes differ{detail}; config.json "
                "and the weights must come from the same model.save_pretrained(folder).")
    if type(error).__name__ == "SafetensorError" or "deserializ" in str(error):
        return (f"--model {source!r}: its weights file cannot be read ({first_line(error)}); it is empty, truncated "
                "or not a safetensors file. Save the model again with model.save_pretrained(folder), or download "
                "it again.")
    return (f"--model {source!r}: the weights could not be loaded ({type(error).__name__}: {first_line(error)}); "
            "expected a classification model saved with save_pretrained (config.json and model.safetensors).")


def first_line(error: Exception, limit: int = 160) -> str:
    """An exception as one short line (transformers' messages span several)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _class_names(config) -> Optional[List[str]]:
    labels = getattr(config, "id2label", None) or {}
    if not labels:
        return None
    return [str(labels.get(index, labels.get(str(index), index))) for index in range(len(labels))]


def _pair(size) -> tuple:
    return (size, size) if isinstance(size, int) else tuple(size)


def _image_tensor(raw, size) -> torch.Tensor:
    """A PIL image as a (3, H, W) float tensor in [0, 1], resized to ``size`` (bilinear)."""
    import numpy as np

    array = np.asarray(raw.convert("RGB"), dtype=np.float32) / 255.0
    image = torch.from_numpy(array).permute(2, 0, 1).unsqueeze(0)
    if tuple(image.shape[-2:]) != tuple(size):
        image = torch.nn.functional.interpolate(image, size=tuple(size), mode="bilinear", align_corners=False,
                                                antialias=True)
    return image[0].clamp(0, 1)


def read_image(path: str):
    """Open ``path`` as a PIL image, with a one-line error when it cannot be read."""
    try:
        from PIL import Image
    except ImportError:
        raise InputError("reading images needs Pillow: pip install pillow.") from None
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise InputError(f"--image {path!r}: no such file.") from None
    except Exception as error:
        raise InputError(f"--image {path!r} is not a readable image ({type(error).__name__}); expected a PNG, JPEG "
                         "or any format Pillow opens.") from None


def on_device(device, model, inputs: Tuple, forward_kwargs: Optional[Dict[str, Any]] = None):
    """``(model, inputs, forward_kwargs)`` on ``device`` (the ``--device`` of ``explain`` and ``explore``,
    checked by :func:`captum_transformers.cli.device.checked_device`) (``None`` or the CPU: as they are).
    Only for a model the command loaded itself: moving it changes nobody else's."""
    forward_kwargs = dict(forward_kwargs or {})
    if device is None or str(device) == "cpu":
        return model, tuple(inputs), forward_kwargs
    model.to(device)
    return (model, tuple(t.to(device) for t in inputs),
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in forward_kwargs.items()})
