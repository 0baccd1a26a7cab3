"""The step loop the built-in task models are trained with: best-on-val weights kept, early stop, float16 rounding.

Each step ``t`` draws its own batch (``batch_at(t)``, seeded by the step so runs are reproducible), sets each
optimizer group's learning rate to ``learning_rate(t, group)``, and takes one AdamW step on ``model(**batch).loss``
with the gradient norm clipped to 1. Every ``eval_every`` steps (and at the last) ``validate(model)`` scores the
model; the best-scoring weights are kept and the loop stops once the score reaches ``target``. Deterministic
algorithms are on for the whole run, so the same seed and thread count give the same weights on the same software.

Example::

    >>> class Regression(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.linear = torch.nn.Linear(2, 1)
    ...     def forward(self, x, y):
    ...         return type("Out", (), {"loss": ((self.linear(x) - y) ** 2).mean()})()
    >>> model = Regression()
    >>> run = train_keeping_best(model, torch.optim.AdamW(model.parameters()), 4,
    ...                          batch_at=lambda t: {"x": torch.ones(3, 2), "y": torch.zeros(3, 1)},
    ...                          learning_rate=lambda t, group: 1e-2, validate=lambda m: 0.5,
    ...                          eval_every=2, target=1.0)
    >>> run["steps_run"], run["best_step"]
    (4, 2)
"""
from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable, Dict, Optional

import torch


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` inside the block; the previous setting restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def train_keeping_best(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int,
                       batch_at: Callable[[int], Dict[str, torch.Tensor]],
                       learning_rate: Callable[[int, Dict[str, Any]], float],
                       validate: Callable[[torch.nn.Module], float], eval_every: int, target: float,
                       log: Optional[Callable[[str], None]] = None, score_name: str = "val accuracy"
                       ) -> Dict[str, Any]:
    """Run at most ``steps`` steps and load the best-on-val weights into ``model``.

    Returns ``losses`` (one per step run), ``best_step``, ``steps_run``, ``val`` (the best score),
    ``train_seconds`` (wall clock) and ``train_cpu_seconds`` (this process's CPU time: the machine may be shared).
    ``log`` receives one line per validation, naming the score ``score_name``.
    """
    losses, best, best_score, best_step = [], None, -1.0, 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(steps):
        model.train()
        batch = batch_at(step)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, group)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            model.eval()
            score = validate(model)
            if log is not None:
                recent = losses[-eval_every:]
                log(f"step {step + 1}/{steps} loss {sum(recent) / len(recent):.4f} {score_name} "
                    f"{score:.4f} ({time.perf_counter() - start:.0f} s)")
            if score > best_score:
                best, best_score, best_step = copy.deepcopy(model.state_dict()), score, step + 1
            if score >= target:
                break
    train_seconds, train_cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    model.load_state_dict(best)
    return {"losses": losses, "best_step": best_step, "steps_run": len(losses), "val": best_score,
            "train_seconds": train_seconds, "train_cpu_seconds": train_cpu_seconds}


def round_to_float16(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` (eval mode) with every floating tensor rounded through float16: what a shipped file holds."""
    rounded = copy.deepcopy(model)
    rounded.load_state_dict({k: v.half().float() if v.is_floating_point() else v
                             for k, v in model.state_dict().items()})
    return rounded.eval()
