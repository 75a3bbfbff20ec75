"""Paged-attention decode kernels with vLLM's op contract: a Triton backend and a PyTorch fallback.

``get_backend("triton" | "torch")`` returns an object with vLLM's ``paged_attention_v1`` and
``paged_attention_v2`` signatures. Nothing here imports vLLM, the probe or the patcher: device
limits come in as arguments (``limits.DeviceLimits``).
"""

from .backend import BACKEND_NAMES, PagedAttentionBackend, get_backend

__all__ = ["BACKEND_NAMES", "PagedAttentionBackend", "get_backend"]
