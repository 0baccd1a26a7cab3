"""Evidence behind the README's "Graph motifs" notes, on the built-in motif model.

1. Why GenericAttention and attention Grad-CAM stay near 0.5 class-specific share on two-motif
   BA graphs: how far GenericAttention's node scores move from the identity term of
   R = I + sum Abar R (each node explaining itself, 1/n under a mean readout), and how often
   Grad-CAM has no positive score on a graph at all.
2. Conservation on the trained model (with biases, so never exact): the relative gap between
   the relevance sum and the explained logit, |sum R - y| / |y|, for GI, AH and AH+LN.

    python benchmarks/graph_motif_checks.py
"""
from __future__ import annotations

import torch

from captum_transformers import AttentionGradCAM, ConservativeLRP, GenericAttention
from captum_transformers.tasks.motifs.graphs import motif_graphs
from captum_transformers.tasks.motifs.model import load_motif_model


def main() -> None:
    torch.set_num_threads(1)
    model = load_motif_model()
    pairs = motif_graphs(200, seed=2, two_motifs=True)  # the benchmark's two-motif graphs
    args = (pairs.edge_index, pairs.batch)
    for explained, name in ((0, "house"), (1, "cycle")):
        target = torch.full((pairs.num_graphs,), explained)
        scores = GenericAttention(model).attribute(pairs.x, additional_forward_args=args, target=target,
                                                   return_tokens=True)
        real = scores != 0
        share = 1.0 / real.sum(-1, keepdim=True)
        moved = ((scores - share) * real).abs().sum(-1) / scores.sum(-1)
        cam = AttentionGradCAM(model).attribute(pairs.x, additional_forward_args=args, target=target,
                                                return_tokens=True)
        empty = int((cam.clamp(min=0).sum(-1) == 0).sum())
        print(f"explaining {name}: GenericAttention moves {float(moved.mean()):.3f} of its mass away from the "
              f"identity term (mean over graphs); Grad-CAM has no positive node on {empty} of "
              f"{pairs.num_graphs} graphs")
    data = motif_graphs(200, seed=1)  # the benchmark's single-motif graphs
    for variant in ("GI", "AH", "AH+LN"):
        _, delta = ConservativeLRP(model, variant=variant).attribute(
            data.x, additional_forward_args=(data.edge_index, data.batch), target=data.labels,
            return_convergence_delta=True)
        with torch.no_grad():
            logits = model(data.x, data.edge_index, data.batch)[torch.arange(data.num_graphs), data.labels]
        gap = delta.abs() / logits.abs()
        print(f"{variant}: |sum R - y| / |y| median {float(gap.median()):.2f}, worst {float(gap.max()):.2f}")


if __name__ == "__main__":
    main()
