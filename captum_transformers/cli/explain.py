"""``captum-transformers explain``: every method side by side on a few inputs, as a PNG.

With no arguments it explains sample DigitCanvas test canvases with the built-in model,
offline, in seconds. ``--model`` takes a HF directory or hub id, a timm name, or a
checkpoint (see ``model_loading``); ``--image`` / ``--text`` give the inputs. The pictures
(``explanations.png`` and a self-contained ``explanations.html``) are drawn by
``captum_transformers.visualization``; ``--save-scores`` adds the raw scores as
``scores.json`` (schema in ``scores_file``).

``--prompt TEXT`` switches to language models: each generated (or ``--target``) token is
explained by every method, written as ``generation.html``, ``generation.png`` and
``scores.json`` (see ``generation_explain``).
"""
from __future__ import annotations

import time
from typing import Dict, List

import torch

from ..capture.targets import output_scores
from ..errors import InputError
from ..methods.catalog import KNOWN_METHOD_NAMES, build_method, resolve_method_names
from . import figures
from ..model_loading import on_device
from .device import ACCEPTED, checked_device
from ..model_loading import LoadedModel, load_model, read_image
from .output_folder import claimed_output_folder
from .scores_file import write_scores


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("explain", help="explain inputs with every method, write a PNG grid and HTML page",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory or hub id, timm model name, or checkpoint file "
                                        "(default: the built-in DigitCanvas ViT)")
    parser.add_argument("--arch", help="timm architecture of a state-dict checkpoint")
    parser.add_argument("--random-init", action="store_true", help="timm: random weights instead of pretrained")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="read a --model checkpoint file as a full pickle (a whole nn.Module saved with "
                             "torch.save(model)). The file then runs as code: unpickling executes whatever it holds, "
                             "with your permissions. Only for a file you trust as a program; by default a checkpoint "
                             "is read with torch.load(weights_only=True), tensors only")
    parser.add_argument("--image", action="append", default=[], help="image file (repeatable)")
    parser.add_argument("--text", action="append", default=[], help="text to classify (repeatable)")
    # Checked in run(), not by argparse: with --prompt a wrong name is one line, as every generation error.
    parser.add_argument("--method", action="append", metavar="{" + ",".join(KNOWN_METHOD_NAMES + ("all",)) + "}",
                        default=None, help="method to run (repeatable; default: all)")
    parser.add_argument("--target", help="class to explain (default: the predicted class); with --prompt, the "
                                         "continuation to explain (text)")
    parser.add_argument("--samples", type=int, default=4, help="built-in model: number of sample canvases")
    parser.add_argument("--motifs", type=int, metavar="N",
                        help="explain N BA-2Motifs test graphs with the built-in graph model (PyG TransformerConv); "
                             "default methods: those that apply to it")
    parser.add_argument("--save-scores", action="store_true",
                        help="also write every method's raw scores (signed, not rescaled) to OUT/scores.json")
    parser.add_argument("--device", default="cpu", help=f"where the model runs: {ACCEPTED} (default: %(default)s)")
    parser.add_argument("--out", default="captum_transformers_explain",
                        help="output folder (default: %(default)s); one that holds an earlier explanations.png is "
                             "never overwritten: the run goes to OUT-2, OUT-3, ... and says so")
    from .generation_explain import add_generation_arguments

    add_generation_arguments(parser)
    parser.set_defaults(run=run, explain_parser=parser)


def _classifier_arguments(args) -> None:
    """What argparse checked before --prompt shared --method and --target: an unknown method
    or a --target that is no int is a usage error (exit 2); generation options need --prompt."""
    parser = args.explain_parser
    for name in args.method or ():
        if name not in KNOWN_METHOD_NAMES + ("all",):
            parser.error(f"argument --method: invalid choice: {name!r} (choose from "
                         f"{', '.join(map(repr, KNOWN_METHOD_NAMES + ('all',)))})")
    if args.target is not None:
        try:
            args.target = int(args.target)
        except ValueError:
            parser.error(f"argument --target: invalid int value: {args.target!r}")
    given = [option for option, value in (("--generate", args.generate), ("--contrast", args.contrast),
                                          ("--score", args.score)) if value is not None]
    if given:
        raise InputError(f"{', '.join(given)} explain(s) a language model's generation and need(s) --prompt TEXT; "
                         "add --prompt, or drop them to explain a classifier.")


