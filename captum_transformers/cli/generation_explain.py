"""``captum-transformers explain --prompt TEXT``: why a language model wrote each token, by every method.

The model continues the prompt greedily (``--generate N`` new tokens at most, cut after its
end-of-sequence token) or is given the continuation (``--target TEXT``); every method then
explains each output token ``y_t`` from the prompt and the tokens before it, with
:class:`~captum_transformers.GenerationAttribution` (``--score``: the logit, log-probability or
probability of ``y_t``; ``--contrast FOIL``: ``score(y_t) - score(foil)``). One generation is
shared by all methods, so their rows explain the same tokens.

Without ``--model`` the built-in recall Llama answers associative-recall prompts
(``"c red fox ; q blue owl ; h green cat ; m pink bee ? h"`` -> ``"green cat <eos>"``); ``--model`` is a local
HuggingFace folder (``AutoModelForCausalLM``, or ``AutoModelForSeq2SeqLM`` when its config is
an encoder-decoder, with ``AutoTokenizer``) or a hub id, read offline when the hub cannot be
reached (``model_loading.hub_unreachable``).

Written into ``--out``: ``generation.html`` (every method's matrix side by side, then each
output token's evidence over the text, per method), ``generation.png`` (the matrices) and
``scores.json`` (``save_scores_json``: tokens, ``token_attr`` and ``target_attr``, score kind,
probabilities, prompt and model; read back with ``load_scores_json``). One line per method
names, for each output token, the prompt token with the largest score (special tokens left
out).

Example::

    captum-transformers explain --prompt "c red fox ; q blue owl ; h green cat ; m pink bee ? h" \
        --method attn-lrp
    #       attn-lrp: 'green' <- 'h'@9 (+10.8) | 'cat' <- 'cat'@11 (+5.02) | '<eos>' <- '?'@16 (+9.67)
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import InputError
from ..methods.catalog import CAPTUM_BASELINES, ON_REQUEST, PACKAGE_METHOD_NAMES, build_method, \
    resolve_method_names
from .device import checked_device
from .output_folder import claimed_output_folder

SCORE_CHOICES = ("logit", "log_prob", "prob")
# Every package method but the exact maximum flow (seconds per token); Captum's rows (IG: a
# gradient per step and interpolation point, Saliency) run when named.
GENERATION_METHODS: Tuple[str, ...] = tuple(name for name in PACKAGE_METHOD_NAMES if name not in ON_REQUEST)
BUILTIN_NAME = "built-in recall Llama"
# New tokens when --generate is not given, for a model other than the built-in one (whose answers
# are recall_model.MAX_NEW_TOKENS long).
DEFAULT_NEW_TOKENS = 20
# Classifier options that mean nothing for a generation: refused instead of ignored.
CLASSIFIER_ONLY = (("image", "--image"), ("text", "--text"), ("motifs", "--motifs"), ("arch", "--arch"),
                   ("random_init", "--random-init"), ("save_scores", "--save-scores"))


def add_generation_arguments(parser) -> None:
    """The options of ``explain`` that only ``--prompt`` uses (checked in ``run_generation``)."""
    parser.add_argument("--prompt", help="explain a language model's continuation of TEXT token by token "
                                         "(default model: the built-in recall Llama); writes generation.html, "
                                         "generation.png and scores.json")
    parser.add_argument("--generate", metavar="N",
                        help="with --prompt: generate up to N new tokens greedily (default: the built-in model's "
                             f"answer length, else {DEFAULT_NEW_TOKENS})")
    parser.add_argument("--contrast", metavar="TEXT", help="with --prompt: explain score(token) - score(foil), the "
                                                           "foil tokens of TEXT (one per output token, or one for all)")
    parser.add_argument("--score", metavar="{" + ",".join(SCORE_CHOICES) + "}",
                        help="with --prompt: the explained score of each output token (default: logit)")


def run_generation(args) -> int:
    """``explain --prompt``: every check before any work, then load, generate, explain, write."""
    methods, new_tokens, kind = _checked_arguments(args)
    device = checked_device(args.device)
    with claimed_output_folder(args.out, "generation.html", "explain") as out:
        model, tokenizer, name, default_new = load_generative_model(args.model)
        _refuse_captum_rows_on_encoder_decoders(model, methods)
        _refuse_methods_the_dtype_cannot_run(model, methods)
        model.to(device)
        prompt_ids = list(tokenizer(args.prompt, add_special_tokens=True)["input_ids"])
        target_ids = _target_ids(args, model, tokenizer, prompt_ids, default_new if new_tokens is None else new_tokens,
                                 explicit=new_tokens is not None)
        print(f"{name}: {_shown(tokenizer, prompt_ids)} -> {_shown(tokenizer, target_ids)}"
              f" ({'given' if args.target is not None else 'generated'}); explaining the {kind} of each output token "
              f"with {len(methods)} method(s)")
        results = explain_generation(model, tokenizer, args.prompt, target_ids, methods, kind, args.contrast,
                                     special_ids=set(getattr(tokenizer, "all_special_ids", ()) or ()))
        meta = dict(prompt=args.prompt, model=name, target=args.target, contrast=args.contrast,
                    generated=args.target is None, device=str(device))
        for path in write_generation_files(results, out, meta):
            print(f"wrote {path}")
    return 0


def _checked_arguments(args) -> Tuple[List[str], Optional[int], str]:
    """``(methods, --generate N or None, score kind)``; every mistake is one ``InputError``."""
    from ..generation.prompts import refuse_undecodable_text

    given = [flag for attribute, flag in CLASSIFIER_ONLY if getattr(args, attribute, None)]
    if given:
        raise InputError(f"--prompt explains a language model's generation; {', '.join(given)} belong(s) to the "
                         "classifier explanations. Drop them (scores.json is always written with --prompt).")
    for flag, text in (("--prompt", args.prompt), ("--target", args.target), ("--contrast", args.contrast)):
        if text is not None:  # bytes that were not UTF-8 arrive as surrogate escapes ('\udcff')
            refuse_undecodable_text(text, flag)
    if not args.prompt.strip():
        raise InputError("--prompt is empty; give the text the model continues, e.g. --prompt "
                         "\"c red fox ; q blue owl ? q\".")
    if args.generate is not None and args.target is not None:
        raise InputError(f"--generate {args.generate} and --target {args.target!r} both say what to explain; give "
                         "--generate N to explain what the model writes, or --target TEXT to explain that text.")
    if args.target is not None and not args.target.strip():
        raise InputError("--target is empty; give the continuation to explain, or drop --target to let the model "
                         "generate it.")
    new_tokens = None
    if args.generate is not None:
        try:
            new_tokens = int(args.generate)
        except ValueError:
            new_tokens = 0
        if new_tokens < 1:
            raise InputError(f"--generate {args.generate}: expected a positive number of new tokens, e.g. "
                             "--generate 5.")
    kind = args.score or "logit"
    if kind not in SCORE_CHOICES:
        raise InputError(f"--score {kind!r}: expected one of {', '.join(SCORE_CHOICES)}.")
    if args.contrast is not None and not args.contrast.strip():
        raise InputError("--contrast is empty; give the foil token(s) to explain against, or drop --contrast.")
    methods = list(dict.fromkeys(GENERATION_METHODS if args.method is None else resolve_method_names(args.method)))
    captum_rows = [name for name in methods if name in CAPTUM_BASELINES]
    if captum_rows and (kind != "logit" or args.contrast is not None):
        # Captum's rows explain one step's logit per prefix call (generation.prefix_calls).
        raise InputError(f"{', '.join(captum_rows)} explain(s) the next-token logit only; drop "
                         f"{'--contrast' if args.contrast is not None else '--score ' + kind} or those methods.")
    return methods, new_tokens, kind


def _refuse_captum_rows_on_encoder_decoders(model, methods: List[str]) -> None:
    from ..generation.assembly import encoder_decoder_model

    captum_rows = [name for name in methods if name in CAPTUM_BASELINES]
    if captum_rows and encoder_decoder_model(model):
        raise InputError(f"{', '.join(captum_rows)} explain(s) one token-id input; this encoder-decoder is explained "
                         "by the package's methods only: drop them.")


def _refuse_methods_the_dtype_cannot_run(model, methods: List[str]) -> None:
    """Methods whose rules refuse this model's dtype (bfloat16: the identity softmax and norm rules),
    refused before any work instead of after the others ran."""
    from ..adapters.input_checks import model_dtype
    from ..errors import CaptumTransformersError
    from ..methods.catalog import build_method
    from ..propagation.rules.rule_set import refuse_rounding_sensitive

    refused = []
    for name in methods:
        rules = getattr(build_method(name, model), "rules", None)
        try:
            refuse_rounding_sensitive(rules, model_dtype(model))
        except CaptumTransformersError:
            refused.append(name)
    if refused:
        raise InputError(f"{', '.join(refused)} refuse(s) a {model_dtype(model)} model (their rules round away the "
                         "relevance); drop them with --method, or save the model in float32.")


def _target_ids(args, model, tokenizer, prompt_ids: List[int], new_tokens: int, explicit: bool) -> List[int]:
    """The output to explain: ``--target``'s tokens, or the model's greedy continuation. The
    positions both need are checked by the rule GenerationAttribution applies
    (:mod:`captum_transformers.generation.positions`: a position table is a limit, rotary or
    relative positions are not), so the command and the API accept the same prompts."""
    from ..generation.assembly import encoder_decoder_model
    from ..generation.generate import generated_targets
    from ..generation.positions import output_room, refuse_positions_past_the_table
    from ..generation.prompts import encode_target

    encoder_decoder = encoder_decoder_model(model)
    if args.target is not None:
        target_ids = encode_target(args.target, tokenizer)
        refuse_positions_past_the_table(model, len(prompt_ids), len(target_ids), encoder_decoder, "--prompt",
                                        "--target tokens", "give a --target of at most {room} tokens")
        return target_ids
    room = output_room(model, len(prompt_ids), encoder_decoder)
    if not explicit and room is not None:
        new_tokens = min(new_tokens, room)  # the default fits what the model reads
    refuse_positions_past_the_table(model, len(prompt_ids), new_tokens, encoder_decoder, "--prompt",
                                    f"new tokens (--generate {new_tokens})", "give --generate at most {room}")
    (target_ids,) = generated_targets(model, tokenizer, [prompt_ids], {"max_new_tokens": new_tokens,
                                                                      "do_sample": False}, encoder_decoder)
    return target_ids


def explain_generation(model, tokenizer, prompt: str, target_ids: List[int], methods: List[str], kind: str,
                       contrast: Optional[str], special_ids=frozenset()) -> Dict[str, Any]:
    """``{method name: GenerationResult}`` of one prompt and output; prints one line per method."""
    from ..generation import GenerationAttribution

    results = {}
    for name in methods:
        start = time.perf_counter()
        explainer = GenerationAttribution(build_method(name, model), tokenizer, score=kind)
        results[name] = explainer.attribute(prompt, target=list(target_ids), contrast=contrast)
        print(f"  {name:>22}: {summary_line(results[name], special_ids)}   "
              f"({(time.perf_counter() - start) * 1000:.0f} ms)")
    return results


def summary_line(result, special_ids=frozenset()) -> str:
    """Per output token, the prompt token with the largest score and its position (special tokens
    left out unless the prompt has no other): ``'green' <- 'h'@9 (+10.8) | ...``; a row with no
    positive score says so instead of naming an arbitrary token."""
    allowed = torch.tensor([int(i) not in special_ids for i in result.input_ids], dtype=torch.bool)
    if not bool(allowed.any()) or len(result.input_ids) != result.token_attr.shape[1]:
        allowed = torch.ones(result.token_attr.shape[1], dtype=torch.bool)
    parts = []
    for row, token in enumerate(result.output_tokens):
        scores = result.token_attr[row].float().masked_fill(~allowed, float("-inf"))
        top = int(scores.argmax())
        value = float(result.token_attr[row, top])
        parts.append(f"{token!r} <- {result.input_tokens[top]!r}@{top} ({value:+.3g})" if value > 0 else
                     f"{token!r} <- no prompt token scores above 0 (largest {value:+.3g})")
    return " | ".join(parts)


def write_generation_files(results: Dict[str, Any], out: Path, meta: Dict[str, Any]) -> Tuple[Path, ...]:
    """``generation.html``, ``generation.png`` and ``scores.json`` in ``out``."""
    from ..generation.serialization import save_scores_json
    from ..visualization import generation_report
    from ..visualization.output import standalone_page

    first = next(iter(results.values()))
    matrices = generation_report(results)
    sections = [matrices.to_html()]
    for index, token in enumerate(first.output_tokens):
        sections.append(generation_report(results, output_index=index,
                                          title=f"Output token {index} {token!r}: its evidence by method").to_html())
    html_path = out / "generation.html"
    html_path.write_text(standalone_page("".join(sections), f"Why {meta.get('model')} wrote each token"),
                         encoding="utf-8")
    png_path = matrices.save(out / "generation.png")
    json_path = save_scores_json(results, out / "scores.json", **meta)
    return html_path, png_path, json_path


def _shown(tokenizer, ids: List[int]) -> str:
    return repr(" ".join(tokenizer.convert_ids_to_tokens(list(ids))))


# -- the model ------------------------------------------------------------------------------
def load_generative_model(spec: Optional[str]):
    """``(model, tokenizer, name, default new tokens)``: the built-in recall Llama, or ``--model``."""
    if spec is None:
        from ..tasks.recall.model import MAX_NEW_TOKENS, load_recall_model

        model, tokenizer = load_recall_model()
        return model.eval(), tokenizer, BUILTIN_NAME, MAX_NEW_TOKENS
    path = Path(spec).expanduser()
    if path.is_file() or (not path.is_dir() and spec.startswith(("./", "../", "/", "~"))):
        raise InputError(f"--model {spec!r} with --prompt: {'a file' if path.is_file() else 'no such directory'}; "
                         "expected a HuggingFace language model folder written by save_pretrained (config.json, "
                         "weights, tokenizer) or a hub id.")
    model, tokenizer = _huggingface_lm(str(path) if path.is_dir() else spec, local=path.is_dir())
    return model, tokenizer, spec, DEFAULT_NEW_TOKENS


def _huggingface_lm(source: str, local: bool):
    """A causal (or encoder-decoder) LM and its tokenizer, with the classifier loader's one-line errors."""
    from ..model_loading import first_line, hub_config, transformers_log_held, weights_problem

    transformers, config, options = hub_config(source, local, "a language model folder written by "
                                               "model.save_pretrained(folder) and tokenizer.save_pretrained(folder)")
    auto = transformers.AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else \
        transformers.AutoModelForCausalLM
    with transformers_log_held() as held:
        try:
            model, loading = auto.from_pretrained(source, output_loading_info=True, **options)
        except (OSError, ValueError) as error:
            raise InputError(f"--model {source!r}: {auto.__name__} could not load it ({first_line(error)}); expected "
                             "a language model with a generation head saved with save_pretrained.") from None
        except Exception as error:  # safetensors' SafetensorError, torch's RuntimeError on sizes, ...
            raise InputError(weights_problem(source, error, held).replace("a classification model",
                                                                           "a language model")) from None
        missing = sorted(loading.get("missing_keys") or ())
        if missing:
            raise InputError(f"--model {source!r}: the weights hold no value for {len(missing)} parameter(s) of "
                             f"{auto.__name__} (first: {', '.join(missing[:3])}), which would be random; expected a "
                             "language model with its generation head, saved with save_pretrained.")
        held.passed_on = True
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, **options)
    except (OSError, ValueError) as error:
        raise InputError(f"{source!r} has no tokenizer ({type(error).__name__}); save the tokenizer with "
                         "tokenizer.save_pretrained into the same directory.") from None
    return model.eval(), tokenizer
