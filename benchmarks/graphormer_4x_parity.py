"""Parity with transformers 4.x's Graphormer: a checkpoint saved by 4.x's
``GraphormerForGraphClassification`` loads into ``captum_transformers.models``' class, and
every method explains both the same way.

transformers 5 (the package's) and 4.x cannot share a process, so this script runs a second
Python process with an unpacked 4.x wheel first on ``sys.path``. That process builds 4.x's
model, saves it, and explains it with this package (found by dotted key); this process loads
the checkpoint with the package's class and compares logits and maps. Not a test: CI has no
transformers 4.x.

    pip download "transformers==4.57.1" --no-deps -d /tmp/tf4whl
    unzip -q /tmp/tf4whl/transformers-4.57.1-py3-none-any.whl -d /tmp/tf4
    python benchmarks/graphormer_4x_parity.py --transformers4 /tmp/tf4

Measured (4.57.1, CPU, 3 graphs of 5/3/7 nodes, post-LN and pre-LN with emb_layer_norm):
logits bit-identical, and all eleven package methods' token maps bit-identical (max |diff| 0).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = [0, 2, 1]


def _setup_paths(transformers4: str = "") -> None:
    for path in (os.path.join(ROOT, "tests"), ROOT) + ((transformers4,) if transformers4 else ()):
        sys.path.insert(0, path)
    if transformers4:
        # 4.x checks its dependencies' versions at import; transformers 5's environment has newer ones.
        stub = types.ModuleType("transformers.dependency_versions_check")
        stub.dep_version_check = lambda *args, **kwargs: None
        sys.modules[stub.__name__] = stub


def build_and_explain_4x(folder: str) -> None:
    """In the 4.x process: one checkpoint and one set of maps per layer-norm placement."""
    import torch
    import transformers
    from transformers.models.deprecated.graphormer import configuration_graphormer, modeling_graphormer

    from captum_transformers.methods.catalog import PACKAGE_METHOD_NAMES, build_method
    from graphormer_models import batch, graphs

    print("transformers", transformers.__version__)
    nodes, rest = batch(graphs((5, 3, 7)))
    results = {}
    for pre in (False, True):
        torch.manual_seed(0)
        config = configuration_graphormer.GraphormerConfig(
            num_classes=3, num_hidden_layers=2, embedding_dim=16, ffn_embedding_dim=24, num_attention_heads=4,
            num_atoms=1100, num_edges=600, num_in_degree=12, num_out_degree=12, num_spatial=512, num_edge_dis=6,
            multi_hop_max_dist=4, pre_layernorm=pre, encoder_normalize_before=pre)
        model = modeling_graphormer.GraphormerForGraphClassification(config).eval()
        with torch.no_grad():  # non-zero structural encodings (4.x's init leaves some at 0)
            for name, parameter in model.named_parameters():
                if "graph_attn_bias" in name:
                    parameter.normal_(0.0, 0.5)
                    if "spatial_pos_encoder" in name or "edge_encoder" in name:
                        parameter[0].zero_()
        model.save_pretrained(os.path.join(folder, f"pre{int(pre)}"))
        with torch.no_grad():
            results[f"logits{int(pre)}"] = model(nodes, **rest).logits
        for name in PACKAGE_METHOD_NAMES:
            results[f"{name}{int(pre)}"] = build_method(name, model).attribute(
                nodes, target=TARGETS, forward_kwargs=rest, return_tokens=True)
        # Nothing the adapter set on 4.x's modules (their forward, batch_first) outlives the explanations.
        left = sorted({key for module in model.modules() for key in ("forward", "batch_first") if key in vars(module)})
        print(f"{'pre' if pre else 'post'}-LN 4.x model: attributes left on modules after explaining: {left or 'none'}")
    torch.save(results, os.path.join(folder, "results.pt"))


def compare(folder: str) -> int:
    import torch

    from captum_transformers.methods.catalog import PACKAGE_METHOD_NAMES, build_method
    from captum_transformers.models import GraphormerForGraphClassification
    from graphormer_models import batch, graphs

    expected = torch.load(os.path.join(folder, "results.pt"))
    nodes, rest = batch(graphs((5, 3, 7)))
    worst = 0.0
    for pre in (0, 1):
        model, info = GraphormerForGraphClassification.from_pretrained(os.path.join(folder, f"pre{pre}"),
                                                                       output_loading_info=True)
        model.eval()
        problems = {key: value for key, value in info.items() if value}
        with torch.no_grad():
            logits = model(nodes, **rest).logits
        print(f"{'pre' if pre else 'post'}-LN: loading problems {problems or 'none'}; logits bit-identical: "
              f"{torch.equal(logits, expected[f'logits{pre}'])}")
        for name in PACKAGE_METHOD_NAMES:
            mine = build_method(name, model).attribute(nodes, target=TARGETS, forward_kwargs=rest, return_tokens=True)
            difference = (mine - expected[f"{name}{pre}"]).abs().max().item()
            worst = max(worst, difference)
            print(f"  {name:22s} max |diff| {difference:.3g} (map scale {mine.abs().max().item():.3g})")
    return 0 if worst == 0.0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers4", help="an unpacked transformers 4.42-4.57 wheel")
    parser.add_argument("--build-in", help=argparse.SUPPRESS)  # the 4.x process's own entry
    args = parser.parse_args()
    if args.build_in:
        _setup_paths(args.transformers4)
        build_and_explain_4x(args.build_in)
        return 0
    if not args.transformers4:
        parser.error("--transformers4 is required")
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, __file__, "--transformers4", args.transformers4, "--build-in", folder],
                       check=True)
        _setup_paths()
        return compare(folder)


if __name__ == "__main__":
    sys.exit(main())
