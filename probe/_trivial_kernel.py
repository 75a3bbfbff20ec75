"""The ladder's step 2 kernel: ``out = 2 * x + y``, small enough that only Triton itself can fail."""

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, 2 * x + y, mask=mask)


def scaled_add(x, y):
    """``2 * x + y`` for 1-D float32 tensors on one device."""
    out = torch.empty_like(x)
    n = x.numel()
    _scaled_add_kernel[(triton.cdiv(n, BLOCK),)](x, y, out, n, BLOCK=BLOCK)
    return out
