"""The ``query_rows`` option: which token rows of the last attention explain the output.

An adapter cannot always see how a model reads its tokens: a user's head that mean-pools a
HuggingFace encoder, or a sentence encoder used for its pooled embedding, looks like any
other module from outside. Adapters that take this option (:class:`TorchMHAAdapter`,
:class:`HuggingFaceAdapter`) let the user say it:

* ``None``: the adapter's default (the CLS token, or the last real token of a causal model);
* ``"mean"``: every real token, each weighted ``1 / n`` (``n`` real tokens of the example);
* ``"last"``: the last real token;
* an int: that position (negative counts from the end of the sequence).

Where a method takes the gradient anyway, :class:`ReadRows` sees which rows the score reads
and refuses a default that leaves some out (see ``docs/explained-tokens.md``).

Example::

    >>> rows, weights = chosen_rows("mean", 4, torch.tensor([[True, True, False, False]]))
    >>> rows.tolist(), weights.tolist()
    ([[0, 1, 2, 3]], [[0.5, 0.5, 0.0, 0.0]])
"""
from __future__ import annotations

import contextlib
import functools
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from ..model_state import patching
from ..errors import InputError, UnsupportedModelError

QueryRows = Union[None, int, str]
#: An adapter's own choice (not a user's): every real token after the first (the CLS token), each
#: weighted ``1 / n``: a head that averages the patch tokens and leaves the CLS token out (BEiT's
#: mean pooling, CLIP's image classifier).
MEAN_AFTER_FIRST = "mean-after-first"
#: Appended to errors about the explained row, so the option can be found from them.
QUERY_ROWS_HINT = ("If the model reads other tokens than the adapter assumes (e.g. a head that mean-pools an encoder), "
                   "pass adapter=HuggingFaceAdapter(query_rows='mean') (or 'last', or a token position); "
                   "TorchMHAAdapter takes the same option.")


# Heads that pool the last layer's tokens as a config field says (rows of data): model type ->
# (the head class's name ends with, the config attribute, its value -> the explained rows as a
# query_rows choice). EuroBERT's sequence classifier: "bos" reads token 0; "mean" averages the real
# tokens' states and "late" their per-token logits (config.classifier_pooling, default "late"), both
# equally weighted over the real tokens of the attention mask (all tokens without one).
# BEiT: config.use_mean_pooling (default True) averages the patch tokens (not the CLS token) before
# the pooler's norm; False reads the CLS token. Data2Vec-Vision's head pools alike.
CONFIG_POOLING: Dict[str, Tuple[str, str, Dict[object, QueryRows]]] = {
    "eurobert": ("ForSequenceClassification", "classifier_pooling", {"bos": 0, "mean": "mean", "late": "mean"}),
    "beit": ("ForImageClassification", "use_mean_pooling", {True: MEAN_AFTER_FIRST, False: 0}),
    "data2vec-vision": ("ForImageClassification", "use_mean_pooling", {True: MEAN_AFTER_FIRST, False: 0}),
}


def config_pooled_rows(model_type: str, head: str, config: object) -> QueryRows:
    """The query_rows choice of a head whose pooling its config names (:data:`CONFIG_POOLING`: the
    ``model_type`` of ``config``, the head's class name ``head``), or None for every other head.
    A pooling value the table does not know is refused (:class:`InputError`): its rows are unknown."""
    row = CONFIG_POOLING.get(model_type)
    if row is None or not head.endswith(row[0]):
        return None
    suffix, attribute, choices = row
    value = getattr(config, attribute, None)
    if value not in choices:
        raise InputError(
            f"{head} pools its tokens as config.{attribute}={value!r} says, a pooling whose explained rows "
            f"captum_transformers does not know (known: {sorted(choices)}). Pass the rows it reads with "
            "adapter=HuggingFaceAdapter(query_rows=...) ('mean', 'last' or a token position)."
        )
    return choices[value]


def checked_query_rows(query_rows: QueryRows) -> QueryRows:
    """``query_rows`` if it is one of the accepted forms, else :class:`InputError`."""
    valid = (query_rows is None or (isinstance(query_rows, str) and query_rows in ("mean", "last"))
             or (isinstance(query_rows, int) and not isinstance(query_rows, bool)))
    if not valid:
        raise InputError(f"query_rows must be None, 'mean', 'last' or an int token position, got {query_rows!r}.")
    return query_rows


