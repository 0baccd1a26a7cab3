"""Metrics that perturb the nodes of graphs: activation / pruning curves and relevance gain.
"""
