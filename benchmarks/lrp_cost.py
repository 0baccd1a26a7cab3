"""The cost of an LRP explanation on decoder LLMs, as ratios to a plain forward + backward.

For each random HF decoder (built from a config, no hub) and attention implementation, one
process times, interleaved (each round runs every operation once, rotated), at least
``--repeats`` rounds and more for cheap operations (about ``--min-seconds`` of CPU time per
operation). Each ratio is the median of the ratios within a round, next to the ratio of the
least CPU times:

* ``reference``: the model's forward on input embeddings that require grad, and
  ``autograd.grad`` of the explained logits (last token, arg-max) to those embeddings;
* ``reference, head at the last position``: the same with ``logits_to_keep=1``, the head run
  only where the score is read, as the package does (its ratio shows what that alone saves);
* the package's ``AttnLRP`` and ``ConservativeLRP`` (AH+LN) token relevance of the same logits;
* LXT's AttnLRP and CP-LRP (``lxt.efficient``, Achtibat et al.) when ``import lxt`` works and
  the family has an LXT patch map (Llama, Qwen2). LXT patches transformers' classes for the whole
  process and never undoes it; here its patches are applied around each of its calls and the
  originals put back after, so the package's runs see the library's own classes. LXT's runs get
  ``logits_to_keep=1`` too, so both libraries run the head on the same rows.

Timing runs with glibc keeping freed buffers (``--allocator reuse``, the steady state of an
evaluation loop; ``fresh`` maps every buffer of 64 KiB or more anew, as earlier runs did).
Peak memory (above what was live before the call, peak RSS on CPU) is measured before the
timings, once per operation, with every buffer mapped anew. Ratios are to the reference of the same model, so values below
1.0x are cheaper than one forward + backward.

Command (one thread; both of the README's tables in one run, about 40 minutes on its 2-core VM)::

    OMP_NUM_THREADS=1 PYTHONPATH=.:/tmp/lxt python benchmarks/lrp_cost.py --threads 1 --repeats 15

A second table times the attention methods on a 6-layer ViT (HF eager, HF sdpa, timm; width
256, 224 px, batch 16): ``AttentionRollout`` against the forward pass, ``GenericAttention``
against a forward + backward to the pixels, ``TransformerRelevance`` against a training step.

``--quick`` runs one small size for a smoke test; ``--sizes``/``--families``/``--impls``/
``--tables`` select rows.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak_memory import _reusing_malloc, _tight_malloc, peak_bytes  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LlmSize:
    name: str
    layers: int
    width: int
    tokens: int
    heads: int = 4
    kv_heads: int = 2
    batch: int = 8
    vocab: int = 1024

    @property
    def intermediate(self) -> int:
        return 3 * self.width


SIZES = {
    "small": LlmSize("4 layers, width 128, 128 tokens", 4, 128, 128),
    "big": LlmSize("6 layers, width 256, 256 tokens", 6, 256, 256),
    "1k": LlmSize("4 layers, width 128, 1024 tokens", 4, 128, 1024),
}
# The 1k-token rows are long on a CPU: the two families LXT has patch maps for, unless --families
# says otherwise.
SIZE_FAMILIES = {"1k": ("llama", "qwen2")}
QUICK = LlmSize("2 layers, width 32, 16 tokens", 2, 32, 16, batch=2, vocab=64)
FAMILIES = ("llama", "qwen2", "gemma", "mistral")


def build_llm(family: str, size: LlmSize, attn_implementation: str, seed: int = 0) -> torch.nn.Module:
    """A random causal LM of ``family`` at ``size`` (grouped-query heads, untied head)."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    config = config_class(vocab_size=size.vocab, hidden_size=size.width, intermediate_size=size.intermediate,
                          num_hidden_layers=size.layers, num_attention_heads=size.heads,
                          num_key_value_heads=size.kv_heads, head_dim=size.width // size.heads,
                          max_position_embeddings=max(2048, size.tokens), tie_word_embeddings=False,
                          attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return model_class(config).eval()


# --------------------------------------------------------------------------- LXT

