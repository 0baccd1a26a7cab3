"""The streamed and replayed attention methods on another device: against the dense path and the CPU.

``attribute()`` streams GenericAttention, TransformerRelevance and AttentionGradCAM (their maps are
folded into the explained rows a chunk of query rows at a time) and replays AttentionRollout and
RawAttention (each call's map recomputed from Q and K after the forward pass); ``trace()`` keeps
every map (the dense path). ConservativeLRP (AH + LN), which keeps no map either way, is compared
with itself run in one block of rows (its AH rule recomputes the map in blocks). On the long-context benchmark's 4-layer Llama (width 256, 8 heads, 2
key-value heads; random weights, seed 0), eager and SDPA attention, float64 and float32, with
chunks of about 64 KiB (16 times that on an accelerator) so that each layer is cut into several chunks,
two inputs:

* ``causal``: one unpadded sequence of ``--tokens`` ids (the fused SDPA forward where it applies);
* ``padded``: a batch of two, the second left-padded by a third of its length.

Each row prints, for the method's token map of the last position's arg-max logit,
``max |a - b| / max |b|`` between the device's stream and the device's dense path, and between the
device's stream and the CPU's stream, and whether the device's call streamed (or why not); each
model's own logits gap between the devices comes first. The stream must equal the dense path on
the same device; between devices the maps differ as the models' forwards do (transformers computes
Llama's rotary angles in float32 even in a float64 model: one H100 against the CPU, logits 1e-8
apart in float64 gave maps up to 9e-6 apart). The script exits with status 1 if a float64 stream
differs from its dense path by more than 1e-10, a call did not stream, or a dense map is all zeros.

Example::

    python benchmarks/streaming_device_parity.py --device cuda
    python benchmarks/streaming_device_parity.py --device cpu --tokens 96   # both columns on the CPU
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from long_context import build_model  # noqa: E402

import captum_transformers as ct  # noqa: E402
import captum_transformers.capture.row_chunks as row_chunks  # noqa: E402
import captum_transformers.propagation.attention.constant_map as constant_map_attention  # noqa: E402

METHODS = {
    "GenericAttention": ct.GenericAttention,
    "TransformerRelevance": ct.TransformerRelevance,
    "AttentionGradCAM": ct.AttentionGradCAM,
    "AttentionRollout": ct.AttentionRollout,
    "RawAttention": ct.RawAttention,
    "ConservativeLRP": ct.ConservativeLRP,  # not streamed: its blocks of rows against one block
}
CHUNK_BYTES = 64 * 2 ** 10
FLOAT64_LIMIT = 1e-10


def inputs(kind: str, tokens: int, vocab: int) -> Tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    if kind == "causal":
        ids = torch.randint(3, vocab, (1, tokens), generator=generator)
        return ids, torch.ones_like(ids)
    ids = torch.randint(3, vocab, (2, tokens), generator=generator)
    mask = torch.ones_like(ids)
    pad = tokens // 3
    ids[1, :pad], mask[1, :pad] = 0, 0
    return ids, mask


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _decision(method) -> str:
    stream = getattr(method, "_row_stream", None)
    if stream is None:
        return "no stream"
    done = getattr(stream, "streamed", getattr(stream, "replayed", False))
    return "yes" if done else f"no: {stream.reason}"


def _one_block(method, ids: torch.Tensor, here: dict) -> torch.Tensor:
    """ConservativeLRP with the AH rule's backward in one block of rows (the reference of its blocks)."""
    budget = constant_map_attention.chunk_budget
    constant_map_attention.chunk_budget = lambda cpu_budget, device: 2 ** 62
    try:
        return method.attribute(ids, return_tokens=True, **here).cpu()
    finally:
        constant_map_attention.chunk_budget = budget


def rows(device: str, tokens: int) -> List[Tuple[str, str, str, str, float, float, str]]:
    row_chunks.ROW_CHUNK_BYTES = CHUNK_BYTES
    constant_map_attention._BLOCK_ELEMENTS = CHUNK_BYTES // 4
    found = []
    for impl in ("eager", "sdpa"):
        base = build_model(impl)
        for dtype in (torch.float64, torch.float32):
            on_cpu = build_model(impl).to(dtype)
            on_cpu.load_state_dict(base.state_dict())
            on_device = build_model(impl).to(dtype)
            on_device.load_state_dict(base.state_dict())
            on_device.to(device)
            for kind in ("causal", "padded"):
                ids, mask = inputs(kind, tokens, base.config.vocab_size)
                with torch.no_grad():
                    logits = on_cpu(ids, attention_mask=mask).logits
                    moved = on_device(ids.to(device), attention_mask=mask.to(device)).logits.cpu()
                target = logits[:, -1].argmax(-1)
                # transformers' eager float64 Llama gives NaN logits to a left-padded example (its padded rows'
                # NaN values times zero weights); the package's kernels do not. Finite logits are compared.
                finite = logits.isfinite() & moved.isfinite()
                found.append((impl, str(dtype).split(".")[1], kind, "(the model's finite logits)", 0.0,
                              _gap(moved[finite], logits[finite]), "-"))
                for name, cls in METHODS.items():
                    maps = {}
                    for where, model in (("cpu", on_cpu), (device, on_device)):
                        method = cls(model)
                        here = dict(forward_kwargs={"attention_mask": mask.to(where)}, target=target.to(where))
                        maps[where] = method.attribute(ids.to(where), return_tokens=True, **here).cpu()
                        if where == device and cls is ct.ConservativeLRP:
                            decision, dense = "blocks", _one_block(method, ids.to(where), here)
                        elif where == device:
                            decision = _decision(method)
                            trace = method.trace(ids.to(where), **here)
                            dense = trace.layout.returned(method.stream_scores(trace)["tokens"]).cpu()
                            del trace
                    if not dense.abs().max() > 0:
                        decision = "zero map"  # a gap to zeros would say nothing
                    found.append((impl, str(dtype).split(".")[1], kind, name, _gap(maps[device], dense),
                                  _gap(maps[device], maps["cpu"]), decision))
            del on_cpu, on_device
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=256, help="sequence length (default 256)")
    args = parser.parse_args(argv)
    found = rows(args.device, args.tokens)
    print(f"| attention | dtype | input | method | {args.device} stream vs {args.device} dense | "
          f"{args.device} stream vs cpu stream | streamed |\n|---|---|---|---|---:|---:|---|")
    for impl, dtype, kind, name, dense_gap, cpu_gap, decision in found:
        print(f"| {impl} | {dtype} | {kind} | {name} | {dense_gap:.1e} | {cpu_gap:.1e} | {decision} |")
    maps = [row for row in found if row[-1] != "-"]
    failed = [row for row in maps if row[-1] not in ("yes", "blocks") or (row[1] == "float64" and row[4] > FLOAT64_LIMIT)]
    for dtype in ("float64", "float32"):
        of_dtype = [row for row in maps if row[1] == dtype]
        print(f"{dtype}: {len(of_dtype)} maps; stream vs dense worst {max(row[4] for row in of_dtype):.1e}; "
              f"vs cpu worst {max(row[5] for row in of_dtype):.1e}")
    print("FAILED: " + "; ".join(" ".join(map(str, row[:4])) for row in failed) if failed else "all streamed; "
          f"float64 within {FLOAT64_LIMIT:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
