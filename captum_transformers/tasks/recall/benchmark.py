r"""``benchmark --task recall``: do explanations of the recall Llama's answers point at the evidence?

On the first ``limit`` test prompts of the associative recall task (:mod:`.task`, e.g.
``c red fox ; q blue owl ; h green cat ; m pink bee ? h -> green cat``), each method explains
the two answer words, teacher-forced (the true answer is the target, so every method explains
the same tokens), over the prompt tokens (``<bos>`` included). Every answer word is a copy of one
prompt word, so its evidence is known (``RecallExample.evidence``): ``value`` (the copied word
inside the queried record: what counts as a hit), ``key`` (the record's key) and ``query`` (the
asked key after ``?``).

Per method, per (prompt, answer word) with scores :math:`a_j` over the prompt positions :math:`j`:

* **rank** of an evidence position :math:`e`: :math:`r_e = |\{j : a_j \ge a_e\}|` (ties count
  against the method, so a constant row ranks the evidence last, never first by luck);
  top-k hit: :math:`r_e \le k`. Reported: top-1 and top-k (``top_k``, default 3) of the value,
  top-1 of the key and of the query; and top-1 **in the record**: the best-scored prompt token
  is one of the queried record's tokens (its key, either value word) or the query, scoring
  strictly above every other token (the second word is found by matching the first, so a
  perturbation method may point at the first word: a hit here, a miss on the value).
* **share** of positive relevance: :math:`\sum_{j \in E} a_j^+ / \sum_j a_j^+` with
  :math:`a^+ = \max(a, 0)`, for :math:`E` = the value, and for :math:`E` = value, key and query.
  Attention maps are non-negative, so for them it is the share of :math:`|a|`. Undefined (left
  out, counted as ``excluded``) for a row with no positive score.
* **SRG** over the prompt, per answer word (:func:`~captum_transformers.evaluation.
  generation_faithfulness.generation_token_scores`): prompt tokens are replaced by ``<unk>``
  most relevant first (MIF) and least relevant first (LIF), 5 % steps, ``<bos>`` never
  replaced; the curves track the word's probability (the same scale for methods explaining a
  logit or a log-probability), so SRG = A(LIF) - A(MIF) lies in [-1, 1], higher is better.
* **cost**: the method's wall time over the explained answer tokens (ms per token; the
  metrics' own forwards, SRG's among them, are not counted).

Each example's value is the mean over its two answer words; the table gives the mean over
prompts with a percentile bootstrap 95 % interval over prompts (:mod:`.bootstrap`, 1000
resamples, seed 0).

Methods: every package method of the catalog (``RECALL_DEFAULT_METHODS``: the catalog's
default set without Captum's baseline rows), explained by
:class:`~captum_transformers.generation.GenerationAttribution` (score: the answer token's
logit, one batched forward per ``batch_size`` prompts), and Captum's LLM wrappers
(score: its log-probability, Captum's only target there): ``llm-integrated-gradients``,
``LLMGradientAttribution(LayerIntegratedGradients(model, embeddings))`` (50 Gauss-Legendre
steps from the ``<pad>`` embedding, Captum's defaults with ``TextTokenInput``'s baseline id 0),
and ``llm-feature-ablation``, ``LLMAttribution(FeatureAblation(model))`` (each prompt token
replaced by ``<pad>`` in turn; ``forward_in_tokens=False``: one teacher-forced forward per
ablation). The catalog's ``integrated-gradients`` and ``saliency`` rows run when named.

Example::

    >>> report = run_recall_benchmark(["conservative-lrp", "llm-feature-ablation"], limit=8)
    >>> report.result("conservative-lrp", "top1_value").text
    '1.000 [1.000, 1.000]'
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ...model_state import offload
from ...errors import InputError
from ...evaluation.results import ResultRecord, ScalarResult
from ...methods.catalog import KNOWN_METHOD_NAMES, METHOD_NAMES, PACKAGE_METHOD_NAMES, build_method
from ..bootstrap import bootstrap_interval
from .task import VALUE_LENGTH, RecallExample, recall_examples
from ..benchmark_runs import BenchmarkReport, progress_bar, rank_and_world_size

LLM_INTEGRATED_GRADIENTS = "llm-integrated-gradients"
LLM_FEATURE_ABLATION = "llm-feature-ablation"
CAPTUM_LLM_METHODS: Tuple[str, ...] = (LLM_INTEGRATED_GRADIENTS, LLM_FEATURE_ABLATION)
# What "all" (or no choice) runs: the package's methods, then Captum's LLM wrappers.
RECALL_DEFAULT_METHODS: Tuple[str, ...] = tuple(
    name for name in METHOD_NAMES if name in PACKAGE_METHOD_NAMES) + CAPTUM_LLM_METHODS
RECALL_METHOD_NAMES: Tuple[str, ...] = KNOWN_METHOD_NAMES + CAPTUM_LLM_METHODS
DEFAULT_LIMIT = 200
DEFAULT_TOP_K = 3
TEST_SEED = 0  # recall_examples(limit, seed=TEST_SEED, split="test")
SRG_ROWS_PER_FORWARD = 1024  # perturbed sequences per forward call of the SRG curves (memory bound)
EXPLAINED = "the true answer words (teacher-forced)"


@dataclass(frozen=True)
class AnswerAttributions:
    """One method's scores of every answer word over its prompt.

    ``scores`` (n, W, N) float64: prompt ``i``'s answer word ``w`` over the first
    ``lengths[i]`` positions (``<bos>`` is 0), zero beyond; ``seconds``: the wall time spent
    explaining them.
    """

    method: str
    scores: torch.Tensor
    lengths: torch.Tensor
    seconds: float

    @property
    def explained_tokens(self) -> int:
        return self.scores.shape[0] * self.scores.shape[1]


@dataclass(frozen=True)
class EvidenceScores:
    """Per (prompt, answer word), (n, W): the ranks of the value, key and query positions, the
    positive-relevance shares of the value and of the whole evidence (NaN: no positive score),
    and whether the top token lies in the queried record or is the query (``record_hit``)."""

    value_rank: torch.Tensor
    key_rank: torch.Tensor
    query_rank: torch.Tensor
    value_share: torch.Tensor
    evidence_share: torch.Tensor
    record_hit: torch.Tensor


def resolve_recall_methods(names: Optional[Sequence[str]]) -> List[str]:
    """``names`` checked against ``RECALL_METHOD_NAMES``; ``None`` or ``["all"]``: ``RECALL_DEFAULT_METHODS``."""
    if names is None or list(names) == ["all"]:
        return list(RECALL_DEFAULT_METHODS)
    unknown = [name for name in names if name not in RECALL_METHOD_NAMES]
    if unknown:
        raise InputError(f"unknown method {', '.join(map(repr, unknown))} for the recall task; expected one of "
                         f"{', '.join(RECALL_METHOD_NAMES)} (or 'all').")
    return list(names)


def evidence_positions(examples: Sequence[RecallExample]) -> torch.Tensor:
    """(n, W, 3) long: the value, key and query positions of each answer word."""
    return torch.tensor([[list(e.positions) for e in example.evidence] for example in examples], dtype=torch.long)


def _padded(rows: List[torch.Tensor], lengths: List[int]) -> torch.Tensor:
    scores = torch.zeros(len(rows), rows[0].shape[0], max(lengths), dtype=torch.float64)
    for i, (row, length) in enumerate(zip(rows, lengths)):
        if row.shape[1] != length:
            raise InputError(f"a method gave {row.shape[1]} prompt columns for a prompt of {length} tokens; the "
                             "benchmark reads one score per prompt token, <bos> included.")
        scores[i, :, :length] = row.detach().to(device="cpu", dtype=torch.float64)
    return scores


def _package_rows(name: str, model, tokenizer, examples, batch_size: int) -> List[torch.Tensor]:
    from ...generation import GenerationAttribution

    explainer = GenerationAttribution(build_method(name, model), tokenizer)
    rows = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        results = explainer.attribute([e.prompt_ids for e in chunk],
                                      target=[e.answer_ids[:VALUE_LENGTH] for e in chunk])
        rows.extend(result.token_attr for result in results)
    return rows


def _captum_llm_rows(name: str, model, tokenizer, examples) -> List[torch.Tensor]:
    from captum.attr import (FeatureAblation, LayerIntegratedGradients, LLMAttribution, LLMGradientAttribution,
                             TextTokenInput)

    if name == LLM_INTEGRATED_GRADIENTS:
        wrapper = LLMGradientAttribution(LayerIntegratedGradients(model, model.get_input_embeddings()), tokenizer)
        options = {}
    else:
        wrapper = LLMAttribution(FeatureAblation(model), tokenizer)
        # Captum 0.9's default cached token-by-token forward scored the second answer word
        # differently from the uncached and teacher-forced ones on this model; one forward is exact.
        options = {"forward_in_tokens": False}
    device = offload.input_device(model)
    rows = []
    for example in examples:
        target = torch.tensor(example.answer_ids[:VALUE_LENGTH], device=device)
        result = wrapper.attribute(TextTokenInput(example.prompt, tokenizer), target=target, **options)
        rows.append(result.token_attr)
    return rows


def explain_answers(name: str, model, tokenizer, examples: Sequence[RecallExample],
                    batch_size: int = 32) -> AnswerAttributions:
    """Scores of ``name`` (a ``RECALL_METHOD_NAMES`` entry) for each example's answer words, timed."""
    (name,) = resolve_recall_methods([name])
    if not examples:
        raise InputError("no examples to explain; pass at least one RecallExample.")
    examples = list(examples)
    lengths = [len(e.prompt_ids) for e in examples]
    start = time.perf_counter()
    if name in CAPTUM_LLM_METHODS:
        rows = _captum_llm_rows(name, model, tokenizer, examples)
    else:
        rows = _package_rows(name, model, tokenizer, examples, batch_size)
    seconds = time.perf_counter() - start
    scores = _padded(rows, lengths)
    if not torch.isfinite(scores).all():
        raise InputError(f"{name} gave non-finite scores on the recall prompts; the evidence metrics need finite "
                         "scores.")
    return AnswerAttributions(name, scores, torch.tensor(lengths), seconds)


