r"""Faithfulness of generation explanations: per generated token, remove its evidence from the prompt.

For a causal LM, a prompt ``x`` (``n`` removable tokens), the generated tokens ``y_1..y_T`` and
an explanation ``token_attr[t]`` (over the prompt) of each ``y_t``, with ``s_t(x)`` the score of
``y_t`` read at its position with ``y_<t`` teacher-forced (its logit, log-probability or
probability, like :class:`~captum_transformers.generation.GenerationResult.score_kind`)::

    drop_k   = s_t(x) - s_t(x \ top_k(token_attr[t]))        for k in ks (default 1, 2, 3, 5)
    MIF(f)   = s_t(x \ ceil(f n) most relevant of token_attr[t])
    LIF(f)   = s_t(x \ ceil(f n) least relevant of token_attr[t])
    SRG      = A(LIF) - A(MIF)    (trapezoid over f; Blücher et al., TMLR 2024)

each averaged over every generated token of every prompt (a token is the unit: a prompt with
three answer tokens weighs three). The curve math is :func:`.relevance_gain.symmetric_relevance_gain`
and the orders :func:`.relevance_gain.removal_masks` (ties: earlier position first for both MIF
and LIF, so a constant map scores SRG 0). ``k`` larger than ``n`` removes every removable token.

**Removal by replacement.** A removed prompt token's id becomes ``replacement_id`` (the
model's ``<unk>``, ``<pad>`` or a neutral word); positions and the attention mask stay. Masking
it out through the attention mask instead is not a removal in a causal LM: the position that
predicts ``y_1`` is the last prompt token itself, whose own embedding reaches the prediction
through the residual stream whatever the mask says (and on the recall task that token is
the query key, part of the evidence). Tokens whose id is in ``never_removed_ids`` (``<bos>``,
attention sinks, chat-template markers) stay.

**Batched.** Sequences are prompt + teacher-forced output, right padded (a causal model does
not read the padding after a position, so no position ids change). Every (prompt, generated
token) pair is one row; the ``1 + len(ks) + 2 len(fractions)`` perturbation steps of all rows
are stacked step-major into one forward call (or calls of ``max_batch_size`` rows at most:
with ``max_batch_size`` = the rows of a batch, one call per step), never a loop over output
tokens. States are exact sums (:mod:`.accumulator`), so
``merge`` and ``all_reduce_metrics`` reproduce one process bit for bit.

Example::

    >>> model, tokenizer = load_recall_model()
    >>> results = GenerationAttribution(AttnLRP(model), tokenizer).attribute(prompts)
    >>> metric = GenerationFaithfulness(model, replacement_id=tokenizer.unk_token_id,
    ...                                 never_removed_ids=[tokenizer.bos_token_id])
    >>> metric.update(results)
    >>> metric.compute().srg
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ...model_state import offload
from ...errors import InputError
from ..accumulator import Accumulator, exact_sum
from ..batched_forward import check_max_batch_size, logits_per_step
from ..relevance_gain import GAIN_FRACTIONS, removal_masks, symmetric_relevance_gain
from ..results import ResultRecord
from ..tokens.token_flipping import ranks
from ..validation import require_choice, require_fractions

GENERATION_KS: Tuple[int, ...] = (1, 2, 3, 5)
"""How many top prompt tokens the score-drop steps remove."""

GENERATION_SCORES: Tuple[str, ...] = ("logit", "log_prob", "prob")


@dataclass(frozen=True)
class GenerationFaithfulnessResult(ResultRecord):
    """Mean score drop per ``k``, mean MIF / LIF curves over the removed fraction, their areas and SRG.

    ``count`` generated tokens of ``examples`` prompts; ``reference_score`` the mean unperturbed
    score; ``score`` the score kind of every number here.
    """

    name: str
    score: str
    ks: Tuple[int, ...]
    score_drop: Tuple[float, ...]
    x: Tuple[float, ...]
    mif: Tuple[float, ...]
    lif: Tuple[float, ...]
    area_mif: float
    area_lif: float
    srg: float
    reference_score: float
    count: int
    examples: int
    higher_is_better: bool = True


class TokenScores(NamedTuple):
    """Per generated token (rows: prompt-major, then output order): the unperturbed score (R,),
    the scores after removing the top k (R, K), and the MIF and LIF curves (R, F)."""

    reference: torch.Tensor
    top_k: torch.Tensor
    mif: torch.Tensor
    lif: torch.Tensor


def _causal_lm_forward(model: torch.nn.Module) -> Callable[[dict], torch.Tensor]:
    device = offload.input_device(model)  # offloaded weights sit on meta: their execution device

    def forward(batch: dict) -> torch.Tensor:
        return model(**{k: v.to(device) for k, v in batch.items()}).logits

    return forward


def _pick(logits: torch.Tensor, read: torch.Tensor, target: torch.Tensor, score: str) -> torch.Tensor:
    """``score`` of token ``target[r]`` in the logits (R, L, V) at position ``read[r]``, float64 (R,)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    picked = logits[rows, read.to(logits.device)].to(torch.float64)
    if score == "log_prob":
        picked = torch.log_softmax(picked, dim=-1)
    elif score == "prob":
        picked = torch.softmax(picked, dim=-1)
    return picked.gather(1, target.to(logits.device)[:, None]).squeeze(1)


