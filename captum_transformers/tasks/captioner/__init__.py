"""The built-in digit captioner (a tiny LLaVA) and its training.
"""
