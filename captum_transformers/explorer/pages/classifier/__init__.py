"""The classifier page: a batch of images or texts, the model's predictions, a methods x
examples grid of maps, deletion/insertion curves and an HTML export.

``workspace`` holds the model, the batch and the cached maps; ``sources`` builds workspaces
from command-line arguments; ``app`` the page's routes; ``export`` the self-contained HTML
grid; ``benchmark`` reads a benchmark's aggregate curves.
"""