class _Rows(NamedTuple):
    ids: torch.Tensor          # (R, L) prompt + output of the row's example, right padded
    mask: torch.Tensor         # (R, L)
    relevance: torch.Tensor    # (R, L) token_attr[t] on the prompt positions, 0 elsewhere
    removable: torch.Tensor    # (R, L) prompt positions whose id is not protected
    read: torch.Tensor         # (R,) position whose logits predict the row's token: P + t - 1
    target: torch.Tensor       # (R,) the row's generated token


def _rows(prompt_ids, output_ids, token_attr, never_removed_ids) -> _Rows:
    if not (len(prompt_ids) == len(output_ids) == len(token_attr)) or not prompt_ids:
        raise InputError(f"Give one prompt, one output and one token_attr per example; received {len(prompt_ids)} "
                         f"prompts, {len(output_ids)} outputs and {len(token_attr)} token_attr.")
    width = max(len(p) + len(o) - 1 for p, o in zip(prompt_ids, output_ids))
    ids, mask, relevance, read, target, example = [], [], [], [], [], []
    for b, (prompt, output, attr) in enumerate(zip(prompt_ids, output_ids, token_attr)):
        prompt, output = [int(i) for i in prompt], [int(i) for i in output]
        attr = torch.as_tensor(attr).detach().to(device="cpu", dtype=torch.float64)
        if not prompt or not output:
            raise InputError(f"Example {b} has {len(prompt)} prompt and {len(output)} output tokens; both must be "
                             "non-empty.")
        if tuple(attr.shape) != (len(output), len(prompt)):
            raise InputError(f"token_attr of example {b} has shape {tuple(attr.shape)}; expected (output tokens, "
                             f"prompt tokens) = ({len(output)}, {len(prompt)}): one row per generated token over every "
                             "prompt token (a result of span=, skip_tokens= or a template input has other columns).")
        if not bool(torch.isfinite(attr).all()):
            raise InputError(f"token_attr of example {b} holds NaN or infinite values; rankings of them are undefined.")
        sequence = (prompt + output)[:-1]  # the last generated token is never read
        ids.append(sequence + [0] * (width - len(sequence)))
        mask.append([1] * len(sequence) + [0] * (width - len(sequence)))
        padded = torch.zeros(len(output), width, dtype=torch.float64)
        padded[:, :len(prompt)] = attr
        relevance.append(padded)
        read += [len(prompt) + t - 1 for t in range(len(output))]
        target += output
        example += [b] * len(output)
    example = torch.tensor(example)
    ids, mask = torch.tensor(ids)[example], torch.tensor(mask)[example]
    lengths = torch.tensor([len(p) for p in prompt_ids])[example]
    in_prompt = torch.arange(width)[None] < lengths[:, None]
    protected = torch.isin(ids, torch.tensor(sorted(set(int(i) for i in never_removed_ids)), dtype=ids.dtype))
    removable = in_prompt & ~protected
    if not bool(removable.any(dim=1).all()):
        bad = sorted(set(example[~removable.any(dim=1)].tolist()))
        raise InputError(f"Examples {bad[:5]} have no removable prompt token (all in never_removed_ids); leave them "
                         "out or protect fewer ids.")
    return _Rows(ids, mask, torch.cat(relevance), removable, torch.tensor(read), torch.tensor(target))


