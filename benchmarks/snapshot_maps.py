"""Every method's maps on every adapter family the tests build, in float64, for a bit-for-bit
comparison of two versions of the package (a refactor must change no map).

    python benchmarks/snapshot_maps.py record OUT.pt      # in the tree to snapshot
    python benchmarks/snapshot_maps.py compare A.pt B.pt  # exit 1 on any difference

Run ``record`` from the root of each tree (it imports that tree's ``captum_transformers`` and its
``tests/`` model builders: the registry test's example per adapter, the HF cases, the decoder
LLMs, the generation models); put the tree first on ``PYTHONPATH`` so that an installed copy of
the package is not imported instead, e.g. ``cd OLD && PYTHONPATH=$PWD python NEW/benchmarks/snapshot_maps.py
record old.pt``. The script reads only the public API (``captum_transformers`` and
``captum_transformers.adapters``). A refused (family, method) pair is recorded as its error's
class and message, so a changed refusal shows as a difference too. ``compare`` checks dtype,
shape and every element (``torch.equal``; NaN compared as NaN).
"""
from __future__ import annotations

import os
import sys
import time
import warnings

import torch

ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)


def _methods():
    import captum_transformers as ct

    classes = list(ct.ATTENTION_METHODS) + list(ct.LRP_ATTENTION_METHODS) + list(ct.RELEVANCE_METHODS)
    classes += [ct.AttentionFlow]
    methods = {cls.__name__: cls for cls in classes}
    for rules in (ct.RuleSet.AH_LN, ct.RuleSet.CHEFER, ct.RuleSet.ATTN_LRP):
        methods[f"RuleGradientXInput[{rules.name}]"] = (lambda model, rules=rules: ct.RuleGradientXInput(model, rules))
    return methods


def _double(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    if isinstance(value, dict):
        return {k: _double(v) for k, v in value.items()}
    return value


def _cases():
    """name -> (model, inputs, forward kwargs, targets), all float64."""
    import test_adapter_registry as registry
    from hf_models import CASES, decoder_llm

    cases = {}
    for name, build in registry.EXAMPLES.items():
        model, inputs, kwargs = build()
        cases[name] = (model.double(), _double(inputs), _double(kwargs), registry.TARGETS.get(name, [0, 1, 2]))
    for name in ("roberta", "distilbert", "vit", "deit_distilled", "clip_vision", "clip_text", "gpt2"):
        if name in CASES:
            spec = CASES[name]
            inputs, kwargs = spec.inputs(dtype=torch.float64)
            cases[f"hf-{name}"] = (spec.model(dtype=torch.float64), inputs, kwargs, [0, 1, 2])
    try:
        from pyg_models import gps_classifier, graph_classifier, graphs
    except ImportError:  # torch_geometric missing: no graph rows
        pass
    else:
        _, (x, edge_index, batch) = graphs()
        for kind in ("TransformerConv", "GATConv", "GATv2Conv"):
            cases[f"pyg-{kind}"] = (graph_classifier(kind).double(), x.double(), {}, [0, 1, 0])
        cases["pyg-gps"] = (gps_classifier().double(), x.double(), {}, [0, 1, 0])
        for name in [n for n in cases if n.startswith("pyg-")]:
            model, nodes, _, targets = cases[name]
            cases[name] = (model, nodes, {"_graph": (edge_index, batch)}, targets)
    for impl in ("eager", "sdpa"):
        model = decoder_llm("llama", impl, dtype=torch.float64)
        ids = torch.randint(3, 53, (2, 7), generator=torch.Generator().manual_seed(3))
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, :2] = 0  # left padding
        ids[1, :2] = 0
        cases[f"llama-gqa-{impl}"] = (model, ids, {"attention_mask": mask}, [4, 9])
    return cases


def _generation_cases():
    from generation_models import IdTokenizer, build

    prompts, targets = [[1, 5, 7, 9, 11, 13], [1, 6, 8]], [[20, 21, 22], [23, 24]]
    out = {}
    for family in ("llama", "bart"):
        try:
            out[f"gen-{family}"] = (build(family), IdTokenizer(), prompts, targets)
        except KeyError:
            continue
    return out


def _record_result(store, key, value):
    if isinstance(value, torch.Tensor):
        store[key] = value.detach().cpu().clone()
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            _record_result(store, f"{key}[{i}]", item)
    elif isinstance(value, dict):
        for name, item in value.items():
            _record_result(store, f"{key}.{name}", item)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            _record_result(store, f"{key}.{name}", getattr(value, name))
    elif isinstance(value, (int, float, bool, str)) or value is None:
        store[key] = repr(value)


def _refusal(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def record(path: str) -> None:
    import captum_transformers as ct
    from captum_transformers.generation import GenerationAttribution

    print("captum_transformers from", ct.__file__)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    store = {}
    methods = _methods()
    for case, (model, inputs, kwargs, targets) in _cases().items():
        for name, cls in methods.items():
            for tokens in (False, True):
                key = f"{case}/{name}/{'tokens' if tokens else 'maps'}"
                torch.manual_seed(0)
                try:
                    explainer = cls(model)
                    if "_graph" in kwargs:  # PyG: edges and the batch vector as positional arguments
                        result = explainer.attribute(inputs, target=targets, additional_forward_args=kwargs["_graph"],
                                                     return_tokens=tokens)
                    else:
                        result = explainer.attribute(inputs, target=targets, forward_kwargs=kwargs,
                                                     return_tokens=tokens)
                except Exception as error:  # a refusal is part of the behaviour
                    store[key] = _refusal(error)
                    continue
                _record_result(store, key, result)
    for case, (model, tokenizer, prompts, targets) in _generation_cases().items():
        for name, cls in methods.items():
            key = f"{case}/{name}"
            torch.manual_seed(0)
            try:
                results = GenerationAttribution(cls(model), tokenizer).attribute(prompts, target=targets)
            except Exception as error:
                store[key] = _refusal(error)
                continue
            for i, result in enumerate(results if isinstance(results, (list, tuple)) else [results]):
                _record_result(store, f"{key}/{i}.seq_attr", getattr(result, "seq_attr", None))
                _record_result(store, f"{key}/{i}.token_attr", getattr(result, "token_attr", None))
    torch.save(store, path)
    tensors = sum(isinstance(v, torch.Tensor) for v in store.values())
    refusals = sum(isinstance(v, str) and ": " in v for v in store.values())
    print(f"recorded {len(store)} snapshots ({tensors} tensors, {refusals} refusals or values) "
          f"in {time.perf_counter() - start:.0f} s -> {path}")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            return bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
                        and torch.equal(a.isnan(), b.isnan()))
        return bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


def compare(first: str, second: str) -> int:
    a, b = torch.load(first, weights_only=False), torch.load(second, weights_only=False)
    keys = sorted(set(a) | set(b))
    differences = [k for k in keys if k not in a or k not in b or not _same(a[k], b[k])]
    for key in differences:
        left, right = a.get(key, "<missing>"), b.get(key, "<missing>")
        describe = (lambda v: f"tensor{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else str(v)[:160])
        print(f"DIFFERENT {key}: {describe(left)} | {describe(right)}")
    tensors = sum(isinstance(a[k], torch.Tensor) for k in keys if k in a)
    print(f"compared {len(keys)} snapshots ({tensors} tensors): {len(differences)} different")
    return 1 if differences else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
