"""Colour scales of relevance: signed (diverging) and sequential, with their limits.

One convention everywhere in this package's pictures, so that colours mean the same thing in
an image overlay, a token heatmap and the CLI's strips:

* **signed** maps use a diverging scale symmetric about zero, ``[-limit, +limit]``: white at
  0, red for positive relevance (evidence for the explained class), blue for negative;
* **sequential** maps (non-negative, e.g. attention-based methods) use ``[0, limit]``: white
  at 0 and the same red at the limit, i.e. the positive half of the signed scale.

``limit`` is the largest ``|value|`` (or a percentile of ``|value|``: a few extreme pixels
would otherwise wash out a per-pixel map), taken over one map (``scale="per-map"``) or over
all maps drawn together (``scale="shared"``), or given as a number. Values beyond the limit
are drawn at full colour. NaN and infinite values are refused: no colour would be honest.

Signed or sequential is decided per METHOD, never by the scale or the data (``signed_per_key``):
a limit shared between LRP and rollout leaves rollout sequential, and an LRP map that happens
to hold no negative value stays signed. Pictures take ``signed=`` as a bool or a
``{method_name: bool}`` dict; with neither, a catalog method name is answered by its catalog
entry (the ``signed`` its method class declares) and only other names get a guess from the data.

>>> scale = ColorScale.fit([torch.tensor([-2.0, 0.0, 1.0])])
>>> scale.signed, scale.limit
(True, 2.0)
>>> scale.rgb(torch.tensor([0.0]))[0].tolist()                    # zero is white
[255, 255, 255]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, Mapping, Optional, Union

import torch

from ..errors import InputError
from ..methods.catalog import METHOD_CATALOG

WHITE = (255.0, 255.0, 255.0)
RED = (178.0, 24.0, 43.0)     # the ends of ColorBrewer's RdBu scale
BLUE = (33.0, 102.0, 172.0)

ScaleOption = Union[str, float, int]


def as_float_tensor(values, what: str) -> torch.Tensor:
    """``values`` (a tensor, numpy array or nested list) as a detached float32 CPU tensor,
    refused with the positions of the first bad values if any is NaN or infinite."""
    if isinstance(values, torch.Tensor):
        tensor = values.detach().to("cpu", torch.float32)
    else:
        try:
            tensor = torch.as_tensor(values, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as error:
            raise InputError(f"{what}: expected a tensor or array of numbers, got {type(values).__name__} "
                             f"({error}).") from None
    bad = ~torch.isfinite(tensor)
    if bool(bad.any()):
        where = bad.nonzero()[:3].tolist()
        raise InputError(f"{what} holds {int(bad.sum())} NaN or infinite value(s) (first at index {where}); "
                         "a colour for them would be made up. Fix the attribution (e.g. a float16 overflow: "
                         "explain in float32) or replace them explicitly with torch.nan_to_num.")
    return tensor


@dataclass(frozen=True)
class ColorScale:
    """A colour scale: ``signed`` (diverging, ``[-limit, limit]``) or sequential (``[0, limit]``)."""

    signed: bool
    limit: float

    def __post_init__(self):
        if not (math.isfinite(self.limit) and self.limit > 0):
            raise InputError(f"a colour scale limit must be a positive finite number, got {self.limit!r}.")

    @classmethod
    def fit(cls, maps: Iterable[torch.Tensor], signed: Optional[bool] = None, percentile: float = 100.0,
            limit: Optional[float] = None) -> "ColorScale":
        """The scale of ``maps`` drawn together: signed if ``signed`` or (when None) if any value
        is negative; ``limit`` given, or the ``percentile`` of ``|values|`` over all maps.

        An all-zero set of maps gets limit 1 (every value drawn white, the neutral colour:
        zero relevance is what it shows, and the colour bar says the scale)."""
        maps = [m.detach().float().flatten() for m in maps]
        if not maps:
            raise InputError("a colour scale needs at least one map.")
        values = torch.cat(maps)
        has_negative = bool((values < 0).any())
        if signed is None:
            signed = has_negative
        elif not signed and has_negative:
            raise InputError(f"signed=False but the map has negative values (min {float(values.min()):.4g}); "
                             "a sequential scale would draw them as zero. Use signed=True (or None).")
        if limit is None:
            if not 0 < percentile <= 100:
                raise InputError(f"percentile must be in (0, 100], got {percentile!r}.")
            magnitude = values.abs()
            if magnitude.numel() == 0:
                limit = 1.0
            elif percentile == 100:
                limit = float(magnitude.max())
            else:  # the k-th smallest |value| (torch.quantile refuses more than 2**24 values)
                rank = min(max(math.ceil(percentile / 100.0 * magnitude.numel()), 1), magnitude.numel())
                limit = float(torch.kthvalue(magnitude, rank).values)
            if limit <= 0:
                limit = float(magnitude.max()) or 1.0
        return cls(bool(signed), float(limit))

    @property
    def low(self) -> float:
        return -self.limit if self.signed else 0.0

    def normalized(self, values: torch.Tensor) -> torch.Tensor:
        """Values divided by the limit and clipped to [-1, 1] (signed) or [0, 1]."""
        scaled = values.float() / self.limit
        return scaled.clamp(-1.0 if self.signed else 0.0, 1.0)

    def rgb(self, values: torch.Tensor) -> torch.Tensor:
        """Colours of ``values`` (any shape) as uint8 RGB, shape ``values.shape + (3,)``."""
        return ramp(self.normalized(values))

    def describe(self) -> str:
        """The legend's words: the range and what each end means."""
        if self.signed:
            return f"blue -{self.limit:.3g} (against)  |  white 0  |  red +{self.limit:.3g} (for)"
        return f"white 0  |  red {self.limit:.3g} (darker = more relevant; unsigned: no direction)"


