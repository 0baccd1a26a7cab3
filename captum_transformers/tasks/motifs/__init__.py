"""BA-2Motifs: the generated graphs, the built-in graph transformer and Graphormer, their training
and their metrics.
"""
