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
from typing import Iterator, List, NamedTuple, Optional, Tuple

from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import StochasticForwardError
from ..model_state import isolation, module_walk
from .random_calls import RANDOM_CALL_CHECKS

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


_MODULE_CALL = nn.Module._call_impl.__code__


class _FunctionalWatch(TorchFunctionMode):
    """Passes every call through; a random or batch-dependent one
    (:data:`.random_calls.RANDOM_CALL_CHECKS`) is refused before it runs (so that no running
    statistic changes), naming the calling module.

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
        check = RANDOM_CALL_CHECKS.get(func)
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