# What the colours mean, said next to every picture. A sequential (unsigned) map has no
# direction: its red must not read as "for the class" (a word the model reads as negative
# can be the most relevant one of a GenericAttention or rollout map).
SIGNED_WORDS = "red = for the explained class, blue = against it, white = 0"
UNSIGNED_WORDS = "darker red = more relevant (unsigned: no direction, neither for nor against the class)"


def legend_words(scales: Iterable["ColorScale"], names: Optional[Iterable[str]] = None) -> str:
    """The sentence saying what the colours of ``scales`` mean: signed, unsigned or both
    (then naming the unsigned maps when ``names``, parallel to ``scales``, is given)."""
    scales = list(scales)
    kinds = {scale.signed for scale in scales}
    if kinds == {True}:
        return f"Signed maps: {SIGNED_WORDS}."
    if kinds == {False}:
        return f"Unsigned maps: {UNSIGNED_WORDS}."
    unsigned = [] if names is None else sorted({n for n, s in zip(names, scales) if not s.signed and n})
    which = f" ({', '.join(unsigned)})" if unsigned else ""
    return f"Signed maps (±range): {SIGNED_WORDS}. Unsigned maps{which} (0..range): {UNSIGNED_WORDS}."


def ramp(normalized: torch.Tensor) -> torch.Tensor:
    """uint8 RGB of values in [-1, 1]: white at 0, towards red for +1 and blue for -1."""
    strength = normalized.abs().unsqueeze(-1)
    end = torch.where(normalized.unsqueeze(-1) >= 0, torch.tensor(RED), torch.tensor(BLUE))
    colour = torch.tensor(WHITE) * (1 - strength) + end * strength
    return colour.round().clamp(0, 255).to(torch.uint8)


def css_rgb(colour: torch.Tensor) -> str:
    """``rgb(r,g,b)`` of one uint8 colour."""
    r, g, b = (int(c) for c in colour.tolist())
    return f"rgb({r},{g},{b})"


def text_colour(normalized: float) -> str:
    """Black text, or white on strongly coloured backgrounds (black is unreadable on deep blue/red)."""
    return "#fff" if abs(normalized) > 0.65 else "#000"


def css_gradient(scale: ColorScale) -> str:
    """The CSS ``linear-gradient`` of ``scale``, for a colour bar."""
    stops = torch.linspace(-1.0 if scale.signed else 0.0, 1.0, 9)
    return "linear-gradient(to right, " + ", ".join(css_rgb(c) for c in ramp(stops)) + ")"


def _any_negative(group) -> bool:
    return any(bool((m < 0).any()) for m in group)


# Whether maps are signed: one answer for every key (a bool), or per key (a dict of bools).
SignedOption = Union[None, bool, Mapping[str, bool]]


def catalog_signedness(name) -> Optional[bool]:
    """Whether the catalog method called ``name`` returns signed maps, as its catalog entry says
    (the ``signed`` its method class declares); None for a name the catalog does not know (a
    display name, a user's own method)."""
    entry = METHOD_CATALOG.get(str(name))
    return None if entry is None else entry.signed