def lxt_available() -> Optional[str]:
    """None when LXT's efficient module imports, else why not."""
    try:
        import lxt.efficient  # noqa: F401
    except Exception as error:  # LXT 2.1 from PyPI fails to import with transformers 5
        return f"{type(error).__name__}: {error}"
    return None


def _lxt_maps(family: str):
    """(AttnLRP map, CP-LRP map) of LXT for ``family``, or None when LXT has none."""
    import importlib

    try:
        module = importlib.import_module(f"lxt.efficient.models.{family}")
    except ImportError:
        return None
    return module.attnLRP, module.cp_LRP


@contextlib.contextmanager
def lxt_patched(patch_map) -> Iterator[None]:
    """LXT's monkey_patch for the duration of the block, undone after (LXT itself never undoes it)."""
    import types

    from lxt.efficient import monkey_patch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = []
    for target in patch_map:
        if isinstance(target, types.ModuleType):
            saved.append((target, "eager_attention_forward", target.__dict__.get("eager_attention_forward")))
        else:
            saved.append((target, "forward", target.__dict__.get("forward")))
    mappings = [getattr(ALL_ATTENTION_FUNCTIONS, name) for name in ("_global_mapping", "_local_mapping")]
    saved_mappings = [dict(mapping) for mapping in mappings]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monkey_patch(None, patch_map)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        for mapping, content in zip(mappings, saved_mappings):
            mapping.clear()
            mapping.update(content)


# --------------------------------------------------------------------------- operations

def make_ops(model: torch.nn.Module, family: str, size: LlmSize, with_lxt: bool) -> Dict[str, Callable[[], object]]:
    from captum_transformers import AttnLRP, ConservativeLRP

    torch.manual_seed(1)
    ids = torch.randint(0, size.vocab, (size.batch, size.tokens))
    with torch.no_grad():
        target = model(ids).logits[:, -1].argmax(-1)
    embed = model.get_input_embeddings()

    def gradient_to_embeddings(logits_to_keep: int = 0) -> torch.Tensor:
        embeddings = embed(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeddings, logits_to_keep=logits_to_keep).logits[:, -1]
        score = logits.gather(1, target[:, None]).sum()
        (grad,) = torch.autograd.grad(score, embeddings)
        return (grad * embeddings).sum(-1).detach()

    attn_lrp, cp_lrp = AttnLRP(model), ConservativeLRP(model)
    ops = {
        "reference": gradient_to_embeddings,
        # The package runs the head at the explained position only; this row shows what that
        # alone saves a plain forward + backward.
        KEPT_REFERENCE: lambda: gradient_to_embeddings(logits_to_keep=1),
        "AttnLRP": lambda: attn_lrp.attribute(ids, target=target, return_tokens=True),
        "ConservativeLRP": lambda: cp_lrp.attribute(ids, target=target, return_tokens=True),
    }
    maps = _lxt_maps(family) if with_lxt else None
    if maps is not None:
        def lxt(patch_map):
            def op():
                with lxt_patched(patch_map):  # LXT with the package's head: the last position only
                    return gradient_to_embeddings(logits_to_keep=1)
            return op

        ops["LXT AttnLRP"], ops["LXT CP-LRP"] = lxt(maps[0]), lxt(maps[1])
    return ops


KEPT_REFERENCE = "reference, head at the last position"


# How glibc allocates while timing: "reuse" keeps freed buffers (the steady state of an evaluation
# loop; see peak_memory._reusing_malloc), "fresh" maps every buffer of 64 KiB or more anew.
# Memory is always measured under "fresh".
ALLOCATOR = {"mode": "reuse"}


def _timing_allocator() -> None:
    (_reusing_malloc if ALLOCATOR["mode"] == "reuse" else _tight_malloc)()


