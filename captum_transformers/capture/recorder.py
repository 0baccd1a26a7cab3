"""The recorder that adapters feed while a model runs inside a capture context.

An adapter calls :meth:`Recorder.connect` on each attention block's input and
:meth:`Recorder.record` with the block's attention probabilities. ``connect`` joins the
tensor to a zero-valued *anchor* through an identity autograd Function, so that one
``torch.autograd.grad(score, anchor)`` reaches every attention map (even in a model whose
parameters are frozen) while per-map tensor hooks fuse the heads the moment each gradient
arrives. Kernels that differentiate their own map (:mod:`..attention_core`) report it through
a :class:`SiteObserver` instead, and no map is kept from the forward pass at all. Nothing
else keeps a per-head gradient alive: memory stays O(L B N^2) or less.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch

from ..errors import CaptureError
from .trace import Block, CaptureSpec, Streams


class _AnchorTap(torch.autograd.Function):
    """Identity in the forward pass; in the backward pass passes the gradient through and
    gives the anchor a zero gradient, which makes autograd visit every tapped block."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:  # noqa: D401
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_zeros(())


@dataclass
class Site:
    """One observed attention call (mutable while the backward pass runs)."""

    block: Block
    call_index: int
    num_queries: int
    num_keys: int
    batch_size: int
    forward_value: Optional[torch.Tensor] = None
    probs: Optional[torch.Tensor] = None
    grad_tensor: Optional[torch.Tensor] = None
    grad_view: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    backward_value: Optional[torch.Tensor] = None
    received_gradient: bool = False
    hooked: bool = False
    streams: Optional[Streams] = None
    group: Optional[Hashable] = None
    # Set when the kernel reports the gradient at the map itself (attention_core): the map
    # is then not kept, only its shape, dtype and device (for a zero gradient).
    observer: Optional["SiteObserver"] = None
    map_like: Optional[tuple] = None
    selected: bool = False
    # A causal self-attention call: key k is real for query q only when k <= q.
    causal: bool = False

    @property
    def requires_grad(self) -> bool:
        return self.observer is not None or self.grad_tensor.requires_grad