def refuse_examples_without_tokens(token_mask: Optional[torch.Tensor], stream: str = "tokens") -> None:
    """:class:`InputError` naming the examples whose mask (B, N) marks no token as real.

    Such an example has nothing to explain: its attention is undefined (NaN in
    ``nn.MultiheadAttention``, uniform over padding in HF kernels) and it has no last token.
    """
    if token_mask is None or token_mask.shape[0] == 0:
        return
    empty = (~token_mask.to(torch.bool).any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise InputError(
            f"Example(s) {empty} of the batch have an attention mask that masks every token of the {stream!r} "
            f"sequence ({token_mask.shape[-1]} positions, none real), so there is no token to explain. Remove "
            "these examples from the batch, or give each at least one unmasked token."
        )


def refuse_masked_explained_rows(query_rows: torch.Tensor, query_weights: Optional[torch.Tensor],
                                 token_mask: Optional[torch.Tensor], stream: str = "tokens") -> None:
    """:class:`InputError` when an explained row (weighted above 0) of some example is padding.

    Padded rows are zeroed in every map, so such an example would get an all-zero explanation
    (e.g. a CLS token at position 0 of a left-padded encoder batch, or a masked text CLS in
    VisualBERT).
    """
    if token_mask is None or query_rows.numel() == 0:
        return
    real = token_mask.to(torch.bool).gather(1, query_rows.to(device=token_mask.device, dtype=torch.long))
    read = torch.ones_like(real) if query_weights is None else query_weights.to(token_mask.device) > 0
    masked = (read & ~real).any(dim=1).nonzero().flatten().tolist()
    if masked:
        positions = [query_rows[i][(read & ~real)[i].to(query_rows.device)].tolist() for i in masked]
        raise InputError(
            f"Example(s) {masked} of the batch would be explained at the {stream!r} token position(s) {positions}, "
            "which their attention mask marks as padding, so their explanation would be all zeros. Pad on the "
            "side the model does not read (e.g. right-pad encoders that read the first token), unmask the explained "
            "token, or choose the explained rows with the adapter's query_rows option."
        )


def chosen_rows(choice: QueryRows, num_tokens: int, token_mask: Optional[torch.Tensor], batch: int = 1,
                device: Optional[torch.device] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The rows (B, R) a non-None ``choice`` selects, or ``(rows, weights)`` for ``"mean"``.

    ``token_mask`` (B, N) is False at padding (None: every token is real).
    """
    if token_mask is not None:
        batch, device = token_mask.shape[0], token_mask.device
    mask = (torch.ones(batch, num_tokens, dtype=torch.bool, device=device) if token_mask is None
            else token_mask.to(torch.bool))
    refuse_examples_without_tokens(mask)
    positions = torch.arange(num_tokens, device=mask.device)
    if choice == "last":
        return torch.where(mask, positions, -1).amax(dim=1).unsqueeze(1)
    if choice in ("mean", MEAN_AFTER_FIRST):
        weights = mask.to(torch.float32)
        if choice == MEAN_AFTER_FIRST:
            if num_tokens < 2:
                raise InputError(f"the head averages the tokens after the first, but the model attends over "
                                 f"{num_tokens} token(s) only.")
            weights[:, 0] = 0
        return positions.expand(batch, -1), weights / weights.sum(dim=1, keepdim=True)
    position = choice + num_tokens if choice < 0 else choice
    if not 0 <= position < num_tokens:
        raise InputError(
            f"query_rows={choice} is outside the {num_tokens} tokens the model attends over; "
            f"use a position in [{-num_tokens}, {num_tokens})."
        )
    return torch.full((batch, 1), position, dtype=torch.long, device=mask.device)


# Attention classes of models that mix token positions outside the attention map (rows of data):
# class name -> how. The rows the score reads at the last attention are then not rows of the map
# that a weighting explains, so a read outside the explained rows is refused naming this.
POSITION_MIXING: Dict[str, str] = {
    "InklingAttention": (
        "Inkling mixes positions outside its attention maps: causal depthwise short convolutions "
        "(config.conv_kernel_size taps, per channel) run over the keys and values (k_sconv, v_sconv) and after "
        "every attention and MLP sublayer (attn_sconv, mlp_sconv), so the next-token score reads the last "
        "attention's output at the last conv_kernel_size positions per sublayer, each channel with its own "
        "weights, and a key column of a map is a mix of several tokens"),
}


class ReadRows:
    """Which token rows of the last attention call's output the explained score depends on.

    A head the adapter cannot see (mean pooling around a HF encoder, a token-classification
    target at another position) reads other rows than the adapter's default. After the
    backward pass, the rows whose gradient at the last attention output is non-zero are the
    rows the score reads (every later operation acts per token): exact, and free for the
    methods that take that gradient anyway. Forward-only methods (raw attention, rollout)
    take none, so for them the rows cannot be known.
    """

    def __init__(self) -> None:
        # The output of each watched call, in call order, until :meth:`listen` lets them go.
        self.outputs: List[Tuple[torch.Tensor, bool]] = []
        # (call index, rows read) of each watched call whose output the gradient reached.
        self.reads: Dict[int, torch.Tensor] = {}
        # The class names of the watched modules (for POSITION_MIXING).
        self.watched: set = set()

    @property
    def read(self) -> Optional[torch.Tensor]:
        """The rows (B, N) the score reads at the last watched call that the gradient reached
        (None: none was): a later call whose output the score does not use (Siglip's attention
        pooling head, run but not read by its image classifier) says nothing of the rows."""
        return self.reads[max(self.reads)] if self.reads else None

    def read_at(self, batch: int, num_tokens: int) -> Optional[torch.Tensor]:
        """The rows read at the last reached call whose output holds ``num_tokens`` tokens of
        ``batch`` examples (a pooling head's attention over one probe query is passed over)."""
        shaped = [index for index, read in self.reads.items() if tuple(read.shape) == (batch, num_tokens)]
        return self.reads[max(shaped)] if shaped else None

    @contextlib.contextmanager
    def watch(self, modules: Iterable[nn.Module]) -> Iterator[None]:
        """Forward hooks keeping the output of every call of any of ``modules``."""
        def keep(module, args, output):
            tensor = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 3 and tensor.requires_grad:
                # nn.MultiheadAttention(batch_first=False) returns (N, B, D).
                self.outputs.append((tensor, getattr(module, "batch_first", True) is False))
            return None

        with contextlib.ExitStack() as stack:
            for module in modules:
                self.watched.add(type(module).__name__)
                stack.enter_context(patching.forward_hook(module, keep))
            yield

    def listen(self) -> None:
        """Before the backward pass: note the rows its gradient reaches at each kept output. The
        outputs are let go once hooked: kept, they would close a cycle (output, its graph, the
        hook, this object) through the autograd graph, which no garbage collector frees."""
        outputs, self.outputs = self.outputs, []
        for index, (output, sequence_first) in enumerate(outputs):
            output.register_hook(functools.partial(self._note, index, sequence_first))

    def _note(self, index: int, sequence_first: bool, grad: torch.Tensor) -> None:
        read = grad.detach().ne(0).any(dim=-1)
        read = read.transpose(0, 1) if sequence_first else read
        self.reads[index] = read if index not in self.reads else self.reads[index] | read

    def refuse_unexplained(self, num_tokens: int, query_rows: torch.Tensor, query_weights: Optional[torch.Tensor],
                           token_mask: Optional[torch.Tensor], hint: str) -> None:
        """:class:`InputError` when the score reads real rows that the explanation leaves out."""
        read = self.read_at(query_rows.shape[0], num_tokens)
        if read is None:
            return  # no reached call over the explained sequence (another stream or layout)
        read = read.to(query_rows.device)
        explained = torch.zeros_like(read)
        weighted = torch.ones_like(query_rows, dtype=torch.bool) if query_weights is None else query_weights > 0
        explained.scatter_(1, query_rows, weighted.to(query_rows.device))
        if token_mask is not None:
            read = read & token_mask.to(device=read.device, dtype=torch.bool)
        unexplained = read & ~explained
        examples = unexplained.any(dim=1).nonzero().flatten().tolist()
        if examples:
            first = examples[0]
            mixing = [POSITION_MIXING[name] for name in sorted(self.watched) if name in POSITION_MIXING]
            if mixing:
                raise UnsupportedModelError(
                    f"The explained score of example {first} depends on the last layer's tokens "
                    f"{read[first].nonzero().flatten().tolist()}, not on the explained row(s) "
                    f"{query_rows[first][weighted[first].to(query_rows.device)].tolist()} alone: {mixing[0]}. No "
                    "choice of rows (query_rows) or weighting of the attention maps describes that mixing, so the "
                    "methods reading the last layer's rows (Grad-CAM, GenericAttention, TransformerRelevance, "
                    "PartialLRP) cannot explain this model. The relevance methods (LRP, AttnLRP, ConservativeLRP, "
                    "GradientXInput) propagate through the convolutions, as do Captum's IntegratedGradients and "
                    "Saliency.")
            raise InputError(
                f"The explained score of example {first} depends on the last layer's tokens "
                f"{read[first].nonzero().flatten().tolist()}, but the explanation reads the row(s) "
                f"{query_rows[first][weighted[first].to(query_rows.device)].tolist()} only (the adapter's default); "
                f"{len(examples)} example(s) differ so. The model's head pools or selects tokens the adapter cannot "
                f"see (mean pooling, a token-level target). {hint}"
            )
