"""Associative recall: the generation task, the built-in recall Llama, its training and benchmark.
"""
