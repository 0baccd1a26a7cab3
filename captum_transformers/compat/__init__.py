"""Other libraries' model forms explained as the plain model: gradient checkpointing, ``torch.compile``,
quantized linear layers, stochastic (training-mode) layers and the calls that make them random, and
library classes another library patched.
"""