def _raw_inputs(loaded: LoadedModel, args) -> tuple:
    """The batch to explain: ``(inputs, forward_kwargs, displays, labels or None)``."""
    if args.image and args.text:
        raise InputError("give either --image or --text, not both.")
    if loaded.modality == "image" and args.text:
        raise InputError(f"{loaded.name} is an image model but got --text; give --image FILE or a text model.")
    if loaded.modality == "text" and args.image:
        raise InputError(f"{loaded.name} is a text model but got --image; give --text STRING or an image model.")
    if args.image:
        return (*loaded.prepare([read_image(path) for path in args.image]), None)
    if args.text:
        return (*loaded.prepare(args.text), None)
    if args.model is not None:
        raise InputError(f"nothing to explain: give --image FILE or --text STRING for {loaded.name}.")
    if args.samples < 1:
        raise InputError(f"--samples {args.samples}: expected at least 1.")
    from ..tasks.digits.canvas import digit_canvases, normalize

    canvases = digit_canvases(split="test", variant="one", n=args.samples, seed=0)
    return (normalize(canvases.images),), {}, list(canvases.images), canvases.labels


def _logits(model, inputs, forward_kwargs) -> torch.Tensor:
    with torch.no_grad():
        output = output_scores(model(*inputs, **forward_kwargs))  # a dict or ModelOutput: its "logits"
    return output[0] if isinstance(output, (tuple, list)) else output


def run(args) -> int:
    if args.prompt is not None:
        from .generation_explain import run_generation

        return run_generation(args)
    _classifier_arguments(args)
    device = checked_device(args.device)
    if args.motifs is not None:
        from .graph_explain import GRAPH_METHODS, explain_motifs

        if args.model or args.image or args.text:
            raise InputError("--motifs explains the built-in graph model; drop --model, --image and --text.")
        if device.type != "cpu":
            raise InputError(f"--motifs runs the built-in graph model on the CPU; drop --device {args.device}.")
        if args.save_scores:
            raise InputError("--save-scores writes image and token scores; graph node scores are not written yet. "
                             "Drop --save-scores, or use captum_transformers.integrations.pyg.TransformerExplainer in Python.")
        methods = resolve_method_names(args.method or list(GRAPH_METHODS))
        with claimed_output_folder(args.out, "explanations.png", "explain") as out:
            print(f"wrote {explain_motifs(args.motifs, methods, args.target, out)}")
        return 0
    methods = resolve_method_names(args.method)
    with claimed_output_folder(args.out, "explanations.png", "explain") as out:
        return _explain(args, methods, device, out)


