r"""Qwen2-VL and Qwen2.5-VL (HF ``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``).

The vision tower embeds flat patches (``pixel_values`` rows, :mod:`.qwen2_vl_geometry`), runs
its blocks over each image separately (HF: one attention call per image; Qwen2.5-VL: per window
of merged cells in its windowed layers, over patches permuted into window order), and its
PatchMerger turns each run of ``m x m`` patch rows into one embedding that replaces the next
image placeholder of ``input_ids``. Decoder image token ``k`` of an image is thus the merged
cell ``k`` (raster order), made of the ``m^2`` patches the tower holds at rows
``m^2 p .. m^2 p + m^2 - 1``, ``p`` the cell's place in the tower's order:

.. math:: E_{k, v} = \frac{1}{m^2}\,[\lfloor v / m^2 \rfloor = p(k)]

(``p(k) = k`` in Qwen2-VL; Qwen2.5-VL: the window order). ``grid_tokens`` gives, per cell of the
image's ``(h, w)`` patch grid, its row in the tower (inverting the processor's merge-block
layout and the window order).

**Streams.** The decoder is ``"tokens"``; the tower is ``"image"``, one flat row holding every
image of the batch. While attention maps are recorded, each tower block makes *one* call over
that row with a block-diagonal additive bias (0 within an image / window, the dtype's lowest
value across), which is the per-image (per-window) softmax exactly: masked keys get weight 0.
So GenericAttention, TransformerRelevance and rollout carry the decoder's image-token scores
through the tower (ICCV'21, :mod:`~captum_transformers.generation.vision_steps`). Where no map
is wanted (relevance under rules) the tower runs its own per-image calls, unrecorded, under the
rules; gradient relevance reaches ``pixel_values``: ``x * dy/dx`` summed over channels and the
temporal copies, laid back into the resized image (:meth:`ImageGrid.patches_to_image`).

Inputs are the processor's: ``pixel_values`` (patches, C T P P), ``image_grid_thw`` (images, 3);
or images (n, C, H, W) normalized as the processor does, sides multiples of ``P m``
(``images=``), laid out as its patch rows here (:func:`patchify`, the maps then in their layout).
:meth:`Qwen2VLAdapter.call_model` builds ``mm_token_type_ids`` from ``input_ids`` when not given
(1 at image tokens) and drops 1-D ``position_ids`` (a generation batch's): the model computes
its M-RoPE positions (temporal, row, column) from ``input_ids``, ``image_grid_thw`` and the
attention mask itself. Refused: videos and multi-frame images (``t > 1``).

Example::

    >>> adapter = get_adapter(qwen)                                    # a Qwen2VLAdapter
    >>> image = adapter.images(qwen, input_ids, {"pixel_values": rows, "image_grid_thw": thw})[0]
    >>> image.grid, image.token_map.shape                              # ((4, 6), (6, 24))
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import torch
from torch import nn

from ..huggingface import kernel as hf_kernel
from ...model_state import patching
from ...capture.recorder import Recorder
from ...errors import InputError
from .qwen2_vl_geometry import ImageGrid, image_grids, patch_row_spans, patchify
from .base import IMAGE_STREAM, TEXT_STREAM, ImageTokens, VisionLanguageAdapter, placeholders_per_image


def _qwen(model: nn.Module) -> nn.Module:
    """The ``Qwen2VLModel`` / ``Qwen2_5_VLModel`` inside ``model`` (tower ``visual`` + ``language_model``)."""
    for module in model.modules():
        if hasattr(module, "visual") and hasattr(module, "language_model") and hasattr(module, "get_rope_index"):
            return module
    raise InputError(f"{type(model).__name__} holds no Qwen2-VL model (a module with visual, language_model and "
                     "get_rope_index).")


def window_order(model: nn.Module, image_grid_thw: torch.Tensor) -> Optional[torch.Tensor]:
    """The merged cell (global, raster order per image) at each merged place of the tower's
    sequence: Qwen2.5-VL's window order; None for Qwen2-VL (no reordering)."""
    tower = _qwen(model).visual
    if not hasattr(tower, "permute_input_for_window_attn"):
        return None
    from transformers.vision_utils import get_vision_window_index

    order, _ = get_vision_window_index(image_grid_thw, spatial_merge_size=tower.spatial_merge_size,
                                       window_size=tower.window_size, patch_size=tower.patch_size)
    return order


def tower_places(grid: ImageGrid, order: Optional[torch.Tensor], first_cell: int) -> torch.Tensor:
    """(num_tokens,): the merged place, within the image's span of the tower, of each merged cell."""
    if order is None:
        return torch.arange(grid.num_tokens)
    own = order[first_cell:first_cell + grid.num_tokens] - first_cell  # cell at each place
    return torch.argsort(own)


