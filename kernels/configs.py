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
# Measured on the H200 (benchmarks/tune_triton_configs.py -> results/nvidia-h200/tune.json), vectorised loads:
# - one query row per kv head: float32 broadcast products, a whole cache block per step, 64 threads
#   (90% of copy; a 16-row padded tl.dot gave 41%);
# - grouped heads: tl.dot with 32-token steps left to Triton's pipeliner (3 stages, 128 threads) where
#   the GPU has async copies (capability >= 8.0): 58%; the kernel's own one-step prefetch with 64
#   threads: 52% (what GPUs without async copies get); broadcast products with 4+ rows: <= 31%.
THREADS_PER_PROGRAM = 64
PIPELINE_CAPABILITY = (8, 0)
PIPELINED_THREADS = 128
PIPELINED_STEPS = ((32, 3), (32, 2), (16, 3))  # (tokens per step, stages), most preferred first
PROGRAMS_PER_SM = 4       # split-KV until the grid covers the SMs this many times
MIN_TOKENS_PER_SPLIT = 512  # shorter splits measured slower (and cost a reduce launch)
REDUCE_NUM_WARPS = 4


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """``block_n`` tokens per step (a multiple of the cache block size), ``heads_block`` query rows;
    ``use_dot``: q.k and p.v by ``tl.dot`` (else float32 broadcast products); ``prefetch``: the kernel's
    own one-step-ahead loads (else Triton's pipeliner with ``num_stages``)."""

    block_n: int
    heads_block: int
    num_warps: int
    num_stages: int
    use_dot: bool = True
    prefetch: bool = True


def _next_power_of_2(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def _bytes(dtype):
    return torch.empty((), dtype=dtype).element_size()


def estimate_shared_bytes(capability, head_size, block_n, heads_block, query_dtype, kv_cache_dtype, num_stages,
                          use_dot=True):
    """The compiler's shared memory for one config, as measured on its output (``variants.compile_variants``).
    tl.dot: K and V tiles in the dot dtype and the query tile (twice for 16-bit dtypes, for the dot-operand
    copy); from capability 8.0 on, ``num_stages`` buffered copies of the loaded K and V tiles besides.
    Broadcast products: only the cross-warp reductions' scratch, bounded by one float32 [HEAD_PAD, block_n]."""
    head_pad = _next_power_of_2(head_size)
    if not use_dot:
        return 4 * head_pad * block_n * heads_block
    dot_bytes = _bytes(query_dtype)
    tiles = 2 * block_n * head_pad * dot_bytes + heads_block * head_pad * dot_bytes * (2 if dot_bytes < 4 else 1)
    if tuple(capability) >= (8, 0):
        load_bytes = 1 if kv_cache_dtype != "auto" else dot_bytes
        tiles += num_stages * 2 * block_n * head_pad * load_bytes
    return tiles


def candidate_configs(limits, head_size, block_size, query_dtype, kv_cache_dtype, queries_per_kv):
    """Configs in preference order, each fitting the limits' shared memory."""
    small_warps = max(1, THREADS_PER_PROGRAM // limits.warp_size)
    fits = lambda c: estimate_shared_bytes(limits.capability, head_size, c.block_n, c.heads_block,  # noqa: E731
                                           query_dtype, kv_cache_dtype, c.num_stages, c.use_dot) \
        <= limits.shared_memory_per_block
    found = []
    if queries_per_kv == 1:  # one query row: no tl.dot, one whole cache block per step
        found.append(KernelConfig(block_size, 1, small_warps, 1, use_dot=False, prefetch=True))
    rows = max(_next_power_of_2(queries_per_kv), MIN_DOT_ROWS)
    # More than 16 query rows per program only where shared memory is plentiful (not on 48 KB parts).
    most_rows = MAX_HEADS_BLOCK if limits.shared_memory_per_block >= BIG_SHARED_MEMORY else MIN_DOT_ROWS
    heads_block = min(rows, most_rows)
    while heads_block >= MIN_DOT_ROWS:
        if tuple(limits.capability) >= PIPELINE_CAPABILITY:
            warps = max(1, PIPELINED_THREADS // limits.warp_size)
            found += [KernelConfig(block_n, heads_block, warps, stages, use_dot=True, prefetch=False)
                      for block_n, stages in PIPELINED_STEPS]
        # The kernel's own prefetch: one whole cache block per step, or a 16-token tile where a 32-token
        # block does not fit (or blocks of 8).
        block_ns = [block_size] if block_size >= MIN_DOT_ROWS else []
        block_ns += [MIN_DOT_ROWS] if block_size != MIN_DOT_ROWS else []
        found += [KernelConfig(block_n, heads_block, small_warps, 1) for block_n in block_ns]
        heads_block //= 2
    return [c for c in found if fits(c)]


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
