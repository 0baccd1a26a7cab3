"""One verdict per (architecture, head, method).

:func:`judge` calls a method on a batch and checks it; the verdict (:class:`Verdict`) is one of

* ``reference``: consistent (below) and equal to the eager reference of :mod:`.reference`;
* ``consistent``: finite, not all zero in any row, zero at padding, each row equal to the call
  on that example alone with its padding cut (relative 1e-8, float64; 1e-5 for models computing
  in float32 inside; not checked where the model's own scores differ), and the model exactly as
  before (parameters, buffers, ``requires_grad``, ``.grad``, modes, hooks, attention
  implementation, and a bit-identical forward output);
* ``zero map``: consistent, but some row is 0 everywhere and the package warned so (Grad-CAM,
  partial LRP: no positive evidence under the rectification; a silent all-zero row fails);
* ``refused``: the method raised a ``CaptumTransformersError`` (the model restored after it);
* ``not applicable``: it raised ``NotSoftmaxAttentionError``: the model mixes its tokens by
  something other than softmax attention, on which the method is defined (restored too);
* ``failed``: anything else: another exception (a package bug), a failed check, a map that
  differs from the reference;
* ``timed out``: the call ran past the time limit.

:func:`run_entry` builds one architecture under one head and judges every method on it;
``does not build`` and ``not a text model`` are the verdicts of every method of an entry that
never got that far.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from captum_transformers.errors import CaptumTransformersError, NotSoftmaxAttentionError

from .entries import HEADS, Entry
from .inputs import Example, call_model, explained_scores, make_example
from .media import ROW_READING_FORWARD, media_reason, read_rows_problem
from .reference import EagerReferences, Reference, eager_references
from .shrink import build_model, model_class, not_text_reason, small_config

# Batch == single, relative to the single call's largest entry: float64 models, and models whose
# eager kernels compute in float32 inside (their eager maps hold float32 values: Llama-style
# softmax and norms cast down), where float32 rounding differs between the two shapes.
BATCH_TOLERANCES = {"float64": 1e-8, "float32": 1e-5}
BATCH_TOLERANCE = BATCH_TOLERANCES["float64"]
# Model types whose attention scores are computed in float32 inside a float64 model (a row of data).
# MiniMax: its forward is batch-invariant to 1e-16, but its backward rounds in float32 somewhere (the
# plain gradient at the embeddings differs by 2**-29 between batch and single; Integrated Gradients'
# cancellation makes that 3e-7 relative).
FLOAT32_SCORES = frozenset({"gpt_neo", "minimax"})
# (model type, method) -> batch tolerance, where a float64 model takes its softmax in float32
# (``softmax(scores.float())``) and the method's rules amplify that rounding: XLM and FlauBERT under
# the LRP epsilon rules, 5e-5 to 3e-4 relative between batch and single, 1e-8 with the softmax
# taken in float64 instead (measured on the harness's XLM and FlauBERT).
AMPLIFIED_FLOAT32_SOFTMAX = {(model_type, method): 1e-3 for model_type in ("xlm", "flaubert")
                             for method in ("lrp", "partial-lrp")}
# (model type, method) -> batch tolerance, where the explained logit's gradient at the pixels is ~1e-12 of the
# values inside (random CvT and LeViT: convolutional stems with batch norm), so float64 rounding, which differs
# between a batch and one example in the worker's one-thread convolutions, reaches 1.6e-6 relative in the input
# gradient (Saliency, and Integrated Gradients' sum of them); with the default threads the two agree to 4e-17 (the
# package's Integrated Gradients equals Captum's bit for bit).
CANCELLING_GRADIENTS = {(model_type, method): 1e-5 for model_type in ("cvt", "levit")
                        for method in ("integrated-gradients", "saliency")}
KINDS = ("reference", "consistent", "zero map", "refused", "not applicable", "failed", "timed out", "does not build",
         "not a text model", "other inputs")
SKIPPED = ("not a text model", "other inputs")  # entries of another modality than the sweep's


@dataclasses.dataclass
class Verdict:
    """A verdict (``kind``, one of :data:`KINDS`) and its evidence.

    Attributes:
        detail: the refusal's first line, the exception or the failed check.
        frame: for an exception, the last traceback frame inside ``captum_transformers``.
        origin: for an exception, the frame that raised it.
        seconds: the wall time of the checks.
    """

    kind: str
    detail: str = ""
    frame: str = ""
    origin: str = ""
    seconds: float = 0.0

    def as_dict(self) -> Dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in ("", None)}

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> "Verdict":
        return cls(**values)


class TimeLimit(BaseException):
    """Raised by :func:`time_limit` (a BaseException, so no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: Optional[float]) -> Iterator[None]:
    """Raise :class:`TimeLimit` in this thread after ``seconds`` (SIGALRM; no limit off the main
    thread, or with ``seconds`` None)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(*_):
        raise TimeLimit(f"ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- exceptions -------------------------------------------------------------------------------
def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _frame_text(frame: traceback.FrameSummary) -> str:
    path = frame.filename
    if "captum_transformers/" in path:
        path = "captum_transformers/" + path.rsplit("captum_transformers/", 1)[1]
    elif "site-packages/" in path:
        path = path.rsplit("site-packages/", 1)[1]
    return f"{path}:{frame.lineno} in {frame.name}"


def exception_verdict(kind: str, error: BaseException, prefix: str = "") -> Verdict:
    """A verdict for ``error``: its type and first line, the last package frame and the origin."""
    frames = traceback.extract_tb(error.__traceback__)
    package = [f for f in frames if "/captum_transformers/" in f.filename]
    detail = first_line(error) if kind in ("refused", "not applicable") else f"{type(error).__name__}: {first_line(error)}"
    return Verdict(kind, prefix + detail, _frame_text(package[-1]) if package else "",
                   _frame_text(frames[-1]) if frames else "")


# -- the model's state ----------------------------------------------------------------------
def _first_tensor(output: Any) -> torch.Tensor:
    for name in ("logits", "start_logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclasses.dataclass
class Snapshot:
    """Everything an explanation could leave behind on a model, and its forward output."""

    state: Dict[str, torch.Tensor]
    flags: Dict[str, Any]
    output: torch.Tensor

    @classmethod
    def take(cls, model: torch.nn.Module, example: Example) -> "Snapshot":
        with torch.no_grad():
            output = _first_tensor(call_model(model, example)).clone()
        return cls({k: v.detach().clone() for k, v in model.state_dict().items()}, _flags(model), output)

    def changes(self, model: torch.nn.Module, example: Example) -> List[str]:
        """What differs now (empty: nothing)."""
        now = Snapshot.take(model, example)
        problems = []
        changed = sorted(k for k in self.state.keys() | now.state.keys()
                         if k not in self.state or k not in now.state or not torch.equal(self.state[k], now.state[k]))
        if changed:
            problems.append(f"state_dict changed ({', '.join(changed[:3])})")
        problems += [f"{name} changed" for name in self.flags if self.flags[name] != now.flags[name]]
        if not torch.allclose(self.output, now.output, rtol=0, atol=0, equal_nan=True):  # bit for bit
            problems.append("forward output changed")
        return problems


def _flags(model: torch.nn.Module) -> Dict[str, Any]:
    modules = list(model.named_modules())
    return {
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        ".grad": {k: p.grad is not None for k, p in model.named_parameters()},
        "training mode": {name: m.training for name, m in modules},
        "hooks": {name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                  for name, m in modules},
        "instance attributes": {name: sorted(k for k in vars(m) if k == "forward") for name, m in modules},
        "attention implementation": {name: (type(m.config).__name__, getattr(m.config, "_attn_implementation", None))
                                     for name, m in modules if hasattr(m, "config")},
    }


# -- the checks -----------------------------------------------------------------------------
def as_maps(result: Any) -> Tuple[torch.Tensor, ...]:
    """A method's result as a tuple of maps, one per input."""
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def attribute(method: Any, example: Example) -> Tuple[torch.Tensor, ...]:
    """``method.attribute`` on ``example`` as the package documents the call."""
    return as_maps(method.attribute(example.method_inputs, target=example.target,
                                    forward_kwargs=example.forward_kwargs))