def signed_per_key(maps: Mapping, signed: SignedOption) -> Dict[str, bool]:
    """Signed or not, for each key (method) of ``maps`` ({key: list of tensors}).

    Signedness belongs to the METHOD, never to the scale or the data: LRP's map of a short
    sentence may hold no negative value and is still signed (red = for the class, its sum
    beside the logit), a rollout map drawn on a limit shared with LRP is still unsigned. So,
    per key: ``signed`` when a bool; ``signed[key]`` when a dict names the key; else the
    catalog's answer when the key is a catalog method name (:func:`catalog_signedness`); else, for a
    name nobody said anything about, a GUESS from the data (signed when a value is negative),
    which is wrong for a signed method's all-positive map: say ``signed=`` to be sure.
    A map drawn unsigned that holds a negative value is refused (its negatives would be
    drawn as zero)."""
    if signed is not None and not isinstance(signed, (bool, Mapping)):
        raise InputError(f"signed={signed!r}: expected None (the catalog's answer per method name), True, False, "
                         "or a {method_name: bool} dict.")
    given: Dict[str, bool] = {}
    if isinstance(signed, Mapping):
        given = {str(key): value for key, value in signed.items()}
        names = {str(key) for key in maps}
        stray = sorted(key for key in given if key not in names)
        if stray:
            raise InputError(f"signed names {stray}, which are not maps of this picture ({sorted(names)}); expected "
                             "a {method_name: bool} dict over the names of the maps (a typo would leave a map "
                             "labelled by a guess).")
        wrong = sorted(key for key, value in given.items() if not isinstance(value, bool))
        if wrong:
            raise InputError(f"signed[{wrong[0]!r}] is {given[wrong[0]]!r}; expected True (signed: for/against the "
                             "class) or False (unsigned: relevance with no direction).")
    out: Dict[str, bool] = {}
    for key, group in maps.items():
        if isinstance(signed, bool):
            out[key], reason = signed, "signed=False was given"
        elif str(key) in given:
            out[key], reason = given[str(key)], f"signed[{str(key)!r}] is False"
        else:
            known = catalog_signedness(key)
            reason = (f"{str(key)!r} is an unsigned method of the catalog (its method class declares "
                      "signed = False)")
            out[key] = _any_negative(group) if known is None else known
        if not out[key] and _any_negative(group):
            low = min(float(m.min()) for m in group if m.numel())
            raise InputError(f"the map(s) of {str(key)!r} hold negative values (min {low:.4g}) but are drawn unsigned: "
                             f"{reason}. An unsigned scale (0..limit) would draw the negatives as zero. Pass "
                             f"signed={{{str(key)!r}: True}} if this method's maps are signed, or check the map.")
    return out


def fit_scales(maps: dict, scale: ScaleOption, signed: SignedOption, percentile: float) -> dict:
    """One ``ColorScale`` per key of ``maps`` ({key: list of tensors}): ``"shared"`` fits one
    limit over all, ``"per-map"`` one scale per tensor (returned as a list per key), a number
    fixes the limit. Signed or not is decided per key (``signed_per_key``), also when the
    limit is shared: an unsigned map on a shared limit is drawn ``0..limit``."""
    kinds = signed_per_key(maps, signed)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        limit = ColorScale(True, float(scale)).limit  # refuses a limit that is not positive and finite
        return {key: [ColorScale(kinds[key], limit)] * len(group) for key, group in maps.items()}
    if scale == "shared":
        every = [m for group in maps.values() for m in group]
        limit = ColorScale.fit(every, signed=True, percentile=percentile).limit  # the limit only
        return {key: [ColorScale(kinds[key], limit)] * len(group) for key, group in maps.items()}
    if scale == "per-map":
        return {key: [ColorScale.fit([m], signed=kinds[key], percentile=percentile) for m in group]
                for key, group in maps.items()}
    if scale == "per-method":
        out = {}
        for key, group in maps.items():
            fitted = ColorScale.fit(group, signed=kinds[key], percentile=percentile)
            out[key] = [fitted] * len(group)
        return out
    raise InputError(f"scale={scale!r}: expected 'shared', 'per-method', 'per-map' or a positive number (the limit).")


def common_scale(scales: Mapping) -> "ColorScale":
    """The scale to show in the one colour bar of a shared limit: a signed one when any map is
    signed (its positive half is the unsigned maps' 0..limit ramp), else the first."""
    every = [scale for group in scales.values() for scale in group]
    return next((scale for scale in every if scale.signed), every[0])
