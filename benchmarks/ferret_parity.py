"""Do the package's ``Comprehensiveness`` / ``Sufficiency`` (``evaluation.aopc``) equal ferret's
``AOPC_Comprehensiveness_Evaluation`` / ``AOPC_Sufficiency_Evaluation`` on identical inputs and
explanations? Two halves, two venvs (ferret-xai 0.4.2 pins transformers < 5 and numpy < 2):

* ``ferret DIR`` (a venv with ferret-xai): builds a tiny random ``BertForSequenceClassification``
  (2 layers, 3 classes, float32) and a WordLevel ``PreTrainedTokenizerFast`` ([CLS] text [SEP],
  words ``w0``..``w59``) from configs, saves both to DIR (no hub), draws texts, labels and token
  scores, and writes ferret's per-example scores of every setting to ``DIR/ferret.json``;
* ``ours DIR`` (the package's venv): loads the same model and tokenizer, evaluates the same
  texts with the package's metrics, one example per ``update`` (per-example values), and
  prints the worst absolute difference per setting.
* no argument: both, the ferret half through ``--ferret-python`` (default
  ``/tmp/venv_ferret/bin/python``).

Settings (ferret's ``evaluation_args``): its defaults (drop tokens, bins 10 %, ..., 100 %,
only positive scores, [CLS]/[SEP] never removed) on 20-word texts with positive scores; the
same with ``remove_tokens=False`` (ids replaced by [MASK]); and the ERASER bins (1, 5, 10, 20,
50 %) on 100-word texts. Scores are positive: ferret's ``only_pos=True`` default leaves
non-positive tokens out of every rationale (not ERASER's definition, which ranks all tokens),
and its ``only_pos=False`` path fails in ferret 0.4.2 (``id_top_k == []`` on a numpy array:
"operands could not be broadcast"), so signed scores cannot be compared. The lengths make ferret's
``int(f * n)`` equal the package's ``ceil(f * n)`` at every bin (checked here), so both remove
the same tokens; ferret also skips a bin whose rationale equals the previous one, which never
happens at these lengths. Where they differ by design the package ranks every changeable token
by its signed score (ERASER; ferret's default keeps only positive ones) and takes ``ceil(f * n)``
tokens (every bin removes at least one, as token flipping; ferret's floor leaves short texts'
small bins empty and skips them).

Result (ferret-xai 0.4.2, whose ``__version__`` still says 0.4.1, with transformers 4.57.6; the
package with transformers 5.24.0; torch 2.14.1, CPU; 12 texts per setting; worst |ours - ferret|
over examples; the model's values reach 0.4-0.7, so a wrong removal shows at once: dropping
where ferret replaces gives 0.23)::

    defaults (drop, 10..100 %)         comprehensiveness 1.7e-07   sufficiency 1.6e-07
    replace by [MASK]                  comprehensiveness 1.1e-07   sufficiency 1.2e-07
    ERASER bins (1..50 %), 100 words   comprehensiveness 1.1e-07   sufficiency 6.0e-07

The differences are float32 rounding of the model's forward (ferret batches 8 padded texts
per call, the package stacks every bin of an example in one call). The script fails above 1e-5.

Example::

    python3 -m venv /tmp/venv_ferret && /tmp/venv_ferret/bin/pip install ferret-xai torch
    .venv/bin/python benchmarks/ferret_parity.py             # both halves, a temporary DIR
    /tmp/venv_ferret/bin/python benchmarks/ferret_parity.py ferret DIR && .venv/bin/python benchmarks/ferret_parity.py ours DIR
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

WORDS = [f"w{i}" for i in range(60)]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
N_TEXTS = 12
TEN_STEPS = [round(0.1 * i, 10) for i in range(1, 11)]
ERASER = [0.01, 0.05, 0.10, 0.20, 0.50]
# name: (words per text, positive scores only, ferret's evaluation_args, the package's options)
SETTINGS = {
    "defaults (drop, 10..100 %)": (20, True, {}, {"fractions": TEN_STEPS}),
    "replace by [MASK]": (20, True, {"removal_args": {"remove_tokens": False}},
                          {"fractions": TEN_STEPS, "removal": "replace"}),
    "ERASER bins (1..50 %), 100 words": (100, True, {"removal_args": {"thresholds": ERASER}},
                                          {"fractions": ERASER}),
}


def ferret_side(directory: str) -> None:
    import numpy as np
    import torch
    from ferret import AOPC_Comprehensiveness_Evaluation, AOPC_Sufficiency_Evaluation
    from ferret.explainers.explanation import Explanation
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    torch.manual_seed(0)
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                        model_input_names=["input_ids", "attention_mask"])
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, num_labels=3,
                        initializer_range=0.5)  # large weights: the probabilities move by ~0.1 per bin, not 1e-5
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    rng = np.random.default_rng(0)
    out = {"versions": {"ferret": __import__("ferret").__version__,
                        "transformers": __import__("transformers").__version__}, "settings": {}}
    for name, (length, positive, args, _) in SETTINGS.items():
        rows = []
        for _ in range(N_TEXTS):
            text = " ".join(rng.choice(WORDS, size=length))
            scores = rng.random(length + 2) + 0.01 if positive else rng.standard_normal(length + 2)
            label = int(rng.integers(0, 3))
            tokens = tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])
            explanation = Explanation(text=text, tokens=tokens, scores=scores, explainer="given", target=label)
            comp = AOPC_Comprehensiveness_Evaluation(model, tokenizer).compute_evaluation(explanation, label, **args)
            suff = AOPC_Sufficiency_Evaluation(model, tokenizer).compute_evaluation(explanation, label, **args)
            rows.append({"text": text, "scores": scores.tolist(), "label": label,
                         "comprehensiveness": float(comp.score), "sufficiency": float(suff.score)})
        out["settings"][name] = rows
    with open(os.path.join(directory, "ferret.json"), "w") as handle:
        json.dump(out, handle)


def ours_side(directory: str) -> dict:
    import torch
    import transformers
    from transformers import BertForSequenceClassification, PreTrainedTokenizerFast

    from captum_transformers.evaluation.tokens.aopc import Comprehensiveness, Sufficiency
    from captum_transformers.evaluation.tokens.token_flipping import flip_counts

    with open(os.path.join(directory, "ferret.json")) as handle:
        reference = json.load(handle)
    model = BertForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    forward = lambda batch: model(**batch).logits  # noqa: E731
    worst = {}
    for name, rows in reference["settings"].items():
        length, _, _, options = SETTINGS[name]
        options = dict(options)
        if options.get("removal") == "replace":
            options["replacement_id"] = tokenizer.mask_token_id
        ours_counts = flip_counts(options["fractions"], torch.ones(1, length, dtype=torch.bool))[:, 0].tolist()
        ferret_counts = [int(f * length) for f in options["fractions"]]  # ferret: int(percentage * n)
        if ours_counts != ferret_counts:
            raise SystemExit(f"{name}: ceil and floor counts differ ({ours_counts} vs {ferret_counts}); "
                             "choose another text length.")
        differences = {"comprehensiveness": [], "sufficiency": []}
        scale = max(abs(row[k]) for row in rows for k in differences)
        for row in rows:
            batch = tokenizer([row["text"]], return_tensors="pt")
            special = torch.tensor([tokenizer.get_special_tokens_mask(batch["input_ids"][0].tolist(),
                                                                      already_has_special_tokens=True)]).bool()
            relevance = torch.tensor([row["scores"]], dtype=torch.float64)
            for metric_name, cls in (("comprehensiveness", Comprehensiveness), ("sufficiency", Sufficiency)):
                metric = cls(forward, **options)
                with torch.no_grad():
                    metric.update(batch["input_ids"], batch["attention_mask"], relevance, torch.tensor([row["label"]]),
                                  special)
                differences[metric_name].append(abs(metric.compute().aopc - row[metric_name]))
        worst[name] = {**{k: max(v) for k, v in differences.items()}, "scale": scale}
    print(f"ferret {reference['versions']['ferret']} (transformers {reference['versions']['transformers']}) vs the "
          f"package (transformers {transformers.__version__}, torch {torch.__version__}), {N_TEXTS} texts per setting")
    for name, values in worst.items():
        print(f"  {name:34s} comprehensiveness {values['comprehensiveness']:.1e}   "
              f"sufficiency {values['sufficiency']:.1e}   (largest |ferret value| {values['scale']:.3f})")
    if not all(math.isfinite(values[k]) and values[k] < 1e-5 for values in worst.values()
               for k in ("comprehensiveness", "sufficiency")):
        raise SystemExit("parity FAILED: a difference reached 1e-5")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("side", nargs="?", choices=("ferret", "ours"))
    parser.add_argument("directory", nargs="?")
    parser.add_argument("--ferret-python", default="/tmp/venv_ferret/bin/python")
    args = parser.parse_args()
    if args.side == "ferret":
        ferret_side(args.directory)
    elif args.side == "ours":
        ours_side(args.directory)
    else:
        directory = args.directory or tempfile.mkdtemp(prefix="ferret_parity_")
        subprocess.run([args.ferret_python, os.path.abspath(__file__), "ferret", directory], check=True,
                       env={**os.environ, "PYTHONPATH": ""})
        ours_side(directory)


if __name__ == "__main__":
    sys.exit(main())
