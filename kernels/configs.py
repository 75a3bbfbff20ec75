"""Launch configs for the Triton decode kernel, chosen from a device's measured limits (never its name).

``choose_config`` picks the tile (tokens per step, query-head rows per program), warps and pipeline
stages so that the kernel's shared memory fits ``limits.shared_memory_per_block``; ``choose_splits``
sizes v1's split-KV from the multiprocessor count. ``variants.py`` compiles every config these can
return for a shared-memory limit, so the fit is checked on real compiler output.
"""

import dataclasses
import functools

import torch

from .limits import DeviceLimits

# Interpreter runs (CPU tensors, TRITON_INTERPRET=1): no device to measure; a small-GPU-like budget.
INTERPRETER_LIMITS = DeviceLimits(shared_memory_per_block=48 * 1024, multiprocessor_count=4, warp_size=32,
                                  capability=(7, 0))
MIN_DOT_ROWS = 16         # tl.dot needs M, N, K >= 16
MAX_HEADS_BLOCK = 64      # more query heads per kv head are split over programs (head chunks)
BIG_SHARED_MEMORY = 96 * 1024
# Measured on the H200 (benchmarks/tune_triton_configs.py -> results/nvidia-h200/tune.json, and the sweep
# in results/nvidia-h200/sweep.json), vectorised loads, block ids loaded a step ahead of their K and V:
# - grouped heads: a 16-row tl.dot, one whole cache block per step;
# - where the GPU has async copies (capability >= 8.0) Triton's pipeliner with 3 stages and one warp per
#   16 rows: small programs, more of them resident per SM, more loads in flight (80% of copy, 98-103% with
#   K loaded in memory order; 4 warps: 66%);
# - elsewhere (a BI-V100) the kernel's own one-step prefetch with 64 threads per 16 rows, one BI-V100 warp
#   (on the H200 this path gave 62%, 77% with 32 threads; nothing was measured on a BI-V100);
# - one query row per kv head: where K loads in memory order (``key_rows``), the same 16-row tl.dot (104%);
#   elsewhere float32 broadcast products, 64 threads, a plain loop (89%; Triton pipelines only loads that
#   feed tl.dot, and the compiler's own scheduling beat the kernel's prefetch, which holds more registers).
PIPELINED_DOT_THREADS = 32  # per 16 query rows
PREFETCH_DOT_THREADS = 64   # per 16 query rows
BROADCAST_THREADS = 64
PIPELINE_CAPABILITY = (8, 0)
PIPELINE_STAGES = (3, 2)  # most preferred first
# Split-KV: a decode program is latency-bound (a lone one takes ~1.2 us per step), so short or few
# sequences want many splits, down to 64 tokens (1 x 2048: 63 -> 18 us; results/nvidia-h200/splits.json).
# v1's splits fill a wave of 4 programs per SM: with K loaded in memory order the sweep of split counts
# (mid_splits.json, pps.json) was fastest at ~512 programs on the H200's 132 SMs, e.g. grouped 32 x 2048
# 2 splits 79.3 us, 4 splits 81.9; (64, 8) 32 x 2048 81.6 us at 4 per SM against 86.4 at 8; 8 x 8192
# 79.4 (8 splits) against 80.7 (16). v2's sub-splits fill the same wave: in an H100 sweep of their count on 27
# v2 rows (results/nvidia-h100-80gb-hbm3/v2_subs_sweep.json) 14 rows change with it, and 4 per SM was faster than
# 8 on 13 of them by 0.3-1.4 us (grouped 1 x 8192 27.3 -> 26.5 us, 8 x 2048 41.9 -> 40.6, MHA 1 x 2048 26.9 ->
# 26.1), 0.26 us slower on (32, 8) 1 x 32768 (65.0 -> 65.2). The H200 figure behind the old 8 per SM was that
# row alone, 0.8 us slower at 4 (50.8 -> 51.6 us); no other row was timed at 4 there.
PROGRAMS_PER_SM = 4
MIN_TOKENS_PER_SPLIT = 64
MAX_SUBSPLITS = 8  # v2: a 512-token partition in 64-token sub-splits at most
# v1's splits are reduced by the program that finishes last, in the attention launch, when its combine loads
# them in at most this many tiles (COMBINE_SPLITS splits each): every tile is an L2 round trip after the last
# split is done, and a second one cost more than _reduce_kernel's launch (H100: 8 splits of 8 heads in 2
# rounds 12.4 -> 14.0 us, 16 splits of 4 heads 13.6 -> 14.0; in one 18.6 -> 18.0). More go to
# _reduce_kernel, whose programs load every split at once.
FUSED_REDUCE_MAX_ROUNDS = 1
# At most 8 splits a tile: MHA's [16 splits, 1 head, 128 dims] tile made its fused 1 x 512 and 1 x 1024 rows
# 7% and 4% slower than _reduce_kernel on an H100 (14.4 -> 15.5 us, 18.8 -> 19.6), where a tile of 8 made 1 x 512
# 8% faster (14.4 -> 13.3) and grouped rows' tiles of 8 splits x 4 heads 5-12% faster
# (results/nvidia-h100-80gb-hbm3/triton_ab-fused-onetile.json, triton_ab-mha-tile8-vs-unfused.json).
FUSED_REDUCE_MAX_TILE_SPLITS = 8
# v1 rows whose splits would overflow the fused tile take the tile's count instead where the grid still gives
# every SM a program and splits stay at most this long: the reduce launch saved outweighs the parallelism
# given up (H100, results/nvidia-h100-80gb-hbm3/split_cap_sweep*.json: MHA 1 x 1024 16 -> 8 splits 18.7 -> 16.5
# us, (64, 8) 8 x 512 8 -> 4 splits 19.7 -> 17.6; with fewer programs than SMs it lost, (64, 8) 1 x 512 12.7 ->
# 14.2, and so did 512-token splits, (64, 8) 6 x 2048 35.2 -> 38.1).
FUSED_CAP_MAX_TOKENS = 256
# Registers per thread that the fused combine's tile may take (float32).
COMBINE_REGISTERS = 128
REDUCE_NUM_WARPS = 4
REDUCE_TILE = 4096        # float32 values per reduce program and load
REDUCE_MAX_SPLITS = 256
MIN_REDUCE_DIMS = 16


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
    """The compiler's shared memory for one config, bounded from above (checked on compiled variants).
    tl.dot: K and V tiles in the dot dtype and the query tile (twice for 16-bit dtypes, for the dot-operand
    copy). Broadcast products: the cross-warp reductions' scratch, bounded by one float32 [HEAD_PAD, block_n].
    Pipelined configs (capability >= 8.0, ``num_stages`` > 1): ``num_stages`` buffered copies of the loaded
    K and V tiles besides (the compiler allocates one fewer)."""
    head_pad = _next_power_of_2(head_size)
    dot_bytes = _bytes(query_dtype)
    if use_dot:
        tiles = 2 * block_n * head_pad * dot_bytes + heads_block * head_pad * dot_bytes * (2 if dot_bytes < 4 else 1)
    else:
        tiles = 4 * head_pad * block_n * heads_block
    if tuple(capability) >= PIPELINE_CAPABILITY and num_stages > 1:
        load_bytes = 1 if kv_cache_dtype != "auto" else dot_bytes
        tiles += num_stages * 2 * block_n * head_pad * load_bytes
    return tiles


