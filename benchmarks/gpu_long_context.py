"""Long contexts on one GPU: a 1B-class Llama in bfloat16 at 1k, 4k and 8k tokens.

For each context length N (batch 1, random token ids, the score the last position's logit of
its arg-max token), one table row per operation:

* ``forward + backward`` (the reference): the model's forward on input embeddings that require
  grad (the head at the last position only, ``logits_to_keep=1``, as the package runs it) and
  ``autograd.grad`` of the score to those embeddings;
* the package's ``AttnLRP``, ``ConservativeLRP`` (AH+LN) and ``GenericAttention`` token maps of
  that score;
* with ``--cpu-chunks``, on an accelerator, ``GenericAttention`` again with the CPU's chunk size (the streamed rows are
  recomputed in chunks of about 4 MiB on a CPU, ``capture.row_chunks.ACCELERATOR_CHUNK_SCALE`` times
  that on an accelerator);
* ``GenerationAttribution(AttnLRP)`` on the last 32 tokens taken as the output, teacher-forced
  (``target=`` the ids: one forward over prompt + output and one backward pass per output token);
* LXT's AttnLRP and CP-LRP (``lxt.efficient``, Achtibat et al.) beside the package's rows when
  ``import lxt.efficient`` works (LXT 2.1 from PyPI does not import with transformers 5: the
  column then says why), patched around each of its calls as in ``benchmarks/lrp_cost.py``.

Columns: the median wall time of ``--repeats`` runs after one warm-up (CUDA synchronised), its
ratio to the reference of the same N, the peak memory above what was live before the call
(``torch.cuda.max_memory_allocated``; peak RSS growth on CPU) and its ratio to the reference's.
An operation that runs out of memory is printed as ``OOM``, and the run goes on.

Model (random weights from a config, no hub): hidden 2048, 16 layers, 32 heads, 8 key/value
heads, MLP 8192, vocabulary 32000, SDPA attention, bfloat16 (about 1.1B parameters, 2.2 GB).
Sized to finish in about 5 minutes on one H100::

    python benchmarks/gpu_long_context.py                 # cuda, 1k / 4k / 8k tokens
    python benchmarks/gpu_long_context.py --tiny --device cpu   # smoke test: 2 layers, width 64, 64 / 128 tokens

Measured on one NVIDIA H100 80GB (torch 2.11.0+cu130, transformers 5.24.0), time / peak relative
to the forward + backward (0.046 s / 1751 MiB at 1k, 0.065 s / 7002 MiB at 4k, 0.139 s / 14003
MiB at 8k); the full table is in docs/large-models.md ("On a GPU")::

    tokens  AttnLRP       ConservativeLRP  GenericAttention  GenerationAttribution, 32 tokens
    1024    1.87x / 0.88  1.30x / 0.73     2.11x / 1.39      22.7x / 0.90
    4096    1.18x / 0.88  2.60x / 0.69     5.37x / 1.11      24.6x / 0.90
    8192    1.19x / 0.88  3.84x / 0.69     9.95x / 1.07      24.6x / 0.90

Before the accelerator chunk sizes (commit 35cf92d), ConservativeLRP took 5.8x / 47x / 75x and
GenericAttention with CPU-sized chunks 25x at 1k and 350x at 4k (``--cpu-chunks``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

# This checkout's package, not whichever one the environment installed (a second worktree).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak_memory import peak_bytes  # noqa: E402

GENERATED = 32  # output tokens of the GenerationAttribution row


@dataclasses.dataclass(frozen=True)
class LlamaSize:
    layers: int
    width: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int


ONE_B = LlamaSize(layers=16, width=2048, heads=32, kv_heads=8, mlp=8192, vocab=32000)
TINY = LlamaSize(layers=2, width=64, heads=4, kv_heads=2, mlp=128, vocab=256)


class IdTokenizer:
    """The tokenizer GenerationAttribution needs for token ids: ids are their own names."""

    pad_token_id, eos_token_id = 0, 2

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> List[str]:
        return [f"t{int(i)}" for i in ids]

    def decode(self, ids: Sequence[int], **_: object) -> str:
        return " ".join(self.convert_ids_to_tokens(ids))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [int(x) for x in text.split()]}


def build_model(size: LlamaSize, device: str, dtype: torch.dtype, tokens: int) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.width, intermediate_size=size.mlp, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, num_key_value_heads=size.kv_heads, max_position_embeddings=max(tokens, 128),
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bfloat16 on the device: no float32 copy of 1B weights
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def lxt_status() -> Optional[str]:
    """None when LXT's efficient module imports, else why not."""
    try:
        import lxt.efficient  # noqa: F401
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def make_ops(model: torch.nn.Module, tokens: int, with_lxt: bool,
             cpu_chunks: bool = False) -> Dict[str, Callable[[], object]]:
    from captum_transformers import AttnLRP, ConservativeLRP, GenericAttention
    from captum_transformers.generation import GenerationAttribution
    from captum_transformers.capture import row_chunks

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=generator).to(device)
    with torch.no_grad():
        target = model(ids, logits_to_keep=1).logits[:, -1].argmax(-1)
    embed = model.get_input_embeddings()

    def forward_backward() -> torch.Tensor:
        embeddings = embed(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeddings, logits_to_keep=1).logits[:, -1]
        (grad,) = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), embeddings)
        return (grad.float() * embeddings.float()).sum(-1)

    attn_lrp, cp_lrp, generic = AttnLRP(model), ConservativeLRP(model), GenericAttention(model)
    generation = GenerationAttribution(AttnLRP(model), IdTokenizer())
    prompt, output = ids[0, :tokens - GENERATED].tolist(), ids[0, tokens - GENERATED:].tolist()
    ops = {
        "forward + backward": forward_backward,
        "AttnLRP": lambda: attn_lrp.attribute(ids, target=target, return_tokens=True),
        "ConservativeLRP": lambda: cp_lrp.attribute(ids, target=target, return_tokens=True),
        "GenericAttention": lambda: generic.attribute(ids, target=target, return_tokens=True),
        f"GenerationAttribution(AttnLRP), {GENERATED} tokens": lambda: generation.attribute(prompt, target=output),
    }
    if cpu_chunks and device.type != "cpu":  # the accelerator's chunk size against the CPU's (chunk_budget)
        def cpu_sized_chunks():
            scale = row_chunks.ACCELERATOR_CHUNK_SCALE
            row_chunks.ACCELERATOR_CHUNK_SCALE = 1
            try:
                return generic.attribute(ids, target=target, return_tokens=True)
            finally:
                row_chunks.ACCELERATOR_CHUNK_SCALE = scale
        ops["GenericAttention, CPU-sized chunks"] = cpu_sized_chunks
    if with_lxt:
        from lrp_cost import _lxt_maps, lxt_patched

        maps = _lxt_maps("llama")
        if maps is not None:
            def lxt(patch_map):
                def op():
                    with lxt_patched(patch_map):
                        return forward_backward()
                return op
            ops["LXT AttnLRP"], ops["LXT CP-LRP"] = lxt(maps[0]), lxt(maps[1])
    return ops