def _explain(args, methods: List[str], device: torch.device, out) -> int:
    loaded = load_model(args.model, args.arch, args.random_init, trust_pickle=args.trust_pickle)
    inputs, forward_kwargs, displays, labels = _raw_inputs(loaded, args)
    _, inputs, forward_kwargs = on_device(device, loaded.model, inputs, forward_kwargs)
    logits = _logits(loaded.model, inputs, forward_kwargs)
    if logits.dim() != 2:
        raise InputError(f"{loaded.name} returns scores of shape {tuple(logits.shape)}; expected (batch, classes).")
    classes = logits.shape[-1]
    if args.target is not None and not 0 <= args.target < classes:
        raise InputError(f"--target {args.target} is out of range: {loaded.name} has {classes} classes "
                         f"(0..{classes - 1}).")
    probabilities = logits.softmax(-1)
    predicted = probabilities.argmax(-1)
    target = predicted if args.target is None else torch.full_like(predicted, args.target)
    titles, examples = [], []
    for index in range(len(displays)):
        title = (f"pred {loaded.class_name(int(predicted[index]))} "
                 f"({float(probabilities[index, predicted[index]]):.2f})")
        if labels is not None:
            title += f", true {loaded.class_name(int(labels[index]))}"
        titles.append(title)
        examples.append(_example_record(loaded, index, title, predicted, probabilities, target, labels, displays))
        print(f"input {index}: {title}")
    print(f"explaining class {'predicted' if args.target is None else loaded.class_name(args.target)} "
          f"with {len(methods)} method(s) on {loaded.name}")
    mask = forward_kwargs.get("attention_mask")
    mask = None if mask is None else mask.cpu()
    scores: Dict[str, torch.Tensor] = {}
    raw_scores: Dict[str, object] = {}
    for name in methods:
        start = time.perf_counter()
        attribution = build_method(name, loaded.model).attribute(
            inputs[0] if len(inputs) == 1 else inputs, target=target, forward_kwargs=forward_kwargs or None,
            return_tokens=loaded.modality == "text")
        attribution = (attribution[0] if isinstance(attribution, tuple) else attribution).detach().float().cpu()
        raw_scores[name] = _raw_scores(loaded, attribution, mask)
        scores[name] = _display_scores(loaded, attribution, displays, mask)
        print(f"  {name:>22}: {(time.perf_counter() - start) * 1000:7.0f} ms")
    # The explained logit per example, so that each signed map shows its relevance sum beside it.
    explained = logits.detach().float().gather(1, target[:, None].to(logits.device)).squeeze(1).cpu()
    if loaded.modality == "image":
        paths = figures.image_grid(displays, scores, titles, out, logits=explained)
    else:
        paths = figures.token_strips(displays, scores, titles, loaded.special_tokens, out, logits=explained)
    if args.save_scores:
        paths += (write_scores(out / "scores.json", model=loaded.name, modality=loaded.modality, target=args.target,
                               examples=examples, scores=raw_scores),)
    for path in paths:
        print(f"wrote {path}")
    return 0


def _example_record(loaded: LoadedModel, index: int, title: str, predicted, probabilities, target, labels,
                    displays) -> dict:
    """One example's entry of scores.json (see ``scores_file``)."""
    record = {"index": index, "title": title, "predicted": int(predicted[index]),
              "predicted_name": loaded.class_name(int(predicted[index])),
              "probability": float(probabilities[index, predicted[index]]), "explained_class": int(target[index]),
              "true": None if labels is None else int(labels[index])}
    if loaded.modality == "text":
        record["tokens"] = list(displays[index])
        record["special"] = [token in loaded.special_tokens for token in displays[index]]
    return record


def _raw_scores(loaded: LoadedModel, attribution: torch.Tensor, mask):
    """What scores.json keeps: the attribution as returned (images), or per example the scores
    of its real tokens, special tokens included (text)."""
    if loaded.modality == "image":
        return attribution
    if mask is None:
        return list(attribution)
    return [row[keep.bool()] for row, keep in zip(attribution, mask)]


def _display_scores(loaded: LoadedModel, attribution: torch.Tensor, displays: List, mask) -> torch.Tensor:
    """Image maps summed over channels (B, H, W); for text, the scores of each example's real
    tokens (left- or right-padding alike), padded after them to (B, longest). Special tokens
    keep their scores: the token strips draw them uncoloured and leave them out of the scale."""
    if loaded.modality == "image":
        return attribution.sum(1) if attribution.dim() == 4 else attribution
    scores = torch.zeros(len(displays), max(len(tokens) for tokens in displays))
    for row, tokens in enumerate(displays):  # display only: a few short examples
        real = attribution[row] if mask is None else attribution[row][mask[row].bool()]
        scores[row, :len(tokens)] = real[:len(tokens)]
    return scores