class SiteObserver:
    """What a kernel that differentiates its own attention map (:mod:`..attention_core`)
    calls in the backward pass instead of a tensor hook: it hands over the map, recomputed,
    with the gradient at it. Made empty before the kernel runs, bound by
    :meth:`Recorder.record`.

    The kernel's autograd node keeps the observer for as long as the graph lives, and the
    recorder's sites keep tensors of that graph: strong references back to the recorder and
    the site would close a cycle through the (C++) autograd graph that no garbage collector
    can see, and every explanation's graph would stay alive. So both are held weakly: the
    trace that made them holds them strongly while its backward passes run."""

    def __init__(self) -> None:
        self._recorder = _no_referent
        self._site = _no_referent

    @property
    def recorder(self) -> Optional["Recorder"]:
        return self._recorder()

    @recorder.setter
    def recorder(self, recorder: Optional["Recorder"]) -> None:
        self._recorder = _no_referent if recorder is None else weakref.ref(recorder)

    @property
    def site(self) -> Optional[Site]:
        return self._site()

    @site.setter
    def site(self, site: Optional[Site]) -> None:
        self._site = _no_referent if site is None else weakref.ref(site)

    @property
    def wanted(self) -> bool:
        """Whether the running backward pass reduces this map (all maps, or the last ones)."""
        return self.site is not None and self.site.selected

    @property
    def deferred(self) -> bool:
        """Whether a later backward pass through the same graph reduces this pass's gradient
        together with its own (:meth:`first`, then :meth:`second`), so the kernel may keep
        something smaller than the gradient at the map until then."""
        return self.recorder is not None and self.recorder.keep_probs

    @property
    def takes_rows(self) -> bool:
        """Whether the kernel may hand the map over in chunks of query rows (:meth:`rows`, then
        :meth:`done`): the recorder streams it (:class:`~..methods.streaming_rows.RowStream`).
        A deferring pass (the first of a pair) takes rows too when the stream pairs the two passes:
        it then hands nothing over, and the second pass hands both gradients per chunk."""
        return self.wanted and self.recorder.streams_site(self.site)

    @property
    def streams_unread(self) -> bool:
        """Whether the map is not reduced in this pass (:attr:`wanted` is False) while the recorder
        streams the maps it does reduce: the kernel may then differentiate it in chunks of rows
        too, handing nothing over (no whole map where the reduced ones are streamed)."""
        return not self.wanted and self.site is not None and self.recorder is not None \
            and self.recorder.spec.row_stream is not None and self.recorder.streams_site(self.site)

    @property
    def reads_masked_keys(self) -> bool:
        """Whether this pass's reduction reads the gradient at masked entries of the map (marked
        ``reads_masked_keys``), where the map is 0 but its gradient is not: chunks then keep every key."""
        recorder = self.recorder
        specs = () if recorder is None else (recorder.spec, recorder.first_spec)
        return any(getattr(spec.backward_reduce, "reads_masked_keys", False) for spec in specs if spec is not None)

    def __call__(self, probs: torch.Tensor, grad: torch.Tensor) -> None:
        self.recorder.note_rows(self.site, probs)
        self.recorder.reduce_gradient(self.site, grad, probs)

    def rows(self, rows: slice, probs: torch.Tensor, grad: torch.Tensor,
             first: Optional[torch.Tensor] = None) -> None:
        """Query rows ``rows`` of the map (B, H, c, K) and of the gradient at it; ``first``: the
        deferred first pass's gradient at those rows (a pair), reduced before ``grad``."""
        self.recorder.note_rows(self.site, probs, rows)
        self.recorder.reduce_rows(self.site, rows, probs, grad, first)

    def done(self) -> None:
        """Every row of the map was handed over (:meth:`rows`)."""
        self.recorder.finish_rows(self.site)

    def defer(self) -> None:
        self.site.received_gradient = True

    def first(self, probs: torch.Tensor, grad: torch.Tensor) -> None:
        """The deferred gradient of the previous pass, reduced by that pass's spec."""
        self.recorder.reduce_first(self.site, probs, grad)

    def second(self, probs: torch.Tensor, grad: torch.Tensor) -> None:
        """This pass's gradient, after :meth:`first`."""
        self.recorder.note_rows(self.site, probs)
        self.recorder.reduce_gradient(self.site, grad, probs)


def _no_referent() -> None:
    """A dead weak reference's answer (what an unbound :class:`SiteObserver` holds)."""
    return None