def _synchronise(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


@dataclasses.dataclass
class Cell:
    seconds: Optional[float]
    peak: Optional[int]
    note: str = ""


def measure(op: Callable[[], object], device: str, repeats: int) -> Cell:
    """Median seconds of ``repeats`` runs after a warm-up, and the peak memory above the live memory."""
    try:
        peak, _ = peak_bytes(op, device, warmup=True)
        times = []
        for _ in range(repeats):
            _synchronise(device)
            start = time.perf_counter()
            result = op()
            _synchronise(device)
            times.append(time.perf_counter() - start)
            del result
        return Cell(statistics.median(times), peak)
    except Exception as error:  # one operation out of memory must not end the table
        if not _out_of_memory(error):
            raise
        return Cell(None, None, "OOM")
    finally:
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def _ratio(value: Optional[float], reference: Optional[float]) -> str:
    if value is None or not reference:
        return "-"
    return f"{value / reference:.2f}x"


def row(tokens: int, name: str, cell: Cell, reference: Cell) -> str:
    if cell.note:
        return f"| {tokens} | {name} | {cell.note} | - | {cell.note} | - |"
    return (f"| {tokens} | {name} | {cell.seconds:.3f} | {_ratio(cell.seconds, reference.seconds)} | "
            f"{cell.peak / 2 ** 20:.1f} | {_ratio(cell.peak, reference.peak)} |")


def table(results: Dict[int, Dict[str, Cell]]) -> List[str]:
    lines = ["| tokens | operation | time (s) | time / fwd+bwd | peak (MiB) | peak / fwd+bwd |",
             "|---:|:---|---:|---:|---:|---:|"]
    for tokens, cells in results.items():
        lines += [row(tokens, name, cell, cells["forward + backward"]) for name, cell in cells.items()]
    return lines


def main(argv: Optional[Sequence[str]] = None) -> List[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2 layers, width 64, 64 and 128 tokens (smoke test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="context lengths (default 1024 4096 8192)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per cell (default 3; --tiny 1)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--cpu-chunks", action="store_true", help="also GenericAttention with the CPU's chunk size")
    args = parser.parse_args(argv)
    size = TINY if args.tiny else ONE_B
    tokens = args.tokens or ([64, 128] if args.tiny else [1024, 4096, 8192])
    repeats = args.repeats or (1 if args.tiny else 3)
    dtype = getattr(torch, args.dtype)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is visible; pass --device cpu (with --tiny for a smoke test)")
    why_not_lxt = lxt_status()
    card = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    header = (f"{card}; torch {torch.__version__}; Llama {size.layers} layers, width {size.width}, {size.heads} heads "
              f"({size.kv_heads} kv), MLP {size.mlp}, {args.dtype}, SDPA; batch 1; median of {repeats}; LXT: "
              + ("side by side" if why_not_lxt is None else f"not run ({why_not_lxt})"))
    print(header, flush=True)
    model = build_model(size, args.device, dtype, max(tokens))
    results: Dict[int, Dict[str, Cell]] = {}
    started = time.perf_counter()
    for length in tokens:
        ops = make_ops(model, length, why_not_lxt is None, args.cpu_chunks)
        results[length] = {}
        for name, op in ops.items():
            results[length][name] = cell = measure(op, args.device, repeats)
            # Each row as soon as it is measured (stderr), so a run stopped at a time limit still reports.
            print(f"{row(length, name, cell, results[length]['forward + backward'])} at "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    lines = [header, ""] + table(results)
    print("\n".join(lines[1:]))
    return lines


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
