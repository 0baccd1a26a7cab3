"""DigitCanvas: the canvases (real digits on real textures, exact masks), the built-in ViT and Swin,
and their training.
"""
