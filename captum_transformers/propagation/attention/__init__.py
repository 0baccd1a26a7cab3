"""The attention Functions: softmax attention that keeps no map (its backward in row chunks), the
constant-map (AH) and recomputed-softmax variants, and fused kernels carrying rules as gradient scalings.
"""
