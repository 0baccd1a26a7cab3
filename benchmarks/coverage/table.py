"""The Markdown support table of a results file (``docs/coverage.md``).

Per head kind one table, one row per architecture and one column per method, in compact cell
codes; the reasons behind ``refused``, ``FAIL`` and ``n.b.`` cells are footnotes (``r3``,
``f2``, ``b1``), each grouped over the cells whose message is the same once class names and
numbers are set aside, with the entries they occur in (and how many methods there). Totals per
head kind, and the versions measured, head the page.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .entries import HEADS

# Method name -> its column heading.
SHORT_NAMES = {
    "raw-attention": "raw", "rollout": "rollout", "attention-flow": "flow", "grad-cam": "grad-cam",
    "partial-lrp": "p-lrp", "lrp": "lrp", "attn-lrp": "attn-lrp", "gradient-x-input": "gxi",
    "conservative-lrp-ah": "cons-ah", "conservative-lrp": "cons", "generic-attention": "generic",
    "transformer-relevance": "relevance", "integrated-gradients": "ig", "saliency": "saliency",
}
CODES = {"reference": "ref", "consistent": "ok", "zero map": "zero", "refused": "refused", "failed": "FAIL",
         "timed out": "t/o", "does not build": "n.b.", "not applicable": "n.a."}
FOOTNOTE_PREFIX = {"refused": "r", "failed": "f", "does not build": "b", "timed out": "t", "zero map": "z",
                   "not applicable": "a"}
EXPLAINED = ("reference", "consistent", "zero map")
HEAD_TITLES = {
    "causal-lm": "Causal LM", "sequence-classification": "Sequence classification",
    "token-classification": "Token classification", "question-answering": "Question answering",
    "masked-lm": "Masked LM", "seq2seq-lm": "Seq2seq LM", "image-classification": "Image classification",
    "audio-classification": "Audio classification",
}
SKIPPED = ("not a text model", "other inputs")
REGENERATE = "nice -n 10 .venv/bin/python benchmarks/coverage_harness.py --markdown docs/coverage.md"
REGENERATE_MEDIA = ("nice -n 10 .venv/bin/python benchmarks/coverage_harness.py --suite vision-audio "
                    "--markdown docs/coverage-vision-audio.md")

_CLASS = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:For[A-Za-z]+|Model|LMHeadModel|Config|Output|Attention|Layer|Block"
                    r"|Decoder|Encoder|Embeddings|MTModel)\w*\b")
_NUMBER = re.compile(r"(?<![A-Za-z_])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def reason_key(detail: str) -> str:
    """A message with class names and numbers set aside: the key that groups like messages."""
    return _NUMBER.sub("N", _CLASS.sub("<model>", detail))


class Footnotes:
    """Footnote numbers per (kind, grouped message), in order of first use, with their cells."""

    def __init__(self) -> None:
        self.notes: Dict[Tuple[str, str], Dict[str, Any]] = {}

    def mark(self, kind: str, verdict: Dict[str, Any], where: str) -> str:
        """The footnote label (``r3``) of ``verdict`` at the cell ``where``."""
        key = (kind, reason_key(verdict.get("detail", "")) + " @ " + _frame_file(verdict.get("frame", "")))
        if key not in self.notes:
            count = sum(1 for k in self.notes if k[0] == kind)
            self.notes[key] = {"label": f"{FOOTNOTE_PREFIX[kind]}{count + 1}", "example": verdict, "cells": []}
        self.notes[key]["cells"].append(where)
        return self.notes[key]["label"]

    def of_kind(self, kind: str) -> List[Dict[str, Any]]:
        return [note for (k, _), note in self.notes.items() if k == kind]


def _frame_file(frame: str) -> str:
    """A frame without its line number (``file in function``): the same bug may move lines."""
    return re.sub(r":\d+ in ", " in ", frame)


def cell(verdict: Optional[Dict[str, Any]], footnotes: Footnotes, where: str) -> str:
    """The compact code of one verdict (with its footnote label)."""
    if verdict is None:
        return ""
    kind = verdict["kind"]
    code = CODES.get(kind, kind)
    if kind in ("refused", "failed", "does not build", "timed out", "not applicable"):
        return f"{code} {footnotes.mark(kind, verdict, where)}"
    return code


def totals(records: Sequence[Dict[str, Any]], methods: Sequence[str]) -> Dict[str, Any]:
    """Counts of one head kind's cells by verdict (text architectures only). Percentages are of
    the applicable cells (run, and not ``n.a.``); an architecture is explained when it builds and
    every applicable cell of it is explained."""
    counts = Counter(record["cells"].get(m, {}).get("kind", "missing") for record in records for m in methods)
    built = sum(counts.values()) - counts["does not build"] - counts["missing"]
    applicable = built - counts["not applicable"]
    explained = sum(counts[kind] for kind in EXPLAINED)
    kinds = [{record["cells"].get(m, {}).get("kind", "missing") for m in methods} for record in records]
    building = [k for k in kinds if "does not build" not in k]
    whole = sum(1 for k in building if k - {"not applicable"} and k <= {*EXPLAINED, "not applicable"})
    return {"architectures": len(records), "built": built, "applicable": applicable, "counts": counts,
            "explained": explained, "explained %": 100.0 * explained / applicable if applicable else 0.0,
            "refused %": 100.0 * counts["refused"] / applicable if applicable else 0.0,
            "building": len(building), "whole": whole,
            "whole %": 100.0 * whole / len(building) if building else 0.0}


def head_section(head: str, records: List[Dict[str, Any]], methods: Sequence[str],
                 footnotes: Footnotes) -> List[str]:
    """The Markdown of one head kind: its table, and the architectures of another modality."""
    text = [r for r in records if _kind_of_entry(r, methods) not in SKIPPED]
    others = [r for r in records if _kind_of_entry(r, methods) in SKIPPED]
    lines = [f"## {HEAD_TITLES.get(head, head)} (`{HEADS[head].mapping}`)", ""]
    lines += ["| architecture | " + " | ".join(SHORT_NAMES.get(m, m) for m in methods) + " |",
              "|---|" + "---|" * len(methods)]
    for record in sorted(text, key=lambda r: r["model_type"]):
        where = f"{record['model_type']}/{head}"
        cells = [cell(record["cells"].get(m), footnotes, f"{where}:{m}") for m in methods]
        mark = " †" if record.get("info", {}).get("model batch == single") is False else ""
        lines.append(f"| `{record['model_type']}` ({record['class']}){mark} | " + " | ".join(cells) + " |")
    if others:
        names = ", ".join(f"`{r['model_type']}`" for r in sorted(others, key=lambda r: r["model_type"]))
        what = ("Not a text model (vision, audio or multimodal inputs; skipped)" if HEADS[head].modality == "text"
                else "Other inputs (token ids, image-text or raw bytes; skipped)")
        lines += ["", f"{what}: {names}."]
    return lines + [""]


def _kind_of_entry(record: Dict[str, Any], methods: Sequence[str]) -> Optional[str]:
    kinds = {record["cells"].get(m, {}).get("kind") for m in methods}
    return kinds.pop() if len(kinds) == 1 else None


def totals_table(by_head: Dict[str, List[Dict[str, Any]]], methods: Sequence[str], noun: str = "text") -> List[str]:
    lines = [f"| head | {noun} architectures | cells run | ref | ok | zero | refused | FAIL | t/o | n.a. | n.b. cells | "
             "explained % | refused % | architectures explained |", "|---|" + "---|" * 13]
    for head, records in by_head.items():
        text = [r for r in records if _kind_of_entry(r, methods) not in SKIPPED]
        t = totals(text, methods)
        c = t["counts"]
        lines.append(f"| {HEAD_TITLES.get(head, head)} | {t['architectures']} | {t['built']} | {c['reference']} | "
                     f"{c['consistent']} | {c['zero map']} | {c['refused']} | {c['failed']} | {c['timed out']} | "
                     f"{c['not applicable']} | {c['does not build']} | {t['explained %']:.1f} | {t['refused %']:.1f} | "
                     f"{t['whole']} of {t['building']} ({t['whole %']:.1f} %) |")
    return lines + [""]


def footnote_section(footnotes: Footnotes) -> List[str]:
    """The footnotes: refusal reasons, failures (with the frame), build failures, time-outs."""
    titles = {"refused": "Refusal reasons", "failed": "Failures", "does not build": "Does not build",
              "timed out": "Timed out", "not applicable": "Not applicable (no softmax attention)"}
    lines = []
    for kind, title in titles.items():
        notes = footnotes.of_kind(kind)
        if not notes:
            continue
        lines += [f"### {title}", ""]
        for note in notes:
            lines.append(_footnote_line(note, kind))
        lines.append("")
    return lines


def _footnote_line(note: Dict[str, Any], kind: str) -> str:
    example = note["example"]
    cells = note["cells"]
    detail = example.get("detail", "")
    detail = detail if "`" in detail else f"`{detail}`"
    where = f" at `{example['frame']}`" if example.get("frame") else ""
    origin = f" (raised in `{example['origin']}`)" if kind == "failed" and example.get("origin") else ""
    return f"* **{note['label']}** ({len(cells)} cells): {detail}{where}{origin}. In {_entries_of(cells)}."


def _entries_of(cells: Sequence[str], shown: int = 8) -> str:
    """The entries (``model_type/head``) of ``cells`` with their method counts, the first ``shown``."""
    counts = Counter(where.split(":")[0] for where in cells)
    listed = [f"`{entry}`" + (f" ({n})" if n > 1 else "") for entry, n in list(counts.items())[:shown]]
    more = f" and {len(counts) - shown} more" if len(counts) > shown else ""
    return ", ".join(listed) + more


def render(results: Dict[str, Any], methods: Optional[Sequence[str]] = None,
           heads: Optional[Sequence[str]] = None, suite: str = "text") -> str:
    """The whole page for ``results`` (methods: those of the results, in catalog order) of the
    sweep ``suite`` (``text`` or ``vision-audio``: the page's introduction)."""
    methods = list(methods or _methods_of(results))
    by_head: Dict[str, List[Dict[str, Any]]] = {}
    for record in results["entries"].values():
        by_head.setdefault(record["head"], []).append(record)
    order = [h for h in (heads or HEADS) if h in by_head]
    by_head = {h: by_head[h] for h in order}
    footnotes = Footnotes()
    sections = [line for head in order for line in head_section(head, by_head[head], methods, footnotes)]
    header = _header(results, methods) if suite == "text" else _media_header(results, methods)
    noun = "text" if suite == "text" else "image / audio"
    return "\n".join(header + totals_table(by_head, methods, noun) + sections
                     + footnote_section(footnotes)).rstrip() + "\n"


def _methods_of(results: Dict[str, Any]) -> List[str]:
    from captum_transformers.methods.catalog import KNOWN_METHOD_NAMES

    found = {m for record in results["entries"].values() for m in record["cells"]}
    return [m for m in KNOWN_METHOD_NAMES if m in found] + sorted(found - set(KNOWN_METHOD_NAMES))


def _header(results: Dict[str, Any], methods: Sequence[str]) -> List[str]:
    legend = ", ".join(f"{SHORT_NAMES.get(m, m)} = `{m}`" for m in methods)
    return [
        "# Text-model coverage",
        "",
        "<!-- Generated by benchmarks/coverage_harness.py; do not edit by hand. -->",
        "",
        f"Measured on **transformers {results.get('transformers', '?')}** (torch {results.get('torch', '?')}, "
        f"captum_transformers {results.get('captum_transformers', '?')} at commit `{results.get('commit', '?')}`, "
        f"Python {results.get('python', '?')}), CPU.",
        "This is the text-model part of the [support matrix](support-matrix.md), measured rather than "
        "hand-written: every architecture of transformers' auto mappings for causal LM, sequence and token "
        "classification, question answering, masked LM and seq2seq LM, built from a shrunk config (width 32, "
        "4 heads, 2 layers, vocabulary 128; random float64 weights, eager attention, seed 0), explained by every "
        "method on a batch of two rows of 8 token ids, the second right-padded after 5 (encoder-decoders: a "
        "decoder prefix of 5, the second padded after 3).",
        "",
        "Each method is built by name (`build_method(name, model)`, the default adapter) and called as the "
        "package documents: `attribute(input_ids, target=..., forward_kwargs={\"attention_mask\": mask})` "
        "(encoder-decoders: `(input_ids, decoder_input_ids)` and both masks). Targets: class 1 (sequence "
        "classification); the logit of token 7 at the last real position (causal LM, seq2seq LM); `(2, label)`, "
        "the token at position 2 (token classification, masked LM); `(0, 2)`, its start score (question "
        "answering).",
        "",
        "Cells:",
        "",
        "* `ref`: consistent, and equal to a reference computed from the model's own eager `output_attentions`: "
        "raw attention (the last layer's head-averaged row of the explained token; encoder-decoders: the last "
        "cross- and decoder self-attention rows), to 1e-10; GenericAttention (Chefer et al., ICCV'21, Eq. 5-6 "
        "from the eager maps and their gradients; one-sequence models), to 1e-8 relative. Where the eager "
        "kernel runs its softmax in float32 (Llama-style), the maps hold float32 values only: 1e-6 and 1e-5; "
        "a map within those only, where the maps look float64 (GPT-J computes its scores in float32), is `ok`. "
        "Models whose eager maps are not all probability maps (linear or differential attention layers) get no "
        "reference.",
        "* `ok` (consistent): finite; no row all zero; zero at padding; each batch row equal to the call on "
        "that example alone, padding cut (1e-8 relative, float64; 1e-5 where the model computes in float32 "
        "inside, as its float32 eager maps show; 1e-3 for LRP and partial LRP on XLM and FlauBERT, whose "
        "float32 softmax the epsilon rule amplifies (1e-8 with it in float64); not checked on the architectures "
        "marked †, whose own scores "
        "differ between batch and single); the model exactly as before (state_dict, `requires_grad`, `.grad`, "
        "modes, hooks, attention implementation, a bit-identical forward output).",
        "* `zero`: consistent, but the map of some row is 0 everywhere, with the package's warning (Grad-CAM and "
        "partial LRP keep only positive evidence; common on random weights).",
        "* `refused rN`: a `CaptumTransformersError`, the model restored; the reason is footnote rN.",
        "* `n.a. aN`: the method's definition does not apply: the package raised `NotSoftmaxAttentionError`, "
        "naming a family whose tokens are mixed by something other than softmax attention (a state-space scan, "
        "a recurrence, Fourier mixing, differential or approximate attention), the model restored; footnote aN. "
        "Integrated Gradients and Saliency apply to every model and are never `n.a.`.",
        "* `FAIL fN`: any other exception (a package bug), a failed check, or a map that differs from the "
        "reference; footnote fN.",
        "* `t/o`: past the time limit; `n.b. bN`: the model does not build (or run on the batch) even with the "
        "harness's overrides: not the package's.",
        "",
        f"Columns: {legend}.",
        "",
        "Regenerate (about 45 minutes on 2 cores; results in `benchmarks/coverage/results.json`, resumable: "
        "entries already there are skipped, so delete it to measure afresh; `--only llama,bert` and `--heads "
        "causal-lm` restrict the sweep, `--table-only` rewrites this page from the JSON):",
        "",
        "```bash",
        REGENERATE,
        "```",
        "",
        "CI runs a fast subset (`tests/test_coverage_harness.py`: Llama, BERT and GPT-2, two heads, three "
        "methods).",
        "",
        "## Totals",
        "",
        "Explained = `ref` + `ok` + `zero`; percentages of the applicable cells (those of text architectures "
        "that build, less `n.a.`). Architectures explained: those that build and whose every applicable cell is "
        "explained.",
        "",
    ]


def _media_header(results: Dict[str, Any], methods: Sequence[str]) -> List[str]:
    legend = ", ".join(f"{SHORT_NAMES.get(m, m)} = `{m}`" for m in methods)
    return [
        "# Vision and audio coverage",
        "",
        "<!-- Generated by benchmarks/coverage_harness.py --suite vision-audio; do not edit by hand. -->",
        "",
        f"Measured on **transformers {results.get('transformers', '?')}** (torch {results.get('torch', '?')}, "
        f"captum_transformers {results.get('captum_transformers', '?')} at commit `{results.get('commit', '?')}`, "
        f"Python {results.get('python', '?')}), CPU.",
        "Every architecture of transformers' auto mappings for image classification and audio classification, "
        "built from a shrunk config (width 32, 4 heads, 2 layers; images of 32 x 32 pixels in patches of at most "
        "8, one block per stage, stage widths / 16; audio feature extractors of 32 channels; random float64 "
        "weights, eager attention, seed 0: `benchmarks/coverage/media.py`), explained by every method on a batch "
        "of two seeded standard-normal inputs of the same size (pixels `(2, C, 32, 32)`; waveforms long enough "
        "for 8 frames; Whisper's log-mel features `(2, mels, 128)`, AST's `(2, 24, 16)`), target class 1, "
        "called as `attribute(inputs, target=1)`. No padding: a padded audio batch is not measured here.",
        "",
        "Cells:",
        "",
        "* `ok` (consistent): a map of the input's shape, finite, no row all zero, each batch row equal to the "
        "call on that example alone (1e-8 relative; 1e-5 for Saliency and Integrated Gradients on CvT and LeViT, whose logit's "
        "gradient at the pixels is ~1e-12 of the values inside, so rounding reaches 1.6e-6), the model exactly as before (state_dict, `requires_grad`, "
        "`.grad`, modes, hooks, attention implementation, a bit-identical forward output). For raw attention, "
        "rollout and attention flow, which take no gradient (so the package's own check of the rows a head reads "
        "cannot run), also: the rows the trace explains are the rows whose gradient of the logit at the output "
        "of the last self-attention block is not zero, equally weighted (the head's mean); a method that "
        "explains another row (the CLS row of a mean-pooled head) is `FAIL`. There is no eager reference for "
        "these maps (no `ref` cells).",
        "* `zero`: consistent, but some row's map is 0 everywhere, with the package's warning.",
        "* `refused rN`: a `CaptumTransformersError` (footnote rN), the model restored; CNNs get one refusal "
        "naming the missing attention.",
        "* `n.a. aN`: the package raised `NotSoftmaxAttentionError`: the tokens are mixed by something other "
        "than softmax attention.",
        "* `FAIL fN`: any other exception, a failed check, or a wrong row; footnote fN.",
        "* `t/o`: past the time limit; `n.b. bN`: the model does not build (or run) from the shrunk config.",
        "",
        f"Columns: {legend}.",
        "",
        "Regenerate (results in `benchmarks/coverage/results-vision-audio.json`, resumable; `--only vit,beit` "
        "restricts the sweep, `--table-only` rewrites this page):",
        "",
        "```bash",
        REGENERATE_MEDIA,
        "```",
        "",
        "CI runs a subset (`tests/test_coverage_media.py`).",
        "",
        "## Totals",
        "",
        "Explained = `ok` + `zero`; percentages of the applicable cells (architectures that build, less `n.a.`). "
        "Architectures explained: those that build and whose every applicable cell is explained.",
        "",
    ]