def merge_map(grid: ImageGrid, places: torch.Tensor) -> torch.Tensor:
    """(tokens, patches): decoder image token ``k`` is the mean of the ``m^2`` tower rows of its place."""
    group = grid.merge ** 2
    token_map = torch.zeros(grid.num_tokens, grid.num_patches, dtype=torch.float64)
    rows = places[:, None] * group + torch.arange(group)[None, :]
    token_map[torch.arange(grid.num_tokens)[:, None].expand_as(rows), rows] = 1.0 / group
    return token_map


def grid_order(grid: ImageGrid, places: torch.Tensor) -> torch.Tensor:
    """(h * w,): the tower row (within the image's span) of each cell of the (h, w) grid, row-major."""
    m = grid.merge
    rows = torch.arange(grid.h)[:, None]
    cols = torch.arange(grid.w)[None, :]
    cell = (rows // m) * (grid.w // m) + cols // m
    return (places[cell] * m * m + (rows % m) * m + cols % m).reshape(-1)


def block_bias(cu_seqlens: torch.Tensor, length: int, like: torch.Tensor) -> torch.Tensor:
    """(1, 1, N, N): 0 between tokens of one chunk of ``cu_seqlens``, the lowest value elsewhere."""
    chunk = torch.bucketize(torch.arange(length, device=like.device), cu_seqlens.to(like.device)[1:], right=True)
    same = chunk[:, None] == chunk[None, :]
    bias = torch.zeros(length, length, dtype=like.dtype, device=like.device)
    return bias.masked_fill_(~same, torch.finfo(like.dtype).min)[None, None]


def _one_call_per_block(original):
    """A tower attention's forward as one recorded call over the flat row (block-diagonal bias)
    when maps are recorded, else its own per-image calls, reported to no recorder."""

    def forward(hidden_states, cu_seqlens, *args, **kwargs):
        active = hf_kernel.ACTIVE.get()  # the recorder the kernel reports to (hf_kernel.active_recorder)
        if active is not None and active[0].wants_maps:
            whole = cu_seqlens.new_tensor([0, hidden_states.shape[0]])
            bias = block_bias(cu_seqlens, hidden_states.shape[0], hidden_states)
            return original(hidden_states, whole, *args, position_bias=bias, **kwargs)
        token = hf_kernel.ACTIVE.set(None)
        try:
            return original(hidden_states, cu_seqlens, *args, **kwargs)
        finally:
            hf_kernel.ACTIVE.reset(token)

    return forward


class Qwen2VLAdapter(VisionLanguageAdapter):
    """Qwen2-VL and Qwen2.5-VL (see the module docstring)."""

    name = "qwen2-vl"
    families = ("Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration: "
                "flat patches, 2x2 merger, M-RoPE decoder)")
    stream_components: Mapping[str, str] = {"visual": IMAGE_STREAM, "language_model": TEXT_STREAM}
    image_input_names = ("pixel_values", "image_grid_thw")

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(super().capture(model, recorder))
            for block in self.blocks(model):
                if block.streams is not None and block.streams[0] == IMAGE_STREAM:
                    stack.enter_context(patching.instance_forward(block.module, _one_call_per_block))
            yield

    def token_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tower's flat (N, D) states as one row (1, N, D); the decoder's as they are."""
        return hidden[None] if hidden.dim() == 2 else hidden

    def vision_tower(self, model: nn.Module) -> nn.Module:
        return _qwen(model).visual

    def projector(self, model: nn.Module) -> nn.Module:
        return _qwen(model).visual.merger

    def image_token_id(self, model: nn.Module) -> int:
        return int(_qwen(model).config.image_token_id)

    def feeding_calls(self, model: nn.Module) -> int:
        """The merger reads the tower's last hidden state: after all its blocks (one call each)."""
        return int(_qwen(model).config.vision_config.depth)

    def _flat_inputs(self, model: nn.Module, image_inputs: Mapping[str, Any]) -> Dict[str, Any]:
        """The image inputs as the model takes them: (n, C, H, W) images (``images=``, normalized as
        the processor does) laid out as its patch rows with their ``image_grid_thw``."""
        pixels = image_inputs.get("pixel_values")
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4:
            return dict(image_inputs)
        if image_inputs.get("image_grid_thw") is not None:
            raise InputError(f"pixel_values of shape {tuple(pixels.shape)} are images (n, C, H, W), which carry their "
                             "own grid; image_grid_thw goes with the processor's patch rows (patches, C*T*P*P) only.")
        vision = _qwen(model).config.vision_config
        rows, thw = patchify(pixels, int(vision.patch_size), int(vision.spatial_merge_size),
                             int(vision.temporal_patch_size))
        return {**image_inputs, "pixel_values": rows, "image_grid_thw": thw}

    def _grids(self, model: nn.Module, image_inputs: Mapping[str, Any]) -> List[ImageGrid]:
        vision = _qwen(model).config.vision_config
        image_inputs = self._flat_inputs(model, image_inputs)
        thw, pixels = image_inputs.get("image_grid_thw"), image_inputs.get("pixel_values")
        if not isinstance(thw, torch.Tensor) or not isinstance(pixels, torch.Tensor) or pixels.dim() != 2:
            raise InputError("Qwen2-VL's images are pixel_values (patches, C*T*P*P) with image_grid_thw (images, 3), "
                             "as its processor returns them, or images (n, C, H, W) normalized as it does; got pixel_values {tuple(getattr(pixels, 'shape', ()))} "
                             f"and image_grid_thw {type(thw).__name__}.")
        grids = image_grids(thw, int(vision.patch_size), int(vision.spatial_merge_size))
        if sum(g.num_patches for g in grids) != pixels.shape[0]:
            raise InputError(f"image_grid_thw gives {sum(g.num_patches for g in grids)} patches but pixel_values has "
                             f"{pixels.shape[0]} rows; pass the processor's pixel_values and image_grid_thw together.")
        return grids

    def images(self, model: nn.Module, input_ids: torch.Tensor, image_inputs: Mapping[str, Any]) -> List[ImageTokens]:
        grids = self._grids(model, image_inputs)
        found = self.image_token_positions(model, input_ids)
        if len(found) != sum(g.num_tokens for g in grids):
            raise InputError(f"input_ids hold {len(found)} image tokens (id {self.image_token_id(model)}) but the "
                             f"images' grids {[(g.h, g.w) for g in grids]} give {[g.num_tokens for g in grids]} "
                             "tokens; expand each image's placeholder to h*w/merge^2 tokens (as the processor does).")
        order = window_order(model, self._flat_inputs(model, image_inputs)["image_grid_thw"].cpu())
        runs = placeholders_per_image(found, [g.num_tokens for g in grids])
        images, start = [], 0
        for (example, positions), grid, span in zip(runs, grids, patch_row_spans(grids)):
            places = tower_places(grid, order, start)
            start += grid.num_tokens
            # The tower's one flat row (vision_row 0): the image's patches are rows span of it.
            images.append(ImageTokens(example, positions, 0, span, merge_map(grid, places), (grid.h, grid.w),
                                      grid_order(grid, places), grid.image_size))
        return images

    def pixel_relevance(self, model: nn.Module, products: Mapping[str, torch.Tensor],
                        images: Sequence[ImageTokens]) -> List[torch.Tensor]:
        vision = _qwen(model).config.vision_config
        rows = products["pixel_values"]
        if rows.dim() == 4:  # images (n, C, H, W) given as such: their gradient is in the image layout
            return list(rows.sum(1).unbind(0))
        maps = []
        for image in images:
            (start, stop), (h, w) = image.vision_span, image.grid
            grid = ImageGrid(1, h, w, int(vision.patch_size), int(vision.spatial_merge_size))
            maps.append(grid.patches_to_image(rows[start:stop], int(vision.in_channels),
                                              int(vision.temporal_patch_size)).sum(0))
        return maps

    def token_type_inputs(self, model: nn.Module, input_ids: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The per-token keywords the processor returns next to ``input_ids`` (what ``generate``
        needs too): ``mm_token_type_ids``, 1 at image tokens, from which M-RoPE places the image."""
        return {"mm_token_type_ids": (input_ids == self.image_token_id(model)).to(torch.int)}

    def generation_inputs(self, model: nn.Module, input_ids: torch.Tensor,
                          image_inputs: Mapping[str, Any]) -> Dict[str, Any]:
        """The image keywords for ``model.generate(input_ids, ...)``: the processor's patch rows
        and grid (from images given as such), and ``mm_token_type_ids``."""
        return {**self._flat_inputs(model, image_inputs), **self.token_type_inputs(model, input_ids)}

    def call_model(self, model, inputs, additional_forward_args, forward_kwargs):
        """With ``mm_token_type_ids`` built from ``input_ids`` when not given, without 1-D
        ``position_ids`` (the model's M-RoPE positions), and the model's ``rope_deltas`` restored."""
        kwargs = self._flat_inputs(model, forward_kwargs or {})
        ids = inputs[0] if inputs and not inputs[0].is_floating_point() else kwargs.get("input_ids")
        positions = kwargs.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.dim() == 2:
            del kwargs["position_ids"]
        if isinstance(ids, torch.Tensor) and kwargs.get("image_grid_thw") is not None:
            expected = self.token_type_inputs(model, ids)["mm_token_type_ids"]
            given = kwargs.get("mm_token_type_ids")
            if given is None:
                kwargs["mm_token_type_ids"] = expected
            elif not torch.equal((given.to(expected.device) == 1).to(torch.int), expected):
                raise InputError("mm_token_type_ids must be 1 exactly at the image tokens of input_ids (Qwen2-VL's "
                                 "M-RoPE positions are read from them); the given ones differ. Pass the processor's "
                                 "mm_token_type_ids, or leave them out to have them built from input_ids.")
        inner = _qwen(model)
        # forward caches rope_deltas on the model for cached decoding; a capture leaves it as it was.
        with patching.attributes(inner, rope_deltas=inner.rope_deltas):
            return super().call_model(model, inputs, additional_forward_args, kwargs)
