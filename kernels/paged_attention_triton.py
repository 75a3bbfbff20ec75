"""Paged-attention decode in Triton: vLLM's paged_attention_v1/v2 contract on any Triton >= 2.3.

Shapes (vLLM's layouts; D = head_size, G = num_heads // num_kv_heads)::

    query, out   [num_seqs, num_heads, D]                      float32 | float16 | bfloat16
    key_cache    [num_blocks, num_kv_heads, D // x, block_size, x]
    value_cache  [num_blocks, num_kv_heads, D, block_size]     (uint8 bit patterns for fp8 caches)
    block_tables [num_seqs, max_blocks_per_seq] int32;  seq_lens [num_seqs] int32
    v2 buffers:  exp_sums, max_logits [num_seqs, num_heads, P] float32; tmp_out [num_seqs, num_heads, P, D]

``_attention_kernel`` runs on the grid (kv head x head chunk, sequence, split). One program loads
the query rows of every query head sharing its kv head and walks its split's tokens ``BLOCK_N`` at a
time through the block table, with 16-byte vector loads (masks per step and per 8 dims, never per
token). On the pipelined path K is read in its memory order, rows of X dims, and permuted in
registers. Block ids are loaded a step ahead of their K and V, so the address of a step's loads never
waits on a load of the same step (and Triton's pipeliner multi-buffers them); whole steps run without
token masks, only the split's last, partial step masks its tokens (and where head_size fills its power-of-2
tile, the pipelined ``tl.dot`` path loads whole steps with no mask at all). Scores and output come from
``tl.dot`` (G padded to >= 16 rows) or, for one query row, from float32 broadcast products
(``USE_DOT``); the next step's loads are issued by the kernel itself or left to Triton's pipeliner
(``PREFETCH``). An online softmax in float32 uses exp2 (log2(e) folded
into the scale). A split either is the whole sequence (writes ``out``) or a token range that
writes its max logit, sum of exp and self-normalised output. v1 picks its own splits to fill one wave of
resident programs, and the program that finishes a row group's splits last (an atomic count per group)
combines them into ``out`` in the same launch (``FUSED_REDUCE``: no second kernel, no second launch's host
time). v2 uses vLLM's 512-token partitions and buffers, which ``_reduce_kernel`` combines; where they leave
SMs idle it cuts each into sub-splits that ``_partition_reduce_kernel`` combines into the partition
outputs and reduces, in one launch.

Language: only what Triton 2.3 has (``tl.math.exp2``, ``tl.static_range``, ``.to()``, plain ``range``), and
Triton 2.3's typing: a Python scalar beside a bfloat16 tensor makes float32 there (zeros of its dtype instead).
Run on the H200 under Triton 2.3.1 too (results/nvidia-h200/triton231.json).
A sequence whose length exceeds ``max_seq_len`` or its block-table row, or that uses a block id
outside the cache, is never read out of bounds: its ``out`` becomes NaN.
"""

import os

import torch
import triton
import triton.language as tl

from . import configs
from .contract import PARTITION_SIZE
from .limits import DeviceLimits

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
FLT_MAX = 3.4028234663852886e38
EPSILON = 1e-6  # vLLM adds it to every sum it divides by
FP8_FORMATS = {"auto": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}


