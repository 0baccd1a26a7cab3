"""LRP as a modified gradient: rule sets, per-operation rule Functions, the fused attention
Function, the two-pass backward switch, and discovery of norms and activations by probing."""
