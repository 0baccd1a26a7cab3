"""Metrics that perturb tokens: activation / pruning curves, AOPC, relevance gain over tokens,
modality removal and rationale F1.
"""
