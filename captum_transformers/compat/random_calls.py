"""The table of calls that make a forward random or batch-dependent, with their argument checks.

Stage 2 of the train-mode rule (:mod:`.stochastic_layers`) looks each call of the forward up in
:data:`RANDOM_CALL_CHECKS`: ``F.dropout`` and its kin, ``scaled_dot_product_attention`` and
``multi_head_attention_forward`` with dropout, batch / instance norm on batch statistics,
``rrelu``, Bernoulli sampling, and every other random sampler with the number of values it draws
(a draw of at most one number is a coin and passes). Each check reads the call's arguments and
returns ``(what, changes_model)`` or None. Kept apart from the rule (walk + watch), which only
consults the table.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

# -- stage 2: functions random or batch-dependent by their arguments ----------------------------

def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _dropout(label: str, training_default: bool, p_index: int = 1, training_index: int = 2,
             p_name: str = "p", training_name: str = "training") -> Callable[[tuple, dict], Optional[Tuple[str, bool]]]:
    def check(args: tuple, kwargs: dict) -> Optional[Tuple[str, bool]]:
        p = _argument(args, kwargs, p_index, p_name, 0.5)
        active = _argument(args, kwargs, training_index, training_name, training_default)
        return (f"{label}(p={float(p)}, training=True)", False) if active and float(p) > 0 else None
    return check


def _sdpa(args: tuple, kwargs: dict) -> Optional[Tuple[str, bool]]:
    p = _argument(args, kwargs, 4, "dropout_p", 0.0)
    return (f"scaled_dot_product_attention(dropout_p={float(p)})", False) if float(p) > 0 else None


def _mha(args: tuple, kwargs: dict) -> Optional[Tuple[str, bool]]:
    p = _argument(args, kwargs, 10, "dropout_p", 0.0)
    active = _argument(args, kwargs, 13, "training", True)
    return (f"multi_head_attention_forward(dropout_p={float(p)}, training=True)", False) \
        if active and float(p) > 0 else None


def _batch_norm(label: str, mean_index: int) -> Callable[[tuple, dict], Optional[Tuple[str, bool]]]:
    def check(args: tuple, kwargs: dict) -> Optional[Tuple[str, bool]]:
        if not _argument(args, kwargs, 5, "training", False):
            return None
        updates = _argument(args, kwargs, mean_index, "running_mean", None) is not None
        return f"{label}(training=True) on batch statistics" + (" updating running statistics" if updates else ""), \
            updates
    return check


def _instance_norm(mean_index: int) -> Callable[[tuple, dict], Optional[Tuple[str, bool]]]:
    def check(args: tuple, kwargs: dict) -> Optional[Tuple[str, bool]]:
        uses_input = _argument(args, kwargs, 5, "use_input_stats", True)
        if uses_input and _argument(args, kwargs, mean_index, "running_mean", None) is not None:
            return "instance_norm updating running statistics", True
        return None
    return check


def _rrelu(args: tuple, kwargs: dict) -> Optional[Tuple[str, bool]]:
    return ("rrelu(training=True)", False) if _argument(args, kwargs, 3, "training", False) else None


def _bernoulli(args: tuple, kwargs: dict) -> Optional[Tuple[str, bool]]:
    # Refused at any size: a one-element Bernoulli draw is a drop-path coin (torchvision's
    # StochasticDepth in "batch" mode), not a harmless one like the layerdrop coin below.
    return "Bernoulli sampling (a random mask, as drop path or a hand-written dropout draws)", False


# -- random draws other than Bernoulli: refused from two numbers up ----------------------------
#
# A draw of many numbers is noise or a mask applied to activations (router jitter in MoE
# models, Gumbel noise, ``torch.rand_like(h) > p``). A draw of at most one number is a coin:
# HuggingFace layers draw ``torch.rand([])`` in training mode even at ``layerdrop=0``, where it
# changes nothing, and a coin that does change something is a ``layerdrop`` (or drop path) the
# module walk refuses. The limit: a hand-written coin the walk cannot name (``if torch.rand([])
# < 0.1: skip``) passes.

def _first_tensor(args: tuple, kwargs: dict, *names: str) -> Optional[torch.Tensor]:
    for name in names:
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name]
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def _shape_count(shape: Any) -> int:
    count = 1
    for extent in shape:
        count *= int(extent)
    return count


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list, torch.Size))


def _count_of_input(args: tuple, kwargs: dict) -> int:
    """Numbers drawn by ``*_like``, in-place samplers, ``poisson`` and kin: one per input element."""
    tensor = _first_tensor(args, kwargs, "input", "self", "tensor", "count", "logits")
    return tensor.numel() if tensor is not None else 2  # unknown: counted as a draw of many


def _count_of_size(args: tuple, kwargs: dict) -> int:
    """``torch.rand(2, 3)``, ``torch.rand((2, 3))``, ``torch.rand(size=...)``, ``torch.randint(low,
    high, size)``: the first shape given (or the leading integers)."""
    if _is_shape(kwargs.get("size")):
        return _shape_count(kwargs["size"])
    for value in args:
        if _is_shape(value):
            return _shape_count(value)
    leading = []
    for value in args:
        if not isinstance(value, int) or isinstance(value, bool):
            break
        leading.append(value)
    return _shape_count(leading) if leading else 2


def _count_of_randint(args: tuple, kwargs: dict) -> int:
    if _is_shape(kwargs.get("size")):
        return _shape_count(kwargs["size"])
    shapes = [value for value in args if _is_shape(value)]
    return _shape_count(shapes[0]) if shapes else 2


def _count_of_randperm(args: tuple, kwargs: dict) -> int:
    return int(_argument(args, kwargs, 0, "n", 2))


def _count_of_normal(args: tuple, kwargs: dict) -> int:
    """``normal(mean, std, size)`` with numbers, or with tensors broadcast together."""
    if _is_shape(kwargs.get("size")) or any(_is_shape(value) for value in args):
        return _count_of_randint(args, kwargs)
    tensors = [value for value in (*args, kwargs.get("mean"), kwargs.get("std")) if isinstance(value, torch.Tensor)]
    return _shape_count(torch.broadcast_shapes(*(t.shape for t in tensors))) if tensors else 2


def _count_of_multinomial(args: tuple, kwargs: dict) -> int:
    probabilities = _first_tensor(args, kwargs, "input", "self")
    samples = int(_argument(args, kwargs, 1, "num_samples", 2))
    rows = probabilities.shape[0] if probabilities is not None and probabilities.dim() == 2 else 1
    return samples * rows


def _count_of_fractional_pool(spatial: int) -> Callable[[tuple, dict], int]:
    def count(args: tuple, kwargs: dict) -> int:
        # One offset per pooled dimension and channel, unless they are given (``_random_samples``).
        if _argument(args, kwargs, 5, "_random_samples", None) is not None:
            return 0
        tensor = _first_tensor(args, kwargs, "input")
        if tensor is None or tensor.dim() < spatial:
            return 2
        return tensor.numel() // max(_shape_count(tensor.shape[-spatial:]), 1) * spatial
    return count


def _draw(label: str, count: Callable[[tuple, dict], int]) -> Callable[[tuple, dict], Optional[Tuple[str, bool]]]:
    def check(args: tuple, kwargs: dict) -> Optional[Tuple[str, bool]]:
        drawn = count(args, kwargs)
        if drawn <= 1:
            return None
        return f"{label} drawing {drawn} random numbers (noise or a mask applied to the activations)", False
    return check


def _random_draws() -> Dict[Any, Callable[[tuple, dict], Optional[Tuple[str, bool]]]]:
    """Every random sampler of torch's public API the forward of a model may call (and the
    Python-level functions that draw inside: a torch-function mode does not see the calls a
    function it already saw makes)."""
    counts: Dict[str, Callable[[tuple, dict], int]] = {
        "rand": _count_of_size, "randn": _count_of_size, "randint": _count_of_randint,
        "randperm": _count_of_randperm, "normal": _count_of_normal, "multinomial": _count_of_multinomial,
        "rand_like": _count_of_input, "randn_like": _count_of_input, "randint_like": _count_of_input,
        "poisson": _count_of_input, "binomial": _count_of_input, "_standard_gamma": _count_of_input,
        "_sample_dirichlet": _count_of_input,
    }
    checks: Dict[Any, Callable] = {}
    for name, count in counts.items():
        function = getattr(torch, name, None)
        if function is not None:
            checks[function] = _draw(f"torch.{name}", count)
    for name in ("uniform_", "normal_", "exponential_", "random_", "geometric_", "log_normal_", "cauchy_",
                 "multinomial"):
        method = getattr(torch.Tensor, name, None)
        if method is not None:
            checks[method] = _draw(f"Tensor.{name}",
                                   _count_of_multinomial if name == "multinomial" else _count_of_input)
    for name in ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                 "kaiming_normal_", "orthogonal_", "sparse_"):
        function = getattr(nn.init, name, None)
        if function is not None:
            checks[function] = _draw(f"nn.init.{name}", _count_of_input)
    checks[F.gumbel_softmax] = _draw("F.gumbel_softmax", _count_of_input)
    for name in ("fractional_max_pool2d", "fractional_max_pool3d", "_fractional_max_pool2d", "_fractional_max_pool3d",
                 "fractional_max_pool2d_with_indices", "fractional_max_pool3d_with_indices"):
        function = getattr(F, name, None)
        if function is not None:
            checks[function] = _draw(f"F.{name.lstrip('_')}", _count_of_fractional_pool(3 if "3d" in name else 2))
    return checks


def _checks() -> Dict[Any, Callable[[tuple, dict], Optional[Tuple[str, bool]]]]:
    checks: Dict[Any, Callable] = {
        F.dropout: _dropout("F.dropout", True), F.dropout1d: _dropout("F.dropout1d", True),
        F.dropout2d: _dropout("F.dropout2d", True), F.dropout3d: _dropout("F.dropout3d", True),
        F.alpha_dropout: _dropout("F.alpha_dropout", False),
        F.feature_alpha_dropout: _dropout("F.feature_alpha_dropout", False),
        F.scaled_dot_product_attention: _sdpa,
        F.multi_head_attention_forward: _mha,
        F.batch_norm: _batch_norm("F.batch_norm", 1), torch.batch_norm: _batch_norm("torch.batch_norm", 3),
        F.instance_norm: _instance_norm(1), torch.instance_norm: _instance_norm(3),
        F.rrelu: _rrelu, F.rrelu_: _rrelu, torch.rrelu: _rrelu,
        torch.bernoulli: _bernoulli, torch.Tensor.bernoulli: _bernoulli, torch.Tensor.bernoulli_: _bernoulli,
    }
    for name in ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout"):
        for suffix in ("", "_"):  # torch.dropout(input, p, train) and its in-place twin
            function = getattr(torch, name + suffix, None)
            if function is not None:
                checks[function] = _dropout(f"torch.{name}{suffix}", False, training_name="train")
    for name in ("rrelu_",):
        function = getattr(torch, name, None)
        if function is not None:
            checks[function] = _rrelu
    checks.update(_random_draws())
    return checks


RANDOM_CALL_CHECKS = _checks()