def zero_rows(maps: Tuple[torch.Tensor, ...], example: Example) -> List[int]:
    """The rows whose maps are 0 everywhere."""
    return [row for row in range(example.batch_size) if all(bool((m[row] == 0).all()) for m in maps)]


def map_problems(maps: Tuple[torch.Tensor, ...], example: Example) -> List[str]:
    """Shape, finiteness and non-zero padding of a batch's maps."""
    if len(maps) != len(example.inputs) or any(
            (m.shape != t.shape) if t.is_floating_point() else (m.shape[:2] != t.shape)
            for m, t in zip(maps, example.inputs)):
        shapes = [tuple(m.shape) for m in maps]
        return [f"maps of shapes {shapes} for inputs {[tuple(t.shape) for t in example.inputs]}"]
    problems = []
    if not all(bool(torch.isfinite(m).all()) for m in maps):
        problems.append("non-finite values")
    for m, mask in zip(maps, example.masks):
        padded = m[mask == 0]
        if padded.numel() and bool((padded != 0).any()):
            problems.append(f"non-zero at padding (max {float(padded.abs().max()):.2e})")
    return problems


def batch_problems(method: Any, maps: Tuple[torch.Tensor, ...], example: Example,
                   tolerance: float = BATCH_TOLERANCE) -> List[str]:
    """Each row of the batch's maps against the call on that example alone (padding cut)."""
    problems = []
    for row in range(example.batch_size):
        single = example.single(row)
        alone = attribute(method, single)
        for stream, (batch_map, single_map, length) in enumerate(zip(maps, alone, single.lengths(0))):
            if tuple(single_map.shape[:2]) != (1, length):
                problems.append(f"single call of row {row} gave shape {tuple(single_map.shape)}")
                continue
            difference = float((batch_map[row, :length].detach() - single_map[0].detach()).abs().max())
            scale = max(float(single_map.abs().max()), 1e-300)
            if difference > tolerance * scale:
                problems.append(f"batch row {row} != single call (input {stream}: max diff {difference:.2e}, "
                                f"{difference / scale:.1e} relative)")
    return problems


