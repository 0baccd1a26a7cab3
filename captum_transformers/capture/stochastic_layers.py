"""One rule for models in training mode: a random or batch-dependent forward is refused.

A model left in training mode with active dropout (or drop path, RReLU, batch norm on batch
statistics) computes a different forward on every call, so every explanation of it differs
too, with no sign that anything is wrong. Every adapter and method therefore runs its
forward under :func:`watched`, which refuses such a forward with
:class:`~captum_transformers.errors.StochasticForwardError`, naming what it found and the fix
(``model.eval()``). Training mode as such is fine: gradient checkpointing needs it, and a model
whose dropouts all have ``p = 0`` (Llama-type models) computes the eval-mode forward.

Two stages, so that the check costs nothing on a model in eval mode:

1. a walk of the modules (the explanation's published walk, :mod:`module_walk`): if none is in
   training mode, nothing else happens. Otherwise modules that are random or batch-dependent
   by their class (``nn.Dropout*`` / ``nn.AlphaDropout`` with ``p > 0``, ``nn.MultiheadAttention``
   with ``dropout > 0``, HF / timm ``DropPath`` and torchvision ``StochasticDepth`` with a drop
   probability, ``nn.RReLU``, batch norm, a ``layerdrop`` above 0) are refused before the forward;
2. during the forward, a ``TorchFunctionMode`` looks at the few functions that are random or
   batch-dependent when called so (``F.dropout`` and its kin with ``p > 0`` and ``training=True``,
   as PyG convolutions and HF attention call it inline; ``scaled_dot_product_attention`` with
   ``dropout_p > 0``; ``F.multi_head_attention_forward`` with dropout; ``F.batch_norm`` /
   ``F.instance_norm`` on batch statistics; ``F.rrelu`` in training; Bernoulli sampling, as drop
   path and hand-written dropout draw masks; every other random draw of more than one number:
   ``torch.rand`` / ``randn`` / ``randint`` / ``randperm`` / ``multinomial`` / ``normal`` /
   ``poisson`` and their ``*_like`` forms, the in-place samplers ``uniform_`` / ``normal_`` /
   ``exponential_`` / ``random_`` / ``geometric_`` / ``log_normal_`` / ``cauchy_``,
   ``F.gumbel_softmax``, ``nn.init`` in the forward: MoE router jitter, Gumbel noise,
   ``h * (torch.rand_like(h) > p)``). The first such call is refused before it runs, naming the
   module whose forward made it. The user's hooks on the model are part of its forward: the
   watch stays on inside them (a hook adding dropout is refused), while another model run from
   such a hook follows its own rule.

A random draw of at most one number is let through: it is a coin, not noise on activations.
HuggingFace layers draw ``torch.rand([])`` in training mode, at some versions even at
``layerdrop=0`` where it skips nothing, and a coin that does skip layers is a ``layerdrop > 0``
that stage 1 refuses. The limit: a hand-written coin with no ``layerdrop`` attribute
(``if torch.rand([]) < 0.1: skip``) is not seen. (Bernoulli draws are refused at any size: a
one-number Bernoulli mask is a drop-path coin.) Comparing the generator's state before and
after the forward is no backstop: the harmless coin moves it too.

The opt-in: a method built with ``allow_stochastic=True`` explains the random forward on
purpose (each call's map is that call's forward); it enters :func:`allowing` around its passes.
Layers that would *change the model* (batch / instance norm updating their running statistics
in training mode) are refused even then: an explanation never changes the model.

Functions called with ``training=True`` from a model in eval mode (a hand-written
``F.dropout(x, 0.1)`` whose ``training`` defaults to True), or random draws made at any mode,
are not seen: stage 2 runs only when some module is in training mode. Neither are draws made
outside torch (NumPy, Python's ``random``) or inside a compiled kernel.

Example::

    >>> model.train()
    >>> GenericAttention(model).attribute(x)                          # StochasticForwardError: ... model.eval()
    >>> GenericAttention(model, allow_stochastic=True).attribute(x)   # one random draw of the forward
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import StochasticForwardError
from . import isolation, module_walk

_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("captum_transformers_allow_stochastic", default=False)
# The models whose forward this thread is watching now (a nested watch of one of them adds nothing).
_WATCHING: contextvars.ContextVar[Tuple[int, ...]] = contextvars.ContextVar("captum_transformers_watching",
                                                                            default=())

#: The keyword every method takes to explain a random forward on purpose.
OPT_IN = "allow_stochastic"


class Finding(NamedTuple):
    """One random or batch-dependent layer: where, what, and whether running it would change
    the model (running statistics updated), which no opt-in allows."""

    where: str
    what: str
    changes_model: bool = False


@contextlib.contextmanager
def allowing(allowed: bool) -> Iterator[None]:
    """Inside, :func:`watched` lets a random or batch-dependent forward run (``allowed=True``)
    or refuses it (``False``); the method's ``allow_stochastic`` enters it around its passes."""
    token = _ALLOWED.set(bool(allowed))
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def module_findings(model: nn.Module) -> Tuple[bool, List[Finding]]:
    """``(any module in training mode, the layers random or batch-dependent by their class)``.

    The first is False for a model in eval mode, and then the list is empty: one pass over the
    (published) module walk reading ``training``, the whole cost of the rule in eval mode."""
    named = module_walk.named_modules(model)
    if not any(module.training for _, module in named):
        return False, []
    found = []
    for name, module in named:
        if module.training:
            finding = _module_finding(_display_name(model, name), module)
            if finding is not None:
                found.append(finding)
    return True, found