def generation_token_scores(forward: Callable[[dict], torch.Tensor], prompt_ids: Sequence[Sequence[int]],
                            output_ids: Sequence[Sequence[int]], token_attr: Sequence[torch.Tensor], *,
                            replacement_id: int, score: str = "logit", ks: Sequence[int] = GENERATION_KS,
                            fractions: Sequence[float] = GAIN_FRACTIONS, never_removed_ids: Sequence[int] = (),
                            max_batch_size: Optional[int] = None) -> TokenScores:
    """Every generated token's scores under every removal step, the steps stacked into batched
    forwards (see the module docstring). ``forward({"input_ids", "attention_mask"})``
    returns the LM's logits (rows, L, V). Per-token values, e.g. for bootstrap intervals.

    >>> s = generation_token_scores(forward, [[1, 7, 8]], [[8, 2]], [torch.rand(2, 3)], replacement_id=3)
    >>> s.reference.shape, s.top_k.shape, s.mif.shape      # (2,), (2, 4), (2, 21)
    """
    require_choice("score", score, GENERATION_SCORES)
    rows = _rows(prompt_ids, output_ids, token_attr, never_removed_ids)
    n_rows, fractions = rows.ids.shape[0], require_fractions(fractions, 0.0, 1.0)
    top_rank = removal_masks(rows.relevance, rows.removable, fractions)  # (2F, R, L): MIF steps, then LIF
    rank = ranks(torch.where(rows.removable, rows.relevance, torch.full_like(rows.relevance, -math.inf)),
                 descending=True)
    top_k = [rows.removable & (rank < k) for k in ks]
    removed = [torch.zeros_like(rows.removable)] + top_k + list(top_rank)

    def build(steps):
        ids = torch.cat([torch.where(removed[s], torch.full_like(rows.ids, replacement_id), rows.ids) for s in steps])
        repeat = lambda t: t.repeat(len(steps), *([1] * (t.dim() - 1)))  # noqa: E731 - step-major copies
        return {"input_ids": ids, "attention_mask": repeat(rows.mask), "read": repeat(rows.read),
                "target": repeat(rows.target)}

    def scores(batch):
        logits = forward({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != batch["input_ids"].shape:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise InputError(f"forward must return the LM's logits (rows, length, vocabulary) for input_ids of shape "
                             f"{tuple(batch['input_ids'].shape)}; got {shape}. Wrap the model so it returns "
                             "model(...).logits.")
        return _pick(logits, batch["read"], batch["target"], score)[:, None]

    values = logits_per_step(scores, build, len(removed), n_rows, max_batch_size)[..., 0].cpu()  # (steps, R)
    k, f = len(ks), len(fractions)
    return TokenScores(values[0], values[1:1 + k].T, values[1 + k:1 + k + f].T, values[1 + k + f:].T)


class GenerationFaithfulness(Accumulator):
    """Score drops of the top-k evidence and MIF / LIF / SRG over the prompt, per generated token.

    Args:
        model: a causal LM (``model(input_ids=, attention_mask=).logits``) or a callable taking
            that dict and returning logits (rows, length, vocabulary).
        replacement_id: the id a removed prompt token becomes (e.g. ``tokenizer.unk_token_id``).
        score: ``"logit"``, ``"log_prob"`` or ``"prob"``; ``None`` (default): the ``score_kind``
            of the results given to ``update`` (all the same); ``update_ids`` then needs it set.
        ks: the top-k steps; fractions: the MIF / LIF steps (removed fractions, from 0 to 1);
        never_removed_ids: token ids never removed (``<bos>``, attention sinks);
        max_batch_size: rows per forward call (None: all rows of a step in one call).

    Example::

        metric = GenerationFaithfulness(model, replacement_id=tokenizer.unk_token_id, never_removed_ids=[1])
        metric.update(results)          # GenerationResults of one or several batches
        result = metric.compute()       # result.score_drop[0]: mean drop of removing the top-1 token
    """

    # ``score=None`` is fixed by the first update (from the results); merge compares the kinds measured.
    ignored_options = Accumulator.ignored_options + ("score",)

    def __init__(self, model: Any, replacement_id: int, score: Optional[str] = None,
                 ks: Sequence[int] = GENERATION_KS, fractions: Sequence[float] = GAIN_FRACTIONS,
                 never_removed_ids: Sequence[int] = (), max_batch_size: Optional[int] = None) -> None:
        super().__init__()
        if isinstance(replacement_id, bool) or not isinstance(replacement_id, int):
            raise InputError(f"replacement_id must be an int token id (e.g. tokenizer.unk_token_id), got "
                             f"{replacement_id!r}.")
        if score is not None:
            require_choice("score", score, GENERATION_SCORES)
        ks = tuple(ks)
        if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks) or \
                list(ks) != sorted(set(ks)):
            raise InputError(f"ks={ks!r} must be increasing positive ints, e.g. (1, 2, 3, 5).")
        if isinstance(model, torch.nn.Module):
            self.forward = _causal_lm_forward(model)
        elif callable(model):
            self.forward = model
        else:
            raise InputError(f"model must be a causal LM (torch.nn.Module) or a callable returning logits; got "
                             f"{type(model).__name__}.")
        self.replacement_id, self.score, self.ks = replacement_id, score, ks
        self.fractions = require_fractions(fractions, 0.0, 1.0)
        self.never_removed_ids = tuple(int(i) for i in never_removed_ids)
        self.max_batch_size = check_max_batch_size(max_batch_size)
        self._add_state("reference", exact=True)
        self._add_state("drop", (len(ks),), exact=True)
        self._add_state("mif", (len(self.fractions),), exact=True)
        self._add_state("lif", (len(self.fractions),), exact=True)
        self._add_state("count")
        self._add_state("examples")

    def update(self, results: Sequence[Any]) -> None:
        """Add GenerationResults (decoder-only, one row per generated token over every prompt token)."""
        results = [results] if not isinstance(results, (list, tuple)) else list(results)
        for index, result in enumerate(results):
            missing = [name for name in ("token_attr", "input_ids", "output_ids", "score_kind")
                       if not hasattr(result, name)]
            if missing:
                raise InputError(f"results[{index}] is a {type(result).__name__} without {missing}; pass the "
                                 "GenerationResults of GenerationAttribution.attribute.")
            if getattr(result, "encoder_decoder", False) or getattr(result, "contrast_tokens", None) is not None:
                raise InputError(f"results[{index}] explains an encoder-decoder or a contrast (score(y) - score(foil)); "
                                 "this metric removes prompt tokens of a decoder-only LM and reads one token's score.")
        kinds = sorted({r.score_kind for r in results})
        score = self.score if self.score is not None else (kinds[0] if len(kinds) == 1 else None)
        if score is None:
            raise InputError(f"The results mix score kinds {kinds}; evaluate each kind with its own metric or set "
                             "score= on the metric.")
        self._update([r.input_ids for r in results], [r.output_ids for r in results], [r.token_attr for r in results],
                     score)
        self.score = score  # fixed by the first update, so later batches are measured alike

    def update_ids(self, prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                   token_attr: Sequence[torch.Tensor]) -> None:
        """Add a batch given as prompt ids, generated ids and token_attr (T_b, P_b) per example."""
        if self.score is None:
            raise InputError("This metric takes its score kind from GenerationResults; with update_ids, build it with "
                             "score='logit', 'log_prob' or 'prob'.")
        self._update(prompt_ids, output_ids, token_attr, self.score)

    def _update(self, prompt_ids, output_ids, token_attr, score: str) -> None:
        s = generation_token_scores(self.forward, prompt_ids, output_ids, token_attr,
                                    replacement_id=self.replacement_id, score=score, ks=self.ks,
                                    fractions=self.fractions, never_removed_ids=self.never_removed_ids,
                                    max_batch_size=self.max_batch_size)
        self._add("reference", exact_sum(s.reference))
        self._add("drop", exact_sum(s.reference[:, None] - s.top_k))
        self._add("mif", exact_sum(s.mif))
        self._add("lif", exact_sum(s.lif))
        self._add("count", torch.tensor(len(s.reference)))
        self._add("examples", torch.tensor(len(prompt_ids)))

    def merge(self, other: "GenerationFaithfulness") -> "GenerationFaithfulness":
        """Add ``other``'s sums; both must measure the same score kind (or one have seen nothing)."""
        if isinstance(other, GenerationFaithfulness) and None not in (self.score, other.score) and \
                self.score != other.score:
            raise InputError(f"Cannot merge a metric of score {other.score!r} into one of score {self.score!r}.")
        super().merge(other)
        self.score = self.score or other.score
        return self

    def compute(self) -> GenerationFaithfulnessResult:
        n = int(self._state["count"].item())
        mean = (lambda name: self._value(name) / n) if n else (  # noqa: E731
            lambda name: torch.full(self._state[name].shape[:-1], math.nan, dtype=torch.float64))
        mif, lif = mean("mif"), mean("lif")
        gain = symmetric_relevance_gain(mif, lif, self.fractions)
        return GenerationFaithfulnessResult(
            name="generation_faithfulness", score=self.score or "", ks=self.ks,
            score_drop=tuple(mean("drop").tolist()), x=self.fractions, mif=tuple(mif.tolist()),
            lif=tuple(lif.tolist()), area_mif=float(gain.area_mif), area_lif=float(gain.area_lif),
            srg=float(gain.srg), reference_score=float(mean("reference")), count=n,
            examples=int(self._state["examples"].item()))