def judge(model: torch.nn.Module, example: Example, make_method: Callable[[torch.nn.Module], Any],
          reference: Optional[Reference] = None, batch_tolerance: Optional[float] = BATCH_TOLERANCE) -> Verdict:
    """The verdict of the method ``make_method(model)`` on ``example`` (see the module docstring);
    ``batch_tolerance`` None: no batch == single check (a model whose own scores differ)."""
    start = time.perf_counter()
    verdict = _judge(model, example, make_method, reference, batch_tolerance)
    verdict.seconds = round(time.perf_counter() - start, 3)
    return verdict


def _judge(model, example, make_method, reference, batch_tolerance) -> Verdict:
    before = Snapshot.take(model, example)
    try:
        method = make_method(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            maps = attribute(method, example)
    except CaptumTransformersError as error:
        changed = before.changes(model, example)
        if changed:
            return Verdict("failed", f"refused, but the model was not restored: {'; '.join(changed)}",
                           origin=first_line(error))
        return exception_verdict("not applicable" if isinstance(error, NotSoftmaxAttentionError) else "refused",
                                 error)
    except TimeLimit as error:
        return Verdict("timed out", first_line(error))
    except Exception as error:  # a raw exception: the package's bug
        return exception_verdict("failed", error)
    try:
        problems = consistency_problems(model, method, maps, example, before, batch_tolerance)
    except TimeLimit as error:
        return Verdict("timed out", f"single calls: {first_line(error)}")
    except Exception as error:
        return exception_verdict("failed", error, prefix="single call: ")
    return _final_verdict(problems, zero_rows(maps, example), caught, maps, reference)


def _blank_reason(message: str) -> str:
    """The reason a blank-map warning gives (its second sentence, up to a colon), else its start."""
    sentences = message.split(". ")
    return (sentences[1] if len(sentences) > 1 else sentences[0]).split(":")[0][:200]


def consistency_problems(model, method, maps, example: Example, before: Snapshot,
                         batch_tolerance: Optional[float]) -> List[str]:
    """Everything the batch call and the single calls got wrong (empty: consistent)."""
    problems = before.changes(model, example) + map_problems(maps, example)
    if batch_tolerance is not None:
        problems += batch_problems(method, maps, example, batch_tolerance)
    return problems or before.changes(model, example)  # the single calls restore the model too


def _final_verdict(problems: List[str], zeros: List[int], caught, maps, reference: Optional[Reference]) -> Verdict:
    blank_warnings = [str(w.message) for w in caught if "0 everywhere" in str(w.message)]
    if zeros and not blank_warnings:
        problems = problems + [f"rows {zeros} all zero, without a warning"]
    if problems:
        return Verdict("failed", "; ".join(dict.fromkeys(problems)))
    if zeros:
        return Verdict("zero map", f"rows {zeros}: {_blank_reason(blank_warnings[0])}")
    if reference is None:
        return Verdict("consistent")
    difference = reference.difference(maps)
    if difference <= 1:
        return Verdict("reference")
    kind = " relative" if reference.relative else ""
    loose = reference.loose_tolerance
    if loose is not None and difference * reference.tolerance <= loose:
        return Verdict("consistent", f"matches the eager reference to {difference * reference.tolerance:.1e}{kind} "
                                     f"only (the eager kernel computes in float32 in places)")
    return Verdict("failed", f"differs from the eager reference ({difference:.1e} x the tolerance "
                             f"{reference.tolerance:g}{kind})")


# -- one entry --------------------------------------------------------------------------------
def method_factory(name: str) -> Callable[[torch.nn.Module], Any]:
    """``model -> method`` for the catalog name ``name`` (:func:`build_method`, default adapter)."""
    from captum_transformers.methods.catalog import build_method

    return lambda model: build_method(name, model)


def model_batch_invariant(model: torch.nn.Module, example: Example, tolerance: float) -> Optional[bool]:
    """Whether the model's own explained scores of the batch equal those of each example alone
    (relative ``tolerance``); None if they cannot be read. When False, a method's batch != single
    would be the model's, not the package's: the check is not made."""
    try:
        with torch.no_grad():
            batch = explained_scores(call_model(model, example), example)
            alone = torch.cat([explained_scores(call_model(model, example.single(row)), example.single(row))
                               for row in range(example.batch_size)])
    except Exception:
        return None
    return bool((batch - alone).abs().max() <= tolerance * max(float(alone.abs().max()), 1e-300))


@dataclasses.dataclass
class Prepared:
    """A built entry: the model, its batch, the references, the batch == single tolerance (None:
    not checked) and notes for the results file."""

    model: torch.nn.Module
    example: Example
    references: Dict[str, Reference]
    batch_tolerance: Optional[float]
    info: Dict[str, Any]


def prepare(entry: Entry) -> Tuple[Optional[Prepared], Optional[Verdict]]:
    """Build ``entry``'s model and inputs and compute the references; or the verdict of every
    method when that fails (``not a text model``, ``does not build``)."""
    head = HEADS[entry.head]
    try:
        config = small_config(entry.model_type, entry.class_name, entry.head)
        if head.modality == "text":
            reason, skipped = not_text_reason(config, entry.class_name), "not a text model"
        else:
            reason, skipped = media_reason(model_class(entry.class_name)), "other inputs"
        if reason is not None:
            return None, Verdict(skipped, reason)
        model = build_model(config, entry.class_name)
    except TimeLimit:
        raise
    except Exception as error:
        return None, exception_verdict("does not build", error)
    try:
        example = make_example(model.config, head, model=model)
    except Exception as error:
        return None, exception_verdict("does not build", error, prefix="inputs: ")
    try:
        output = Snapshot.take(model, example).output
    except Exception as error:
        return None, exception_verdict("does not build", error, prefix="forward on the batch: ")
    if output.is_floating_point() and not bool(torch.isfinite(output).all()):
        return None, Verdict("does not build", "forward on the batch: the model's own output is not finite")
    if head.modality != "text":
        eager = EagerReferences({}, "none: image and audio maps are checked for consistency and the rows read")
    else:
        try:
            eager = eager_references(model, example)
        except Exception as error:
            eager = EagerReferences({}, f"none: {type(error).__name__}: {first_line(error)}")
    # GPT-Neo computes its scores in float32 (queries and keys cast) though its maps look float64: a
    # batch rounds them otherwise than one example alone (1e-8 to 3e-7 relative measured).
    precision = "float32" if entry.model_type in FLOAT32_SCORES else eager.precision
    tolerance = BATCH_TOLERANCES[precision or "float64"]
    invariant = model_batch_invariant(model, example, tolerance)
    info = {"parameters": sum(p.numel() for p in model.parameters()), "reference": eager.note,
            "model batch == single": invariant, "batch tolerance": None if invariant is False else tolerance}
    return Prepared(model, example, eager.references, info["batch tolerance"], info), None


def run_entry(entry: Entry, methods: Sequence[str], method_timeout: Optional[float] = None,
              entry_timeout: Optional[float] = None) -> Iterator[Tuple[str, Any]]:
    """Judge every method of ``methods`` on ``entry``: yields ``("info", dict)`` once, then
    ``(method, Verdict)`` per method. ``method_timeout`` limits each method (and the build);
    past ``entry_timeout`` seconds in all, the methods left are ``timed out``."""
    start = time.perf_counter()
    try:
        with time_limit(method_timeout):
            prepared, verdict = prepare(entry)
    except TimeLimit as error:
        prepared, verdict = None, Verdict("does not build", f"build ran past the limit ({first_line(error)})")
    yield "info", ({} if prepared is None else prepared.info)
    for name in methods:
        if prepared is None:
            yield name, dataclasses.replace(verdict)
        elif entry_timeout and time.perf_counter() - start > entry_timeout:
            yield name, Verdict("timed out", f"entry past {entry_timeout:g} s")
        else:
            yield name, limited_judge(prepared, name, method_timeout)


def limited_judge(prepared: Prepared, name: str, seconds: Optional[float]) -> Verdict:
    """:func:`judge` of the catalog method ``name`` on a prepared entry, within ``seconds``."""
    start = time.perf_counter()
    try:
        with time_limit(seconds):
            tolerance = prepared.batch_tolerance
            if tolerance is not None:
                model_type = getattr(getattr(prepared.model, "config", None), "model_type", None)
                tolerance = AMPLIFIED_FLOAT32_SOFTMAX.get((model_type, name), tolerance)
                tolerance = CANCELLING_GRADIENTS.get((model_type, name), tolerance)
            verdict = judge(prepared.model, prepared.example, method_factory(name),
                            prepared.references.get(name), tolerance)
            if verdict.kind in EXPLAINED_KINDS and name in ROW_READING_FORWARD and not prepared.references.get(name):
                verdict = rows_verdict(prepared, name, verdict)
            return verdict
    except TimeLimit as error:
        return Verdict("timed out", first_line(error), seconds=round(time.perf_counter() - start, 3))


EXPLAINED_KINDS = ("reference", "consistent", "zero map")


def rows_verdict(prepared: Prepared, name: str, verdict: Verdict) -> Verdict:
    """``verdict`` of a forward-only row-reading method (no eager reference) after the rows
    check of :func:`.media.read_rows_problem`: ``failed`` when it explains other rows than the
    head reads; else the same verdict, the check noted in its detail."""
    example = prepared.example
    try:
        problem, note = read_rows_problem(prepared.model, method_factory(name)(prepared.model), example,
                                          lambda output: explained_scores(output, example))
    except CaptumTransformersError:
        return verdict
    except Exception as error:
        return exception_verdict("failed", error, prefix="rows check: ")
    if problem:
        return Verdict("failed", problem, seconds=verdict.seconds)
    return dataclasses.replace(verdict, detail="; ".join(d for d in (verdict.detail, note) if d))