def candidate_configs(limits, head_size, block_size, query_dtype, kv_cache_dtype, queries_per_kv):
    """Configs in preference order, each fitting the limits' shared memory."""
    fits = lambda c: estimate_shared_bytes(limits.capability, head_size, c.block_n, c.heads_block,  # noqa: E731
                                           query_dtype, kv_cache_dtype, c.num_stages, c.use_dot) \
        <= limits.shared_memory_per_block
    warps = lambda threads: max(1, threads // limits.warp_size)  # noqa: E731
    pipelined = tuple(limits.capability) >= PIPELINE_CAPABILITY and triton_3()
    broadcast = []
    if queries_per_kv == 1:  # one query row: float32 products, one whole cache block per step
        if pipelined:
            broadcast += [KernelConfig(block_size, 1, warps(BROADCAST_THREADS), stages, use_dot=False, prefetch=False)
                          for stages in PIPELINE_STAGES]
        broadcast.append(KernelConfig(block_size, 1, warps(BROADCAST_THREADS), 1, use_dot=False, prefetch=True))
    found = []
    rows = max(_next_power_of_2(queries_per_kv), MIN_DOT_ROWS)
    # More than 16 query rows per program only where shared memory is plentiful (not on 48 KB parts).
    plentiful = limits.shared_memory_per_block >= BIG_SHARED_MEMORY and triton_3()
    most_rows = MAX_HEADS_BLOCK if plentiful else MIN_DOT_ROWS
    heads_block = min(rows, most_rows)
    while heads_block >= MIN_DOT_ROWS:
        row_groups = heads_block // MIN_DOT_ROWS
        # One whole cache block per step (16 tokens for blocks of 8: tl.dot's minimum), or a 16-token
        # tile where a 32-token block does not fit.
        block_ns = [max(block_size, MIN_DOT_ROWS)] + ([MIN_DOT_ROWS] if block_size > MIN_DOT_ROWS else [])
        if pipelined:
            found += [KernelConfig(block_n, heads_block, warps(PIPELINED_DOT_THREADS * row_groups), stages,
                                   use_dot=True, prefetch=False)
                      for block_n in block_ns for stages in PIPELINE_STAGES]
        found += [KernelConfig(block_n, heads_block, warps(PREFETCH_DOT_THREADS * row_groups), 1)
                  for block_n in block_ns]
        heads_block //= 2
    # One query row: a 16-row tl.dot (15 rows of padding) where K loads in memory order (H200: 104% of copy
    # against the broadcast products' 89%, results/nvidia-h200/mha_dot.json), else broadcast products.
    if pipelined and key_rows(found[0], block_size):
        found += broadcast
    else:
        found = broadcast + found
    return [c for c in found if fits(c)]


def key_rows(config, block_size):
    """Whether the kernel loads K in its memory order (``KEY_ROWS``: rows of X dims, permuted in registers):
    the pipelined ``tl.dot`` path with one cache block per step, on Triton >= 3 (``tl.permute``); the launch
    also needs vLLM's slot layout. On the H200 (results/nvidia-h200/key_rows.json, key_rows2.json; Nsight
    Compute in ncu_gqa.txt) grouped rows went from 80% to 98-103% of copy on 2 GB, 67% to 82% on 268 MB,
    1 x 32768 from 59.6 to 50.2 us: loaded as [dims, tokens], K's async copies had moved twice the L2
    sectors they needed."""
    return config.use_dot and not config.prefetch and config.block_n == block_size and triton_has_permute()


@functools.lru_cache(maxsize=None)
def triton_version():
    """Triton's (major, minor); (0, 0) where it is missing or unreadable. Imported on first use, like
    ``triton_has_permute``."""
    try:
        import triton

        return tuple(int(part) for part in triton.__version__.split(".")[:2])
    except (ImportError, ValueError, AttributeError):
        return (0, 0)


def triton_3():
    """Triton >= 3. Under Triton 2.x configs keep to what was right under 2.3.1 on the H200
    (results/nvidia-h200/triton231.json): the kernel's own prefetch, never Triton's pipeliner (its pipelined
    paths got 9 of the 20 golden cases wrong, by up to 4.6), and at most 16 query rows per program (64 rows
    crashed its compiler)."""
    return triton_version() >= (3, 0)


@functools.lru_cache(maxsize=None)
def triton_has_permute():
    """Triton >= 3.0 (2.x transposes 2-D tensors only). Imported on first use, not with this module: the
    compile workers set up Triton's interpreter switch before they import Triton."""
    try:
        import triton.language as tl
    except ImportError:
        return False
    return hasattr(tl, "permute")


def choose_config(limits, head_size, block_size, query_dtype, kv_cache_dtype, queries_per_kv):
    found = candidate_configs(limits, head_size, block_size, query_dtype, kv_cache_dtype, queries_per_kv)
    if not found:
        raise ValueError(f"shared_memory_per_block: no Triton config for head_size={head_size} "
                         f"block_size={block_size} fits {limits.shared_memory_per_block} bytes")
    return found[0]


def unmasked_steps(config, head_size):
    """Whether the kernel loads whole steps without masks: the pipelined ``tl.dot`` path where head_size fills
    its power-of-2 tile. On the H200 (results/nvidia-h200/nomask_variants.json) that took the grouped-query
    kernel from 255 to 214 registers and 341 to 310 instructions per step: 0.3-0.6% faster on the largest rows,
    1.5-3% on mid-sized ones, 1 x 2048 19.0 -> 17.3 us. The one-row broadcast path lost 8-11% without masks."""
    return config.use_dot and not config.prefetch and head_size == _next_power_of_2(head_size)


def attention_key(head_size, block_size, dtype, kv_cache_dtype, config):
    """The attention binary a call runs, as a JSON-friendly list: calls with equal keys share one binary. The
    probe records the keys whose calls it found wrong; the Triton backend refuses those calls (see
    ``paged_attention_triton.make_forward``). ``dtype``: a torch dtype or its name."""
    return ["attention", _next_power_of_2(head_size), unmasked_steps(config, head_size), block_size,
            str(dtype).replace("torch.", ""), kv_cache_dtype, *dataclasses.astuple(config)]


def choose_splits(limits, programs, max_seq_len, block_n, fused_splits=1):
    """v1's split-KV: ``(num_splits, tokens_per_split)``. As many splits as a wave of ``PROGRAMS_PER_SM``
    programs per SM holds, each at least ``MIN_TOKENS_PER_SPLIT`` long; one split when the grid already
    fills the wave. Short rows take at most ``fused_splits`` (what the attention launch reduces itself)
    where that still gives every SM a program and splits of at most ``FUSED_CAP_MAX_TOKENS``."""
    wave = limits.multiprocessor_count * PROGRAMS_PER_SM
    most = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    splits = max(1, min(wave // max(programs, 1), most, REDUCE_MAX_SPLITS))
    if (fused_splits < splits and programs * fused_splits >= limits.multiprocessor_count
            and max_seq_len <= fused_splits * FUSED_CAP_MAX_TOKENS):
        splits = fused_splits
    if splits == 1:
        return 1, max(max_seq_len, 1)
    tokens = -(-max_seq_len // splits)
    tokens = -(-tokens // block_n) * block_n
    return -(-max_seq_len // tokens), tokens


def choose_subsplits(limits, programs, partitions, partition_size, block_n):
    """v2's sub-splits per vLLM partition (a power of 2): as many as keep the grid within one wave of resident
    programs, each at least ``MIN_TOKENS_PER_SPLIT`` tokens and a whole number of steps. On the H200 they took
    grouped-query 1 x 2048 from 31 to 17 us and 1 x 8192 from 57 to 32 us (two bench runs of 2026-12-03).
    They used to stop where the partitions alone gave a program per SM, because a separate partition kernel
    cost 3-9 us; with the combine and the reduce in one kernel, sub-splits won there too
    (results/nvidia-h200/v2_subs.json): 8 x 2048 and 1 x 16384 grouped 39 -> 33 us, 1 x 32768 51.5 -> 50.1
    us, MHA 1 x 8192 49.1 -> 49.6 us. The wave is v1's (``PROGRAMS_PER_SM``), no longer twice it: see there."""
    wave = limits.multiprocessor_count * PROGRAMS_PER_SM
    subs = 1
    while (subs < MAX_SUBSPLITS and programs * partitions * subs * 2 <= wave
           and subsplits_fit_reduce_tile(partitions, subs * 2)
           and partition_size // (subs * 2) >= MIN_TOKENS_PER_SPLIT and (partition_size // (subs * 2)) % block_n == 0):
        subs *= 2
    return subs


def subsplits_fit_reduce_tile(partitions, subs):
    """Whether ``_partition_reduce_kernel`` loads every partition's ``subs`` sub-splits in one tile
    (``partition_reduce_tile``): at most ``REDUCE_MAX_SPLITS`` of them, partitions padded to a power of 2."""
    return _next_power_of_2(partitions) * subs <= REDUCE_MAX_SPLITS


def reduce_tile(num_splits, head_size):
    """The reduce kernel's tile: ``(splits_block, dims_block)``, splits per load (all of them up to
    ``REDUCE_MAX_SPLITS``) by head dims per program, at most ``REDUCE_TILE`` float32 values. Its two
    passes are then one round of loads each, not a chain of 4096-value tiles: on the H200 the chain made
    256 splits cost more than they gained."""
    head_pad = _next_power_of_2(head_size)
    splits_block = max(1, min(_next_power_of_2(num_splits), REDUCE_MAX_SPLITS))
    dims_block = min(head_pad, max(MIN_REDUCE_DIMS, REDUCE_TILE // splits_block))
    return splits_block, dims_block


def combine_tile(config, queries_per_kv, head_size, warp_size):
    """The fused v1 combine's tile: ``(rows, splits)``, query heads (the group's heads, a power of 2, at most
    the config's ``heads_block``) by splits loaded together, as many as keep the tile within
    ``COMBINE_REGISTERS`` float32 registers per thread (a power of 2, at most ``FUSED_REDUCE_MAX_TILE_SPLITS``)."""
    rows = min(config.heads_block, _next_power_of_2(queries_per_kv))
    per_split = max(1, rows * _next_power_of_2(head_size) // (config.num_warps * warp_size))
    splits = max(1, min(FUSED_REDUCE_MAX_TILE_SPLITS, COMBINE_REGISTERS // per_split))
    return rows, 1 << (splits.bit_length() - 1)


def partition_reduce_tile(partitions, subs, head_size):
    """``_partition_reduce_kernel``'s tile: ``(parts_block, dims_block)``, every partition's ``subs``
    sub-splits (``choose_subsplits`` keeps them within ``REDUCE_MAX_SPLITS``) by head dims per program,
    at most ``REDUCE_TILE`` float32 values where ``MIN_REDUCE_DIMS`` dims allow it."""
    head_pad = _next_power_of_2(head_size)
    parts_block = _next_power_of_2(max(partitions, 1))
    dims_block = min(head_pad, max(MIN_REDUCE_DIMS, REDUCE_TILE // (parts_block * subs)))
    return parts_block, dims_block