class Recorder:
    """Collects :class:`Site` objects for one forward pass, as the spec asks."""

    def __init__(self, spec: CaptureSpec):
        self.spec = spec
        self.sites: List[Site] = []
        self.anchors: Dict[torch.device, torch.Tensor] = {}
        # Non-padding tokens (B, N) per stream, from the first call that reports a key mask.
        self.stream_valid: Dict[str, torch.Tensor] = {}
        self.causal: bool = False
        # True while a later backward pass through the same graph still needs the maps.
        self.keep_probs: bool = False
        # The spec of the previous backward pass through the same graph (None in the first).
        self.first_spec: Optional[CaptureSpec] = None
        # Whether this pass is the first of a pair reduced together (None: when keep_probs).
        self.pair_first: Optional[bool] = None
        # The token streams (StreamLayouts), given by the adapter between the forward and the
        # backward pass: what a row stream (spec.row_stream) starts its rows from.
        self.streams = None
        # Query positions (T,) whose sums over keys every causal self-attention call records
        # (:meth:`watch_rows`; None: none), and those sums by call index: ``(sums (B, H, T), seen (T,))``.
        self.watched_rows: Optional[torch.Tensor] = None
        self.watched_blocks: Optional[Callable[[Block], bool]] = None
        self.row_sums: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def wants_maps(self) -> bool:
        """Whether any attention map is reduced (in the forward or the backward pass): when not,
        a kernel need not make one, and :meth:`record` reads only the shape of ``probs``."""
        return self.spec.forward_reduce is not None or self.spec.needs_gradient

    def connect(self, tensor: torch.Tensor) -> torch.Tensor:
        """Tap a block's floating-point input so gradients reach this block's attention."""
        if not self.spec.needs_gradient or not torch.is_grad_enabled() or not tensor.is_floating_point():
            return tensor
        anchor = self.anchors.get(tensor.device)
        if anchor is None:
            anchor = torch.zeros((), device=tensor.device, requires_grad=True)
            self.anchors[tensor.device] = anchor
        return _AnchorTap.apply(tensor, anchor)

    def record(
        self,
        block: Block,
        probs: torch.Tensor,
        *,
        grad_tensor: Optional[torch.Tensor] = None,
        grad_view: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        key_valid: Optional[torch.Tensor] = None,
        causal: bool = False,
        streams: Optional[Streams] = None,
        group: Optional[Hashable] = None,
        observer: Optional[SiteObserver] = None,
        replayed: bool = False,
    ) -> None:
        """Store one call's attention ``probs`` (B, H, Q, K).

        ``grad_tensor`` is the tensor autograd actually differentiates when ``probs`` is a
        view outside the graph (``nn.MultiheadAttention`` returns such a view);
        ``grad_view`` reshapes its gradient to (B, H, Q, K). ``key_valid`` (B, K) marks
        non-padding keys (of the first stream that reports any). ``streams`` names the
        (query stream, key stream) of this call when the block alone does not say it;
        ``group`` ties consecutive calls that read the same inputs (see AttentionRecord).
        ``observer``: the kernel reports the gradient at the map through it (no hook, and
        the map is not kept); ignored for a map outside the autograd graph, which is then
        refused like any other when a gradient is needed. ``replayed``: ``probs`` is a stand-in (the
        spec's ``replay`` recomputes the map after the forward pass), so no forward value is made.
        """
        if probs.dim() != 4:
            raise ValueError(f"attention probabilities must be (B, H, Q, K), got shape {tuple(probs.shape)}")
        site = Site(block, len(self.sites), probs.shape[2], probs.shape[3], probs.shape[0],
                    streams=tuple(streams) if streams is not None else block.default_streams, group=group)
        if self.spec.forward_reduce is not None and not replayed:
            site.forward_value = self.spec.forward_reduce(probs.detach())
        if self.spec.needs_gradient and observer is not None and probs.requires_grad:
            observer.recorder, observer.site = self, site
            site.observer, site.map_like = observer, (probs.shape, probs.dtype, probs.device)
        elif self.spec.needs_gradient:
            site.probs = probs.detach()
            site.grad_tensor = probs if grad_tensor is None else grad_tensor
            site.grad_view = grad_view
        if key_valid is not None:
            key_valid = key_valid.expand(probs.shape[0], -1) if key_valid.shape[0] == 1 else key_valid
            self.stream_valid.setdefault(site.streams[1], key_valid)
        self.causal = self.causal or causal
        site.causal = causal
        self.sites.append(site)
        if not replayed:
            self.note_rows(site, probs)

    def watch_rows(self, rows: Optional[torch.Tensor], blocks: Optional[Callable[[Block], bool]] = None) -> None:
        """Record, for the causal self-attention calls of the blocks ``blocks`` accepts (None: every
        one), the sum over keys of the map at the query positions ``rows`` (T,) (:attr:`row_sums`;
        ``rows=None``: stop). A model with attention sinks
        (:mod:`~captum_transformers.propagation.attention.sinks`) leaves ``1 - p_sink`` there. Read
        from the map the forward pass makes, or, where it makes none (a stand-in: a streamed map),
        from the map the kernel hands over in a backward pass; a map never made gives none."""
        self.watched_rows = None if rows is None else rows.detach().to("cpu", torch.long).reshape(-1)
        self.watched_blocks = blocks
        self.row_sums = {}

    def note_rows(self, site: Site, probs: torch.Tensor, rows: Optional[slice] = None) -> None:
        """Keep the sums over keys of ``probs`` (B, H, c, K) at the watched positions among its query
        rows (``rows``: which of the map's, None: all), once per site (see :meth:`watch_rows`)."""
        watched = self.watched_rows
        if watched is None or not site.causal or watched.numel() == 0:
            return
        entry = self.row_sums.get(site.call_index)
        if (entry is not None and bool(entry[1].all())) or not any(probs.stride()) \
                or int(watched.max()) >= site.num_queries:  # kept already, a stand-in, another stream
            return
        if entry is None and self.watched_blocks is not None and not self.watched_blocks(site.block):
            return
        start = 0 if rows is None or rows.start is None else int(rows.start)
        inside = (watched >= start) & (watched < start + probs.shape[2])
        if not bool(inside.any()):
            return
        dtype = torch.promote_types(probs.dtype, torch.float32)
        if entry is None:
            entry = (torch.full((probs.shape[0], probs.shape[1], watched.numel()), float("nan"), dtype=dtype,
                                device=probs.device), torch.zeros(watched.numel(), dtype=torch.bool))
            self.row_sums[site.call_index] = entry
        sums = probs.detach().sum(-1, dtype=dtype)  # (B, H, c): no copy of the watched rows' keys
        entry[0][:, :, inside.to(probs.device)] = sums[:, :, (watched[inside] - start).to(probs.device)]
        entry[1][inside] = True

    def stream_length(self, stream: str) -> int:
        """The number of tokens of ``stream``, from every call that reads or queries it."""
        lengths = {s.num_keys for s in self.sites if s.streams[1] == stream}
        lengths |= {s.num_queries for s in self.sites if s.streams[0] == stream}
        if len(lengths) != 1:
            calls = sorted({(s.block.name, s.streams) for s in self.sites})
            raise CaptureError(
                f"The {stream!r} stream was seen with lengths {sorted(lengths)} in the calls {calls}; expected one "
                "sequence length per stream. Run the whole model on one batch of inputs."
            )
        return lengths.pop()

    def stream_mask(self, stream: str) -> Optional[torch.Tensor]:
        """Non-padding tokens (B, N) of ``stream`` as booleans, if a call reported them."""
        mask = self.stream_valid.get(stream)
        return None if mask is None else mask.to(torch.bool)

    @property
    def key_valid(self) -> Optional[torch.Tensor]:
        """Non-padding keys (B, K) of the first stream that reported a mask (one-stream models:
        the sequence's)."""
        return next(iter(self.stream_valid.values()), None)

    def valid_pairs(self, site: Site, rows: Optional[slice] = None) -> Optional[torch.Tensor]:
        """(B, 1, Q, K) True where both the query and the key are real tokens, if known;
        ``rows``: only those query rows (B, 1, c, K)."""
        queries = self.stream_valid.get(site.streams[0])
        keys = self.stream_valid.get(site.streams[1])
        if queries is None and keys is None:
            return self._causal_pairs(site, None, rows)
        device = (queries if queries is not None else keys).device
        # A stream's mask covers its tokens; a call over other lengths (none known here) is all valid.
        if queries is None or queries.shape[-1] != site.num_queries:
            queries = torch.ones(site.batch_size, site.num_queries, dtype=torch.bool, device=device)
        if keys is None or keys.shape[-1] != site.num_keys:
            keys = torch.ones(site.batch_size, site.num_keys, dtype=torch.bool, device=device)
        queries, keys = queries.to(torch.bool), keys.to(device=device, dtype=torch.bool)  # streams' devices
        if rows is not None:
            queries = queries[:, rows]
        return self._causal_pairs(site, (queries[:, :, None] & keys[:, None, :]).unsqueeze(1), rows)

    @staticmethod
    def _causal_pairs(site: Site, pairs: Optional[torch.Tensor], rows: Optional[slice] = None) -> Optional[torch.Tensor]:
        """``pairs`` (B, 1, Q, K) without the keys after each query of a causal call: what a
        query never attends to is no (query, key) pair (a row's real keys are those before it,
        the same whether the sequence ends there or goes on)."""
        if not site.causal or site.num_queries != site.num_keys:
            return pairs
        device = pairs.device if pairs is not None else None
        earlier = torch.ones(site.num_queries, site.num_keys, dtype=torch.bool, device=device).tril_() \
            if rows is None else _earlier_keys(rows, site.num_queries, site.num_keys, device)
        return earlier[None, None] if pairs is None else pairs & earlier

    def reduce_gradient(self, site: Site, grad: torch.Tensor, probs: Optional[torch.Tensor] = None) -> None:
        """Fuse ``site``'s heads with its gradient (B, H, Q, K), then drop the raw map (unless
        another backward pass through the same graph will need it). ``probs``: the map, when
        the site does not keep it."""
        site.received_gradient = True
        value = self._reduce(self.spec, site, site.probs if probs is None else probs, grad)
        if not self.keep_probs:
            site.probs = None
        # Folded into the explained rows and dropped; a pair's first pass only kept what its spec keeps.
        if not self.first_of_pair and self.streams_site(site):
            self.spec.row_stream.fold(site.call_index, value)
            return
        site.backward_value = value

    @property
    def first_of_pair(self) -> bool:
        """Whether this pass is the first of two reduced together (its values wait for the second):
        ``pair_first`` where the passes say so (generation), else while the maps are kept."""
        return self.keep_probs if self.pair_first is None else self.pair_first

    @property
    def pairs_passes(self) -> bool:
        """Whether this pass is one of two reduced together (the first, or the one after it)."""
        return self.first_of_pair or self.first_spec is not None

    def streams_site(self, site: Site) -> bool:
        """Whether ``site``'s reduced map goes to the spec's row stream instead of the trace."""
        stream = self.spec.row_stream
        return stream is not None and stream.accepts(self)

    def reduce_rows(self, site: Site, rows: slice, probs: torch.Tensor, grad: torch.Tensor,
                    first: Optional[torch.Tensor] = None) -> None:
        """Reduce query rows ``rows`` of a streamed site's map (B, H, c, K) into its row stream;
        ``first``: the previous pass's gradient at those rows, reduced first (a pair)."""
        # A reduction marked ``reads_valid = False`` ignores the pairs: not made for every chunk.
        reductions = [self.spec.backward_reduce] + ([self.first_spec.backward_reduce] if first is not None else [])
        reads_valid = any(getattr(reduction, "reads_valid", True) for reduction in reductions)
        valid = self.valid_pairs(site, rows) if reads_valid else None
        if valid is not None:  # the kernel may stop at the last key these rows attend to; on the map's device
            valid = valid[..., :probs.shape[-1]].to(probs.device)
        if first is not None:
            extra = {"call_index": site.call_index} if self.first_spec.pass_call_index else {}
            self.first_spec.backward_reduce(probs, first, valid, **extra)
        extra = {"call_index": site.call_index} if self.spec.pass_call_index else {}
        value = self.spec.backward_reduce(probs, grad, valid, **extra)
        self.spec.row_stream.fold_rows(site.call_index, rows, value)

    def finish_rows(self, site: Site) -> None:
        """Every row of a streamed site's map was reduced (:meth:`reduce_rows`)."""
        site.received_gradient = True
        self.spec.row_stream.finish(site.call_index)

    def reduce_first(self, site: Site, probs: torch.Tensor, grad: torch.Tensor) -> None:
        """The previous pass's reduction of a map whose kernel deferred it to this pass
        (:meth:`reduce_gradient` with this pass's gradient follows)."""
        self._reduce(self.first_spec, site, probs, grad)

    def _reduce(self, spec: CaptureSpec, site: Site, probs: torch.Tensor, grad: torch.Tensor):
        extra = {"call_index": site.call_index} if spec.pass_call_index else {}
        valid = self.valid_pairs(site)  # on the mask's device; the map is on its layer's (a spread model)
        return spec.backward_reduce(probs, grad, None if valid is None else valid.to(probs.device), **extra)

    def zero_gradient(self, site: Site) -> None:
        """Reduce a map the explained output does not depend on, with a zero gradient."""
        if site.observer is None:
            self.reduce_gradient(site, torch.zeros_like(site.probs))
            return
        if self.first_of_pair:
            site.received_gradient = True  # the first of two passes: both are reduced in the second
            return
        shape, dtype, device = site.map_like
        if self.streams_site(site):  # folded a chunk of rows at a time: no (B, H, N, N) zeros
            rows_per_chunk = max(1, _ZERO_CHUNK_BYTES // max(1, shape[0] * shape[1] * shape[3] * 4))
            for start in range(0, shape[2], rows_per_chunk):
                rows = slice(start, min(start + rows_per_chunk, shape[2]))
                zeros = torch.zeros((shape[0], shape[1], rows.stop - start, shape[3]), dtype=dtype, device=device)
                self.reduce_rows(site, rows, zeros, zeros, zeros if self.first_spec is not None else None)
            self.finish_rows(site)
            return
        zeros = torch.zeros(shape, dtype=dtype, device=device)
        if self.first_spec is not None:
            self.reduce_first(site, zeros, zeros)
        self.reduce_gradient(site, zeros, zeros)

    def last_per_streams(self) -> List[Site]:
        """The last call of each (query stream, key stream) pair, in call order."""
        last = {site.streams: site for site in self.sites}
        return sorted(last.values(), key=lambda site: site.call_index)

    def next_pass(self, spec: CaptureSpec) -> None:
        """Reduce the next backward pass through the same graph with ``spec`` (the last pass:
        maps are dropped as they are reduced). The previous pass's values are overwritten."""
        self.first_spec, self.spec = self.spec, spec
        self.keep_probs = False
        for site in self.sites:
            site.received_gradient = False

    def begin_pass(self, spec: CaptureSpec, first_spec: Optional[CaptureSpec], keep_probs: bool,
                   pair_first: bool = False) -> None:
        """Set up one more backward pass through the same graph, for graphs that serve many
        explained rows (one generation step after another): reduced by ``spec``, after
        ``first_spec``'s pass when the two form a pair (:meth:`next_pass`), the maps kept when
        ``keep_probs`` (a later pass will read them); ``pair_first``: the first pass of a pair.
        The previous pass's values are overwritten."""
        self.spec, self.first_spec, self.keep_probs, self.pair_first = spec, first_spec, keep_probs, pair_first
        for site in self.sites:
            site.received_gradient = False

    def hook(self, site: Site) -> None:
        """Fuse ``site``'s heads as soon as its gradient arrives (once per site; the hook
        serves every backward pass through the graph)."""
        site.selected = True
        if site.hooked or site.observer is not None:
            return
        site.hooked = True
        # The hook lives on the graph, which the site keeps (grad_tensor): weak references, so
        # that graph, site and recorder are freed by reference counting once the trace is done.
        recorder, site_ref = weakref.ref(self), weakref.ref(site)

        def on_gradient(grad: torch.Tensor) -> None:
            me, hooked = recorder(), site_ref()
            if me is not None and hooked is not None:
                me.reduce_gradient(hooked, hooked.grad_view(grad) if hooked.grad_view is not None else grad)

        site.grad_tensor.register_hook(on_gradient)


# A zero gradient of a streamed map is reduced in chunks of rows of about this size.
_ZERO_CHUNK_BYTES = 4 * 2**20


def _earlier_keys(rows: slice, num_queries: int, num_keys: int, device) -> torch.Tensor:
    """(c, K) True where key ``k <= q`` for the queries ``q`` in ``rows`` (a causal call's pairs)."""
    queries = torch.arange(num_queries, device=device)[rows]
    return torch.arange(num_keys, device=device)[None, :] <= queries[:, None]