def _fix_interpreter():
    """Two bugs of Triton 3.x's interpreter (TRITON_INTERPRET=1, the CPU test path), fixed in place:
    it takes ``int()`` of a 1-element array for a runtime ``range`` bound, which NumPy >= 2.4 refuses;
    its ``tl.dot`` multiplies bfloat16 tiles as their raw uint16 storage; and it rounds float32 to
    bfloat16 toward zero where the GPU rounds to nearest even."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if patch is None or builder is None or getattr(patch, "biv100_fixed", False):
        return

    def patch_lang_tensor(tensor, *scope):  # Triton 3.0 passes the tensor class alone, later ones a scope too
        patch(tensor, *scope)
        index = lambda self: int(self.handle.data.reshape(-1)[0])  # noqa: E731
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    create_dot = builder.create_dot

    def create_dot_bf16(self, a, b, *rest):
        def widened(h):
            if h.dtype != tl.bfloat16:
                return h
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return create_dot(self, widened(a), widened(b), *rest)

    cast_impl = builder.cast_impl

    def cast_nearest_even(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    patch_lang_tensor.biv100_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    builder.create_dot = create_dot_bf16
    builder.cast_impl = cast_nearest_even


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter()


@triton.jit
def _decode_fp8(bits, FORMAT: tl.constexpr):
    """uint8 fp8 bit patterns -> float32 with integer arithmetic only (no fp8 hardware, no subnormal floats)."""
    b = bits.to(tl.int32) & 0xFF
    magnitude = b & 0x7F
    if FORMAT == 1:  # e4m3fn: bias 7, no infinities, 0x7F is NaN
        exponent = magnitude >> 3
        mantissa = magnitude & 0x7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
        value = tl.where(magnitude == 0x7F, float("nan"), value)
    else:  # e5m2: bias 15, exponent 31 is inf / NaN
        exponent = magnitude >> 2
        mantissa = magnitude & 0x3
        normal = (((exponent + 112) << 23) | (mantissa << 21)).to(tl.float32, bitcast=True)
        value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.0000152587890625, normal)
        value = tl.where(exponent == 31, tl.where(mantissa == 0, float("inf"), float("nan")), value)
    return tl.where(b >= 0x80, -value, value)


@triton.jit
def _step_ids(table_row, stride_bt1, first, end, offs_n, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block ids of the step at token ``first`` (0 past ``end``): a scalar when the step is one whole cache
    block, else one per token. Loaded a step ahead of their K and V: a K/V address that waits on a load of
    the same step leaves every step's latency exposed (and Triton's pipeliner single-buffered)."""
    if BLOCK_N == BLOCK_SIZE:
        ids = tl.load(table_row + (first // BLOCK_SIZE) * stride_bt1, mask=first < end, other=0)
    else:
        tokens = first + offs_n
        ids = tl.load(table_row + (tokens // BLOCK_SIZE) * stride_bt1, mask=tokens < end, other=0)
    return ids


@triton.jit
def _load_step(key_head, value_head, ids, first, end, num_blocks, key_offsets, key_ok, dims, dim_ok, offs_n,
               stride_k0, key_slot_stride, stride_v0, stride_v2, stride_v3,
               BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_PAD: tl.constexpr, X: tl.constexpr,
               CONTIGUOUS_SLOTS: tl.constexpr, UNMASKED: tl.constexpr, KEY_ROWS: tl.constexpr):
    """Issue the loads of the step at token ``first``: K [HEAD_PAD, BLOCK_N], V [BLOCK_N, HEAD_PAD] and the
    number of out-of-range block ids met. ``ids`` come from ``_step_ids``; a scalar id keeps V's rows
    contiguous (vector loads). Load masks are per step (a scalar) and per 8 dims only: a per-token mask would
    split every vector load; ``UNMASKED``: none (a whole step inside the sequence, head_size == HEAD_PAD).
    ``KEY_ROWS``: K is loaded in its memory order, [HEAD_PAD // X, BLOCK_N * X] (``key_offsets``, ``key_ok``
    per row), and permuted to [HEAD_PAD, BLOCK_N] in registers (Triton >= 3: ``tl.permute``). Unused slots
    and bad ids read block 0 (in bounds); the caller masks them."""
    step_ok = (first < end) & (num_blocks > 0)
    if BLOCK_N == BLOCK_SIZE:
        block_bad = (first < end) & ((ids < 0) | (ids >= num_blocks))
        bad = block_bad.to(tl.int32)
        safe_id = tl.where(block_bad, 0, ids).to(tl.int64)
        if KEY_ROWS:
            key_ptrs = key_head + safe_id * stride_k0 + key_offsets
        else:
            key_ptrs = key_head + safe_id * stride_k0 + key_offsets[:, None] + offs_n[None, :] * key_slot_stride
        value_ptrs = value_head + safe_id * stride_v0 + offs_n[:, None] * stride_v3 + dims[None, :] * stride_v2
    else:  # a step spans several cache blocks (block_size 8) or part of one (a smaller tile)
        tokens = first + offs_n
        ids_bad = (tokens < end) & ((ids < 0) | (ids >= num_blocks))
        bad = tl.sum(ids_bad.to(tl.int32), axis=0)
        safe_ids = tl.where(ids_bad, 0, ids).to(tl.int64)
        slots = tokens % BLOCK_SIZE
        key_ptrs = key_head + safe_ids[None, :] * stride_k0 + key_offsets[:, None] + slots[None, :] * key_slot_stride
        value_rows = safe_ids * stride_v0 + slots * stride_v3
        if CONTIGUOUS_SLOTS:  # tell the compiler V's rows come in aligned runs (one block, or the step): vector loads
            if BLOCK_N >= BLOCK_SIZE:
                value_rows = tl.max_contiguous(tl.multiple_of(value_rows, BLOCK_SIZE), BLOCK_SIZE)
            else:
                value_rows = tl.max_contiguous(tl.multiple_of(value_rows, BLOCK_N), BLOCK_N)
        value_ptrs = value_head + value_rows[:, None] + dims[None, :] * stride_v2
    if UNMASKED:
        k = tl.load(key_ptrs)
        v = tl.load(value_ptrs)
    else:
        k = tl.load(key_ptrs, mask=key_ok[:, None] & step_ok, other=0)
        v = tl.load(value_ptrs, mask=dim_ok[None, :] & step_ok, other=0)
    if KEY_ROWS:  # [group, (token, e)] -> [(group, e), token] = [dims, tokens]
        k = tl.reshape(tl.permute(tl.reshape(k, (HEAD_PAD // X, BLOCK_N, X)), (0, 2, 1)), (HEAD_PAD, BLOCK_N))
    return k, v, bad


@triton.jit
def _attend_step(q, k, v, tokens, end, m_i, l_i, acc, qk_scale, seq_len, slopes, sparse_offset, query_sparse_block,
                 sparse_block_size, sparse_vert_stride, sparse_local_blocks, KV_FORMAT: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, IS_SPARSE: tl.constexpr, USE_DOT: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over K [HEAD_PAD, BLOCK_N] and V [BLOCK_N, HEAD_PAD] at ``tokens``: the new
    (m_i, l_i, acc). ``q`` is the dot operand (float32 for broadcast products). ``MASKED``: some tokens are
    at or past ``end``: their logits are -inf and their V rows zero (unused slots may hold NaN, and 0 * NaN
    would reach the output)."""
    if MASKED:
        token_ok = tokens < end
        v = tl.where(token_ok[:, None], v, tl.zeros(v.shape, v.dtype))  # a scalar 0 made bfloat16 float32 in 2.3
    if KV_FORMAT != 0:
        k = _decode_fp8(k, KV_FORMAT).to(q.dtype)
        v = _decode_fp8(v, KV_FORMAT).to(q.dtype)
    if USE_DOT:
        logits = tl.dot(q, k, allow_tf32=False) * qk_scale  # [HEADS_BLOCK, BLOCK_N], log2 units
    else:  # few query rows: broadcast products in float32 beat a 16-row padded tl.dot
        logits = tl.sum(q[:, :, None] * k.to(tl.float32)[None, :, :], axis=1) * qk_scale
    if HAS_ALIBI:
        logits += slopes[:, None] * (tokens - seq_len + 1).to(tl.float32)[None, :]
    if IS_SPARSE:  # vLLM's rule: skipped blocks get logit -FLT_MAX and add no V
        key_sparse_block = tokens // sparse_block_size
        keep = ((key_sparse_block[None, :] + sparse_offset[:, None]) % sparse_vert_stride == 0) \
            | (key_sparse_block[None, :] > query_sparse_block - sparse_local_blocks)
        logits = tl.where(keep, logits, -3.4028234663852886e38)
    if MASKED:
        logits = tl.where(token_ok[None, :], logits, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IS_SPARSE:
        p = tl.where(keep, p, 0.0)
    if USE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, allow_tf32=False)
    else:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_new, l_i, acc


@triton.jit
def _combine_splits(out_ptr, stride_o0, stride_o1, stride_o2, tmp_ptr, stride_t0, stride_t1, stride_t2, stride_t3,
                    exp_sums_ptr, stride_e0, stride_e1, stride_e2, max_logits_ptr, stride_m0, stride_m1, stride_m2,
                    seq, first_head, group_rows, used, seq_bad, head_size,
                    HEAD_PAD: tl.constexpr, COMBINE_ROWS: tl.constexpr, COMBINE_SPLITS: tl.constexpr):
    """v1's reduce in the program that finished its rows' splits last (``FUSED_REDUCE``): the ``used`` split
    outputs of the ``group_rows`` query heads from ``first_head`` on, combined into ``out`` as
    ``_reduce_kernel`` combines them (the result does not depend on which program came last). Tiles of
    [COMBINE_SPLITS splits, COMBINE_ROWS heads, HEAD_PAD], one load each: the group's real heads, not the
    HEADS_BLOCK rows tl.dot pads them to (16 padded rows of 8 splits spilled registers and cost 5-8 us), and
    one tile, not a loop unrolled per split (which made the kernel 2-3x slower to compile). Loads bypass L1
    (``.cg``): the splits were written by other multiprocessors."""
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < head_size
    for row0 in range(0, group_rows, COMBINE_ROWS):
        rows = row0 + tl.arange(0, COMBINE_ROWS)
        row_ok = rows < group_rows
        heads = first_head + rows
        max_rows = max_logits_ptr + seq * stride_m0 + heads * stride_m1
        sum_rows = exp_sums_ptr + seq * stride_e0 + heads * stride_e1
        tmp_rows = tmp_ptr + seq.to(tl.int64) * stride_t0 + heads[:, None] * stride_t1 + dims[None, :] * stride_t3
        top = tl.zeros([COMBINE_ROWS], dtype=tl.float32) - float("inf")
        total = tl.zeros([COMBINE_ROWS], dtype=tl.float32)
        acc = tl.zeros([COMBINE_ROWS, HEAD_PAD], dtype=tl.float32)
        nan_splits = tl.zeros([COMBINE_ROWS], dtype=tl.int32)
        for first in range(0, used, COMBINE_SPLITS):
            splits = first + tl.arange(0, COMBINE_SPLITS)
            ok = (splits < used)[:, None] & row_ok[None, :]
            part_max = tl.load(max_rows[None, :] + splits[:, None] * stride_m2, mask=ok, other=float("-inf"),
                               cache_modifier=".cg")
            part_sum = tl.load(sum_rows[None, :] + splits[:, None] * stride_e2, mask=ok, other=0.0,
                               cache_modifier=".cg")
            part_out = tl.load(tmp_rows[None, :, :] + splits[:, None, None] * stride_t2,
                               mask=ok[:, :, None] & dim_ok[None, None, :], other=0.0, cache_modifier=".cg")
            is_nan = part_max != part_max
            nan_splits += tl.sum(is_nan.to(tl.int32), axis=0)
            new_top = tl.maximum(top, tl.max(tl.where(is_nan, float("-inf"), part_max), axis=0))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # (no -inf - -inf)
            rescale = tl.math.exp2((top - shift) * 1.4426950408889634)
            weight = part_sum * tl.math.exp2((part_max - shift[None, :]) * 1.4426950408889634)
            weight = tl.where(used == 1, tl.where(ok, 1.0, 0.0), weight)
            acc = acc * rescale[:, None] + tl.sum(part_out * weight[:, :, None], axis=0)
            total = total * rescale + tl.sum(weight, axis=0)
            top = new_top
        denominator = tl.where(used == 1, 1.0, total + 1e-6)
        result = tl.where(seq_bad | (nan_splits > 0)[:, None], float("nan"), acc / denominator[:, None])
        tl.store(out_ptr + seq.to(tl.int64) * stride_o0 + heads[:, None] * stride_o1 + dims[None, :] * stride_o2,
                 result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_blocks", "table_columns", "max_seq_len", "tokens_per_split", "num_splits",
                              "tp_rank", "sparse_local_blocks", "sparse_vert_stride", "sparse_block_size",
                              "sparse_sliding_step"])
def _attention_kernel(
    out_ptr, stride_o0, stride_o1, stride_o2,
    tmp_ptr, stride_t0, stride_t1, stride_t2, stride_t3,
    exp_sums_ptr, stride_e0, stride_e1, stride_e2,
    max_logits_ptr, stride_m0, stride_m1, stride_m2,
    counters_ptr,
    query_ptr, stride_q0, stride_q1, stride_q2,
    key_ptr, stride_k0, stride_k1, stride_k2, stride_k3, stride_k4,
    value_ptr, stride_v0, stride_v1, stride_v2, stride_v3,
    block_tables_ptr, stride_bt0, stride_bt1,
    seq_lens_ptr, alibi_ptr, k_scale, v_scale,
    scale_log2, head_size, queries_per_kv, head_chunks, num_blocks, table_columns, max_seq_len,
    tokens_per_split, num_splits, tp_rank, num_heads, num_kv_heads, sparse_local_blocks, sparse_vert_stride,
    sparse_block_size, sparse_sliding_step,
    HEADS_BLOCK: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    X: tl.constexpr, KV_FORMAT: tl.constexpr, SCALES_IN_MEMORY: tl.constexpr, HAS_ALIBI: tl.constexpr,
    IS_SPARSE: tl.constexpr, PARTIAL: tl.constexpr, FUSED_REDUCE: tl.constexpr, CONTIGUOUS_SLOTS: tl.constexpr,
    USE_DOT: tl.constexpr,
    PREFETCH: tl.constexpr, UNMASKED_STEPS: tl.constexpr, KEY_ROWS: tl.constexpr, COMBINE_ROWS: tl.constexpr,
    COMBINE_SPLITS: tl.constexpr,
):
    """Grid (num_kv_heads * head_chunks, num_seqs, num_splits); split s covers tokens
    [s * tokens_per_split, (s + 1) * tokens_per_split) of its sequence. Head sizes are runtime values
    (a multiple of 8, padded to HEAD_PAD): one compiled kernel serves 80 ... 128. ``UNMASKED_STEPS``
    (head_size == HEAD_PAD, Triton's pipeliner): whole steps load without masks."""
    kv_head = tl.program_id(0) // head_chunks
    chunk = tl.program_id(0) % head_chunks
    head_size = tl.multiple_of(head_size, 8)
    seq = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    seq_bad = (seq_len < 0) | (seq_len > max_seq_len) | (seq_len > table_columns * BLOCK_SIZE)
    usable_len = tl.where(seq_bad, 0, seq_len)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, usable_len)

    rows = chunk * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    row_ok = rows < queries_per_kv
    heads = kv_head * queries_per_kv + rows
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = (dims // 8) < (head_size // 8)  # = dims < head_size, constant over runs of 8 (vector loads)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(query_ptr + seq.to(tl.int64) * stride_q0 + heads[:, None] * stride_q1 + dims[None, :] * stride_q2,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    if SCALES_IN_MEMORY:
        k_factor = tl.load(k_scale)
        v_factor = tl.load(v_scale)
    else:
        k_factor = k_scale
        v_factor = v_scale
    if KV_FORMAT == 0:  # vLLM ignores the scales for unquantised caches
        qk_scale = scale_log2
    else:
        qk_scale = scale_log2 * k_factor  # k * k_scale folded into the logit scale: no extra rounding
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=row_ok, other=0.0) * 1.4426950408889634
    if IS_SPARSE:
        # vLLM's head offset: per query head for a step >= 0, per kv head otherwise (no runtime branch)
        sparse_offset = tl.where(sparse_sliding_step >= 0,
                                 (tp_rank * num_heads + heads) * sparse_sliding_step + 1,
                                 (tp_rank * num_kv_heads + kv_head) * (-sparse_sliding_step) + 1)
        query_sparse_block = (seq_len - 1) // sparse_block_size

    key_head = key_ptr + kv_head.to(tl.int64) * stride_k1
    value_head = value_ptr + kv_head.to(tl.int64) * stride_v1
    # vLLM's layout has K's slots X apart: a constexpr stride lets the compiler prove 16-byte runs (vector
    # loads); a runtime stride of 8 carries no divisibility and every K element became its own 2-byte load.
    if CONTIGUOUS_SLOTS:
        key_slot_stride = X
    else:
        key_slot_stride = stride_k3
    if KEY_ROWS:
        # One row per X dims, its BLOCK_N * X elements contiguous: 8 consecutive lanes of a 16-byte
        # async copy then read and write 128 contiguous bytes. Loaded as [dims, tokens], 8 lanes
        # spanned 8 rows 256 bytes apart: twice the L2 sectors and 7.6x the shared-memory wavefronts.
        key_groups = tl.arange(0, HEAD_PAD // X)
        key_ok = key_groups < head_size // X
        key_offsets = key_groups[:, None] * stride_k2 + tl.arange(0, BLOCK_N * X)[None, :]
    else:
        key_ok = dim_ok
        key_offsets = (dims // X) * stride_k2 + (dims % X) * stride_k4
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt0

    m_i = tl.zeros([HEADS_BLOCK], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([HEADS_BLOCK], dtype=tl.float32)
    acc = tl.zeros([HEADS_BLOCK, HEAD_PAD], dtype=tl.float32)
    if not USE_DOT:
        q = q.to(tl.float32)
    if not HAS_ALIBI:
        slopes = 0.0
    if not IS_SPARSE:
        sparse_offset = 0
        query_sparse_block = 0
    # Whole steps run unmasked; the last, partial step (if any) masks its tokens: the main loop's V goes
    # from memory to the dot operand without a select in between.
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    if UNMASKED_STEPS:  # an empty cache has no block 0 to read: there every step stays masked
        full_end = tl.where(num_blocks > 0, full_end, start)
    bad_blocks = 0
    ids = _step_ids(table_row, stride_bt1, start, end, offs_n, BLOCK_SIZE, BLOCK_N)
    if PREFETCH:
        # Software pipelining by hand (for GPUs without async copies): the next step's K and V are in
        # flight while this step computes, the block ids two steps ahead.
        k, v, bad_blocks = _load_step(key_head, value_head, ids, start, end, num_blocks, key_offsets, key_ok, dims,
                                      dim_ok, offs_n, stride_k0, key_slot_stride, stride_v0, stride_v2, stride_v3,
                                      BLOCK_SIZE, BLOCK_N, HEAD_PAD, X, CONTIGUOUS_SLOTS, False, KEY_ROWS)
        ids = _step_ids(table_row, stride_bt1, start + BLOCK_N, end, offs_n, BLOCK_SIZE, BLOCK_N)
    for first in range(start, full_end, BLOCK_N):
        if PREFETCH:
            k_next, v_next, bad_next = _load_step(key_head, value_head, ids, first + BLOCK_N, end, num_blocks,
                                                  key_offsets, key_ok, dims, dim_ok, offs_n, stride_k0,
                                                  key_slot_stride, stride_v0, stride_v2, stride_v3, BLOCK_SIZE,
                                                  BLOCK_N, HEAD_PAD, X, CONTIGUOUS_SLOTS, False, KEY_ROWS)
            ids = _step_ids(table_row, stride_bt1, first + 2 * BLOCK_N, end, offs_n, BLOCK_SIZE, BLOCK_N)
        else:  # Triton's pipeliner (num_stages > 1) overlaps the loads where the GPU has async copies
            k, v, bad_step = _load_step(key_head, value_head, ids, first, end, num_blocks, key_offsets, key_ok, dims,
                                        dim_ok, offs_n, stride_k0, key_slot_stride, stride_v0, stride_v2, stride_v3,
                                        BLOCK_SIZE, BLOCK_N, HEAD_PAD, X, CONTIGUOUS_SLOTS, UNMASKED_STEPS, KEY_ROWS)
            ids = _step_ids(table_row, stride_bt1, first + BLOCK_N, end, offs_n, BLOCK_SIZE, BLOCK_N)
            bad_blocks += bad_step
        m_i, l_i, acc = _attend_step(q, k, v, first + offs_n, end, m_i, l_i, acc, qk_scale, seq_len, slopes,
                                     sparse_offset, query_sparse_block, sparse_block_size, sparse_vert_stride,
                                     sparse_local_blocks, KV_FORMAT, HAS_ALIBI, IS_SPARSE, USE_DOT, False)
        if PREFETCH:
            bad_blocks += bad_next
            k = k_next
            v = v_next
    if full_end < end:
        if not PREFETCH:  # (the prefetching loop has already loaded this step)
            k, v, bad_step = _load_step(key_head, value_head, ids, full_end, end, num_blocks, key_offsets, key_ok,
                                        dims, dim_ok, offs_n, stride_k0, key_slot_stride, stride_v0, stride_v2,
                                        stride_v3, BLOCK_SIZE, BLOCK_N, HEAD_PAD, X, CONTIGUOUS_SLOTS, False, KEY_ROWS)
            bad_blocks += bad_step
        m_i, l_i, acc = _attend_step(q, k, v, full_end + offs_n, end, m_i, l_i, acc, qk_scale, seq_len, slopes,
                                     sparse_offset, query_sparse_block, sparse_block_size, sparse_vert_stride,
                                     sparse_local_blocks, KV_FORMAT, HAS_ALIBI, IS_SPARSE, USE_DOT, True)

    if KV_FORMAT != 0:
        acc = acc * v_factor
    result = acc / (l_i[:, None] + 1e-6)
    broken = seq_bad | (bad_blocks > 0)
    result = tl.where(broken, float("nan"), result)
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if PARTIAL:  # only splits that hold tokens write (vLLM leaves the others untouched)
        written = start < tl.maximum(seq_len, 0)
        tmp_ptrs = tmp_ptr + seq.to(tl.int64) * stride_t0 + heads[:, None] * stride_t1 + split * stride_t2 \
            + dims[None, :] * stride_t3
        tl.store(tmp_ptrs, result.to(tmp_ptr.dtype.element_ty), mask=out_mask & written)
        max_logit = tl.where(m_i <= -3.4028234663852886e38, -3.4028234663852886e38, m_i * 0.6931471805599453)
        max_logit = tl.where(broken, float("nan"), max_logit)
        exp_sum = tl.where(broken, float("nan"), l_i)
        tl.store(max_logits_ptr + seq * stride_m0 + heads * stride_m1 + split * stride_m2, max_logit,
                 mask=row_ok & written)
        tl.store(exp_sums_ptr + seq * stride_e0 + heads * stride_e1 + split * stride_e2, exp_sum,
                 mask=row_ok & written)
        if FUSED_REDUCE:  # v1: the last of this row group's splits to finish reduces them into out
            tl.debug_barrier()  # every thread's split stores come before the count (the atomic releases them)
            counter = counters_ptr + seq * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(counter, 1) == num_splits - 1:
                tl.store(counter, 0)  # the next launch counts from 0
                used = tl.minimum((usable_len + tokens_per_split - 1) // tokens_per_split, num_splits)
                _combine_splits(out_ptr, stride_o0, stride_o1, stride_o2, tmp_ptr, stride_t0, stride_t1, stride_t2,
                                stride_t3, exp_sums_ptr, stride_e0, stride_e1, stride_e2, max_logits_ptr, stride_m0,
                                stride_m1, stride_m2, seq, kv_head * queries_per_kv + chunk * HEADS_BLOCK,
                                tl.minimum(queries_per_kv - chunk * HEADS_BLOCK, HEADS_BLOCK), used, seq_bad,
                                head_size, HEAD_PAD, COMBINE_ROWS, COMBINE_SPLITS)
    else:
        out_ptrs = out_ptr + seq.to(tl.int64) * stride_o0 + heads[:, None] * stride_o1 + dims[None, :] * stride_o2
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["table_columns", "max_seq_len", "tokens_per_split", "num_splits"])
def _reduce_kernel(
    out_ptr, stride_o0, stride_o1, stride_o2,
    tmp_ptr, stride_t0, stride_t1, stride_t2, stride_t3,
    exp_sums_ptr, stride_e0, stride_e1, stride_e2,
    max_logits_ptr, stride_m0, stride_m1, stride_m2,
    seq_lens_ptr, head_size, block_size, table_columns, max_seq_len, tokens_per_split, num_splits,
    SPLITS_BLOCK: tl.constexpr, DIMS_BLOCK: tl.constexpr,
):
    """Grid (num_seqs, num_heads, dim chunks of DIMS_BLOCK): out = sum_p tmp_p * w_p / (sum_p w_p + 1e-6),
    w_p = exp_sum_p * exp(max_p - max), over the splits that hold tokens only; a single split is copied.
    A split that met a bad block (NaN) makes the head's out and all its written splits NaN. One pass of
    SPLITS_BLOCK splits per load (usually all of them), the statistics and outputs loaded together and
    rescaled to the running max: one round of loads after seq_lens, not a max pass and then a sum pass."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dim_chunk = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    seq_bad = (seq_len < 0) | (seq_len > max_seq_len) | (seq_len > table_columns * block_size)
    used = tl.minimum((tl.where(seq_bad, 0, seq_len) + tokens_per_split - 1) // tokens_per_split, num_splits)

    splits = tl.arange(0, SPLITS_BLOCK)
    dims = dim_chunk * DIMS_BLOCK + tl.arange(0, DIMS_BLOCK)
    dim_ok = dims < head_size
    max_row = max_logits_ptr + seq * stride_m0 + head * stride_m1
    sum_row = exp_sums_ptr + seq * stride_e0 + head * stride_e1
    tmp_row = tmp_ptr + seq.to(tl.int64) * stride_t0 + head * stride_t1

    top = float("-inf")  # the running max over the splits seen; acc and total are relative to it
    acc = tl.zeros([DIMS_BLOCK], dtype=tl.float32)
    total = 0.0
    nan_splits = 0
    for first in range(0, used, SPLITS_BLOCK):
        part = first + splits
        part_ok = part < used
        part_max = tl.load(max_row + part * stride_m2, mask=part_ok, other=float("-inf"))
        part_sum = tl.load(sum_row + part * stride_e2, mask=part_ok, other=0.0)
        part_out = tl.load(tmp_row + part[:, None] * stride_t2 + dims[None, :] * stride_t3,
                           mask=part_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        nan_splits += tl.sum((part_max != part_max).to(tl.int32), axis=0)
        new_top = tl.maximum(top, tl.max(tl.where(part_max != part_max, float("-inf"), part_max), axis=0))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # (no -inf - -inf)
        rescale = tl.math.exp2((top - shift) * 1.4426950408889634)
        weight = tl.where(part_ok, part_sum * tl.math.exp2((part_max - shift) * 1.4426950408889634), 0.0)
        weight = tl.where(used == 1, tl.where(part_ok, 1.0, 0.0), weight)
        acc = acc * rescale + tl.sum(part_out * weight[:, None], axis=0)
        total = total * rescale + tl.sum(weight, axis=0)
        top = new_top
    broken = seq_bad | (nan_splits > 0)
    denominator = tl.where(used == 1, 1.0, total + 1e-6)
    result = tl.where(broken, float("nan"), acc / denominator)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o0 + head * stride_o1 + dims * stride_o2,
             result.to(out_ptr.dtype.element_ty), mask=dim_ok)
    # A broken head's written splits become NaN (no pass at all otherwise); one program per head marks the
    # statistics.
    nan_block = tl.zeros([SPLITS_BLOCK], dtype=tl.float32) + float("nan")
    first_chunk = dim_chunk == 0
    for first in range(0, tl.where(broken, used, 0), SPLITS_BLOCK):
        part = first + splits
        part_ok = part < used
        tl.store(max_row + part * stride_m2, nan_block, mask=part_ok & first_chunk)
        tl.store(sum_row + part * stride_e2, nan_block, mask=part_ok & first_chunk)
        tl.store(tmp_row + part[:, None] * stride_t2 + dims[None, :] * stride_t3,
                 (nan_block[:, None] + tl.zeros([DIMS_BLOCK], dtype=tl.float32)[None, :]).to(tmp_ptr.dtype.element_ty),
                 mask=part_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["table_columns", "max_seq_len", "sub_tokens", "partitions"])
def _partition_reduce_kernel(
    out_ptr, stride_o0, stride_o1, stride_o2,
    tmp_ptr, stride_t0, stride_t1, stride_t2, stride_t3,
    exp_sums_ptr, stride_e0, stride_e1, stride_e2,
    max_logits_ptr, stride_m0, stride_m1, stride_m2,
    sub_tmp_ptr, stride_st0, stride_st1, stride_st2, stride_st3,
    sub_sums_ptr, stride_se0, stride_se1, stride_se2,
    sub_max_ptr, stride_sm0, stride_sm1, stride_sm2,
    seq_lens_ptr, head_size, block_size, table_columns, max_seq_len, sub_tokens, partitions,
    SUBS: tl.constexpr, PARTS_BLOCK: tl.constexpr, DIMS_BLOCK: tl.constexpr,
):
    """Grid (num_seqs, num_heads, dim chunks of DIMS_BLOCK): v2 from sub-splits in one kernel. First
    vLLM's partition outputs from the SUBS sub-splits the attention kernel wrote for each partition
    (max = max_s max_s, w_s = exp_sum_s * exp(max_s - max), exp_sum = sum_s w_s, tmp_out = sum_s out_s
    * w_s / (exp_sum + 1e-6); a NaN sub-split makes its partition NaN), written where the partition
    holds tokens; then ``_reduce_kernel``'s combination of those partitions (from tmp_out as stored, in
    the query dtype, as vLLM's reduce reads it) into ``out``. All partitions at once, in [PARTS_BLOCK,
    DIMS_BLOCK] tiles, one per sub-split: a launch fewer than a partition kernel followed by the reduce."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    dim_chunk = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    seq_bad = (seq_len < 0) | (seq_len > max_seq_len) | (seq_len > table_columns * block_size)
    written_len = tl.maximum(seq_len, 0)
    parts = tl.arange(0, PARTS_BLOCK)
    in_grid = parts < partitions
    subs = parts[:, None] * SUBS + tl.arange(0, SUBS)[None, :]
    sub_ok = (subs * sub_tokens < written_len) & in_grid[:, None]  # the sub-splits the attention kernel wrote
    written = (parts * SUBS * sub_tokens < written_len) & in_grid
    dims = dim_chunk * DIMS_BLOCK + tl.arange(0, DIMS_BLOCK)
    dim_ok = dims < head_size

    sub_max = tl.load(sub_max_ptr + seq * stride_sm0 + head * stride_sm1 + subs * stride_sm2, mask=sub_ok,
                      other=float("-inf"))
    sub_sum = tl.load(sub_sums_ptr + seq * stride_se0 + head * stride_se1 + subs * stride_se2, mask=sub_ok,
                      other=0.0)
    part_broken = tl.sum((sub_max != sub_max).to(tl.int32), axis=1) > 0
    part_top = tl.max(tl.where(sub_max != sub_max, float("-inf"), sub_max), axis=1)
    shift = tl.where(part_top == float("-inf"), 0.0, part_top)  # (no -inf - -inf for empty partitions)
    weight = tl.where(sub_ok, sub_sum * tl.math.exp2((sub_max - shift[:, None]) * 1.4426950408889634), 0.0)
    part_total = tl.sum(weight, axis=1)
    # One sub-split column at a time: Triton 2.3.1's compiler aborted on a [parts, subs, dims] tile (H200).
    part_out = tl.zeros([PARTS_BLOCK, DIMS_BLOCK], dtype=tl.float32)
    for sub in tl.static_range(SUBS):
        column = parts * SUBS + sub
        column_ok = (column * sub_tokens < written_len) & in_grid
        column_max = tl.load(sub_max_ptr + seq * stride_sm0 + head * stride_sm1 + column * stride_sm2,
                             mask=column_ok, other=float("-inf"))
        column_sum = tl.load(sub_sums_ptr + seq * stride_se0 + head * stride_se1 + column * stride_se2,
                             mask=column_ok, other=0.0)
        column_weight = tl.where(column_ok, column_sum * tl.math.exp2((column_max - shift) * 1.4426950408889634),
                                 0.0)
        column_out = tl.load(sub_tmp_ptr + seq.to(tl.int64) * stride_st0 + head * stride_st1
                             + column[:, None] * stride_st2 + dims[None, :] * stride_st3,
                             mask=column_ok[:, None] & dim_ok[None, :], other=0.0)
        part_out += column_out * column_weight[:, None]
    part_out = part_out / (part_total[:, None] + 1e-6)
    part_out = tl.where(part_broken[:, None], float("nan"), part_out)
    part_max = tl.where(part_broken, float("nan"), part_top)
    part_sum = tl.where(part_broken, float("nan"), part_total)

    # The reduce over the partitions that hold tokens, as _reduce_kernel does it.
    usable_len = tl.where(seq_bad, 0, seq_len)
    used = tl.minimum((usable_len + SUBS * sub_tokens - 1) // (SUBS * sub_tokens), partitions)
    part_ok = parts < used
    broken = seq_bad | (tl.sum((part_ok & part_broken).to(tl.int32), axis=0) > 0)
    top = tl.max(tl.where(part_ok & (part_max == part_max), part_max, float("-inf")), axis=0)
    stored = tl.where(part_ok[:, None], part_out.to(tmp_ptr.dtype.element_ty).to(tl.float32), 0.0)
    top = tl.where(top == float("-inf"), 0.0, top)
    part_weight = tl.where(part_ok, part_sum * tl.math.exp2((part_max - top) * 1.4426950408889634), 0.0)
    part_weight = tl.where(used == 1, tl.where(part_ok, 1.0, 0.0), part_weight)
    denominator = tl.where(used == 1, 1.0, tl.sum(part_weight, axis=0) + 1e-6)
    result = tl.sum(stored * part_weight[:, None], axis=0) / denominator
    result = tl.where(broken, float("nan"), result)

    kill = broken & part_ok  # a broken head's used partitions all become NaN (as _reduce_kernel marks them)
    tl.store(tmp_ptr + seq.to(tl.int64) * stride_t0 + head * stride_t1 + parts[:, None] * stride_t2
             + dims[None, :] * stride_t3, tl.where(kill[:, None], float("nan"), part_out).to(tmp_ptr.dtype.element_ty),
             mask=written[:, None] & dim_ok[None, :])
    stats_mask = written & (dim_chunk == 0)  # one program per head writes the head's statistics
    tl.store(exp_sums_ptr + seq * stride_e0 + head * stride_e1 + parts * stride_e2,
             tl.where(kill, float("nan"), part_sum), mask=stats_mask)
    tl.store(max_logits_ptr + seq * stride_m0 + head * stride_m1 + parts * stride_m2,
             tl.where(kill, float("nan"), part_max), mask=stats_mask)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o0 + head * stride_o1 + dims * stride_o2,
             result.to(out_ptr.dtype.element_ty), mask=dim_ok)


class _Launcher:
    """One kernel's launches. Pointer arguments come as raw addresses, their tensors beside them (in the
    order of the kernel's ``*_ptr`` parameters). The first launch of a specialisation goes through
    Triton's JIT (compile or cache) with the tensors put back; later ones call the compiled kernel's
    launcher directly with the addresses, which skips re-binding and re-specialising ~60 arguments and a
    driver pointer query per tensor: most of a decode call's host time (Triton's JIT path took 54-72 us
    a call under 3.6 and 291 us under 2.3.1 on the H200's hosts). The caller's key must hold everything
    Triton specialises on that can change between calls (strides, pointer alignment); the per-call integers
    are ``do_not_specialize``. Launchers of other Triton versions, and the interpreter, always take the JIT
    path; so does a kernel whose launcher refuses the direct call's arguments (a vendor build laid out
    otherwise), from its first refusal on."""

    def __init__(self, fn):
        self.fn = fn
        self.pointer_positions = tuple(i for i, name in enumerate(fn.arg_names) if name.endswith("_ptr"))
        self.kernels = {}
        self.last = (None, None)  # (key, launch) of the last direct launch: decode steps repeat it
        self.direct = _DIRECT_LAUNCH

    def __call__(self, key, grid, device, args, tensors, make_constants):
        last_key, launch = self.last
        if key != last_key:  # tuple equality: cheaper than hashing the ~30 strides in the key
            launch = self.kernels.get(key)
            if launch is not None:
                if not self._launch_checked(launch, grid, device, args):
                    return self._jit(key, grid, args, tensors, make_constants)
                self.last = (key, launch)
                return
        if launch is not None:
            entry, before_stream, after_stream, tail = launch
            entry(grid[0], grid[1], grid[2], *before_stream, _current_stream(device.index), *after_stream, *args,
                  *tail)
            return
        self._jit(key, grid, args, tensors, make_constants)

    def _launch_checked(self, launch, grid, device, args):
        """A direct launch after a change of key (a specialisation's first included); False, and the JIT from
        then on, where the launcher refuses it. Argument parsing comes before the launch: a refusal launched
        nothing."""
        entry, before_stream, after_stream, tail = launch
        try:
            entry(grid[0], grid[1], grid[2], *before_stream, _current_stream(device.index), *after_stream, *args,
                  *tail)
        except (TypeError, SystemError, OverflowError):
            self.direct = False
            self.kernels.clear()
            self.last = (None, None)
            return False
        return True

    def _jit(self, key, grid, args, tensors, make_constants):
        args = list(args)
        for position, tensor in zip(self.pointer_positions, tensors):
            args[position] = tensor
        constants = make_constants()
        kernel = self.fn[grid](*args, **constants)
        if self.direct:
            launch = _direct_entry(kernel, constants, self.fn.arg_names[len(args):])
            if launch is not None:
                self.kernels[key] = launch


def _direct_entry(kernel, constants, constexpr_names):
    """(callable, its arguments before the stream, after it, after the kernel's own) for a compiled kernel,
    on the Triton versions whose launchers these layouts were checked against; None elsewhere.

    Triton 3.6, where the kernel needs no scratch memory: the C launch function that ``kernel.run`` wraps
    (about 1.7 us less per launch than ``kernel.run``: a Python frame, a closure and two allocator calls).
    Other 3.x: ``kernel.run``. Triton 2.3 (the BI-V100's 2.3.1; TMA descriptors excluded): its launcher, as
    its JIT calls it, with the non-constexpr arguments only."""
    if _TRITON_VERSION >= (3, 0):
        if not (hasattr(kernel, "packed_metadata") and hasattr(kernel, "function")):
            return None
        tail = tuple(constants[name] for name in constexpr_names)
        run = kernel.run
        launch = getattr(run, "launch", None)
        if (_BARE_LAUNCH and callable(launch) and getattr(run, "global_scratch_size", None) == 0
                and getattr(run, "profile_scratch_size", None) == 0 and hasattr(run, "launch_cooperative_grid")
                and hasattr(run, "launch_pdl")):
            # launch(grid x, y, z, stream, function, cooperative grid, PDL, global scratch, profile scratch,
            #        metadata, launch metadata, enter hook, exit hook, *arguments)
            return launch, (), (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                                kernel.packed_metadata, None, None, None), tail
        return run, (), (kernel.function, kernel.packed_metadata, None, None, None), tail
    cluster = getattr(kernel, "cluster_dims", None)
    if getattr(kernel, "tensormaps_info", None) or cluster is None or len(cluster) != 3:
        return None
    # run(grid x, y, z, num_warps, num_ctas, cluster x, y, z, shared, stream, function, enter hook, exit hook,
    #     compiled kernel, *arguments)
    run = kernel.run  # (reading it loads the binary onto the device once)
    return run, (kernel.num_warps, kernel.num_ctas, *cluster, kernel.shared), (kernel.function, None, None,
                                                                                  kernel), ()


_TRITON_VERSION = configs.triton_version()
_DIRECT_LAUNCH = (_TRITON_VERSION >= (3, 0) or _TRITON_VERSION == (2, 3)) and hasattr(torch._C,
                                                                                  "_cuda_getCurrentRawStream")
_BARE_LAUNCH = _DIRECT_LAUNCH and _TRITON_VERSION == (3, 6)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_attention = _Launcher(_attention_kernel)
_reduce = _Launcher(_reduce_kernel)
_partition_reduce = _Launcher(_partition_reduce_kernel)


def _scale_argument(value, device):
    """Floats go by value; device tensors by pointer (no host sync); a CPU tensor is read on the host."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value, True
        return float(value.item()), False
    return float(value), False


class VariantExcluded(RuntimeError):
    """A call whose kernel variant the probe found wrong on this device (raised before anything is written)."""


def make_forward(limits=None, excluded=()):
    """``forward(call: contract.DecodeCall) -> None`` for the Triton backend.

    ``limits`` (``limits.DeviceLimits``) bounds the configs; left out, each device's limits are measured at
    its first call (CPU tensors under ``TRITON_INTERPRET=1`` use ``configs.INTERPRETER_LIMITS``). Launch
    decisions are cached per call shape (not per max_seq_len, which changes every decode step).
    ``excluded``: ``configs.attention_key`` lists of variants the probe found wrong; a call that would run one
    raises ``VariantExcluded`` (the patch then routes its shape to the PyTorch backend).
    """
    plans = {}
    device_limits = {}
    excluded = {tuple(key) for key in excluded}

    def limits_for(device):
        found = device_limits.get(device)
        if found is None:
            if limits is not None:
                found = limits
            elif device.type == "cpu":
                found = configs.INTERPRETER_LIMITS
            else:
                found = DeviceLimits.from_torch_device(device)
            device_limits[device] = found
        return found

    def forward(call):
        if call.num_seqs == 0:
            return
        key = (call.device, call.query.dtype, call.head_size, call.block_size, call.kv_cache_dtype, call.num_heads,
               call.num_kv_heads, call.num_seqs, call.exp_sums is not None, call.alibi_slopes is not None,
               call.blocksparse is not None)
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = _plan(call, limits_for(call.device))
            plan.excluded = bool(excluded) and tuple(configs.attention_key(
                call.head_size, call.block_size, call.query.dtype, call.kv_cache_dtype, plan.config)) in excluded
        if plan.excluded:
            raise VariantExcluded(f"the probe found this shape's kernel variant wrong on this device ({plan.config})")
        _launch(call, plan)

    return forward


class _Plan:
    """Everything about a launch that depends only on the call's shapes (cached per shape)."""

    __slots__ = ("limits", "config", "head_chunks", "programs", "constants", "combine", "fused_splits", "splits",
                 "scratch", "token", "dense_args", "excluded")

    def splits_for(self, call):
        """(num_splits, tokens_per_split, subs, reduce tile): v1 its own split-KV (``subs`` 1); v2 vLLM's
        512-token partitions, each cut into ``subs`` sub-splits where the grid is small (combined into the
        partition outputs and ``out`` by ``_partition_reduce_kernel``); the tile of the kernel that reduces."""
        found = self.splits.get(call.max_seq_len)
        if found is None:
            if call.exp_sums is not None:
                partitions = max(call.max_num_partitions, 1)
                subs = configs.choose_subsplits(self.limits, self.programs, partitions, PARTITION_SIZE,
                                                self.config.block_n)
                tile = (configs.partition_reduce_tile(partitions, subs, call.head_size) if subs > 1
                        else configs.reduce_tile(partitions, call.head_size))
                found = (partitions * subs, PARTITION_SIZE // subs, subs, tile)
            else:
                splits, tokens = configs.choose_splits(self.limits, self.programs, call.max_seq_len,
                                                       self.config.block_n, self.fused_splits)
                found = (splits, tokens, 1, configs.reduce_tile(splits, call.head_size))
            if len(self.splits) > 4096:  # one entry per max_seq_len seen: keep it bounded
                self.splits.clear()
            self.splits[call.max_seq_len] = found
        return found

    def scratch_for(self, call, num_splits):
        """v1's split outputs (float32) and the arrival counters of its fused reduce, one per row group (each
        launch leaves them at 0); reused by later calls of this shape: a stream runs them in order."""
        found = self.scratch.get(num_splits)
        if found is None:
            shape = (call.num_seqs, call.num_heads, num_splits)
            device = call.device
            found = (torch.empty(shape + (call.head_size,), dtype=torch.float32, device=device),
                     torch.empty(shape, dtype=torch.float32, device=device),
                     torch.empty(shape, dtype=torch.float32, device=device),
                     torch.zeros(call.num_seqs, call.num_kv_heads * self.head_chunks, dtype=torch.int32,
                                 device=device))
            self.scratch[num_splits] = found
        return found


def _plan(call, limits):
    config = configs.choose_config(limits, call.head_size, call.block_size, call.query.dtype, call.kv_cache_dtype,
                                   call.queries_per_kv)
    plan = _Plan()
    plan.limits = limits
    plan.config = config
    plan.head_chunks = triton.cdiv(call.queries_per_kv, config.heads_block)
    plan.programs = call.num_kv_heads * plan.head_chunks * call.num_seqs
    plan.splits = {}
    plan.scratch = {}
    plan.token = object()  # identifies this plan in the launchers' keys
    plan.dense_args = (0, call.num_heads, call.num_kv_heads, 0, 1, 1, 0)  # the sparsity arguments of a dense call
    plan.constants = dict(
        HEADS_BLOCK=config.heads_block, HEAD_PAD=triton.next_power_of_2(call.head_size), BLOCK_SIZE=call.block_size,
        BLOCK_N=config.block_n, X=call.x, KV_FORMAT=FP8_FORMATS[call.kv_cache_dtype],
        HAS_ALIBI=call.alibi_slopes is not None, IS_SPARSE=call.blocksparse is not None,
        USE_DOT=config.use_dot, PREFETCH=config.prefetch,
        UNMASKED_STEPS=configs.unmasked_steps(config, call.head_size), num_warps=config.num_warps,
        num_stages=config.num_stages)
    plan.combine = configs.combine_tile(config, call.queries_per_kv, call.head_size, limits.warp_size)
    # v1: reduced in the same launch where the combine's loads take few rounds (its most splits)
    plan.fused_splits = plan.combine[1] * configs.FUSED_REDUCE_MAX_ROUNDS
    return plan


def _alignment(addresses):
    """True when every address is 16-byte aligned, else one flag per address: Triton specialises pointers
    on it, so the launch key must too (one OR in the common case)."""
    bits = 0
    for address in addresses:
        bits |= address
    if bits & 15 == 0:
        return True
    return tuple(address % 16 == 0 for address in addresses)


def _contiguous_slots(call, key_strides, value_strides):
    """vLLM's layout (block slots innermost in V, X apart in K, blocks a multiple of block_size apart), which
    allows vector hints. Decided when a specialisation is compiled: the strides are in the launch key."""
    return (value_strides[3] == 1 and value_strides[0] % call.block_size == 0 and key_strides[4] == 1
            and key_strides[3] == call.x)


def _attention_constants(plan, call, cache_strides, scales_in_memory, partial, fused):
    """The attention kernel's constexprs for a launch: the plan's, and those that depend on the call's
    tensors (scales in memory, split outputs, v1's fused reduce, vLLM's slot layout)."""
    contiguous = _contiguous_slots(call, *cache_strides[1:3])
    rows, splits = plan.combine
    return dict(plan.constants, SCALES_IN_MEMORY=scales_in_memory, PARTIAL=partial, FUSED_REDUCE=fused,
                CONTIGUOUS_SLOTS=contiguous, KEY_ROWS=contiguous and configs.key_rows(plan.config, call.block_size),
                COMBINE_ROWS=rows if fused else 1, COMBINE_SPLITS=splits if fused else 1)


def _launch(call, plan):
    query, out, key_cache, value_cache = call.query, call.out, call.key_cache, call.value_cache
    device = call.device
    num_splits, tokens_per_split, subs, tile = plan.splits_for(call)
    out_strides = out.stride()
    fused = False
    if call.exp_sums is not None and subs == 1:
        partial = True
        tmp, exp_sums, max_logits = call.tmp_out, call.exp_sums, call.max_logits
        split_strides = (tmp.stride(), exp_sums.stride(), max_logits.stride())
    elif num_splits > 1:
        partial = True
        tmp, exp_sums, max_logits, counters = plan.scratch_for(call, num_splits)
        split_strides = (tmp.stride(), exp_sums.stride(), max_logits.stride())
        fused = subs == 1 and num_splits <= plan.fused_splits
    else:  # the split outputs are unused (PARTIAL off): out stands in, no views made
        partial = False
        tmp = exp_sums = max_logits = out
        split_strides = ((out_strides[0], out_strides[1], 0, out_strides[2]), out_strides, out_strides)
    k_scale, v_scale = call.k_scale, call.v_scale
    if type(k_scale) is float and type(v_scale) is float:
        scales_in_memory = False
    else:
        k_scale, scales_in_memory = _scale_argument(k_scale, device)
        v_scale, v_in_memory = _scale_argument(v_scale, device)
        if scales_in_memory != v_in_memory:  # one kind for both, to keep one specialisation
            k_scale, v_scale = (float(k_scale.item()) if scales_in_memory else k_scale,
                                float(v_scale.item()) if v_in_memory else v_scale)
            scales_in_memory = False
    sparse = call.blocksparse
    if sparse is not None:
        sparse_args = (sparse.tp_rank, call.num_heads, call.num_kv_heads, sparse.local_blocks, sparse.vert_stride,
                       sparse.block_size, sparse.head_sliding_step)
    else:
        sparse_args = plan.dense_args
    alibi = call.alibi_slopes if call.alibi_slopes is not None else call.seq_lens
    block_tables, seq_lens = call.block_tables, call.seq_lens
    cache_strides = (query.stride(), key_cache.stride(), value_cache.stride(), block_tables.stride())
    if not fused:
        counters = seq_lens  # (unused: a stand-in pointer)
    tensors = (out, tmp, exp_sums, max_logits, counters, query, key_cache, value_cache, block_tables, seq_lens,
               alibi)
    out_at, lens_at = out.data_ptr(), seq_lens.data_ptr()
    if partial:
        tmp_at, sums_at, max_at = tmp.data_ptr(), exp_sums.data_ptr(), max_logits.data_ptr()
    else:
        tmp_at = sums_at = max_at = out_at
    alibi_at = lens_at if call.alibi_slopes is None else alibi.data_ptr()
    query_at, key_at, value_at, tables_at = (query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                             block_tables.data_ptr())
    counters_at = counters.data_ptr() if fused else lens_at
    aligned = _alignment((out_at, tmp_at, sums_at, max_at, counters_at, query_at, key_at, value_at, tables_at, lens_at,
                          alibi_at))
    tmp_strides, sum_strides, max_strides = split_strides
    args = (out_at, *out_strides, tmp_at, *tmp_strides, sums_at, *sum_strides, max_at, *max_strides, counters_at,
            query_at, *cache_strides[0], key_at, *cache_strides[1], value_at, *cache_strides[2],
            tables_at, *cache_strides[3], lens_at, alibi_at, k_scale, v_scale, call.scale * LOG2E, call.head_size,
            call.queries_per_kv, plan.head_chunks, call.num_blocks, block_tables.shape[1], call.max_seq_len,
            tokens_per_split, num_splits, *sparse_args)
    grid = (call.num_kv_heads * plan.head_chunks, call.num_seqs, num_splits)
    _attention((plan.token, out_strides, split_strides, cache_strides, aligned, scales_in_memory, partial, fused),
               grid, device, args, tensors,
               lambda: _attention_constants(plan, call, cache_strides, scales_in_memory, partial, fused))
    if subs > 1:  # v2 from sub-splits: vLLM's partition outputs and the reduce over them, one kernel
        parts = (call.tmp_out, call.exp_sums, call.max_logits)
        part_strides = tuple(buffer.stride() for buffer in parts)
        part_at = [buffer.data_ptr() for buffer in parts]
        args = (out_at, *out_strides, part_at[0], *part_strides[0], part_at[1], *part_strides[1], part_at[2],
                *part_strides[2], tmp_at, *tmp_strides, sums_at, *sum_strides, max_at, *max_strides, lens_at,
                call.head_size, call.block_size, block_tables.shape[1], call.max_seq_len, tokens_per_split,
                num_splits // subs)
        _partition_reduce((plan.token, out_strides, part_strides, split_strides,
                           _alignment([out_at] + part_at + [tmp_at, sums_at, max_at, lens_at]), subs, tile),
                          (call.num_seqs, call.num_heads, plan.constants["HEAD_PAD"] // tile[1]), device, args,
                          (out,) + parts + (tmp, exp_sums, max_logits, seq_lens),
                          lambda: dict(SUBS=subs, PARTS_BLOCK=tile[0], DIMS_BLOCK=tile[1],
                                       num_warps=configs.REDUCE_NUM_WARPS, num_stages=1))
    elif partial and not fused:  # v2's partitions, or v1's splits past one combine tile
        reduce_aligned = _alignment((out_at, tmp_at, sums_at, max_at, lens_at))
        args = (out_at, *out_strides, tmp_at, *tmp_strides, sums_at, *sum_strides, max_at, *max_strides, lens_at,
                call.head_size, call.block_size, block_tables.shape[1], call.max_seq_len, tokens_per_split,
                num_splits)
        _reduce((plan.token, out_strides, split_strides, reduce_aligned, tile),
                (call.num_seqs, call.num_heads, plan.constants["HEAD_PAD"] // tile[1]), device, args,
                (out, tmp, exp_sums, max_logits, seq_lens),
                lambda: dict(SPLITS_BLOCK=tile[0], DIMS_BLOCK=tile[1], num_warps=configs.REDUCE_NUM_WARPS,
                             num_stages=1))
