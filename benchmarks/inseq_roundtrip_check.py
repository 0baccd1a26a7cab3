"""Does inseq read what the package writes, and do inseq's steps with the package's methods equal
``GenerationAttribution``? Two halves, two venvs (inseq may pin its own libraries):

* ``write DIR`` (the package's venv): tiny float64 Llama and BART (random weights, a WordLevel
  tokenizer whose token ``t<i>`` is id ``i``, saved with ``save_pretrained``), explained by
  several methods; writes per method ``<family>_<method>.inseq.json`` (``save_inseq_json``) and
  per family ``<family>_scores.json`` (``save_scores_json``: the float64 reference).
* ``check DIR`` (a venv with inseq, e.g. ``python3 -m venv /tmp/inseq_export_venv &&
  /tmp/inseq_export_venv/bin/pip install inseq``): ``FeatureAttributionOutput.load`` of every
  file, compared with the reference read as plain JSON (tokens, NaN layout, arrays: max abs
  difference against float64 and against float32, inseq's load dtype); then, with
  ``PYTHONPATH`` holding the package, inseq's ``"ct_<method>"`` (``register_inseq_methods``) run
  on the saved models, each step compared with the reference rows.

Example::

    .venv/bin/python benchmarks/inseq_roundtrip_check.py write /tmp/inseq_rt
    PYTHONPATH=$PWD /tmp/inseq_export_venv/bin/python benchmarks/inseq_roundtrip_check.py check /tmp/inseq_rt
"""
from __future__ import annotations

import argparse
import json
import math
import os

PROMPT, TARGET = [5, 7, 9, 11], [3, 4, 6]
METHODS = {"llama": ["AttnLRP", "GenericAttention", "RawAttention", "AttentionRollout", "TransformerRelevance"],
           "bart": ["AttnLRP", "GenericAttention", "RawAttention"]}


def _text(ids):
    return " ".join(f"t{i}" for i in ids)


def write(out: str) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    import captum_transformers as ct
    from captum_transformers.integrations.inseq.export import save_inseq_json
    from captum_transformers.generation.serialization import save_scores_json

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 40)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                                     eos_token="</s>", pad_token="<unk>")
    configs = {
        "llama": transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "bart": transformers.BartConfig(vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                                        decoder_ffn_dim=32, max_position_embeddings=32, init_std=0.1, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                                        forced_eos_token_id=None)}
    classes = {"llama": transformers.LlamaForCausalLM, "bart": transformers.BartForConditionalGeneration}
    for family, config in configs.items():
        torch.manual_seed(0)
        config._attn_implementation = "eager"
        model = classes[family](config).double().eval()
        model.save_pretrained(os.path.join(out, family))
        tokenizer.save_pretrained(os.path.join(out, family))
        results = {}
        for name in METHODS[family]:
            explainer = ct.GenerationAttribution(getattr(ct, name)(model), tokenizer)
            results[name] = explainer.attribute(_text(PROMPT), target=_text(TARGET))
            save_inseq_json(results[name], os.path.join(out, f"{family}_{name}.inseq.json"), model_name=family)
        results["AttnLRP_contrast"] = ct.GenerationAttribution(ct.AttnLRP(model), tokenizer).attribute(
            _text(PROMPT), target=_text(TARGET), contrast="t8")
        save_inseq_json(results["AttnLRP_contrast"], os.path.join(out, f"{family}_AttnLRP_contrast.inseq.json"))
        save_scores_json(results, os.path.join(out, f"{family}_scores.json"), prompt=_text(PROMPT), model=family)
    print(f"wrote {out}")


