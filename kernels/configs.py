"""Launch configs for the Triton decode kernel, chosen from a device's measured limits (never its name).

``choose_config`` picks the tile (tokens per step, query-head rows per program), warps and pipeline
stages so that the kernel's shared memory fits ``limits.shared_memory_per_block``; ``choose_splits``
sizes v1's split-KV from the multiprocessor count. ``variants.py`` compiles every config these can
return for a shared-memory limit, so the fit is checked on real compiler output.
"""

import dataclasses

import torch

from .limits import DeviceLimits

# Interpreter runs (CPU tensors, TRITON_INTERPRET=1): no device to measure; a small-GPU-like budget.
INTERPRETER_LIMITS = DeviceLimits(shared_memory_per_block=48 * 1024, multiprocessor_count=4, warp_size=32,
                                  capability=(7, 0))
MIN_DOT_ROWS = 16         # tl.dot needs M, N, K >= 16
MAX_HEADS_BLOCK = 64      # more query heads per kv head are split over programs (head chunks)
BIG_SHARED_MEMORY = 96 * 1024
# 64 threads (2 warps of 32, 1 of 64): on the H200, 2 warps beat 4 by 1.3-1.7x on every row measured
# (more programs per SM in flight); 16-token steps beat 32/64/128-token gathered steps.
THREADS_PER_PROGRAM = 64
PROGRAMS_PER_SM = 4       # split-KV until the grid covers the SMs this many times
MIN_TOKENS_PER_SPLIT = 512  # shorter splits measured slower (and cost a reduce launch)
REDUCE_NUM_WARPS = 4


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """``block_n`` tokens per step (a multiple of the cache block size), ``heads_block`` query rows."""

    block_n: int
    heads_block: int
    num_warps: int
    num_stages: int


def _next_power_of_2(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def _bytes(dtype):
    return torch.empty((), dtype=dtype).element_size()


def estimate_shared_bytes(capability, head_size, block_n, heads_block, query_dtype, kv_cache_dtype, num_stages):
    """The compiler's shared memory for one config, as measured on its output (``variants.compile_variants``):
    K and V tiles in the dot dtype and the query tile (twice for 16-bit dtypes, for the dot-operand copy);
    from capability 8.0 on, ``num_stages`` buffered copies of the loaded K and V tiles besides."""
    head_pad = _next_power_of_2(head_size)
    dot_bytes = _bytes(query_dtype)
    tiles = 2 * block_n * head_pad * dot_bytes + heads_block * head_pad * dot_bytes * (2 if dot_bytes < 4 else 1)
    if tuple(capability) >= (8, 0):
        load_bytes = 1 if kv_cache_dtype != "auto" else dot_bytes
        tiles += num_stages * 2 * block_n * head_pad * load_bytes
    return tiles


def candidate_configs(limits, head_size, block_size, query_dtype, kv_cache_dtype, queries_per_kv):
    """Configs in preference order, each fitting the limits' shared memory."""
    rows = max(_next_power_of_2(queries_per_kv), MIN_DOT_ROWS)
    # More than 16 query rows per program only where shared memory is plentiful (not on 48 KB parts).
    most_rows = MAX_HEADS_BLOCK if limits.shared_memory_per_block >= BIG_SHARED_MEMORY else MIN_DOT_ROWS
    num_warps = max(1, THREADS_PER_PROGRAM // limits.warp_size)
    # The kernel pipelines by hand (next step's loads in flight): Triton's own stages add nothing.
    stages = (1,)
    # One whole cache block per step; a 16-token tile where a 32-token block does not fit (or blocks of 8).
    block_ns = [block_size] if block_size >= MIN_DOT_ROWS else []
    block_ns += [MIN_DOT_ROWS] if block_size != MIN_DOT_ROWS else []
    found = []
    heads_block = min(rows, most_rows)
    while heads_block >= MIN_DOT_ROWS:
        for block_n in block_ns:
            for num_stages in stages:
                if estimate_shared_bytes(limits.capability, head_size, block_n, heads_block, query_dtype,
                                         kv_cache_dtype, num_stages) <= limits.shared_memory_per_block:
                    found.append(KernelConfig(block_n, heads_block, num_warps, num_stages))
        heads_block //= 2
    return found


def choose_config(limits, head_size, block_size, query_dtype, kv_cache_dtype, queries_per_kv):
    found = candidate_configs(limits, head_size, block_size, query_dtype, kv_cache_dtype, queries_per_kv)
    if not found:
        raise ValueError(f"shared_memory_per_block: no Triton config for head_size={head_size} "
                         f"block_size={block_size} fits {limits.shared_memory_per_block} bytes")
    return found[0]


def choose_splits(limits, programs, max_seq_len, block_n):
    """v1's split-KV: ``(num_splits, tokens_per_split)``; one split when the grid already fills the device."""
    wanted = -(-limits.multiprocessor_count * PROGRAMS_PER_SM // max(programs, 1))
    most = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(wanted, most))
    if splits == 1:
        return 1, max(max_seq_len, 1)
    tokens = -(-max_seq_len // splits)
    tokens = -(-tokens // block_n) * block_n
    return -(-max_seq_len // tokens), tokens


def reduce_splits_block(num_splits, head_size):
    """Splits the reduce kernel loads per step: at most 4096 float32 values per tile."""
    head_pad = _next_power_of_2(head_size)
    return max(1, min(_next_power_of_2(num_splits), 4096 // head_pad))
