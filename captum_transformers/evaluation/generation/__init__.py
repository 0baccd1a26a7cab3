"""Metrics of generation explanations: per generated token, its evidence removed from the prompt.
"""
