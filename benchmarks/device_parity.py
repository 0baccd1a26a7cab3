"""Every catalog method on another device against the CPU, on the same weights and inputs.

For the four benchmark models at their quick sizes (``benchmark_models.QUICK``: HF ViT, HF
BERT with odd examples padded, timm ViT, an ``nn.TransformerEncoder`` classifier), in float64
and float32, each method explains class 0 on the CPU and on ``--device``; printed is
``max |map_device - map_cpu| / max |map_cpu|`` per (model, dtype, method), as a markdown table,
then the median and worst figure per dtype. A method that refuses a model (Captum's baselines
need input embeddings, which the encoder classifier does not expose) prints its error.

Example::

    python benchmarks/device_parity.py --device cuda
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_models import EXTRA_MODELS, MODELS, QUICK, build_model, make_batch  # noqa: E402

from captum_transformers.methods.catalog import METHOD_NAMES, build_method  # noqa: E402


def _moved(value, device, dtype):
    if torch.is_tensor(value):
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: _moved(item, device, dtype) for key, item in value.items()}
    return value


def relative_gaps(device: str, models=MODELS + EXTRA_MODELS, dtypes=(torch.float64, torch.float32)):
    """Rows ``(model, dtype name, method, gap or error text)``."""
    rows = []
    for name in models:
        for dtype in dtypes:
            torch.manual_seed(0)
            on_cpu = build_model(name, QUICK, "cpu").to(dtype).eval()
            on_device = build_model(name, QUICK, "cpu").to(dtype).eval()
            on_device.load_state_dict(on_cpu.state_dict())
            on_device.to(device)
            batch = make_batch(name, QUICK, "cpu")
            for method in METHOD_NAMES:
                maps = []
                try:
                    for model, where in ((on_cpu, "cpu"), (on_device, device)):
                        kwargs = _moved(batch.forward_kwargs, where, dtype)
                        found = build_method(method, model).attribute(
                            _moved(batch.inputs, where, dtype), target=0, **({"forward_kwargs": kwargs} if kwargs else {}))
                        maps.append(found.detach().cpu())
                except Exception as error:  # a refusal is reported as a row, the run goes on
                    rows.append((name, str(dtype).split(".")[1], method, f"{type(error).__name__}: {str(error)[:100]}"))
                    continue
                scale = maps[0].abs().max().clamp_min(1e-30)
                rows.append((name, str(dtype).split(".")[1], method, float((maps[1] - maps[0]).abs().max() / scale)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="the device compared with the CPU (cuda, cuda:N, mps)")
    args = parser.parse_args(argv)
    rows = relative_gaps(args.device)
    print("| model | dtype | method | max abs difference / max abs (CPU vs device) |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(f"{x:.1e}" if isinstance(x, float) else str(x) for x in row) + " |")
    for dtype in ("float64", "float32"):
        gaps = sorted(row[3] for row in rows if row[1] == dtype and isinstance(row[3], float))
        if gaps:
            print(f"{dtype}: {len(gaps)} maps, median {statistics.median(gaps):.1e}, worst {gaps[-1]:.1e}")


if __name__ == "__main__":
    main()