def evidence_scores(scores: torch.Tensor, lengths: torch.Tensor, evidence: torch.Tensor) -> EvidenceScores:
    """Ranks and shares (see the module docstring) of ``scores`` (n, W, N) against ``evidence`` (n, W, 3).

    Example::

        >>> scores = torch.tensor([[[0.0, 0.2, 0.5, 0.3]]])        # one prompt, one word, 4 tokens
        >>> out = evidence_scores(scores, torch.tensor([4]), torch.tensor([[[2, 1, 3]]]))
        >>> out.value_rank.tolist(), out.key_rank.tolist(), round(float(out.value_share), 2)
        ([[1]], [[3]], 0.5)
    """
    if scores.dim() != 3 or evidence.shape != (*scores.shape[:2], 3) or lengths.shape != scores.shape[:1]:
        raise InputError(f"expected scores (n, W, N), lengths (n,) and evidence (n, W, 3); received "
                         f"{tuple(scores.shape)}, {tuple(lengths.shape)} and {tuple(evidence.shape)}.")
    if (evidence < 0).any() or (evidence >= lengths[:, None, None]).any():
        raise InputError("an evidence position lies outside its prompt; positions index the prompt's tokens.")
    scores = scores.to(torch.float64)
    inside = torch.arange(scores.shape[-1])[None, None, :] < lengths[:, None, None]
    at_evidence = scores.gather(-1, evidence)  # (n, W, 3)
    ranks = ((scores[..., None, :] >= at_evidence[..., None]) & inside[..., None, :]).sum(-1)
    positive = scores.clamp(min=0) * inside
    total = positive.sum(-1)
    on_evidence = positive.gather(-1, evidence)
    defined = total > 0
    safe_total = torch.where(defined, total, torch.ones_like(total))
    nan = torch.full_like(total, float("nan"))
    # The record: every answer word's value, the key and the query (all in evidence).
    record = torch.zeros(scores.shape[0], scores.shape[-1], dtype=torch.bool)
    record.scatter_(1, evidence.reshape(scores.shape[0], -1), True)
    record = record[:, None, :] & inside
    other = inside & ~record
    best_in = torch.where(record, scores, torch.full_like(scores, -torch.inf)).amax(-1)
    best_out = torch.where(other, scores, torch.full_like(scores, -torch.inf)).amax(-1)
    return EvidenceScores(ranks[..., 0], ranks[..., 1], ranks[..., 2],
                          torch.where(defined, on_evidence[..., 0] / safe_total, nan),
                          torch.where(defined, on_evidence.sum(-1) / safe_total, nan), best_in > best_out)


