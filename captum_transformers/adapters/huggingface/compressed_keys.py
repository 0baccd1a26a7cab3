"""Attention over keys that are no tokens of the sequence: compressed summaries of token blocks.

DeepSeek-V4's compressed-attention layers (``layer_types`` ``"compressed_sparse_attention"``, CSA,
and ``"heavily_compressed_attention"``, HCA) concatenate onto the sliding-window keys of the
sequence's tokens one compressed entry per closed window of ``config.compress_rates[type]`` tokens
(``DeepseekV4Attention.compressor``): ``kv_norm(sum_j softmax_j(Z_j + B) * C_j)`` over the
window's tokens ``j`` (CSA: its own window and the previous one), the softmax taken per channel,
then RMS-normalised and rotated; under CSA a top-k indexer chooses per query which entries it
may read. A query's attention weight on such an entry is a weight on a summary vector, not on
any token: the entry's dependence on token ``j`` differs per channel (one gate per channel) and
passes through a normalisation, so no share of the weight per token reproduces it, and dropping
the entries' columns (as an attention sink's, whose value is zero) would drop the information
they carry. The attention methods, which chain one token-by-token map per layer, are refused by
name where a layer appended such entries (sequences of at least one compress rate); shorter
sequences, and layers without a compressor (``"sliding_attention"``), are read as any other.

The rows of :data:`COMPRESSED_KEYS` name the modules (class name, the attribute holding their
compressor, and why); a module not in it is not checked here.

Example::

    >>> refuse_compressed_keys(recorder)   # after the forward pass, before the layouts are built
"""
from __future__ import annotations

from typing import Dict, Tuple

from ...capture.recorder import Recorder
from ...errors import UnsupportedModelError

# Attention class name -> (the attribute holding the compressor, what the appended keys are).
COMPRESSED_KEYS: Dict[str, Tuple[str, str]] = {
    "DeepseekV4Attention": (
        "compressor",
        "compressed KV entries (CSA / HCA, config.compress_rates): each a per-channel softmax-gated, "
        "RMS-normalised summary of a window of tokens (CSA: two overlapping windows, chosen per query by a "
        "top-k indexer)"),
}


def refuse_compressed_keys(recorder: Recorder) -> None:
    """:class:`UnsupportedModelError` naming the first recorded call of a :data:`COMPRESSED_KEYS`
    module that attended over more keys than the sequence has queries (its compressor appended
    entries). Calls without appended keys pass; so do every other module's."""
    for site in recorder.sites:
        row = COMPRESSED_KEYS.get(type(site.block.module).__name__)
        if row is None or getattr(site.block.module, row[0], None) is None or site.num_keys <= site.num_queries:
            continue
        module = site.block.module
        layer = getattr(module, "layer_type", None)
        rates = getattr(getattr(module, "config", None), "compress_rates", None)
        rate = rates.get(layer) if isinstance(rates, dict) else None
        raise UnsupportedModelError(
            f"{site.block.name} ({type(module).__name__}, layer type {layer!r}) attends over "
            f"{site.num_keys} keys for {site.num_queries} tokens: {site.num_keys - site.num_queries} of them are "
            f"{row[1]}, no tokens of the sequence. An attention weight on a compressed entry is not a weight on any "
            "token, and no share of it per token reproduces the entry (one gate per channel, then a normalisation), "
            "so the attention methods, which chain token-by-token maps, cannot read this layer exactly. Sequences "
            f"shorter than the compress rate{'' if rate is None else f' ({rate})'} append no entries and are "
            "explained; for longer ones use a method that needs no attention map (Captum's IntegratedGradients or "
            "Saliency).")
