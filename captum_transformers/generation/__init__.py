"""Explaining what language models generate: every method, token by token, one forward pass."""
from .attribution import GenerationAttribution
from .result import GenerationResult
from .steps import ExplainedSteps

__all__ = ["GenerationAttribution", "GenerationResult", "ExplainedSteps"]