def _module_finding(where: str, module: nn.Module) -> Optional[Finding]:
    kind = type(module).__name__
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return Finding(where, f"{kind}(p={module.p})") if module.p > 0 else None
    if isinstance(module, nn.MultiheadAttention):
        return Finding(where, f"{kind}(dropout={module.dropout})") if module.dropout > 0 else None
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        updates = module.track_running_stats and module.running_mean is not None
        return Finding(where, f"{kind} on batch statistics" + (" (updating running_mean / running_var)" if updates
                                                               else ""), updates)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        updates = module.track_running_stats and module.running_mean is not None
        return Finding(where, f"{kind} updating running_mean / running_var", True) if updates else None
    if isinstance(module, nn.RReLU):
        return Finding(where, f"{kind} (random slopes in training mode)")
    if any(part in kind for part in ("DropPath", "StochasticDepth", "DropBlock")):
        probability = getattr(module, "drop_prob", getattr(module, "p", None))
        if isinstance(probability, (int, float)) and probability > 0:
            return Finding(where, f"{kind}(drop probability {probability})")
        return None
    layerdrop = getattr(module, "layerdrop", None)
    if isinstance(layerdrop, float) and layerdrop > 0:
        return Finding(where, f"{kind} with layerdrop={layerdrop} (layers skipped at random)")
    return None


def _display_name(model: nn.Module, name: str) -> str:
    return name or f"the model ({type(model).__name__})"


@contextlib.contextmanager
def watched(model: nn.Module, allowed: Optional[bool] = None) -> Iterator[None]:
    """Run the forward of ``model`` inside: refused (before it runs) when it is random or
    batch-dependent, unless ``allowed`` (default: the innermost :func:`allowing`); refused even
    then when it would update running statistics. Costs one pass reading ``module.training``
    when the model is in eval mode; otherwise a torch-function mode observes the forward."""
    if id(model) in _WATCHING.get():
        yield
        return
    allowed = _ALLOWED.get() if allowed is None else bool(allowed)
    training, found = module_findings(model)
    if not training:
        yield
        return
    refused = [f for f in found if f.changes_model] if allowed else found
    if refused:
        raise StochasticForwardError(refusal(model, refused, allowed))
    token = _WATCHING.set(_WATCHING.get() + (id(model),))
    try:
        with _FunctionalWatch(model, allowed):
            yield
    finally:
        _WATCHING.reset(token)


def refusal(model: nn.Module, found: List[Finding], allowed: bool) -> str:
    """The error message: what was found, why it is refused, how to fix it."""
    shown = "; ".join(f"{f.where}: {f.what}" for f in found[:6])
    more = f"; and {len(found) - 6} more" if len(found) > 6 else ""
    if allowed or all(f.changes_model for f in found):
        return (
            f"{type(model).__name__} is in training mode and its forward would update running statistics ({shown}"
            f"{more}): explaining must not change the model, and the explained forward would depend on the rest of "
            "the batch. Call model.eval() before explaining (model.train() afterwards to go on training); "
            f"{OPT_IN}=True does not cover layers that change the model."
        )
    return (
        f"{type(model).__name__} is in training mode and its forward is random or batch-dependent ({shown}{more}), "
        "so every call would explain a different forward and give a different map. Call model.eval() before "
        "explaining (model.train() afterwards to go on training), or set the probabilities to 0; to explain one "
        f"random draw on purpose, build the method with {OPT_IN}=True."
    )


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


_CHECKS = _checks()


_MODULE_CALL = nn.Module._call_impl.__code__


class _FunctionalWatch(TorchFunctionMode):
    """Passes every call through; a random or batch-dependent one (:data:`_CHECKS`) is refused
    before it runs (so that no running statistic changes), naming the calling module.

    It stays on inside the user's hooks on the model (``kept_in_user_hooks``, read by
    :mod:`.isolation`, which sets the package's other modes aside there): a hook that adds
    dropout or noise to a module's output makes the explained forward random just as the
    module would. It holds no recorder or rule, so nothing else of the explanation reaches the
    hook. Another model run or explained from such a hook follows its own rule, not this one:
    a call made inside one of *its* modules passes here (its own :func:`watched`, if it is in
    training mode, judges it)."""

    kept_in_user_hooks = True

    def __init__(self, model: nn.Module, allowed: bool) -> None:
        super().__init__()
        self.model, self.allowed = model, allowed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = _CHECKS.get(func)
        if check is not None:
            found = check(args, kwargs)
            if found is not None and (found[1] or not self.allowed) and not self._another_models_call():
                raise StochasticForwardError(refusal(self.model, [Finding(self._caller(), found[0], found[1])],
                                                     self.allowed))
        return func(*args, **kwargs)

    def _another_models_call(self) -> bool:
        """Whether the call is made inside a module of another model, run from one of this
        model's user hooks (the innermost module being called is not one of this model's).
        Outside those hooks every call of the forward is this model's (the refusal path only)."""
        if id(self.model) not in isolation.inside_hooks_of():
            return False
        ours = {id(module) for _, module in module_walk.named_modules(self.model)}
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is _MODULE_CALL:
                return id(frame.f_locals.get("self")) not in ours
            frame = frame.f_back
        return False

    def _caller(self) -> str:
        """The innermost module of the model whose forward is on the stack (the error path only)."""
        names = {id(module): name for name, module in module_walk.named_modules(self.model)}
        frame = sys._getframe(2)
        while frame is not None:
            for local in ("self", "module"):
                candidate = frame.f_locals.get(local)
                if isinstance(candidate, nn.Module) and id(candidate) in names:
                    name = names[id(candidate)]
                    return f"{name} ({type(candidate).__name__})" if name else _display_name(self.model, name)
            frame = frame.f_back
        return _display_name(self.model, "")