def prompt_relevance_gain(model, tokenizer, examples: Sequence[RecallExample],
                          answers: AnswerAttributions) -> torch.Tensor:
    """Per (prompt, answer word), (n, W) float64: SRG over the prompt (see the module docstring),
    from :func:`~captum_transformers.evaluation.generation.faithfulness.generation_token_scores`."""
    from ...evaluation.generation.faithfulness import generation_token_scores
    from ...evaluation.relevance_gain import GAIN_FRACTIONS, symmetric_relevance_gain

    device = offload.input_device(model)

    def forward(batch):
        with torch.no_grad():
            return model(**{key: value.to(device) for key, value in batch.items()}).logits

    words = answers.scores.shape[1]
    token_attr = [answers.scores[i, :, :length] for i, length in enumerate(answers.lengths.tolist())]
    scores = generation_token_scores(forward, [e.prompt_ids for e in examples],
                                     [e.answer_ids[:words] for e in examples], token_attr,
                                     replacement_id=tokenizer.unk_token_id, score="prob", ks=(1,),
                                     fractions=GAIN_FRACTIONS, never_removed_ids=[tokenizer.bos_token_id],
                                     max_batch_size=SRG_ROWS_PER_FORWARD)
    return symmetric_relevance_gain(scores.mif, scores.lif, GAIN_FRACTIONS).srg.reshape(len(examples), words)


