"""biv100-patch: vLLM decode attention for Iluvatar CoreX BI-V100 and other CUDA-like GPUs.

Kept tiny: the import hook imports this package at every interpreter start.
"""

__version__ = "0.1.0"
