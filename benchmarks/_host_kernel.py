"""A one-argument Triton kernel for timing a bare launch (``kernel[(1,)](x)``): the host-speed reference.

In its own module, with Triton imported at the top: Triton 2.x resolves a kernel's names in its module's
globals, so a kernel defined inside a function that imports ``triton.language`` locally does not compile."""

import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)