def time_interleaved(ops: Dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                     min_seconds: float = 0.0) -> Dict[str, List[tuple]]:
    """(wall, CPU) seconds of every op in each round; each round runs every op once, rotated.

    At least ``repeats`` rounds, and more for cheap ops: enough that each op runs for about
    ``min_seconds`` of CPU time in all (a 90 ms call gets some 45 rounds where a 1 s call gets
    ``repeats``), so short calls on a shared machine are not read from a handful of samples."""
    _timing_allocator()
    names = list(ops)
    warm_cpu = 0.0
    for _ in range(warmup):
        for name in names:
            started = time.process_time()
            ops[name]()
            warm_cpu = max(warm_cpu, time.process_time() - started)
    rounds = max(repeats, math.ceil(min_seconds / warm_cpu)) if warm_cpu > 0 else repeats
    seconds: Dict[str, List[tuple]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            ops[name]()
            seconds[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return seconds


def ratios(seconds: Dict[str, List[tuple]], name: str, reference: str) -> tuple:
    """(median wall ratio, median CPU ratio, least CPU ratio) of ``name`` to ``reference``.

    The medians are of the ratios within each round (the two calls at most one round apart),
    which a slowdown of the whole machine for a while moves far less than a ratio of
    two medians. The least CPU times are what interference cannot inflate."""
    pairs = list(zip(seconds[name], seconds[reference]))
    return (statistics.median(op[0] / ref[0] for op, ref in pairs),
            statistics.median(op[1] / ref[1] for op, ref in pairs),
            min(op[1] for op, _ in pairs) / min(ref[1] for _, ref in pairs))


def median_seconds(samples: List[tuple]) -> tuple:
    """(median wall, median CPU) seconds."""
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def measure(family: str, size: LlmSize, impl: str, repeats: int, with_lxt: bool, memory: bool,
            min_seconds: float = 0.0) -> tuple:
    """(per-round seconds of every op, peak bytes of every op or None)."""
    model = build_llm(family, size, impl)
    ops = make_ops(model, family, size, with_lxt)
    # Memory first, every buffer mapped anew (a heap that kept freed buffers would hide the peak).
    _tight_malloc()
    peaks = {name: peak_bytes(op)[0] for name, op in ops.items()} if memory else {}
    return time_interleaved(ops, repeats, min_seconds=min_seconds), {name: peaks.get(name) for name in ops}


# --------------------------------------------------------------------------- ViT attention methods

VIT_MODELS = (("HF ViT", "vit", "eager"), ("HF ViT", "vit", "sdpa"), ("timm ViT", "timm_vit", None))
# method -> (reference, target ratio)
VIT_TARGETS = {"AttentionRollout": ("forward", 1.05), "GenericAttention": ("fwd+bwd to pixels", 1.10),
               "TransformerRelevance": ("training step", 2.2)}


def vit_ops(model: torch.nn.Module, batch) -> Dict[str, Callable[[], object]]:
    import captum_transformers as ct
    from benchmark_models import _logits

    pixels, target = batch.inputs, batch.target
    params = [p for p in model.parameters() if p.requires_grad]

    def score(logits: torch.Tensor) -> torch.Tensor:
        return logits.gather(1, target[:, None]).sum()

    def forward():
        with torch.no_grad():
            return _logits(model(pixels))

    def fwd_bwd_pixels():
        leaf = pixels.detach().requires_grad_()
        return torch.autograd.grad(score(_logits(model(leaf))), leaf)

    def training_step():
        return torch.autograd.grad(score(_logits(model(pixels))), params)

    rollout, generic, relevance = ct.AttentionRollout(model), ct.GenericAttention(model), ct.TransformerRelevance(model)
    return {"forward": forward, "fwd+bwd to pixels": fwd_bwd_pixels, "training step": training_step,
            "AttentionRollout": lambda: rollout.attribute(pixels),
            "GenericAttention": lambda: generic.attribute(pixels, target=target),
            "TransformerRelevance": lambda: relevance.attribute(pixels, target=target)}


def vit_table(repeats: int, quick: bool, min_seconds: float = 0.0) -> None:
    from benchmark_models import FULL, QUICK as VIT_QUICK, build_model, make_batch

    sizes = VIT_QUICK if quick else FULL
    print(f"\nViT attention methods ({sizes.layers} layers, width {sizes.hidden}, {sizes.image}px, patch "
          f"{sizes.patch}, batch {sizes.batch}); ratios to the reference named, median wall; CPU time")
    print("| model | attention | method | reference | time / reference (median wall; median CPU; least CPU) | target |")
    print("|---|---|---|---|---|---|")
    for label, name, impl in VIT_MODELS:
        model = build_model(name, sizes, attn_implementation=impl)
        seconds = time_interleaved(vit_ops(model, make_batch(name, sizes)), repeats, min_seconds=min_seconds)
        for method, (reference, target) in VIT_TARGETS.items():
            wall, cpu, least = ratios(seconds, method, reference)
            print(f"| {label} | {impl or 'fused_attn (SDPA)'} | {method} | {reference} | "
                  f"{wall:.2f}x; {cpu:.2f}x; {least:.2f}x | <= {target}x |", flush=True)
        print(f"| {label} | {impl or 'fused_attn (SDPA)'} | (references, {len(seconds['forward'])} rounds) | | "
              + ", ".join(f"{r} {median_seconds(seconds[r])[0] * 1000:.0f} ms"
                          for r in ("forward", "fwd+bwd to pixels", "training step"))
              + " | |", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--impls", nargs="+", default=["sdpa", "eager"], choices=["sdpa", "eager"])
    parser.add_argument("--repeats", type=int, default=5, help="the least number of rounds")
    parser.add_argument("--min-seconds", type=float, default=4.0,
                        help="more rounds for cheap operations: about this much CPU time per operation")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--quick", action="store_true", help="one tiny size, two repeats (smoke test)")
    parser.add_argument("--tables", nargs="+", default=["llm", "vit"], choices=["llm", "vit"])
    parser.add_argument("--allocator", default="reuse", choices=["reuse", "fresh"],
                        help="glibc while timing: keep freed buffers (reuse) or map each anew (fresh)")
    args = parser.parse_args(argv)
    ALLOCATOR["mode"] = args.allocator
    args.families_given = any(a.startswith("--families") for a in (argv if argv is not None else sys.argv[1:]))
    torch.set_num_threads(args.threads)
    why_not = lxt_available()
    print(f"torch {torch.__version__}, {args.threads} thread(s), timed with the {args.allocator!r} allocator; LXT: "
          + ("imported (run from its repository's source)" if why_not is None else f"not importable ({why_not})"))
    sizes = [QUICK] if args.quick else [SIZES[name] for name in args.sizes]
    repeats = 2 if args.quick else args.repeats
    min_seconds = 0.0 if args.quick else args.min_seconds
    print("| model | size | attention | method | time / reference (median wall; median CPU; least CPU) | peak memory / reference |")
    print("|---|---|---|---|---|---|")
    for size_name, size in zip(["quick"] if args.quick else args.sizes, sizes) if "llm" in args.tables else ():
        families = args.families if args.families_given else SIZE_FAMILIES.get(size_name, args.families)
        for family in families:
            for impl in args.impls:
                seconds, peaks = measure(family, size, impl, repeats, why_not is None, not args.no_memory,
                                         min_seconds)
                base_peak = peaks["reference"]
                for name in seconds:
                    if name == "reference":
                        continue
                    wall, cpu, least = ratios(seconds, name, "reference")
                    peak = peaks[name]
                    memory = f"{peak / base_peak:.2f}x" if peak is not None and base_peak else "-"
                    print(f"| {family} | {size.name}, batch {size.batch} | {impl} | {name} | "
                          f"{wall:.2f}x; {cpu:.2f}x; {least:.2f}x | {memory} |", flush=True)
                base_wall, base_cpu = median_seconds(seconds["reference"])
                print(f"| {family} | {size.name}, batch {size.batch} | {impl} | (reference, "
                      f"{len(seconds['reference'])} rounds) | {base_wall * 1000:.0f} ms; {base_cpu * 1000:.0f} ms | "
                      f"{base_peak / 2**20 if base_peak else 0:.0f} MiB |", flush=True)
    if "vit" in args.tables:
        vit_table(repeats, args.quick, min_seconds)

if __name__ == "__main__":
    main()