def _array(entry):
    import torch
    values = [[{"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(v, v) if isinstance(v, str) else v
               for v in row] if isinstance(row, list) else row for row in entry["values"]]
    return torch.tensor(values, dtype=torch.float64).reshape(entry["shape"])


def _expected(reference: dict, family: str):
    """inseq's layout of the reference result: (source (n, T) or None, target rows (m, T))."""
    import torch
    token_attr, target_attr = _array(reference["token_attr"]), _array(reference["target_attr"])
    steps = target_attr.shape[0]
    first = 1 if family == "bart" else 0
    unread = torch.arange(target_attr.shape[1])[None, :] >= torch.arange(steps)[:, None] + first
    target_attr = target_attr.masked_fill(unread, math.nan)
    if family == "bart":
        rows = torch.cat([target_attr, torch.full((steps, 1), math.nan, dtype=torch.float64)], 1)
        return token_attr.t(), rows.t()
    return None, torch.cat([token_attr, target_attr], 1).t()


def _difference(got, want) -> float:
    import torch
    if not torch.equal(torch.isnan(got), torch.isnan(want)):
        raise SystemExit("NaN layout differs")
    keep = ~torch.isnan(want)
    return float((got.double()[keep] - want[keep]).abs().max())


def check_files(folder: str) -> None:
    import torch
    from inseq import FeatureAttributionOutput

    worst64 = worst32 = 0.0
    for family in METHODS:
        with open(os.path.join(folder, f"{family}_scores.json")) as handle:
            methods = json.load(handle)["methods"]
        for name, reference in methods.items():
            loaded = FeatureAttributionOutput.load(os.path.join(folder, f"{family}_{name}.inseq.json"))
            sequence = loaded[0]
            source, target = _expected(reference, family)
            pairs = [(sequence.target_attributions, target)]
            if source is not None:
                pairs.append((sequence.source_attributions, source))
            elif sequence.source_attributions is not None:
                raise SystemExit(f"{family} {name}: decoder-only output with source attributions")
            probability = sequence.step_scores["probability"]
            pairs.append((probability, _array(reference["output_probs"])))
            tokens = [t.token for t in sequence.target][-len(reference["output_tokens"]):]
            if tokens != reference["output_tokens"] or loaded.info["attribution_method"] != reference["method"]:
                raise SystemExit(f"{family} {name}: tokens {tokens} or method {loaded.info['attribution_method']}")
            d64 = max(_difference(got, want) for got, want in pairs)
            d32 = max(_difference(got, want.float()) for got, want in pairs)
            worst64, worst32 = max(worst64, d64), max(worst32, d32)
            print(f"{family:5s} {name:22s} dtype {str(sequence.target_attributions.dtype):13s} "
                  f"max|inseq - float64| {d64:.2e}   max|inseq - float32| {d32:.2e}")
            loaded.aggregate()
            loaded.show(display=False, return_html=True)
    print(f"FILES: max abs difference {worst64:.2e} against float64, {worst32:.2e} against float32 (inseq's dtype)")


def check_registered(folder: str) -> None:
    import inseq
    import torch

    from captum_transformers.integrations.inseq.method import INSEQ_METHOD_NAMES, register_inseq_methods

    register_inseq_methods()
    worst = 0.0
    for family in METHODS:
        with open(os.path.join(folder, f"{family}_scores.json")) as handle:
            methods = json.load(handle)["methods"]
        for name in METHODS[family]:
            model = inseq.load_model(os.path.join(folder, family), INSEQ_METHOD_NAMES[name],
                                     model_kwargs={"dtype": torch.float64, "attn_implementation": "eager"})
            generated = _text(PROMPT + TARGET) if family == "llama" else _text(TARGET)
            out = model.attribute(_text(PROMPT), generated_texts=generated, attribute_target=True,
                                  show_progress=False, pretty_progress=False)
            sequence = out[0]
            source, target = _expected(methods[name], family)
            pairs = [(sequence.target_attributions, target)]
            if source is not None:
                pairs.append((sequence.source_attributions, source))
            d = max(_difference(got, want) for got, want in pairs)
            worst = max(worst, d)
            print(f"{family:5s} inseq {INSEQ_METHOD_NAMES[name]:26s} dtype {sequence.target_attributions.dtype} "
                  f"max|inseq step - GenerationAttribution| {d:.2e}")
    print(f"REGISTERED: max abs difference {worst:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["write", "check"])
    parser.add_argument("folder")
    args = parser.parse_args()
    if args.mode == "write":
        write(args.folder)
    else:
        check_files(args.folder)
        check_registered(args.folder)


if __name__ == "__main__":
    main()