def _per_prompt(values: torch.Tensor) -> torch.Tensor:
    """(n, W) -> (n,): the mean over a prompt's answer words that have a value (NaN if none has)."""
    return torch.nanmean(values.to(torch.float64), dim=1)


def evidence_rows(evidence: EvidenceScores, top_k: int = DEFAULT_TOP_K) -> List[ResultRecord]:
    """The bootstrap-interval results of one method: hit rates, shares, then the top-1 value hit
    of each answer word alone (``top1_value_word1``, ...: the JSON and CSV files, not the table)."""
    hits = [("top1_value", evidence.value_rank <= 1), (f"top{top_k}_value", evidence.value_rank <= top_k),
            ("top1_key", evidence.key_rank <= 1), ("top1_query", evidence.query_rank <= 1),
            ("top1_record", evidence.record_hit)]
    shares = [("share_value", evidence.value_share), ("share_evidence", evidence.evidence_share)]
    words = [(f"top1_value_word{w + 1}", evidence.value_rank[:, w:w + 1] <= 1)
             for w in range(evidence.value_rank.shape[1])]
    return [bootstrap_interval(_per_prompt(values), name=name) for name, values in hits + shares + words]


def recall_columns(top_k: int = DEFAULT_TOP_K) -> List[Tuple[str, str, str, str]]:
    """The table's columns as ``tasks.report`` reads them: (header, metric name, field, format)."""
    return [("top-1 value hit", "top1_value", "text", "{}"),
            (f"top-{top_k} value hit", f"top{top_k}_value", "text", "{}"),
            ("top-1 key", "top1_key", "text", "{}"),
            ("top-1 query", "top1_query", "text", "{}"),
            ("top-1 in record", "top1_record", "text", "{}"),
            ("positive share, value", "share_value", "text", "{}"),
            ("positive share, value+key+query", "share_evidence", "text", "{}"),
            ("SRG (prob)", "srg", "text", "{}"),
            ("ms / token", "ms_per_token", "value", "{:.2f}")]


def run_recall_benchmark(methods: Optional[Sequence[str]] = None, limit: Optional[int] = None,
                         batch_size: int = 32, progress: bool = False, device: str = "cpu",
                         explain: Optional[str] = None, top_k: int = DEFAULT_TOP_K) -> BenchmarkReport:
    """Explain the answers of the first ``limit`` (default 200) recall test prompts with every method
    and return the report (rows per method: see :func:`evidence_rows`, ``ms_per_token``)."""
    from .model import load_recall_model

    if explain not in (None, "label"):
        raise InputError(f"explain={explain!r}: the recall task explains the true answer (teacher-forced, "
                         "explain='label'); drop the option.")
    if limit is not None and limit < 1:
        raise InputError(f"--limit {limit}: expected a positive number of prompts.")
    if batch_size < 1:
        raise InputError(f"batch size {batch_size}: expected a positive integer.")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise InputError(f"top_k must be a positive int, received {top_k!r}.")
    if rank_and_world_size()[1] > 1:
        raise InputError("the recall benchmark runs in one process (its intervals resample whole prompts); "
                         "run it without torchrun.")
    names = resolve_recall_methods(methods)
    examples = recall_examples(DEFAULT_LIMIT if limit is None else limit, seed=TEST_SEED, split="test")
    evidence = evidence_positions(examples)
    model, tokenizer = load_recall_model()
    model = model.to(device)
    start, rows = time.perf_counter(), []
    for name in progress_bar(names, len(names), "recall", progress):
        answers = explain_answers(name, model, tokenizer, examples, batch_size)
        scored = evidence_scores(answers.scores, answers.lengths, evidence)
        rows += [(name, result) for result in evidence_rows(scored, top_k)]
        srg = prompt_relevance_gain(model, tokenizer, examples, answers)
        rows.append((name, bootstrap_interval(_per_prompt(srg), name="srg")))
        rows.append((name, ScalarResult("ms_per_token", 1000.0 * answers.seconds / answers.explained_tokens,
                                        answers.explained_tokens)))
    return BenchmarkReport("recall", tuple(names), tuple(rows), len(examples), 1, time.perf_counter() - start,
                           EXPLAINED)


__all__ = ["CAPTUM_LLM_METHODS", "RECALL_DEFAULT_METHODS", "RECALL_METHOD_NAMES", "AnswerAttributions",
           "EvidenceScores", "evidence_positions", "evidence_rows", "evidence_scores", "explain_answers",
           "prompt_relevance_gain",
           "recall_columns", "resolve_recall_methods", "run_recall_benchmark"]
